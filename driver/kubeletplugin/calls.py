"""What a kubelet call carries and when it must end: claim references, deadlines, per-claim results.

Kept free of pydantic and of the claim model: the registration path
(``driver/commands/run/startup.py``) imports the DRA services, which need these, and must not pay
for the rest before the plugin is registered.
:mod:`driver.kubeletplugin.types` re-exports all of it as part of the driver contract.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for the annotation only: the model is pydantic, imported where devices are made
    from driver.kubeletplugin.prepared import PreparedDevice


@dataclass(frozen=True)
class ClaimRef:
    """What the kubelet sends for each claim: enough to find it, nothing more."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


# Every prepare must finish well inside the kubelet's 45 s gRPC timeout (kubelet pkg/kubelet/cm/dra,
# defaultClientCallTimeout), so a claim that cannot be prepared in time gets an error the user can see,
# and its work is rolled back, rather than being cut off by the kubelet half-done.
KUBELET_PREPARE_TIMEOUT = 45.0
DEFAULT_PREPARE_DEADLINE = 30.0


class DeadlineExceeded(Exception):
    """The call's deadline passed, or its caller went away, before the work was done."""


def _always_active() -> bool:
    return True


@dataclass(frozen=True)
class Deadline:
    """When a call's work must be finished, whether its caller still waits for it, and how to name it.

    Made by the plugin machinery from the kubelet's gRPC deadline, capped by the driver's own
    limit, so every step of a call can bound its waits with :meth:`remaining` and stop work the
    kubelet has given up on (:meth:`check`) instead of finishing it for nobody. Steps with a limit
    of their own (an MPS daemon's start, one control command) make one :meth:`after` with a
    ``purpose``, or a shorter one inside it with :meth:`capped`.
    """

    at: float  # time.monotonic() value
    is_active: Callable[[], bool] = _always_active
    what: str = "the call's deadline"  # in errors, e.g. "the 10s start deadline"

    @classmethod
    def after(cls, seconds: float, is_active: Callable[[], bool] = _always_active,
              purpose: str | None = None) -> Deadline:
        what = "the call's deadline" if purpose is None else f"the {seconds:g}s {purpose} deadline"
        return cls(time.monotonic() + seconds, is_active, what)

    def remaining(self) -> float:
        """Seconds left, never negative: a deadline that passed has 0 left."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return self.remaining() <= 0 or not self.is_active()

    def check(self, before: str) -> None:
        """Raise :class:`DeadlineExceeded` naming the step ``before`` which time ran out."""
        if not self.is_active():
            raise DeadlineExceeded(f"the kubelet gave up on the call (cancelled or timed out) before {before}")
        if self.remaining() <= 0:
            raise DeadlineExceeded(f"{self.what} passed before {before}")

    def bound(self, seconds: float) -> float:
        """``seconds`` shortened to what is left (for timeouts of individual steps)."""
        return min(seconds, self.remaining())

    def capped(self, seconds: float) -> Deadline:
        """This deadline, or ``seconds`` from now if that comes first (one step's share), same name."""
        return replace(self, at=min(self.at, time.monotonic() + seconds))


@dataclass
class PrepareResult:
    """Outcome for one claim: devices on success, or a message that tells the user what to do."""

    devices: list[PreparedDevice] = field(default_factory=list)
    error: str | None = None
