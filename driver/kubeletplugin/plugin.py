"""The kubelet-facing side of a DRA driver process: its two Unix sockets and gRPC servers.

One server on ``<plugin_dir>/dra.sock`` serves the DRA node API (v1 and v1beta1); one on
``<registrar_dir>/<driver>-reg.sock`` serves plugin registration. With a pod UID both names carry
it, so the old and new pod of a rolling update can be registered side by side.

The sockets can be served before the driver behind them is ready: DRA calls go through the plugin's
:class:`StartGate` and wait there until :meth:`KubeletPlugin.serve_claims` hands over the driver's
calls. This module is on the registration path: grpc, the generated stubs and nothing heavier.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import grpc

from driver.kubeletplugin.activity import CallActivity, DraActivity
from driver.kubeletplugin.api import pluginregistration_v1_pb2_grpc
from driver.kubeletplugin.calls import DEFAULT_PREPARE_DEADLINE
from driver.kubeletplugin.filemodes import ensure_private_dir, restrict_socket
from driver.kubeletplugin.healthservice import HEALTH_SERVICE_VERSIONS, HealthBoard, add_health_services
from driver.kubeletplugin.registration import RegistrationServicer, RegistrationStatus
from driver.kubeletplugin.service import ClaimCalls, add_dra_services
from driver.kubeletplugin.startgate import StartGate

log = logging.getLogger(__name__)

DEFAULT_REGISTRAR_DIR = Path("/var/lib/kubelet/plugins_registry")
DEFAULT_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")

# sun_path is 108 bytes on Linux, including the terminating NUL, but gRPC (1.85) refuses a "unix://" path
# of 106 bytes or more ("should not have more than 107 characters"): the most that binds is 105.
GRPC_UNIX_PATH_MAX_BYTES = 105


class KubeletPlugin:
    """Owns the registration and DRA sockets of one plugin process; ``start()`` then ``stop()``."""

    def __init__(
        self,
        driver_name: str,
        *,
        on_registration_failed: Callable[[str], None],
        registrar_dir: Path = DEFAULT_REGISTRAR_DIR,
        plugin_dir: Path | None = None,
        pod_uid: str | None = None,
        max_workers: int = 16,
        health_services: Sequence[str] = (),
        prepare_deadline: float = DEFAULT_PREPARE_DEADLINE,
        health: HealthBoard | None = None,
    ):
        """``health``: serve the kubelet's device health stream (v1 and v1alpha1) from this board.

        DRA calls wait (bounded by their deadlines, and by ``prepare_deadline``) until
        :meth:`serve_claims`; until then the plugin can be registered but prepares nothing."""
        _require_name("driver_name", driver_name)
        if pod_uid is not None:
            _require_name("pod_uid", pod_uid)
        if max_workers < 1:
            raise ValueError(f"max_workers must be at least 1, got {max_workers}")
        plugin_dir = plugin_dir if plugin_dir is not None else DEFAULT_PLUGINS_DIR / driver_name
        self._registration_socket = registrar_dir / (
            f"{driver_name}-{pod_uid}-reg.sock" if pod_uid else f"{driver_name}-reg.sock")
        self._dra_socket = plugin_dir / (f"dra-{pod_uid}.sock" if pod_uid else "dra.sock")
        for path in (self._registration_socket, self._dra_socket):
            if len(os.fsencode(path)) > GRPC_UNIX_PATH_MAX_BYTES:
                raise ValueError(f"socket path {path} is {len(os.fsencode(path))} bytes; gRPC's Unix sockets allow at "
                                 f"most {GRPC_UNIX_PATH_MAX_BYTES}: use shorter registrar_dir/plugin_dir")
        self._activity = CallActivity()
        self._gate = StartGate(self._activity, max_wait_s=prepare_deadline)
        if health is not None:
            health_services = [*health_services, *(v for v in HEALTH_SERVICE_VERSIONS if v not in health_services)]
        self._health = health
        self._registration = RegistrationServicer(driver_name, str(self._dra_socket), on_registration_failed,
                                                  health_services=health_services)
        self._max_workers = max_workers
        self._driver_name = driver_name
        self._servers: list[_Served] = []
        self._lock = threading.Lock()

    @property
    def driver_name(self) -> str:
        return self._driver_name

    @property
    def registration_socket(self) -> Path:
        return self._registration_socket

    @property
    def dra_socket(self) -> Path:
        return self._dra_socket

    @property
    def registered(self) -> threading.Event:
        """Set once the kubelet accepted the registration."""
        return self._registration.registered

    @property
    def registration_status(self) -> RegistrationStatus | None:
        return self._registration.status

    @property
    def activity(self) -> CallActivity:
        """Where DRA calls are counted while they run; the driver's calls should count there too."""
        return self._activity

    def dra_activity(self) -> DraActivity:
        """DRA calls (prepare and unprepare requests) in flight, and seconds since one last started or finished."""
        return self._activity.snapshot()

    @property
    def serving_claims(self) -> bool:
        """Whether DRA calls go to the driver (:meth:`serve_claims` was called)."""
        return self._gate.ready

    def serve_claims(self, calls: ClaimCalls) -> None:
        """Hand DRA calls to ``calls`` from now on, those waiting included."""
        self._gate.open(calls)

    def refuse_claims(self, reason: str) -> None:
        """The driver will not be ready (it failed to start): DRA calls, those waiting included, get ``reason``."""
        self._gate.fail(reason)

    def start(self) -> None:
        """Serve the DRA socket, then the registration socket; on failure nothing is left behind."""
        with self._lock:
            if self._servers:
                raise RuntimeError("plugin already started")
            self._registration.registered.clear()  # a restarted plugin must be registered again
            try:
                # The plugin dir is this driver's own (state, checkpoint, lock); the registrar dir is
                # the kubelet's and keeps its mode.
                ensure_private_dir(self._dra_socket.parent)
                # The kubelet dials the DRA endpoint right after GetInfo, so it must already be served.
                if self._health is not None:
                    self._health.reopen()
                self._servers.append(_serve(self._dra_socket, self._max_workers, self._add_dra_services))
                self._servers.append(_serve(
                    self._registration_socket, 2,
                    lambda server: pluginregistration_v1_pb2_grpc.add_RegistrationServicer_to_server(
                        self._registration, server)))
            except BaseException:
                self._stop_servers(grace_s=0)
                raise
        log.info("plugin serving", extra={"driver": self._driver_name, "dra_socket": str(self._dra_socket),
                                          "registration_socket": str(self._registration_socket)})

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop serving (in-flight calls get ``grace_s``) and remove this plugin's own sockets."""
        with self._lock:
            if self._health is not None:
                self._health.close()  # health streams never end by themselves
            self._stop_servers(grace_s)

    def _add_dra_services(self, server: grpc.Server) -> None:
        add_dra_services(server, self._gate)
        if self._health is not None:
            add_health_services(server, self._health)

    def __enter__(self) -> KubeletPlugin:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _stop_servers(self, grace_s: float) -> None:
        # Registration goes first: removing its socket makes the kubelet deregister this endpoint
        # while calls already in flight on the DRA socket can still finish.
        for served in reversed(self._servers):
            served.server.stop(grace_s).wait()
            served.executor.shutdown(wait=False)
            _remove_if_same(served.path, served.identity)
        self._servers.clear()


