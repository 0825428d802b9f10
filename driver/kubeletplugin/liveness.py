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
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import grpc

from driver.kubeletplugin.api import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    pluginregistration_v1_pb2,
    pluginregistration_v1_pb2_grpc,
)
from driver.kubeletplugin.registration import DRA_PLUGIN_TYPE

DEFAULT_TIMEOUT_S = 5.0

T = TypeVar("T")


def check_sockets(registration_socket: Path, dra_socket: Path, driver_name: str,
                  timeout: float = DEFAULT_TIMEOUT_S) -> tuple[bool, str]:
    """(ok, detail): whether both sockets answer like a registered DRA plugin should."""
    try:
        _check_sockets(registration_socket, dra_socket, driver_name, timeout)
    except _SocketProblem as problem:
        return False, str(problem)
    return True, f"registration socket {registration_socket} and DRA socket {dra_socket} answer"


class _SocketProblem(Exception):
    """What is wrong with one socket, worded for the probe's output."""


def _check_sockets(registration_socket: Path, dra_socket: Path, driver_name: str, timeout: float) -> None:
    for label, path in (("registration", registration_socket), ("DRA", dra_socket)):
        problem = _socket_file_problem(path)
        if problem:
            raise _SocketProblem(f"{label} socket {path}: {problem}")
    info = _call("registration", registration_socket, "GetInfo",
                 lambda channel: pluginregistration_v1_pb2_grpc.RegistrationStub(channel).GetInfo(
                     pluginregistration_v1_pb2.InfoRequest(), timeout=timeout))
    if info.name != driver_name or info.type != DRA_PLUGIN_TYPE:
        raise _SocketProblem(f"registration socket {registration_socket} belongs to {info.type} {info.name!r}, "
                             f"expected {DRA_PLUGIN_TYPE} {driver_name!r}")
    response = _call("DRA", dra_socket, "empty NodePrepareResources",
                     lambda channel: dra_v1_pb2_grpc.DRAPluginStub(channel).NodePrepareResources(
                         dra_v1_pb2.NodePrepareResourcesRequest(), timeout=timeout))
    if len(response.claims) != 0:
        raise _SocketProblem(f"DRA socket {dra_socket}: empty NodePrepareResources answered "
                             f"{len(response.claims)} claims")


def _call(label: str, socket: Path, rpc: str, call: Callable[[grpc.Channel], T]) -> T:
    """``call`` over a fresh channel to ``socket``, as the kubelet dials it; _SocketProblem if the RPC fails."""
    try:
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            return call(channel)
    except grpc.RpcError as err:
        raise _SocketProblem(f"{label} socket {socket}: {rpc} failed: {_rpc_error(err)}") from err


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
