"""The DRA node gRPC services (v1 and v1beta1 ``DRAPlugin``) that the kubelet calls.

The servicers only translate protobuf messages; what happens to the claims is behind
:class:`ClaimCalls` (:class:`driver.kubeletplugin.claimbatch.ClaimBatch`, behind the plugin's
:class:`driver.kubeletplugin.startgate.StartGate` while the driver initialises). The RPC always
succeeds: every claim gets its own answer or error. This module is on the registration path, so it
imports nothing heavier than grpc and the generated stubs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from driver.kubeletplugin.api import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from driver.kubeletplugin.calls import ClaimRef

if TYPE_CHECKING:
    from driver.kubeletplugin.calls import PrepareResult


class ClaimCalls(Protocol):
    """Prepare and unprepare the claims of one kubelet request, answering every claim."""

    def prepare(self, refs: Sequence[ClaimRef], is_active: Callable[[], bool],
                time_remaining: float | None = None) -> Mapping[str, PrepareResult]:
        """Result per claim UID; ``time_remaining`` is the caller's deadline in seconds, None without one."""
        ...

    def unprepare(self, refs: Sequence[ClaimRef], is_active: Callable[[], bool],
                  time_remaining: float | None = None) -> Mapping[str, str | None]:
        """Error per claim UID, None for success."""
        ...


class _DRAPluginServicer:
    """``k8s.io.kubelet.pkg.apis.dra.<version>.DRAPlugin``: v1 (kubelet 1.34+) and v1beta1 (kubelet 1.32/1.33)
    have the same messages in their own modules, except that v1beta1's Device has no share_id."""

    def __init__(self, calls: ClaimCalls, pb: Any, *, share_ids: bool):
        self._calls = calls
        self._pb = pb
        self._share_ids = share_ids

    def NodePrepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        response = self._pb.NodePrepareResourcesResponse()
        for uid, result in self._calls.prepare(_refs(request.claims), context.is_active,
                                               context.time_remaining()).items():
            entry = response.claims[uid]  # reading a map key creates the entry: the claim is answered
            if result.error:
                entry.error = result.error
                continue
            for device in result.devices:
                wire = entry.devices.add(request_names=device.request_names, pool_name=device.pool_name,
                                         device_name=device.device_name, cdi_device_ids=device.cdi_device_ids)
                if device.share_id is not None and self._share_ids:
                    wire.share_id = device.share_id
        return response

    def NodeUnprepareResources(self, request: Any, context: grpc.ServicerContext) -> Any:
        response = self._pb.NodeUnprepareResourcesResponse()
        for uid, error in self._calls.unprepare(_refs(request.claims), context.is_active,
                                                context.time_remaining()).items():
            response.claims[uid].error = error or ""
        return response


def add_dra_services(server: grpc.Server, calls: ClaimCalls) -> None:
    """Serve both DRA API versions from ``server``."""
    dra_v1_pb2_grpc.add_DRAPluginServicer_to_server(_DRAPluginServicer(calls, dra_v1_pb2, share_ids=True), server)
    dra_v1beta1_pb2_grpc.add_DRAPluginServicer_to_server(
        _DRAPluginServicer(calls, dra_v1beta1_pb2, share_ids=False), server)


def _refs(claims: Iterable[dra_v1_pb2.Claim | dra_v1beta1_pb2.Claim]) -> list[ClaimRef]:
    return [ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims]
