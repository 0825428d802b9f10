"""The contract between the generic plugin machinery and a concrete driver."""

from __future__ import annotations

from typing import Protocol

from driver.kubeletplugin.calls import DEFAULT_PREPARE_DEADLINE as DEFAULT_PREPARE_DEADLINE
from driver.kubeletplugin.calls import KUBELET_PREPARE_TIMEOUT as KUBELET_PREPARE_TIMEOUT
from driver.kubeletplugin.calls import ClaimRef as ClaimRef
from driver.kubeletplugin.calls import Deadline as Deadline
from driver.kubeletplugin.calls import DeadlineExceeded as DeadlineExceeded
from driver.kubeletplugin.calls import PrepareResult as PrepareResult
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.prepared import PreparedDevice as PreparedDevice

# Who will use a claim's devices (``ResourceClaim.reserved_pods``) and what of them could reach host root
# (``ReservedPods.findings()``: reservedpods.py, podsecurity.py). What a driver makes of that is its own decision.
from driver.kubeletplugin.reservedpods import Finding as Finding
from driver.kubeletplugin.reservedpods import PodsUnreadable as PodsUnreadable
from driver.kubeletplugin.reservedpods import ReservedPods as ReservedPods


class DRADriver(Protocol):
    """What a driver implements; the plugin machinery does everything else.

    The machinery fetches and checks each claim (UID, allocation), calls these once per claim,
    and turns an exception into that claim's error, so one bad claim never fails a batch.
    Calls for different claims may run concurrently.
    """

    def prepare_claim(self, claim: ResourceClaim, deadline: Deadline) -> PrepareResult:
        """Prepare one allocated claim within ``deadline``; return its devices, or an error telling the
        user what to do. Work still running when the deadline passes (or the kubelet gives up) is
        rolled back and reported as an error; the kubelet retries."""
        ...

    def unprepare_claim(self, claim: ClaimRef) -> str | None:
        """Undo prepare from local state (the claim object may be gone); None on success.

        A claim this driver never prepared is a success.
        """
        ...
