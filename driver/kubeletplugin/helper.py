"""The generic DRA kubelet plugin behind one call, in the spirit of Go's ``kubeletplugin.Start``.

A driver implements :class:`driver.kubeletplugin.types.DRADriver` and calls :func:`start`; the
:class:`Helper` it gets back owns everything that is not about the driver's devices: the
registration and DRA sockets and their gRPC services (:mod:`.plugin`), reading claims
(:mod:`.claimfetch`), publishing ResourceSlices (:mod:`.slicepublisher`), liveness and readiness, and
telemetry with the metrics endpoint (:mod:`.telemetry`). The driver then only hands over its
devices with :meth:`Helper.publish` and calls :meth:`Helper.stop` at the end.

A driver that must register quickly calls :func:`driver.kubeletplugin.serving.serve` first (sockets,
registration, HTTP; nothing of this module is imported for it), initialises, then makes a
:class:`Helper` of what it served and calls :meth:`Helper.complete`: DRA calls that arrived in
between waited for that.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from driver.kubeletplugin.claimbatch import ClaimBatch
from driver.kubeletplugin.claimfetch import ClaimFetcher, ClaimSource
from driver.kubeletplugin.claimstatus import ClaimStatusWriter, StatusSource
from driver.kubeletplugin.healthservice import HealthBoard
from driver.kubeletplugin.kubeclient import KubeClient
from driver.kubeletplugin.plugin import DEFAULT_REGISTRAR_DIR
from driver.kubeletplugin.registration import RegistrationStatus
from driver.kubeletplugin.serving import HttpEndpoint as HttpEndpoint
from driver.kubeletplugin.serving import ServedPlugin, serve
from driver.kubeletplugin.slicemodel import CounterSet, Device
from driver.kubeletplugin.slicepublisher import ResourceSlicePublisher
from driver.kubeletplugin.slicevalidation import validate_driver_and_pool
from driver.kubeletplugin.telemetry import CONTENT_TYPE, Telemetry
from driver.kubeletplugin.types import DEFAULT_PREPARE_DEADLINE, ClaimRef, DRADriver

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TelemetryNames:
    """What this layer's traces and metrics are called; nothing here is named after one driver."""

    # ``service.name`` of every span.
    service: str
    # Metrics are ``<metric_prefix>_<name>``, e.g. ``tessera_prepare_claims_total``.
    metric_prefix: str
    # Tracer and meter name, and the prefix of span names; defaults to ``metric_prefix``.
    scope: str | None = None


