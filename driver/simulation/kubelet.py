"""SIMULATION: a kubelet stand-in for tests and the demo.

It finds and registers a DRA plugin, then prepares and unprepares claims.

It follows the real kubelet's steps (see the kubelet contract reference): the plugin watcher finds
``*-reg.sock`` sockets in the registrar directory (skipping dot-files and non-sockets), calls
``GetInfo``, validates the answer, picks the first DRA API in the plugin's order that this
"kubelet" supports, connects to the endpoint and reports ``NotifyRegistrationStatus``. Responses
are checked the way the kubelet checks them: a result for an unknown claim or a skipped claim
raises :class:`KubeletProtocolError`.
"""

from __future__ import annotations

import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

import grpc

from driver.kubeletplugin.api import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_v1_pb2,
    pluginregistration_v1_pb2_grpc,
)
from driver.kubeletplugin.types import ClaimRef
from driver.simulation.kubelethealth import HealthWatch, health_api_version

# What a 1.34+ kubelet supports; pass ("v1beta1.DRAPlugin",) to emulate a 1.32/1.33 kubelet.
KUBELET_DRA_VERSIONS: tuple[str, ...] = ("v1.DRAPlugin", "v1beta1.DRAPlugin")

GET_INFO_TIMEOUT_S = 1.0  # the kubelet's GetInfo deadline
CALL_TIMEOUT_S = 45.0  # the kubelet's NodePrepare/NodeUnprepare deadline


class KubeletProtocolError(AssertionError):
    """The plugin did something a real kubelet would reject."""


@dataclass(frozen=True)
class KubeletDevice:
    """One prepared device as the kubelet stores it in its checkpoint."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None


@dataclass(frozen=True)
class PrepareAnswer:
    """The plugin's answer for one claim: devices, or an error (then devices are ignored)."""

    devices: tuple[KubeletDevice, ...] = ()
    error: str | None = None


@dataclass(frozen=True)
class RegisteredPlugin:
    """What the plugin said in GetInfo and what this kubelet made of it."""

    registration_socket: Path
    name: str
    endpoint: str
    supported_versions: tuple[str, ...]
    api_version: str
    accepted: bool


