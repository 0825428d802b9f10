"""SIMULATION: a MIG partitioner for the simulated node, enforcing NVIDIA's placement rules from the profile tables.

It answers as ``nvmlmig.NvmlMigPartitioner`` does on hardware: each refusal is the NVML return code the real calls
give (nvml.h, ``nvmlDeviceCreateGpuInstanceWithPlacement``; nvidia-gpu reference 3.5-3.6), read through the same
``mig.create_refusal_reason``:

* unknown GPU UUID: ``NVML_ERROR_NOT_FOUND`` from ``nvmlDeviceGetHandleByUUID`` (reason ``failed``);
* MIG mode off (or no MIG): ``NVML_ERROR_NOT_SUPPORTED`` ("device doesn't have MIG mode enabled");
* a profile id the GPU does not have: ``NVML_ERROR_NOT_SUPPORTED`` ("profile isn't supported"), MIG on: ``invalid``;
* a placement that is not one of the profile's possible placements (start, or size): ``NVML_ERROR_INVALID_ARGUMENT``;
* memory slices ``[start, start + size)`` meeting an existing GPU instance, more instances of the profile than
  its ``max_instances`` (the table's ``instanceCount``), or more compute slices than the GPU's: all
  ``NVML_ERROR_INSUFFICIENT_RESOURCES`` ("the requested GPU instance could not be created"), told apart as
  ``occupied`` or ``insufficient-resources`` from the state, as on hardware.

Destroy: CI, then GI; an unknown GI or CI is done already (NOT_FOUND), MIG off is done (NOT_SUPPORTED on the GI
lookup); a GI that still holds a compute instance not named answers ``NVML_ERROR_IN_USE``.

GPU instance ids are the lowest free from 1 (NVML hands ids out itself; their order is not documented), the compute
instance spanning a GI is CI 0, and MIG UUIDs derive from (GPU UUID, GI id, CI id), so tests can predict them: by
default with the creation's serial too (every create a new UUID), or, after :meth:`SimulatedMigPartitioner
.use_name_derived_uuids`, from those ids alone (an instance re-created at the same place gets the same UUID), the
two things NVML may do: published MIG UUIDs are name-based (version 5) and nvml.h does not say from what.
Failure injection: :meth:`SimulatedMigPartitioner.inject_failure` (kept in the state file, so it reaches the
driver process): the call answers ``NVML_ERROR_UNKNOWN``; a failed CI create destroys its GI again, as the
production partitioner does, unless a ``destroy-gi`` failure is injected too. A create can be made to hang
instead (``effect="hang"`` before its step, ``"hang-after"`` once the step is saved), logging
``SIMULATION: MIG create hangs``, so a test can kill -9 the driver between two steps; a hang that ends
(its seconds or the caller's deadline) destroys what the create made and fails, as a late NVML create does.

With ``host`` (the simulated host tree), each change also creates or removes the MIG capability files under
``/proc`` of the instance it made or destroyed, and only those, as the NVIDIA driver does
(``hostroot.sync_mig_devices``); like the kernel module it makes no ``/dev/nvidia-caps`` node.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from driver.gpu.discovery.inventory import MigProfileInfo
from driver.gpu.runtime.mig import (
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    NVML_ERROR_UNKNOWN,
    CreatedMig,
    MigCreateError,
    MigError,
    MigGpuInstance,
    create_refusal_reason,
    describe_refusal,
    overlaps,
)
from driver.kubeletplugin.types import Deadline
from driver.simulation.discovery import build_inventory, load_layout
from driver.simulation.gpus import MigProfileSpec, MigTable, gpu_models, mig_table_of
from driver.simulation.hostroot import MARKER_FILE, sync_mig_devices
from driver.simulation.migstate import (
    Fault,
    FaultCall,
    FaultEffect,
    MigState,
    MigStateFile,
    SimulatedGi,
    SimulatedMigGpuState,
    real_boot_id,
    reboot,
)

log = logging.getLogger(__name__)

_UUID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://gpu.tessera.dev/simulation/mig")
# nvmlErrorString's words for the codes used here, so messages read as they would on hardware.
_NVML_STRINGS = {NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument", NVML_ERROR_NOT_SUPPORTED: "Not Supported",
                 NVML_ERROR_NOT_FOUND: "Not Found", NVML_ERROR_IN_USE: "In use by another client",
                 NVML_ERROR_INSUFFICIENT_RESOURCES: "Insufficient Resources", NVML_ERROR_UNKNOWN: "Unknown Error"}


def simulated_mig_device_uuid(gpu_uuid: str, gi_id: int, ci_id: int, serial: int | None) -> str:
    """A created MIG device's UUID: with the creation ``serial``, a new one for every create (also at the GI/CI ids
    of an instance destroyed before); without (None), the same for every instance at these ids, as NVML would give
    if it derives the name-based UUID from the GPU and the ids alone (docs/sharing.md, "Whose MIG instance")."""
    name = f"{gpu_uuid}/gi/{gi_id}/ci/{ci_id}" + ("" if serial is None else f"/{serial}")
    return f"MIG-{uuid.uuid5(_UUID_NAMESPACE, name)}"


class SimulatedMigGpu(BaseModel):
    """A GPU of the simulated node as the engine sees it: its MIG table, MIG mode and what it holds at boot."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uuid: str
    mig_enabled: bool
    table: MigTable | None  # None: no MIG at all
    boot_instances: tuple[SimulatedGi, ...] = ()
    minor: int | None = None  # /dev/nvidia<minor>: where its capability files go in the host tree


