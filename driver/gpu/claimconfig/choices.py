"""The enumerated values users choose from in claims and in the node sharing plan: device kinds, time-slice
intervals and who may be an MPS client."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal


class DeviceKind(StrEnum):
    """A device's ``type`` attribute, which DeviceClasses and claims select on; checkpoints and specs hold its value."""

    GPU = "gpu"
    MIG = "mig"
    MPS = "mps"
    TIMESLICE = "timeslice"
    CONSUMABLE = "consumable"


# Shares of a GPU (or MIG instance): their limits come from the node's sharing plan or the capacity they consumed.
SHARE_KINDS = (DeviceKind.MPS, DeviceKind.TIMESLICE, DeviceKind.CONSUMABLE)


TimeSliceInterval = Literal["Default", "Short", "Medium", "Long"]

# nvidia-smi compute-policy --set-timeslice values.
TIMESLICE_VALUES: dict[str, int] = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}


# Who may be a client of an MPS daemon (plan entry ``mps.clients``, per-claim ``mpsConfig.clients``):
# ``nonRoot``: only claims all of whose consumers are pods that meet Pod Security "baseline" and cannot run
# as root or group root (checked at prepare, ``driver/gpu/claim/tenancy.py``); ``any``: every claim, whose root
# processes can then change or stop the daemon, so its limits are advisory.
MpsClients = Literal["nonRoot", "any"]