@dataclass(frozen=True)
class _Served:
    server: grpc.Server
    executor: ThreadPoolExecutor
    path: Path
    identity: tuple[int, int]  # (st_dev, st_ino) of the socket file this process bound


def _serve(path: Path, workers: int, add_services: Callable[[grpc.Server], None]) -> _Served:
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(path)
    executor = ThreadPoolExecutor(workers, thread_name_prefix=f"grpc-{path.name}")
    server = grpc.server(executor)
    try:
        add_services(server)
        server.add_insecure_port(f"unix://{path}")
        server.start()
        restrict_socket(path)
        st = path.stat()
    except BaseException:
        server.stop(0)
        executor.shutdown(wait=False)
        raise
    return _Served(server, executor, path, (st.st_dev, st.st_ino))


def _remove_stale(path: Path) -> None:
    """Clear what a previous run left at ``path``; gRPC replaces old sockets, but not other files."""
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(f"cannot create socket {path}: a directory is in the way; remove it")
    log.info("removing stale socket", extra={"path": str(path)})
    path.unlink()


def _remove_if_same(path: Path, identity: tuple[int, int]) -> None:
    """Unlink ``path`` if it is still the socket this process bound.

    gRPC core already unlinks the path when the server stops, whatever is there by then
    (grpc/grpc#17122), so a successor that reused the same name loses its socket anyway; only
    pod-UID socket names avoid that. This covers a gRPC that leaves the file behind.
    """
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if (st.st_dev, st.st_ino) == identity:
        path.unlink(missing_ok=True)
    else:
        log.warning("socket was replaced by another process; leaving it", extra={"path": str(path)})


def _require_name(field: str, value: str) -> None:
    if not value or "/" in value or value.startswith("."):
        raise ValueError(f"{field} must be a non-empty name without '/' and not starting with '.', got {value!r}")