class Helper:
    """A served kubelet plugin; :meth:`complete` makes it serve claims and publish, :meth:`stop` ends it."""

    def __init__(self, served: ServedPlugin):
        self._served = served
        self._plugin = served.plugin
        self._publisher: ResourceSlicePublisher | None = None
        self._status: ClaimStatusWriter | None = None
        self._telemetry: Telemetry | None = None
        self._stopped = False

    @property
    def telemetry(self) -> Telemetry:
        """For the driver's own gauges and spans (after :meth:`complete`); shut down by :meth:`stop`."""
        if self._telemetry is None:
            raise RuntimeError("the kubelet plugin is not completed yet: call complete() first")
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
        return self._served.http_port

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
        return self._publishing().kubernetes_minor_version

    @property
    def server_gates_off(self) -> frozenset[str]:
        """Feature gates the API server showed to be off by dropping fields it was sent (none known yet before
        publishing): what needs one should not be published again."""
        return self._publisher.server_gates_off if self._publisher is not None else frozenset()

    @property
    def published_device_count(self) -> int:
        """Devices in the last state confirmed to be on the API server."""
        return self._publisher.published_device_count if self._publisher is not None else 0

    def publish(self, devices: Sequence[Device], counter_sets: Sequence[CounterSet] = ()) -> list[str]:
        """Make the node's ResourceSlices hold ``devices`` (and the counter sets they consume from), from
        now on and whatever others do to them.

        Returns the problems that stopped it (logged too; the previous devices stay published),
        empty when accepted. The writes happen in the background: see :meth:`wait_published`.
        """
        return self._publishing().update(devices, counter_sets)

    def claim_status_changed(self, ref: ClaimRef) -> None:
        """Write ``ref``'s ``status.devices`` again soon (e.g. a device's health changed); never blocks.
        Prepare and unprepare do it by themselves."""
        if self._status is not None:
            self._status.mark(ref)

    def resync_slices(self) -> None:
        """Sync the node's ResourceSlices again at once (e.g. the Node was re-created under a new UID)."""
        self._publishing().resync()

    def wait_published(self, timeout: float) -> bool:
        """True once the latest devices are on the API server and nothing has changed them since."""
        return self._publishing().wait_synced(timeout)

    def liveness(self) -> tuple[bool, str]:
        """(ok, detail) of both sockets; busy with slow prepares is alive, a wedged server is not."""
        return self._served.liveness()

    def readiness(self) -> tuple[bool, str]:
        """(ok, detail): ready once the kubelet accepted the registration and claims are served."""
        return self._served.readiness()

    def complete(self, driver: DRADriver, *, api: KubeClient, names: TelemetryNames, claims: ClaimSource | None = None,
                 kubernetes_minor_version: int | None = None, resync_delay: float = 2.0,
                 span_exporter: SpanExporter | None = None, claim_status: StatusSource | None = None,
                 node_uid: Callable[[], str | None] | None = None) -> None:
        """Serve claims with ``driver`` (calls that waited included) and get ready to publish its devices.

        ``claims`` defaults to reading ResourceClaims through ``api``; ``kubernetes_minor_version``
        defaults to asking the API server. ``claim_status``: the driver's entries of a claim's
        ``status.devices``, written after each prepare and unprepare (:mod:`.claimstatus`); None writes none.
        ``node_uid``: the Node's UID from a watch (:class:`.nodewatch.NodeWatch`); None reads the Node when
        the slices are synced.
        On failure the plugin keeps refusing nothing and serving nothing new: the caller stops it. Raises
        ``ValueError`` for a bad node name.
        """
        if self._telemetry is not None:
            raise RuntimeError("the kubelet plugin is already completed")
        served = self._served
        telemetry = Telemetry(names.service, names.metric_prefix, span_exporter, scope=names.scope)
        publisher: ResourceSlicePublisher | None = None
        status = (ClaimStatusWriter(api, self._plugin.driver_name, self._plugin.driver_name, claim_status)
                  if claim_status is not None else None)
        try:
            publisher = ResourceSlicePublisher(api, self._plugin.driver_name, served.node_name, telemetry,
                                               minor_version=kubernetes_minor_version, resync_delay=resync_delay,
                                               node_uid=node_uid)
            batch = ClaimBatch(driver, claims if claims is not None else ClaimFetcher(api), telemetry,
                               activity=self._plugin.activity, prepare_deadline=served.prepare_deadline,
                               changed=status.mark if status is not None else None)
            telemetry.observe_gauge("published_devices", "Devices published in ResourceSlices",
                                    lambda: float(self.published_device_count))
            publisher.start()
            if status is not None:
                status.start()
        except BaseException:
            if publisher is not None:
                publisher.stop()
            telemetry.shutdown()
            raise
        self._telemetry, self._publisher, self._status = telemetry, publisher, status
        if served.http is not None:
            served.http.serve_metrics(telemetry.render_metrics, CONTENT_TYPE)
        self._plugin.serve_claims(batch)
        log.info("kubelet plugin started", extra={
            "driver": self._plugin.driver_name, "node": served.node_name, "dra_socket": str(self.dra_socket),
            "registration_socket": str(self.registration_socket), "http_port": self.http_port,
            "kubernetes_minor_version": publisher.kubernetes_minor_version})

    def refuse_claims(self, reason: str) -> None:
        """The driver will not become ready: DRA calls, those waiting included, are answered with ``reason``."""
        self._plugin.refuse_claims(reason)

    def stop(self) -> None:
        """Stop serving and remove this plugin's sockets; the published slices stay.

        During a rolling update the other pod keeps serving them, and after a real removal the
        kubelet wipes them 30 s after the sockets are gone. Calling it again does nothing.
        """
        if self._stopped:
            return
        self._stopped = True
        self._served.stop()
        if self._publisher is not None and not self._publisher.stop():
            log.warning("the ResourceSlice publisher did not stop in time")
        if self._status is not None and not self._status.stop():
            log.warning("the claim status writer did not stop in time")
        if self._telemetry is not None:
            self._telemetry.shutdown()

    def _publishing(self) -> ResourceSlicePublisher:
        if self._publisher is None:
            raise RuntimeError("the kubelet plugin is not completed yet: call complete() first")
        return self._publisher


def start(driver: DRADriver, *, driver_name: str, node_name: str, api: KubeClient,
          names: TelemetryNames, on_registration_failed: Callable[[str], None],
          registrar_dir: Path = DEFAULT_REGISTRAR_DIR, plugin_dir: Path | None = None, pod_uid: str | None = None,
          http: HttpEndpoint | None = None, claims: ClaimSource | None = None,
          kubernetes_minor_version: int | None = None, max_workers: int = 16, health_services: Sequence[str] = (),
          prepare_deadline: float = DEFAULT_PREPARE_DEADLINE, resync_delay: float = 2.0,
          span_exporter: SpanExporter | None = None, health: HealthBoard | None = None) -> Helper:
    """Serve ``driver`` to the kubelet and get ready to publish its devices; on failure nothing is left running.

    :func:`driver.kubeletplugin.serving.serve` and :meth:`Helper.complete` in one call (their
    arguments are documented there). Every prepare request is answered within ``prepare_deadline``
    seconds (or the kubelet's deadline, if sooner). Raises ``ValueError`` for a bad name or path.
    """
    # A name the slices cannot carry is refused before any socket is served (complete() would refuse it later).
    problems = validate_driver_and_pool(driver_name, node_name)
    if problems:
        raise ValueError("; ".join(problems))
    helper = Helper(serve(driver_name=driver_name, node_name=node_name, on_registration_failed=on_registration_failed,
                          registrar_dir=registrar_dir, plugin_dir=plugin_dir, pod_uid=pod_uid, http=http,
                          max_workers=max_workers, health_services=health_services,
                          prepare_deadline=prepare_deadline, health=health))
    try:
        helper.complete(driver, api=api, names=names, claims=claims, kubernetes_minor_version=kubernetes_minor_version,
                        resync_delay=resync_delay, span_exporter=span_exporter)
    except BaseException:
        helper.stop()
        raise
    return helper
