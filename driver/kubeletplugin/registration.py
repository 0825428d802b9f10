"""The kubelet plugin-registration service (``pluginregistration.Registration``) for a DRA driver.

The kubelet's plugin watcher finds the registration socket, calls ``GetInfo`` to learn the
driver name, the DRA endpoint and the services it serves, and then reports its verdict with
``NotifyRegistrationStatus``. A rejection is fatal for the plugin: the kubelet will never call it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc

from driver.kubeletplugin.api import pluginregistration_v1_pb2 as reg_pb2

log = logging.getLogger(__name__)

DRA_PLUGIN_TYPE = "DRAPlugin"

# The kubelet takes the first entry it also supports, so the newest API comes first.
DRA_SERVICE_VERSIONS: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin")


@dataclass(frozen=True)
class RegistrationStatus:
    """The kubelet's last verdict."""

    registered: bool
    error: str


class RegistrationServicer:
    """Answers the kubelet's registration calls for one DRA endpoint.

    ``health_services`` is where served health APIs (e.g. ``"v1alpha1.DRAResourceHealth"``) get
    advertised once the plugin serves them; the kubelet ignores them when choosing the DRA API.

    ``on_rejected`` runs on a gRPC worker thread with the kubelet's error. It should only signal
    the main thread (which then stops the plugin and exits): stopping the server from inside the
    call would wait for that very call to finish.
    """

    def __init__(self, driver_name: str, endpoint: str, on_rejected: Callable[[str], None],
                 dra_versions: Sequence[str] = DRA_SERVICE_VERSIONS, health_services: Sequence[str] = ()):
        self._driver_name = driver_name
        self._endpoint = endpoint
        self._versions = [*dra_versions, *health_services]
        self._on_rejected = on_rejected
        self._lock = threading.Lock()
        self._status: RegistrationStatus | None = None
        self.registered = threading.Event()

    @property
    def status(self) -> RegistrationStatus | None:
        """The kubelet's last verdict, or None before it gave one."""
        with self._lock:
            return self._status

    def GetInfo(self, request: reg_pb2.InfoRequest, context: grpc.ServicerContext) -> reg_pb2.PluginInfo:
        log.debug("kubelet asked for plugin info", extra={"driver": self._driver_name})
        return reg_pb2.PluginInfo(
            type=DRA_PLUGIN_TYPE, name=self._driver_name, endpoint=self._endpoint,
            supported_versions=self._versions,
        )

    def NotifyRegistrationStatus(self, request: reg_pb2.RegistrationStatus,
                                 context: grpc.ServicerContext) -> reg_pb2.RegistrationStatusResponse:
        status = RegistrationStatus(registered=bool(request.plugin_registered), error=str(request.error))
        with self._lock:
            self._status = status
        if status.registered:
            log.info("kubelet registered the plugin", extra={"driver": self._driver_name, "endpoint": self._endpoint})
            self.registered.set()
        else:
            # The kubelet never calls a plugin it rejected; the process must exit so that the
            # DaemonSet restarts it, hopefully after the cause is fixed.
            self.registered.clear()
            log.error("kubelet rejected the plugin registration",
                      extra={"driver": self._driver_name, "endpoint": self._endpoint, "error": status.error})
            self._on_rejected(status.error or "the kubelet rejected the registration without giving a reason")
        return reg_pb2.RegistrationStatusResponse()
