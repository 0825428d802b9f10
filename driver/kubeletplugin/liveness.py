"""Liveness check for the plugin's sockets, served on HTTP ``/healthz`` for the DaemonSet probe.

It dials both sockets the way the kubelet does and makes harmless calls: ``GetInfo`` on the
registration socket and an empty ``NodePrepareResources`` on the DRA socket. That proves the
files exist, the servers accept connections and their worker pools are not wedged.

It only partly covers the kubelet 1.34.0-1.34.1 failure where the kubelet loses its connection
to a healthy plugin: this check dials fresh connections, so it cannot see that the kubelet's own
connection is gone. It does catch the plugin-side half (a deleted socket or a dead server).
"""

from __future__ import annotations

import stat
from pathlib import Path

import grpc

from driver.kubeletplugin.api import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    pluginregistration_v1_pb2,
    pluginregistration_v1_pb2_grpc,
)
from driver.kubeletplugin.registration import DRA_PLUGIN_TYPE

DEFAULT_TIMEOUT_S = 5.0


def check_sockets(registration_socket: Path, dra_socket: Path, driver_name: str,
                  timeout: float = DEFAULT_TIMEOUT_S) -> tuple[bool, str]:
    """(ok, detail): whether both sockets answer like a registered DRA plugin should."""
    for label, path in (("registration", registration_socket), ("DRA", dra_socket)):
        problem = _socket_file_problem(path)
        if problem:
            return False, f"{label} socket {path}: {problem}"
    try:
        with grpc.insecure_channel(f"unix://{registration_socket}") as channel:
            info = pluginregistration_v1_pb2_grpc.RegistrationStub(channel).GetInfo(
                pluginregistration_v1_pb2.InfoRequest(), timeout=timeout)
    except grpc.RpcError as err:
        return False, f"registration socket {registration_socket}: GetInfo failed: {_rpc_error(err)}"
    if info.name != driver_name or info.type != DRA_PLUGIN_TYPE:
        return False, (f"registration socket {registration_socket} belongs to {info.type} {info.name!r}, "
                       f"expected {DRA_PLUGIN_TYPE} {driver_name!r}")
    try:
        with grpc.insecure_channel(f"unix://{dra_socket}") as channel:
            response = dra_v1_pb2_grpc.DRAPluginStub(channel).NodePrepareResources(
                dra_v1_pb2.NodePrepareResourcesRequest(), timeout=timeout)
    except grpc.RpcError as err:
        return False, f"DRA socket {dra_socket}: empty NodePrepareResources failed: {_rpc_error(err)}"
    if len(response.claims) != 0:
        return False, f"DRA socket {dra_socket}: empty NodePrepareResources answered {len(response.claims)} claims"
    return True, f"registration socket {registration_socket} and DRA socket {dra_socket} answer"


def _socket_file_problem(path: Path) -> str | None:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as err:
        return f"cannot stat: {err.strerror}"
    return None if stat.S_ISSOCK(mode) else "exists but is not a socket"


def _rpc_error(err: grpc.RpcError) -> str:
    # grpc raises objects that are both RpcError and Call; RpcError alone declares no accessors.
    code = err.code() if isinstance(err, grpc.Call) else None
    details = err.details() if isinstance(err, grpc.Call) else str(err)
    return f"{code.name if code is not None else 'UNKNOWN'}: {details}"