class KubeletEmulator:
    """Registers one DRA plugin from ``registrar_dir`` and calls it like a kubelet would."""

    def __init__(self, registrar_dir: Path, supported_versions: Sequence[str] = KUBELET_DRA_VERSIONS,
                 call_timeout_s: float = CALL_TIMEOUT_S):
        self._registrar_dir = registrar_dir
        self._supported = tuple(supported_versions)
        self._call_timeout_s = call_timeout_s
        self._channel: grpc.Channel | None = None
        self._api_version = ""
        self.plugin: RegisteredPlugin | None = None

    def __enter__(self) -> KubeletEmulator:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def registration_sockets(self) -> list[Path]:
        """Sockets the kubelet's plugin watcher would pick up, sorted by path."""
        if not self._registrar_dir.is_dir():
            return []
        found = []
        for path in self._registrar_dir.rglob("*-reg.sock"):
            relative = path.relative_to(self._registrar_dir)
            if any(part.startswith(".") for part in relative.parts):
                continue
            try:
                if stat.S_ISSOCK(path.lstat().st_mode):
                    found.append(path)
            except FileNotFoundError:
                continue
        return sorted(found)

    def wait_for_plugin(self, driver_name: str, timeout: float = 10.0,
                        reject_with: str | None = None) -> RegisteredPlugin:
        """Register the first plugin socket whose GetInfo names ``driver_name``.

        With ``reject_with`` the plugin is told it was rejected, with that error, and not connected.
        """
        deadline = time.monotonic() + timeout
        while True:
            for socket_path in self.registration_sockets():
                info = self._get_info(socket_path)
                if info is not None and info.name == driver_name:
                    return self._register(socket_path, info, reject_with)
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no plugin for driver {driver_name!r} registered in {self._registrar_dir} "
                                   f"within {timeout} s (sockets seen: {self.registration_sockets()})")
            time.sleep(0.02)

    def prepare(self, claims: Sequence[ClaimRef],
                share_ids: Mapping[str, Mapping[str, str]] | None = None) -> dict[str, PrepareAnswer]:
        """Send one NodePrepareResources for ``claims``; the answer per claim UID.

        ``share_ids``: claim UID -> device name -> the allocation's ``shareID``, as a real kubelet
        knows them from the claim; each answered device must carry its share's ID (kubelet DRA v1
        ``Device.share_id``), since the kubelet tells shares of one device apart by it."""
        pb2, stub = self._dra()
        response = stub.NodePrepareResources(pb2.NodePrepareResourcesRequest(claims=_claims(pb2, claims)),
                                             timeout=self._call_timeout_s)
        _check_answered("NodePrepareResources", claims, set(response.claims))
        answers = {}
        for uid, entry in response.claims.items():
            if entry.error:
                answers[uid] = PrepareAnswer(error=entry.error)
                continue
            devices = tuple(
                KubeletDevice(
                    request_names=tuple(d.request_names), pool_name=d.pool_name, device_name=d.device_name,
                    cdi_device_ids=tuple(d.cdi_device_ids),
                    share_id=d.share_id if self._api_version == "v1.DRAPlugin" and d.HasField("share_id") else None,
                )
                for d in entry.devices
            )
            answers[uid] = PrepareAnswer(devices=devices)
            _check_share_ids(uid, devices, (share_ids or {}).get(uid, {}))
        return answers

    def unprepare(self, claims: Sequence[ClaimRef]) -> dict[str, str | None]:
        """Send one NodeUnprepareResources for ``claims``; the error per claim UID, None for success."""
        pb2, stub = self._dra()
        response = stub.NodeUnprepareResources(pb2.NodeUnprepareResourcesRequest(claims=_claims(pb2, claims)),
                                               timeout=self._call_timeout_s)
        _check_answered("NodeUnprepareResources", claims, set(response.claims))
        return {uid: entry.error or None for uid, entry in response.claims.items()}

    def watch_health(self, api_version: str | None = None) -> HealthWatch:
        """Open the device health stream as a 1.37 kubelet does (v1 first); close() it when done."""
        if self.plugin is None:
            raise RuntimeError("no plugin registered: call wait_for_plugin() first")
        version = api_version or health_api_version(self.plugin.supported_versions)
        if version is None:
            raise KubeletProtocolError(f"the plugin advertises no health service: {self.plugin.supported_versions}")
        return HealthWatch(self.plugin.endpoint, version)

    def _get_info(self, socket_path: Path) -> pluginregistration_v1_pb2.PluginInfo | None:
        try:
            with grpc.insecure_channel(f"unix://{socket_path}") as channel:
                stub = pluginregistration_v1_pb2_grpc.RegistrationStub(channel)
                info: pluginregistration_v1_pb2.PluginInfo = stub.GetInfo(
                    pluginregistration_v1_pb2.InfoRequest(), timeout=GET_INFO_TIMEOUT_S)
                return info
        except grpc.RpcError:
            return None  # like the kubelet: try again on a later pass

    def _register(self, socket_path: Path, info: pluginregistration_v1_pb2.PluginInfo,
                  reject_with: str | None) -> RegisteredPlugin:
        versions = tuple(info.supported_versions)
        problem = None
        api_version = next((v for v in versions if v in self._supported), "")
        endpoint = info.endpoint or str(socket_path)
        if info.type != "DRAPlugin":
            problem = f"no handler registered for plugin type: {info.type}"
        elif not api_version:
            problem = (f"plugin validation failed: none of the versions supported by the plugin {list(versions)} "
                       f"is supported by this kubelet {list(self._supported)}")
        elif not Path(endpoint).is_absolute():
            problem = f"plugin validation failed: endpoint {endpoint!r} is not an absolute path"
        if problem is not None:
            _notify(socket_path, False, problem)
            raise KubeletProtocolError(f"{socket_path}: {problem}")
        plugin = RegisteredPlugin(socket_path, info.name, endpoint, versions, api_version,
                                  accepted=reject_with is None)
        if reject_with is not None:
            _notify(socket_path, False, reject_with)
            self.plugin = plugin
            return plugin
        channel = grpc.insecure_channel(f"unix://{endpoint}")
        try:
            grpc.channel_ready_future(channel).result(timeout=10)
        except grpc.FutureTimeoutError as err:
            channel.close()
            _notify(socket_path, False, f"cannot connect to endpoint {endpoint}")
            raise KubeletProtocolError(f"{socket_path}: DRA endpoint {endpoint} does not accept connections") from err
        self.close()
        self._channel, self._api_version, self.plugin = channel, api_version, plugin
        _notify(socket_path, True, "")
        return plugin

    def _dra(self) -> tuple[ModuleType, Any]:
        """The registered DRA API's messages and a stub for it: v1 and v1beta1 messages have the same fields."""
        if self._api_version == "v1.DRAPlugin":
            return dra_v1_pb2, dra_v1_pb2_grpc.DRAPluginStub(self._connected())
        return dra_v1beta1_pb2, dra_v1beta1_pb2_grpc.DRAPluginStub(self._connected())

    def _connected(self) -> grpc.Channel:
        if self._channel is None:
            raise RuntimeError("no plugin registered: call wait_for_plugin() first")
        return self._channel


def _notify(socket_path: Path, registered: bool, error: str) -> None:
    with grpc.insecure_channel(f"unix://{socket_path}") as channel:
        pluginregistration_v1_pb2_grpc.RegistrationStub(channel).NotifyRegistrationStatus(
            pluginregistration_v1_pb2.RegistrationStatus(plugin_registered=registered, error=error),
            timeout=GET_INFO_TIMEOUT_S * 5)


def _check_share_ids(uid: str, devices: Sequence[KubeletDevice], wanted: Mapping[str, str]) -> None:
    for device in devices:
        if device.device_name in wanted and device.share_id != wanted[device.device_name]:
            raise KubeletProtocolError(
                f"NodePrepareResources: claim {uid} device {device.device_name}: share_id {device.share_id!r}, "
                f"but the allocation's shareID is {wanted[device.device_name]!r}")


def _check_answered(method: str, claims: Sequence[ClaimRef], answered: set[str]) -> None:
    requested = {c.uid for c in claims}
    unknown = answered - requested
    if unknown:
        raise KubeletProtocolError(f"{method}: result for unknown claim UID(s) {sorted(unknown)}")
    skipped = requested - answered
    if skipped:
        raise KubeletProtocolError(f"{method} skipped {len(skipped)} ResourceClaims: {sorted(skipped)}")


def _claims(pb2: ModuleType, refs: Sequence[ClaimRef]) -> list[Any]:
    return [pb2.Claim(namespace=ref.namespace, name=ref.name, uid=ref.uid) for ref in refs]
