"""Liveness check for the plugin's sockets, served on HTTP ``/healthz`` for the DaemonSet probe.

It dials both sockets the way the kubelet does and makes harmless calls: ``GetInfo`` on the
registration socket and an empty ``NodePrepareResources`` on the DRA socket. That proves the
files exist, the servers accept connections and their worker pools are not wedged.

The DRA call shares its worker pool with the kubelet's calls. When that pool is full of slow
prepares (each may wait seconds on the node lock or an MPS daemon start), the probe's call would
queue, time out, and get a healthy container restarted, killing its MPS daemons. So
:func:`check_plugin` skips the DRA call while calls are in flight and one started or finished
recently: a busy server that makes progress is alive. Only a server with calls in flight and no
progress for ``progress_window_s`` (or an idle one) is called.

It only partly covers the kubelet 1.34.0-1.34.1 failure where the kubelet loses its connection
to a healthy plugin: this check dials fresh connections, so it cannot see that the kubelet's own
connection is gone. It does catch the plugin-side half (a deleted socket or a dead server).
"""

from __future__ import annotations

import logging
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import grpc

from driver.kubeletplugin.activity import DraActivity
from driver.kubeletplugin.api import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    pluginregistration_v1_pb2,
    pluginregistration_v1_pb2_grpc,
)
from driver.kubeletplugin.registration import DRA_PLUGIN_TYPE

log = logging.getLogger(__name__)

# Per call: both calls together stay under the probe's usual 5 s timeout.
DEFAULT_TIMEOUT_S = 2.0
# Longer than any single prepare step waits (the node lock and MPS start wait at most 10 s each).
DEFAULT_PROGRESS_WINDOW_S = 60.0

T = TypeVar("T")


class LivenessTarget(Protocol):
    """What :func:`check_plugin` needs of a plugin (:class:`driver.kubeletplugin.plugin.KubeletPlugin`)."""

    @property
    def driver_name(self) -> str: ...

    @property
    def registration_socket(self) -> Path: ...

    @property
    def dra_socket(self) -> Path: ...

    def dra_activity(self) -> DraActivity: ...


def check_plugin(plugin: LivenessTarget, timeout: float = DEFAULT_TIMEOUT_S,
                 progress_window_s: float = DEFAULT_PROGRESS_WINDOW_S) -> tuple[bool, str]:
    """(ok, detail) for a plugin served by this process; ``timeout`` bounds each of the (at most two) calls.

    The registration socket is always called (it has its own worker pool). The DRA socket is
    called only when no call is in flight, or none started or finished within ``progress_window_s``.
    ``detail`` names no host path: it is served on the HTTP port. A failure is logged with the paths.
    """
    registration = _Socket("registration", plugin.registration_socket)
    dra = _Socket("DRA", plugin.dra_socket)
    try:
        _check_files(registration, dra)
        _check_registration(registration, plugin.driver_name, timeout)
        activity = plugin.dra_activity()
        if activity.in_flight > 0 and activity.seconds_since_progress < progress_window_s:
            return True, (f"{registration} answers; {dra} busy: "
                          f"{activity.in_flight} calls in flight, last progress "
                          f"{activity.seconds_since_progress:.1f}s ago")
        try:
            _check_dra(dra, timeout)
        except _SocketProblem as problem:
            if activity.in_flight > 0:
                raise _SocketProblem(f"{problem} ({activity.in_flight} calls in flight, no progress for "
                                     f"{activity.seconds_since_progress:.1f}s)") from problem
            raise
    except _SocketProblem as problem:
        log.warning("liveness check failed", extra={"problem": str(problem),
                                                    "registration_socket": str(registration.path),
                                                    "dra_socket": str(dra.path)})
        return False, str(problem)
    return True, f"{registration} and {dra} answer"


class _SocketProblem(Exception):
    """What is wrong with one socket, worded for the probe's output."""


@dataclass(frozen=True)
class _Socket:
    label: str
    path: Path

    def __str__(self) -> str:
        return f"{self.label} socket"


def _check_files(*sockets: _Socket) -> None:
    for sock in sockets:
        problem = _socket_file_problem(sock.path)
        if problem:
            raise _SocketProblem(f"{sock}: {problem}")


def _check_registration(registration: _Socket, driver_name: str, timeout: float) -> None:
    info = _call(registration, "GetInfo",
                 lambda channel: pluginregistration_v1_pb2_grpc.RegistrationStub(channel).GetInfo(
                     pluginregistration_v1_pb2.InfoRequest(), timeout=timeout))
    if info.name != driver_name or info.type != DRA_PLUGIN_TYPE:
        raise _SocketProblem(f"{registration} belongs to {info.type} {info.name!r}, "
                             f"expected {DRA_PLUGIN_TYPE} {driver_name!r}")


def _check_dra(dra: _Socket, timeout: float) -> None:
    response = _call(dra, "empty NodePrepareResources",
                     lambda channel: dra_v1_pb2_grpc.DRAPluginStub(channel).NodePrepareResources(
                         dra_v1_pb2.NodePrepareResourcesRequest(), timeout=timeout))
    if len(response.claims) != 0:
        raise _SocketProblem(f"{dra}: empty NodePrepareResources answered {len(response.claims)} claims")


def _call(sock: _Socket, rpc: str, call: Callable[[grpc.Channel], T]) -> T:
    """``call`` over a fresh channel to ``sock``, as the kubelet dials it; _SocketProblem if the RPC fails."""
    try:
        with grpc.insecure_channel(f"unix://{sock.path}") as channel:
            return call(channel)
    except grpc.RpcError as err:
        raise _SocketProblem(f"{sock}: {rpc} failed: {_rpc_error(err, sock)}") from err


def _socket_file_problem(path: Path) -> str | None:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "missing"
    except OSError as err:
        return f"cannot stat: {err.strerror}"
    return None if stat.S_ISSOCK(mode) else "exists but is not a socket"


def _rpc_error(err: grpc.RpcError, sock: _Socket) -> str:
    # grpc raises objects that are both RpcError and Call; RpcError alone declares no accessors.
    code = err.code() if isinstance(err, grpc.Call) else None
    details = err.details() if isinstance(err, grpc.Call) else str(err)
    # gRPC's connection errors quote the target ("unix:/var/lib/kubelet/..."); keep it out.
    details = (details or "").replace(f"unix://{sock.path}", "the socket").replace(f"unix:{sock.path}", "the socket")
    details = details.replace(str(sock.path), "the socket")
    return f"{code.name if code is not None else 'UNKNOWN'}: {details}"