@dataclass(frozen=True)
class SimulatedMigHost:
    """The simulated host tree whose MIG capability files under /proc the engine keeps (``hostroot.py``)."""

    root: Path  # --host-root: /proc is under it


class _Hang(Exception):
    """An injected hang: raised out of the state lock, then waited out by the caller."""

    def __init__(self, seconds: float, made_gi: int | None) -> None:
        super().__init__(f"hang of {seconds} s")
        self.seconds = seconds
        self.made_gi = made_gi


def _nvml(code: int) -> str:
    return f"NVML error {code}: {_NVML_STRINGS.get(code, 'Unknown Error')}"


class SimulatedMigPartitioner:
    """SIMULATION: :class:`~driver.gpu.runtime.mig.MigPartitioner` over the state file (``migstate.py``)."""

    def __init__(self, state: Path, gpus: Mapping[str, SimulatedMigGpu],
                 boot_id: Callable[[], str | None] = real_boot_id, host: SimulatedMigHost | None = None) -> None:
        self.state_file = MigStateFile(state, boot_id)
        self._gpus = dict(gpus)
        # Only a tree the simulation built (its marker file): never files under a real /proc or /dev.
        self._host = host if host is not None and (host.root / MARKER_FILE).is_file() else None

    @classmethod
    def for_layout(cls, layout_name_or_path: str, node_name: str, state: Path,
                   boot_id: Callable[[], str | None] = real_boot_id,
                   host: SimulatedMigHost | None = None) -> SimulatedMigPartitioner:
        """The partitioner of the simulated node ``layout_name_or_path`` (GPU UUIDs seeded by ``node_name``)."""
        label, node = load_layout(layout_name_or_path)
        models = gpu_models()
        gpus: dict[str, SimulatedMigGpu] = {}
        for entry, info in zip(node.gpus, build_inventory(label, node, node_name).gpus, strict=True):
            model = models[entry.model]
            table = mig_table_of(model) if model.mig_profiles else None
            boot = tuple(SimulatedGi(gi_id=m.gi_id, gi_profile_id=m.gi_profile_id, placement_start=m.placement_start,
                                     placement_size=m.placement_size, ci_id=m.ci_id, uuid=m.uuid,
                                     ci_profile_enum=_ci_enum(table, m.gi_profile_id))
                         for m in info.mig_instances)
            gpus[info.uuid] = SimulatedMigGpu(uuid=info.uuid, mig_enabled=info.mig_enabled, table=table,
                                              boot_instances=boot, minor=info.minor)
        return cls(state, gpus, boot_id, host)

    # ------------------------------------------------------------------------------------------ the protocol

    def create(self, gpu_uuid: str, profile: MigProfileInfo, placement_start: int,
               deadline: Deadline | None = None) -> CreatedMig:
        what = f"create MIG {profile.name} (GI profile {profile.gi_profile_id}) at placement {placement_start}"
        gpu = self._gpu(gpu_uuid, what, MigCreateError)
        with self._changing() as state:
            try:
                return self._create(state, gpu, profile, placement_start, f"{what} on {gpu_uuid}")
            except _Hang as exc:
                hang = exc
        raise self._hung(hang, gpu, f"{what} on {gpu_uuid}", deadline)

    def destroy(self, gpu_uuid: str, gi_id: int, ci_id: int | None, deadline: Deadline | None = None) -> None:
        what = f"destroy MIG GI {gi_id}" + (f" CI {ci_id}" if ci_id is not None else "")
        gpu = self._gpu(gpu_uuid, what, MigError)
        if not gpu.mig_enabled:
            return  # nvmlDeviceGetGpuInstanceById: NOT_SUPPORTED, MIG off: nothing can be left
        with self._changing() as state:
            self._destroy(state, gpu, gi_id, ci_id, f"{what} on {gpu_uuid}")

    def instances(self, gpu_uuid: str, deadline: Deadline | None = None) -> list[CreatedMig]:
        return [m for m in self._listed(gpu_uuid) if isinstance(m, CreatedMig)]

    def bare_gpu_instances(self, gpu_uuid: str, deadline: Deadline | None = None) -> list[MigGpuInstance]:
        return [m for m in self._listed(gpu_uuid) if not isinstance(m, CreatedMig)]

    def close(self) -> None:
        """Nothing to release: no NVML session in a simulation."""

    # ------------------------------------------------------------------------------------------ test helpers

    def inject_failure(self, call: FaultCall, gpu: str | None = None, profile: str | None = None,
                       placement: int | None = None, times: int | None = 1, effect: FaultEffect = "fail",
                       seconds: float = 300.0) -> None:
        """Make the next ``times`` matching calls (every one: None) fail with NVML_ERROR_UNKNOWN, or hang
        (``effect``, creates only: :class:`~driver.simulation.migstate.Fault`)."""
        with self.state_file.changing() as state:
            state.faults.append(Fault(call=call, gpu=gpu, profile=profile, placement=placement, times=times,
                                      effect=effect, seconds=seconds))

    def use_name_derived_uuids(self) -> None:
        """From now on (for every process using the state file) a MIG device's UUID derives from its GPU and
        GI/CI ids alone: an instance re-created at the same ids gets the UUID of the one destroyed there."""
        with self.state_file.changing() as state:
            state.uuid_mode = "name-derived"

    def clear_failures(self) -> None:
        with self.state_file.changing() as state:
            state.faults.clear()

    def reboot(self) -> None:
        """SIMULATION: the node rebooted: created instances are gone, each GPU holds its layout's again."""
        reboot(self.state_file)
        with self._changing():
            pass  # the host tree follows: only the layout's instances' files and nodes are left

    # ------------------------------------------------------------------------------------------ the host tree

    @contextmanager
    def _changing(self) -> Iterator[MigState]:
        """The state under its lock; the host tree rewritten from it afterwards, also when the change raised."""
        with self.state_file.changing() as state:
            try:
                yield state
            finally:
                if self._host is not None:
                    sync_mig_devices(self._host.root, {
                        gpu.minor: [(g.gi_id, g.ci_id) for g in self._gis(state, gpu)]
                        for gpu in self._gpus.values() if gpu.minor is not None and gpu.mig_enabled})

    def _hung(self, hang: _Hang, gpu: SimulatedMigGpu, what: str, deadline: Deadline | None) -> MigCreateError:
        """Wait out an injected hang; what the create made is then destroyed, as a create returning too late is."""
        log.warning("SIMULATION: MIG create hangs (injected)", extra={"what": what, "seconds": hang.seconds,
                                                                       "gi_made": hang.made_gi})
        threading.Event().wait(hang.seconds if deadline is None else min(hang.seconds, deadline.remaining()))
        if hang.made_gi is not None:
            with self._changing() as state:
                self._save(state, gpu, [g for g in self._gis(state, gpu) if g.gi_id != hang.made_gi])
        return MigCreateError("failed", f"{what}: {_nvml(NVML_ERROR_UNKNOWN)} (SIMULATION: an injected hang ended); "
                                        "what it made was destroyed again")

    # ------------------------------------------------------------------------------------------ the rules

    def _gpu(self, gpu_uuid: str, what: str, error: type[MigError]) -> SimulatedMigGpu:
        gpu = self._gpus.get(gpu_uuid)
        if gpu is None:  # nvmlDeviceGetHandleByUUID
            message = f"{what} on {gpu_uuid}: {_nvml(NVML_ERROR_NOT_FOUND)}"
            raise MigCreateError("failed", message) if error is MigCreateError else MigError(message)
        return gpu

    def _gis(self, state: MigState, gpu: SimulatedMigGpu) -> list[SimulatedGi]:
        """The GPU's GPU instances, its layout's until the engine first changes it (then in the state)."""
        entry = state.gpus.get(gpu.uuid)
        return list(entry.gis) if entry is not None else list(gpu.boot_instances)

    def _save(self, state: MigState, gpu: SimulatedMigGpu, gis: list[SimulatedGi]) -> None:
        state.gpus[gpu.uuid] = SimulatedMigGpuState(gis=sorted(gis, key=lambda g: g.placement_start))

    def _create(self, state: MigState, gpu: SimulatedMigGpu, profile: MigProfileInfo, start: int,
                what: str) -> CreatedMig:
        table = gpu.table
        spec = table.by_id(profile.gi_profile_id) if table is not None else None

        def refuse(code: int, detail: str = "", capacity_left: int | None = None,
                   overlapping: list[MigGpuInstance] | None = None) -> MigCreateError:
            reason = create_refusal_reason(code, gpu.mig_enabled, capacity_left, bool(overlapping))
            return MigCreateError(reason, f"{what} refused: {describe_refusal(reason)}{detail} ({_nvml(code)})")

        if table is None or not gpu.mig_enabled:
            raise refuse(NVML_ERROR_NOT_SUPPORTED)
        if spec is None:
            raise refuse(NVML_ERROR_NOT_SUPPORTED, f" (no GI profile {profile.gi_profile_id} on this GPU)")
        gi_fault = state.take_fault("create-gi", gpu.uuid, spec.name, start)
        if gi_fault is not None and gi_fault.effect == "fail":
            raise MigCreateError("failed", f"{what}: {_nvml(NVML_ERROR_UNKNOWN)} (SIMULATION: injected)")
        if gi_fault is not None and gi_fault.effect == "hang":
            raise _Hang(gi_fault.seconds, None)
        if start not in spec.placement_starts or profile.memory_slices != spec.memory_slices:
            raise refuse(NVML_ERROR_INVALID_ARGUMENT, f" (possible placements: "
                         f"{', '.join(f'{s}:{spec.memory_slices}' for s in spec.placement_starts)})")
        gis = self._gis(state, gpu)
        existing = [_gi(g) for g in gis]
        overlapping = overlaps(start, spec.memory_slices, existing)
        left = _remaining_capacity(table, spec, gis)
        if overlapping or left == 0:
            taken = ", ".join(f"GI {g.gi_id} at {g.placement_start}:{g.placement_size}" for g in overlapping)
            raise refuse(NVML_ERROR_INSUFFICIENT_RESOURCES, f" ({taken})" if taken else "", left, overlapping)
        gi = SimulatedGi(gi_id=_lowest_free_id({g.gi_id for g in gis}), gi_profile_id=spec.gi_profile_id,
                         placement_start=start, placement_size=spec.memory_slices)
        if gi_fault is not None:  # hang-after: the GI exists, its CI not yet
            self._save(state, gpu, [*gis, gi])
            raise _Hang(gi_fault.seconds, gi.gi_id)
        ci_fault = state.take_fault("create-ci", gpu.uuid, spec.name, start)
        if ci_fault is not None and ci_fault.effect == "hang":
            self._save(state, gpu, [*gis, gi])
            raise _Hang(ci_fault.seconds, gi.gi_id)
        if ci_fault is not None and ci_fault.effect == "fail":
            # As NvmlMigPartitioner: the GI is destroyed again before the error, unless that fails too.
            if state.take_fault("destroy-gi", gpu.uuid, spec.name, start) is not None:
                self._save(state, gpu, [*gis, gi])
                left_behind = "destroying the GPU instance again failed too: it holds its memory slices"
            else:
                left_behind = "it was destroyed again"
            raise MigCreateError("failed", f"{what}: the GPU instance was made, then {_nvml(NVML_ERROR_UNKNOWN)} "
                                           f"(SIMULATION: injected); {left_behind}")
        state.instances_created += 1
        serial = state.instances_created if state.uuid_mode == "per-create" else None
        made = gi.model_copy(update={"ci_id": 0, "ci_profile_enum": spec.ci_profile_enum,
                                     "uuid": simulated_mig_device_uuid(gpu.uuid, gi.gi_id, 0, serial)})
        self._save(state, gpu, [*gis, made])
        if ci_fault is not None:  # hang-after: the MIG device exists and nobody was told yet
            raise _Hang(ci_fault.seconds, gi.gi_id)
        return _created(made)

    def _destroy(self, state: MigState, gpu: SimulatedMigGpu, gi_id: int, ci_id: int | None, what: str) -> None:
        gis = self._gis(state, gpu)
        gi = next((g for g in gis if g.gi_id == gi_id), None)
        if gi is None:
            return  # gone already
        spec = gpu.table.by_id(gi.gi_profile_id) if gpu.table is not None else None
        name = spec.name if spec is not None else None
        others = [g for g in gis if g.gi_id != gi_id]
        if ci_id is not None and gi.ci_id == ci_id:
            if state.take_fault("destroy-ci", gpu.uuid, name, gi.placement_start) is not None:
                raise MigError(f"{what}: destroying CI {ci_id} failed: {_nvml(NVML_ERROR_UNKNOWN)} "
                               "(SIMULATION: injected)")
            gi = gi.model_copy(update={"ci_id": None, "ci_profile_enum": None, "uuid": None})
            self._save(state, gpu, [*others, gi])
        if gi.ci_id is not None:
            raise MigError(f"{what}: destroying GI {gi_id} failed: {_nvml(NVML_ERROR_IN_USE)}; processes or "
                           f"other compute instances still use it (CI {gi.ci_id})")
        if state.take_fault("destroy-gi", gpu.uuid, name, gi.placement_start) is not None:
            raise MigError(f"{what}: destroying GI {gi_id} failed: {_nvml(NVML_ERROR_UNKNOWN)} (SIMULATION: injected)")
        self._save(state, gpu, others)

    def _listed(self, gpu_uuid: str) -> list[MigGpuInstance]:
        gpu = self._gpu(gpu_uuid, "list MIG devices", MigError)
        if not gpu.mig_enabled:
            return []
        return [_created(g) if g.ci_id is not None else _gi(g) for g in self._gis(self.state_file.read(), gpu)]


