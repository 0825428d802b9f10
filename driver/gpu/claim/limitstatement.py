"""The published limit statement of MPS shares whose daemon's limits cannot be confirmed now.

``memoryLimitEnforcement`` / ``computeLimitEnforcement`` say how a share's limits hold (docs/sharing.md,
"Enforcement, honestly"). While a client holds a daemon's control socket so that the driver cannot
read its limits back for longer than the watch interval, they may have been changed: the shares of the
GPUs that daemon serves are published as ``mps-unconfirmed`` until a read-back confirms them, so CEL
selectors on the statement stop choosing them meanwhile.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from driver.gpu.published.sharelayout import Enforcement
from driver.gpu.record.checkpoint import Checkpoint
from driver.kubeletplugin.slicemodel import Device, string_attr

_STATEMENTS = ("memoryLimitEnforcement", "computeLimitEnforcement")
_MPS_LEVELS = {Enforcement.MPS_PER_PROCESS.value, Enforcement.MPS_ADVISORY.value}


def unconfirmed_gpus(cp: Checkpoint) -> set[str]:
    """GPUs served by daemons whose limits count as unconfirmed."""
    return {uuid for daemon_id in cp.mps_limits_unconfirmed if (d := cp.mps_daemons.get(daemon_id)) is not None
            for uuid in d.spec.gpu_uuids}


def with_unconfirmed_limits(devices: Sequence[Device], gpu_uuids: Iterable[str]) -> list[Device]:
    """``devices``, those of ``gpu_uuids`` that state an MPS level stating ``mps-unconfirmed`` instead."""
    gpus = set(gpu_uuids)
    if not gpus:
        return list(devices)
    out = []
    for device in devices:
        parent = device.attributes.get("parentUUID")
        stated = [device.attributes[k].string for k in _STATEMENTS if k in device.attributes]
        if parent is not None and parent.string in gpus and any(level in _MPS_LEVELS for level in stated):
            attributes = {**device.attributes, **{k: string_attr(Enforcement.MPS_UNCONFIRMED.value)
                                                  for k in _STATEMENTS if k in device.attributes}}
            device = device.model_copy(update={"attributes": attributes})
        out.append(device)
    return out
