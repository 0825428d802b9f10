"""The first half of a plugin's start: its sockets, its registration with the kubelet and its HTTP port.

:func:`serve` needs nothing of the driver: the kubelet sends no DRA call before the plugin is
registered, so a driver can register within a fraction of a second and initialise behind the open
sockets. DRA calls that arrive meanwhile wait (:mod:`.startgate`), ``/readyz`` says "initialising",
``/healthz`` checks the sockets as always. :class:`driver.kubeletplugin.helper.Helper` is the second
half. Only grpc, the generated stubs and ``http.server`` are imported here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from driver.kubeletplugin.calls import DEFAULT_PREPARE_DEADLINE
from driver.kubeletplugin.healthservice import HealthBoard
from driver.kubeletplugin.httpendpoint import Route, RouteServer
from driver.kubeletplugin.liveness import check_plugin
from driver.kubeletplugin.plugin import DEFAULT_REGISTRAR_DIR, KubeletPlugin

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpEndpoint:
    """Where to serve ``/metrics``, ``/healthz`` (liveness) and ``/readyz`` (registered and initialised).

    ``routes`` adds paths or replaces those two, e.g. a ``/readyz`` that also checks the driver's
    own state and calls :meth:`ServedPlugin.readiness`.
    """

    port: int
    host: str = "::"
    routes: Mapping[str, Route] | None = None


class ServedPlugin:
    """Sockets served and registration under way; DRA calls wait until the driver's calls are handed over."""

    def __init__(self, plugin: KubeletPlugin, node_name: str, prepare_deadline: float):
        self.plugin = plugin
        self.node_name = node_name
        self.prepare_deadline = prepare_deadline
        self.http: RouteServer | None = None

    @property
    def http_port(self) -> int | None:
        """The bound port of the HTTP endpoint, None when none was asked for."""
        return self.http.port if self.http is not None else None

    def liveness(self) -> tuple[bool, str]:
        """(ok, detail) of both sockets; busy with slow prepares is alive, a wedged server is not."""
        return check_plugin(self.plugin)

    def readiness(self) -> tuple[bool, str]:
        """(ok, detail): ready once the kubelet accepted the registration and the driver serves claims."""
        if not self.plugin.registered.is_set():
            return False, "not yet registered with the kubelet"
        if not self.plugin.serving_claims:
            return False, "initialising: registered, prepares wait until the driver is ready"
        return True, "ok"

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop serving and remove the sockets; calling it again does nothing."""
        self.plugin.stop(grace_s)
        if self.http is not None:
            self.http.shutdown()
            self.http = None


def serve(*, driver_name: str, node_name: str, on_registration_failed: Callable[[str], None],
          registrar_dir: Path = DEFAULT_REGISTRAR_DIR, plugin_dir: Path | None = None, pod_uid: str | None = None,
          http: HttpEndpoint | None = None, max_workers: int = 16, health_services: Sequence[str] = (),
          prepare_deadline: float = DEFAULT_PREPARE_DEADLINE, health: HealthBoard | None = None) -> ServedPlugin:
    """Open the DRA and registration sockets and the HTTP port; on failure nothing is left running.

    ``on_registration_failed`` runs on a gRPC thread with the kubelet's reason when it refuses the
    plugin; it should only tell the main thread to stop. ``plugin_dir`` defaults to
    ``/var/lib/kubelet/plugins/<driver_name>``; with ``pod_uid`` the socket names carry it, so the old
    and new pod of a rolling update can be registered side by side. DRA calls wait for the driver at
    most ``prepare_deadline`` seconds (or the kubelet's deadline, if sooner). With ``health`` the
    kubelet's device health stream is served from that board (its streams wait for the first list).
    Raises ``ValueError`` for a bad name or path.
    """
    plugin = KubeletPlugin(driver_name, on_registration_failed=on_registration_failed, registrar_dir=registrar_dir,
                           plugin_dir=plugin_dir, pod_uid=pod_uid, max_workers=max_workers,
                           health_services=health_services, prepare_deadline=prepare_deadline, health=health)
    served = ServedPlugin(plugin, node_name, prepare_deadline)
    try:
        if http is not None:
            routes: dict[str, Route] = {"/healthz": _as_route(served.liveness), "/readyz": _as_route(served.readiness)}
            routes.update(http.routes or {})
            served.http = RouteServer(http.host, http.port, routes)
        plugin.start()
    except BaseException:
        served.stop(grace_s=0)
        raise
    return served


def _as_route(check: Callable[[], tuple[bool, str]]) -> Route:
    def route() -> tuple[int, str]:
        ok, detail = check()
        return (200 if ok else 503), detail + "\n"

    return route
