"""The GPU driver as the plugin machinery sees it: a thin adapter from claims to per-claim results."""

from __future__ import annotations

import logging
from collections.abc import Callable

from driver.gpu.errors import DriverError
from driver.gpu.state import DeviceState
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.nodelock import LockTimeout
from driver.kubeletplugin.types import ClaimRef, Deadline, PrepareResult

log = logging.getLogger(__name__)


class GpuDriver:
    """Implements :class:`driver.kubeletplugin.types.DRADriver` on top of :class:`DeviceState`."""

    def __init__(self, state: DeviceState, admit: Callable[[ResourceClaim], str | None] | None = None):
        """``admit``: why a claim must not be prepared at all (None: it may), asked before anything is done."""
        self.state = state
        self.admit = admit

    def prepare_claim(self, claim: ResourceClaim, deadline: Deadline) -> PrepareResult:
        refusal = self.admit(claim) if self.admit is not None else None
        if refusal is not None:
            return PrepareResult(error=refusal)
        try:
            return PrepareResult(devices=self.state.prepare(claim, deadline))
        except (DriverError, LockTimeout) as exc:
            return PrepareResult(error=str(exc))

    def unprepare_claim(self, claim: ClaimRef) -> str | None:
        try:
            self.state.unprepare(claim)
        except (DriverError, LockTimeout, OSError) as exc:  # OSError: the claim's files (CDI spec, checkpoint)
            return f"unprepare of {claim} failed and will be retried by the kubelet: {exc}"
        return None
