"""The device naming scheme users depend on (they select devices by these names), and its parser.

Pure logic, no I/O. Names:

* whole GPU: ``gpu-<minor>``;
* MIG device (an instance that exists): ``gpu-<minor>-mig-<profile fragment>-<placement start>``
  (``gpu-0-mig-1g10gb-3``);
* shares: ``gpu-<minor>-mps-<k>`` / ``gpu-<minor>-ts-<k>``, k = 0 .. count-1;
* shares of a MIG instance: its MIG device name followed by ``-mps-<k>`` / ``-ts-<k>``
  (``gpu-0-mig-1g10gb-6-ts-1``), published instead of the instance's own name, which no share name equals;
* consumable GPU (one device many claims share by capacity): ``gpu-<minor>-shared``;
* dynamic MIG placement (an instance prepare will create): ``gpu-<minor>-dynmig-<profile fragment>-<start>``
  (``gpu-0-dynmig-3g40gb-4``); its GPU's counter set (not a device) is ``gpu-<minor>-counter-set``.

A placement is never named as the instance that could later stand at the same place: if something
other than Tessera creates an instance there between a claim's allocation and its prepare (and the
GPU is then published as that static MIG device), the claim's name must not resolve to that instance,
which another workload may be using.

The minor (``/dev/nvidia<minor>``) is used rather than the NVML index because the index changes
when a GPU drops off the bus.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict

from driver.gpu.claimconfig.choices import DeviceKind
from driver.gpu.discovery.migprofiles import device_name_fragment
from driver.kubeletplugin.slicelimits import MAX_DEVICE_NAME_LENGTH

ShareStrategy = Literal["MPS", "TimeSlicing"]

_SHARE_INFIX: dict[ShareStrategy, str] = {"MPS": "mps", "TimeSlicing": "ts"}
_KIND_BY_SHARE_INFIX = {"mps": DeviceKind.MPS, "ts": DeviceKind.TIMESLICE}


# --- names -------------------------------------------------------------------------------------


def _checked_name(name: str) -> str:
    if len(name) > MAX_DEVICE_NAME_LENGTH:
        raise ValueError(f"device name {name!r} is longer than {MAX_DEVICE_NAME_LENGTH} characters (a DNS label)")
    return name


def gpu_device_name(minor: int) -> str:
    if minor < 0:
        raise ValueError(f"GPU minor must be >= 0, got {minor}")
    return f"gpu-{minor}"


def mig_device_name(minor: int, profile: str, placement_start: int) -> str:
    return _mig_name(minor, "mig", profile, placement_start)


def dynamic_mig_device_name(minor: int, profile: str, placement_start: int) -> str:
    return _mig_name(minor, "dynmig", profile, placement_start)


def _mig_name(minor: int, infix: str, profile: str, placement_start: int) -> str:
    if placement_start < 0:
        raise ValueError(f"MIG placement start must be >= 0, got {placement_start}")
    name = _checked_name(f"{gpu_device_name(minor)}-{infix}-{device_name_fragment(profile)}-{placement_start}")
    if _MIG_SHARE_NAME.match(name):
        # A profile ending in "-<n>-ts" would name an instance as another instance's share.
        raise ValueError(f"MIG profile {profile!r} gives device name {name!r}, which reads as a share's name")
    return name


def share_device_name(minor: int, strategy: ShareStrategy, k: int) -> str:
    return f"{gpu_device_name(minor)}{_share_suffix(strategy, k)}"


def mig_share_device_name(minor: int, profile: str, placement_start: int, strategy: ShareStrategy, k: int) -> str:
    """Share ``k`` of the MIG instance of ``profile`` at ``placement_start``: its MIG device name plus the suffix."""
    return _checked_name(f"{mig_device_name(minor, profile, placement_start)}{_share_suffix(strategy, k)}")


def _share_suffix(strategy: ShareStrategy, k: int) -> str:
    if strategy not in _SHARE_INFIX:
        raise ValueError(f"share strategy must be one of {sorted(_SHARE_INFIX)}, got {strategy!r}")
    if k < 0:
        raise ValueError(f"share index must be >= 0, got {k}")
    return f"-{_SHARE_INFIX[strategy]}-{k}"


def consumable_device_name(minor: int) -> str:
    return f"{gpu_device_name(minor)}-shared"


def counter_set_name(minor: int) -> str:
    """The counter set of a dynamic MIG GPU (a DNS label, as counter set names must be)."""
    return _checked_name(f"{gpu_device_name(minor)}-counter-set")


class ParsedDeviceName(BaseModel):
    """What a device name says. ``mig_profile`` is the name fragment (``1g10gb``), not the profile; a share of a
    MIG instance has it, ``placement_start`` and ``share_index``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: DeviceKind
    minor: int
    mig_profile: str | None = None
    placement_start: int | None = None
    share_index: int | None = None
    dynamic: bool = False  # a dynamic MIG placement (``-dynmig-``): the instance is created at prepare


_NUMBER = r"(0|[1-9][0-9]*)"
_GPU_NAME = re.compile(rf"^gpu-{_NUMBER}$")
_MIG_NAME = re.compile(rf"^gpu-{_NUMBER}-(mig|dynmig)-([a-z0-9]+(?:-[a-z0-9]+)*)-{_NUMBER}$")
_SHARE_NAME = re.compile(rf"^gpu-{_NUMBER}-(mps|ts)-{_NUMBER}$")
_CONSUMABLE_NAME = re.compile(rf"^gpu-{_NUMBER}-shared$")
# Matched before _MIG_NAME, whose fragment would otherwise take "-<start>-ts" in.
_MIG_SHARE_NAME = re.compile(rf"^gpu-{_NUMBER}-mig-([a-z0-9]+(?:-[a-z0-9]+)*)-{_NUMBER}-(mps|ts)-{_NUMBER}$")


def parse_device_name(name: str) -> ParsedDeviceName:
    """Parse a name this driver publishes; ValueError for anything else."""
    if match := _GPU_NAME.match(name):
        return ParsedDeviceName(kind=DeviceKind.GPU, minor=int(match[1]))
    if match := _SHARE_NAME.match(name):
        return ParsedDeviceName(kind=_KIND_BY_SHARE_INFIX[match[2]], minor=int(match[1]), share_index=int(match[3]))
    if match := _CONSUMABLE_NAME.match(name):
        return ParsedDeviceName(kind=DeviceKind.CONSUMABLE, minor=int(match[1]))
    if match := _MIG_SHARE_NAME.match(name):
        return ParsedDeviceName(kind=_KIND_BY_SHARE_INFIX[match[4]], minor=int(match[1]), mig_profile=match[2],
                                placement_start=int(match[3]), share_index=int(match[5]))
    if match := _MIG_NAME.match(name):
        return ParsedDeviceName(kind=DeviceKind.MIG, minor=int(match[1]), mig_profile=match[3],
                                placement_start=int(match[4]), dynamic=match[2] == "dynmig")
    raise ValueError(
        f"device name {name!r} is not one of this driver's: expected gpu-<minor>, "
        "gpu-<minor>-mig-<profile>-<start>, gpu-<minor>-dynmig-<profile>-<start>, gpu-<minor>-mps-<k>, "
        "gpu-<minor>-ts-<k>, gpu-<minor>-mig-<profile>-<start>-mps-<k>, gpu-<minor>-mig-<profile>-<start>-ts-<k> "
        "or gpu-<minor>-shared"
    )


def device_kind(name: str) -> DeviceKind:
    """The ``type`` attribute of a device, from its name alone (the prepare path has only the name)."""
    return parse_device_name(name).kind