def _gi(g: SimulatedGi) -> MigGpuInstance:
    return MigGpuInstance(gi_id=g.gi_id, gi_profile_id=g.gi_profile_id, placement_start=g.placement_start,
                          placement_size=g.placement_size)


def _created(g: SimulatedGi) -> CreatedMig:
    if g.ci_id is None or g.uuid is None:
        raise ValueError(f"GI {g.gi_id} has no compute instance")
    return CreatedMig(**_gi(g).model_dump(), uuid=g.uuid, ci_id=g.ci_id)


def _ci_enum(table: MigTable | None, gi_profile_id: int) -> int | None:
    spec = table.by_id(gi_profile_id) if table is not None else None
    return spec.ci_profile_enum if spec is not None else None


def _lowest_free_id(taken: set[int]) -> int:
    return next(i for i in range(1, len(taken) + 2) if i not in taken)


def _remaining_capacity(table: MigTable, spec: MigProfileSpec, gis: list[SimulatedGi]) -> int:
    """What ``nvmlDeviceGetGpuInstanceRemainingCapacity`` answers for ``spec``: how many more fit, all rules kept."""
    used_compute = 0
    for g in gis:
        held = table.by_id(g.gi_profile_id)
        used_compute += held.compute_slices if held is not None else 0
    by_compute = (table.total_compute_slices - used_compute) // spec.compute_slices
    by_count = spec.max_instances - sum(1 for g in gis if g.gi_profile_id == spec.gi_profile_id)
    by_engines = _engines_left(table, spec, gis)
    taken = [_gi(g) for g in gis]
    free_placements = 0
    for start in spec.placement_starts:  # greedy, in order: a profile's placements are aligned to its size
        if not overlaps(start, spec.memory_slices, taken):
            free_placements += 1
            taken.append(MigGpuInstance(gi_id=-1, gi_profile_id=spec.gi_profile_id, placement_start=start,
                                        placement_size=spec.memory_slices))
    return max(0, min(by_compute, by_count, by_engines, free_placements))


def _engines_left(table: MigTable, spec: MigProfileSpec, gis: list[SimulatedGi]) -> int:
    """How many more ``spec`` instances the GPU's decoders, JPEG and OFA engines allow: an instance takes its
    profile's engines from the GPU's, which are the whole-GPU profile's (the GPU has one OFA: one ``+me``)."""
    whole = max(table.profiles, key=lambda p: (p.memory_slices, p.compute_slices))
    held = [p for g in gis if (p := table.by_id(g.gi_profile_id)) is not None]
    fits = table.total_compute_slices
    for name in ("decoders", "jpeg_engines", "ofa_engines"):
        total, need = getattr(whole.engines, name), getattr(spec.engines, name)
        if total is None or not need:
            continue
        fits = min(fits, (total - sum(getattr(p.engines, name) or 0 for p in held)) // need)
    return fits
