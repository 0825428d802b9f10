"""The contract between the generic plugin machinery and a concrete driver."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pydantic import BaseModel, ConfigDict

from driver.kubeletplugin.claim import ResourceClaim


@dataclass(frozen=True)
class ClaimRef:
    """What the kubelet sends for each claim: enough to find it, nothing more."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"


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

    def prepare_claim(self, claim: ResourceClaim) -> PrepareResult:
        """Prepare one allocated claim; return its devices, or an error telling the user what to do."""
        ...

    def unprepare_claim(self, claim: ClaimRef) -> str | None:
        """Undo prepare from local state (the claim object may be gone); None on success.

        A claim this driver never prepared is a success.
        """
        ...
