"""Dynamic MIG: the contract for creating and destroying MIG devices, and how NVML's refusals are read.

A MIG device is a GPU instance (GI) at a placement plus one compute instance (CI) spanning it. The production
partitioner is ``nvmlmig.NvmlMigPartitioner``; the simulated node's is ``driver.simulation.migengine``. Both
refuse a create with a :class:`MigCreateError` whose ``reason`` comes from :func:`create_refusal_reason`, so the
prepare path reads one vocabulary whichever is behind it.

Return codes (nvml.h, ``nvmlDeviceCreateGpuInstanceWithPlacement``; nvidia-gpu reference 3.5 and 3.6):

* ``NVML_ERROR_INVALID_ARGUMENT`` (2): "device, profileId, placement or gpuInstance are invalid", a placement
  that is not one of the profile's possible placements included;
* ``NVML_ERROR_NOT_SUPPORTED`` (3): "device doesn't have MIG mode enabled or in vGPU guest" (nvml.h of CUDA
  13.4); older headers also gave it for a profile id the GPU does not support (13.4 lists that under
  INVALID_ARGUMENT);
* ``NVML_ERROR_INSUFFICIENT_RESOURCES`` (23): "the requested GPU instance could not be created". nvml.h does not
  say more: it says only that a create "will fail if there is overlap with the already occupied memory slices".
  That an occupied placement answers this code (not INVALID_ARGUMENT, not "already exists") rests on a comment
  in NVIDIA's own DRA driver (kubernetes-sigs/dra-driver-nvidia-gpu, cmd/gpu-kubelet-plugin/nvlib.go,
  ``createMigDevice``: "one cannot rely on the error code alone. One must check the device state") and on
  InstaSlice, which lists the GIs on this code. Not checked on hardware here. One code, two causes: the caller
  tells them apart from the GPU's state (:func:`create_refusal_reason`); NVIDIA's tools do not try.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict

from driver.gpu.discovery.inventory import MigProfileInfo
from driver.gpu.errors import DriverError
from driver.gpu.host.capnodes import instance_capabilities
from driver.gpu.record.checkpoint import Checkpoint
from driver.kubeletplugin.types import Deadline

# nvml.h nvmlReturn_t values (nvidia-ml-py: NVML_ERROR_*) this module reads.
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_IN_USE = 19
NVML_ERROR_INSUFFICIENT_RESOURCES = 23
NVML_ERROR_UNKNOWN = 999

MigRefusal = Literal["occupied", "insufficient-resources", "invalid", "not-mig-mode", "failed"]


class MigGpuInstance(BaseModel):
    """A GPU instance: where it sits on its GPU and which profile it has."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gi_id: int
    gi_profile_id: int  # NVML GpuInstanceProfileInfo.id (device specific)
    placement_start: int
    placement_size: int  # memory slices occupied: [start, start + size)


class CreatedMig(MigGpuInstance):
    """A MIG device: a GPU instance and the compute instance inside it."""

    uuid: str  # "MIG-..."
    ci_id: int


class MigError(DriverError):
    """A MIG operation failed; the message names the GPU and what was asked."""


class MigCreateError(MigError):
    """A MIG device was not created, and nothing of it is left behind unless the message says so.

    ``reason``: ``occupied`` (the placement overlaps an existing GPU instance), ``insufficient-resources`` (no
    room left for the profile on this GPU), ``invalid`` (a placement or profile this GPU does not offer),
    ``not-mig-mode`` (MIG is off), ``failed`` (anything else: see the message).
    """

    def __init__(self, reason: MigRefusal, message: str) -> None:
        super().__init__(message)
        self.reason: MigRefusal = reason


class MigPartitioner(Protocol):
    """Creates and destroys MIG devices on whole GPUs (by ``GPU-...`` UUID)."""

    def create(self, gpu_uuid: str, profile: MigProfileInfo, placement_start: int,
               deadline: Deadline | None = None) -> CreatedMig:
        """A GPU instance of ``profile`` at ``placement_start`` and a compute instance spanning it.

        :class:`MigCreateError` if it cannot be made; a GPU instance made before a failure is destroyed first.
        """
        ...

    def destroy(self, gpu_uuid: str, gi_id: int, ci_id: int | None, deadline: Deadline | None = None) -> None:
        """Destroy compute instance ``ci_id`` (if given), then GPU instance ``gi_id``; already gone is done.

        :class:`MigError` if NVML refuses (e.g. processes still use it).
        """
        ...

    def instances(self, gpu_uuid: str, deadline: Deadline | None = None) -> list[CreatedMig]:
        """The MIG devices (GI + CI) on the GPU now, by placement; none when MIG is off."""
        ...

    def bare_gpu_instances(self, gpu_uuid: str, deadline: Deadline | None = None) -> list[MigGpuInstance]:
        """GPU instances with no compute instance (a create cut short between its two steps, or another tool's):
        they hold their memory slices until destroyed with ``destroy(gpu, gi_id, None)``."""
        ...

    def close(self) -> None:
        """Release what the partitioner holds (its NVML session)."""
        ...


def overlaps(start: int, size: int, existing: list[MigGpuInstance]) -> list[MigGpuInstance]:
    """The GPU instances whose memory slices meet ``[start, start + size)``."""
    return [gi for gi in existing
            if gi.placement_start < start + size and start < gi.placement_start + gi.placement_size]


def create_refusal_reason(code: int | None, mig_enabled: bool | None = None, capacity_left: int | None = None,
                          overlapping: bool | None = None) -> MigRefusal:
    """What a refused ``nvmlDeviceCreateGpuInstanceWithPlacement`` means, from its return code and the GPU's state.

    ``mig_enabled`` (for NOT_SUPPORTED), ``capacity_left`` (``nvmlDeviceGetGpuInstanceRemainingCapacity`` for the
    profile) and ``overlapping`` (whether an existing GI meets the placement) are None when unknown. No capacity
    left is reported as such even where the placement is also taken: no other placement would do either.
    """
    if code == NVML_ERROR_INSUFFICIENT_RESOURCES:
        if capacity_left != 0 and overlapping:
            return "occupied"
        return "insufficient-resources"
    if code == NVML_ERROR_INVALID_ARGUMENT:
        return "invalid"
    if code == NVML_ERROR_NOT_SUPPORTED:
        # "MIG off" (or a vGPU guest) in every header; "profile not on this GPU" in older ones.
        return "invalid" if mig_enabled else "not-mig-mode"
    return "failed"


def describe_refusal(reason: MigRefusal) -> str:
    """A clause for messages: why NVML refused, in words an operator acts on."""
    return {
        "occupied": "the placement overlaps an existing GPU instance",
        "insufficient-resources": "NVML had no room for it (the profile's instances are used up, or its memory "
                                  "slices are taken)",
        "invalid": "this GPU does not offer the profile at that placement",
        "not-mig-mode": "MIG mode is not enabled on the GPU",
        "failed": "NVML failed",
    }[reason]


def capabilities_of(cp: Checkpoint, device_uuids: Iterable[str]) -> list[str]:
    """The capabilities of the MIG devices among ``device_uuids``, as the checkpoint's claims record them (static
    MIG devices and instances created for claims alike); whole GPUs need none."""
    wanted = {u for u in device_uuids if u.startswith("MIG-")}
    found: list[str] = []
    for record in cp.claims.values():
        for dev in record.devices:
            if dev.mig_uuid in wanted and dev.mig_gi_id is not None and dev.mig_ci_id is not None:
                found += [c for c in instance_capabilities(dev.gpu_minor, dev.mig_gi_id, dev.mig_ci_id)
                          if c not in found]
    return found
