"""The generic DRA kubelet plugin behind one call, in the spirit of Go's ``kubeletplugin.Start``.

A driver implements :class:`driver.kubeletplugin.types.DRADriver` and calls :func:`start`; the
:class:`Helper` it gets back owns everything that is not about the driver's devices: the
registration and DRA sockets and their gRPC services (:mod:`.plugin`), reading claims
(:mod:`.claimfetch`), publishing ResourceSlices (:mod:`.slicepublisher`), liveness and readiness, and
telemetry with the metrics endpoint (:mod:`.telemetry`). The driver then only hands over its
devices with :meth:`Helper.publish` and calls :meth:`Helper.stop` at the end.

Nothing in this package knows about GPUs or the simulation: it could be lifted out as its own
package (tests/unit/test_kubeletplugin_helper.py checks its imports).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import kubernetes.client
from opentelemetry.sdk.trace.export import SpanExporter

from driver.kubeletplugin.claimfetch import ClaimFetcher, ClaimSource
from driver.kubeletplugin.healthservice import HealthBoard
from driver.kubeletplugin.liveness import check_plugin
from driver.kubeletplugin.plugin import DEFAULT_REGISTRAR_DIR, KubeletPlugin
from driver.kubeletplugin.registration import RegistrationStatus
from driver.kubeletplugin.slicemodel import Device
from driver.kubeletplugin.slicepublisher import ResourceSlicePublisher
from driver.kubeletplugin.telemetry import Telemetry
from driver.kubeletplugin.types import DEFAULT_PREPARE_DEADLINE, DRADriver

log = logging.getLogger(__name__)

Route = Callable[[], tuple[int, str]]


@dataclass(frozen=True)
class TelemetryNames:
    """What this layer's traces and metrics are called; nothing here is named after one driver."""

    # ``service.name`` of every span.
    service: str
    # Metrics are ``<metric_prefix>_<name>``, e.g. ``tessera_prepare_claims_total``.
    metric_prefix: str
    # Tracer and meter name, and the prefix of span names; defaults to ``metric_prefix``.
    scope: str | None = None


@dataclass(frozen=True)
class HttpEndpoint:
    """Where to serve ``/metrics``, ``/healthz`` (liveness) and ``/readyz`` (registered).

    ``routes`` adds paths or replaces those two, e.g. a ``/readyz`` that also checks the driver's
    own state and calls :meth:`Helper.readiness`.
    """

    port: int
    host: str = "::"
    routes: Mapping[str, Route] | None = None


class Helper:
    """A started kubelet plugin: made by :func:`start`, ended by :meth:`stop`."""

    def __init__(self, plugin: KubeletPlugin, publisher: ResourceSlicePublisher, telemetry: Telemetry):
        self._plugin = plugin
        self._publisher = publisher
        self._telemetry = telemetry
        self._http_port: int | None = None
        self._stopped = False

    @property
    def telemetry(self) -> Telemetry:
        """For the driver's own gauges and spans; shut down by :meth:`stop`."""
        return self._telemetry

    @property
    def dra_socket(self) -> Path:
        return self._plugin.dra_socket

    @property
    def registration_socket(self) -> Path:
        return self._plugin.registration_socket

    @property
    def http_port(self) -> int | None:
        """The bound port of the HTTP endpoint, None when none was asked for."""
        return self._http_port

    @property
    def registration_status(self) -> RegistrationStatus | None:
        """The kubelet's last verdict on the registration, None before it gave one."""
        return self._plugin.registration_status

    @property
    def registered(self) -> bool:
        return self._plugin.registered.is_set()

    def wait_registered(self, timeout: float | None = None) -> bool:
        """Block until the kubelet accepted the plugin; False on timeout."""
        return self._plugin.registered.wait(timeout)

    @property
    def kubernetes_minor_version(self) -> int:
        """The release whose ResourceSlice limits apply (read from the API server at start)."""
        return self._publisher.kubernetes_minor_version

    @property
    def published_device_count(self) -> int:
        """Devices in the last state confirmed to be on the API server."""
        return self._publisher.published_device_count

    def publish(self, devices: Sequence[Device]) -> list[str]:
        """Make the node's ResourceSlices hold ``devices``, from now on and whatever others do to them.

        Returns the problems that stopped it (logged too; the previous devices stay published),
        empty when accepted. The writes happen in the background: see :meth:`wait_published`.
        """
        return self._publisher.update(devices)

    def wait_published(self, timeout: float) -> bool:
        """True once the latest devices are on the API server and nothing has changed them since."""
        return self._publisher.wait_synced(timeout)

    def liveness(self) -> tuple[bool, str]:
        """(ok, detail) of both sockets; busy with slow prepares is alive, a wedged server is not."""
        return check_plugin(self._plugin)

    def readiness(self) -> tuple[bool, str]:
        """(ok, detail): ready once the kubelet accepted the registration."""
        if not self.registered:
            return False, "not yet registered with the kubelet"
        return True, "ok"

    def stop(self) -> None:
        """Stop serving and remove this plugin's sockets; the published slices stay.

        During a rolling update the other pod keeps serving them, and after a real removal the
        kubelet wipes them 30 s after the sockets are gone. Calling it again does nothing.
        """
        if self._stopped:
            return
        self._stopped = True
        self._plugin.stop()
        if not self._publisher.stop():
            log.warning("the ResourceSlice publisher did not stop in time")
        self._telemetry.shutdown()

    def _serve_http(self, endpoint: HttpEndpoint) -> None:
        routes: dict[str, Route] = {"/healthz": _as_route(self.liveness), "/readyz": _as_route(self.readiness)}
        routes.update(endpoint.routes or {})
        self._http_port = self._telemetry.serve_metrics(endpoint.host, endpoint.port, routes)


