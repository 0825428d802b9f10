"""The contract between the generic plugin machinery and a concrete driver."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from driver.kubeletplugin.claimmodel import ResourceClaim

# Who will use a claim's devices: ``ResourceClaim.reserved_pods(timeout_s)`` reads the pods in its
# ``status.reservedFor`` on first use (one GET per pod, RBAC ``get`` on pods), and
# ``ReservedPods.host_root()`` names every container that may run as UID 0 on the host, why, and
# the field to set (``podsecurity.py``). What a driver makes of that is its own decision.
from driver.kubeletplugin.podsecurity import HostRootContainer as HostRootContainer
from driver.kubeletplugin.podsecurity import PodsUnreadable as PodsUnreadable
from driver.kubeletplugin.podsecurity import ReservedPods as ReservedPods


@dataclass(frozen=True)
class ClaimRef:
    """What the kubelet sends for each claim: enough to find it, nothing more."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


# Every prepare must finish well inside the kubelet's 45 s gRPC timeout (kubelet pkg/kubelet/cm/dra,
# defaultClientCallTimeout), so a
# claim that cannot be prepared in time gets an error the user can see, and its work is rolled
# back, rather than being cut off by the kubelet half-done.
KUBELET_PREPARE_TIMEOUT = 45.0
DEFAULT_PREPARE_DEADLINE = 30.0


class DeadlineExceeded(Exception):
    """The call's deadline passed, or its caller went away, before the work was done."""


def _always_active() -> bool:
    return True


@dataclass(frozen=True)
class Deadline:
    """When a call's work must be finished, and whether its caller still waits for it.

    Made by the plugin machinery from the kubelet's gRPC deadline, capped by the driver's own
    limit, so every step of a call can bound its waits with :meth:`remaining` and stop work the
    kubelet has given up on (:meth:`check`) instead of finishing it for nobody.
    """

    at: float  # time.monotonic() value
    is_active: Callable[[], bool] = _always_active

    @classmethod
    def after(cls, seconds: float, is_active: Callable[[], bool] = _always_active) -> Deadline:
        return cls(time.monotonic() + seconds, is_active)

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return self.remaining() <= 0 or not self.is_active()

    def check(self, before: str) -> None:
        """Raise :class:`DeadlineExceeded` naming the step ``before`` which time ran out."""
        if not self.is_active():
            raise DeadlineExceeded(f"the kubelet gave up on the call (cancelled or timed out) before {before}")
        if self.remaining() <= 0:
            raise DeadlineExceeded(f"the call's deadline passed before {before}")

    def bound(self, seconds: float) -> float:
        """``seconds`` shortened to what is left (for timeouts of individual steps)."""
        return min(seconds, self.remaining())


class PreparedDevice(BaseModel):
    """One device of a prepared claim, as the kubelet will store it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_names: list[str]
    pool_name: str
    device_name: str
    cdi_device_ids: list[str]
    share_id: str | None = None


@dataclass
class PrepareResult:
    """Outcome for one claim: devices on success, or a message that tells the user what to do."""

    devices: list[PreparedDevice] = field(default_factory=list)
    error: str | None = None


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
