"""Dynamic MIG in the checkpoint: the instance a claim's device is to have, recorded before it is created.

A prepared device of a dynamic MIG placement carries a :class:`DynamicMigRecord` from its claim's
``PrepareStarted`` record on: the profile (with what creating it again needs, so a reboot can be
undone without asking NVML for the profile table) and the placement. The created instance's GPU/compute
instance ids and MIG UUID go into the device record's ``mig_*`` fields once it exists, as for static MIG.

``create_started`` is set (durably) after the placement was found free of instances Tessera did not
create and before NVML is asked to create one there. Recovery relies on it: an instance of this profile
at exactly this placement, with ``create_started`` and no ids recorded, can only be the one this create
made (see ``runtime/migruntime.py``); without it, nothing at the placement is touched.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from driver.gpu.discovery.inventory import MigProfileInfo
from driver.gpu.discovery.migplacement import MigPlacement


class DynamicMigRecord(BaseModel):
    # Ignore unknown fields: it lives in the checkpoint, which must load after a rollback.
    model_config = ConfigDict(extra="ignore")

    profile: str  # e.g. "3g.40gb"
    gi_profile_id: int  # NVML's GPU instance profile id (device specific)
    ci_profile_id: int  # the compute instance profile spanning the GI
    compute_slices: int
    memory_slices: int  # the placement's size
    memory_bytes: int
    multiprocessors: int
    placement_start: int = Field(ge=0)
    create_started: bool = False

    @property
    def placement_end(self) -> int:
        """One past the last memory slice the instance covers."""
        return self.placement_start + self.memory_slices

    def describe(self) -> str:
        """``3g.40gb at placement 4`` (memory slices 4-7), for messages."""
        return f"{self.profile} at placement {self.placement_start} (memory slices {self.placement_start}-" \
               f"{self.placement_end - 1})"

    def profile_info(self) -> MigProfileInfo:
        """What the partitioner's create takes (placements left out: the start was checked when published)."""
        return MigProfileInfo(name=self.profile, gi_profile_id=self.gi_profile_id, ci_profile_id=self.ci_profile_id,
                              compute_slices=self.compute_slices, memory_slices=self.memory_slices,
                              memory_bytes=self.memory_bytes, multiprocessors=self.multiprocessors)


def intent_for(placement: MigPlacement) -> DynamicMigRecord:
    """The record of an instance to be created at ``placement``."""
    p = placement.profile
    return DynamicMigRecord(profile=p.name, gi_profile_id=p.gi_profile_id, ci_profile_id=p.ci_profile_id,
                            compute_slices=p.compute_slices, memory_slices=p.memory_slices,
                            memory_bytes=p.memory_bytes, multiprocessors=p.multiprocessors,
                            placement_start=placement.start)