def start(driver: DRADriver, *, driver_name: str, node_name: str, api: kubernetes.client.ApiClient,
          names: TelemetryNames, on_registration_failed: Callable[[str], None],
          registrar_dir: Path = DEFAULT_REGISTRAR_DIR, plugin_dir: Path | None = None, pod_uid: str | None = None,
          http: HttpEndpoint | None = None, claims: ClaimSource | None = None,
          kubernetes_minor_version: int | None = None, max_workers: int = 16, health_services: Sequence[str] = (),
          prepare_deadline: float = DEFAULT_PREPARE_DEADLINE, resync_delay: float = 2.0,
          span_exporter: SpanExporter | None = None, health: HealthBoard | None = None) -> Helper:
    """Serve ``driver`` to the kubelet and get ready to publish its devices; on failure nothing is left running.

    ``on_registration_failed`` runs on a gRPC thread with the kubelet's reason when it refuses
    the plugin; it should only tell the main thread to stop (the kubelet will never call a
    refused plugin). ``plugin_dir`` defaults to ``/var/lib/kubelet/plugins/<driver_name>``;
    with ``pod_uid`` the socket names carry it, so the old and new pod of a rolling update can
    be registered side by side. ``claims`` defaults to reading ResourceClaims through ``api``;
    ``kubernetes_minor_version`` defaults to asking the API server. Every prepare request is
    answered within ``prepare_deadline`` seconds (or the kubelet's deadline, if sooner). With
    ``health`` the kubelet's device health stream is served from that board. Raises
    ``ValueError`` for a bad name or path.
    """
    telemetry = Telemetry(names.service, names.metric_prefix, span_exporter, scope=names.scope)
    publisher: ResourceSlicePublisher | None = None
    plugin: KubeletPlugin | None = None
    try:
        publisher = ResourceSlicePublisher(api, driver_name, node_name, telemetry,
                                           minor_version=kubernetes_minor_version, resync_delay=resync_delay)
        plugin = KubeletPlugin(driver, driver_name, claims if claims is not None else ClaimFetcher(api), telemetry,
                               on_registration_failed=on_registration_failed, registrar_dir=registrar_dir,
                               plugin_dir=plugin_dir, pod_uid=pod_uid, max_workers=max_workers,
                               health_services=health_services, prepare_deadline=prepare_deadline,
                               health=health)
        helper = Helper(plugin, publisher, telemetry)
        telemetry.observe_gauge("published_devices", "Devices published in ResourceSlices",
                                lambda: float(helper.published_device_count))
        if http is not None:
            helper._serve_http(http)
        publisher.start()
        plugin.start()
    except BaseException:
        if plugin is not None:
            plugin.stop(grace_s=0)
        if publisher is not None:
            publisher.stop()
        telemetry.shutdown()
        raise
    log.info("kubelet plugin started", extra={
        "driver": driver_name, "node": node_name, "dra_socket": str(plugin.dra_socket),
        "registration_socket": str(plugin.registration_socket), "http_port": helper.http_port,
        "kubernetes_minor_version": publisher.kubernetes_minor_version})
    return helper


def _as_route(check: Callable[[], tuple[bool, str]]) -> Route:
    def route() -> tuple[int, str]:
        ok, detail = check()
        return (200 if ok else 503), detail + "\n"

    return route
