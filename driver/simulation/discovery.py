"""SIMULATION: a Discovery that reports a simulated node instead of asking NVML.

The node comes from a named layout in ``layouts.yaml`` (or a YAML file holding one layout).
Everything is deterministic: UUIDs derive from the node name and GPU minor (and the MIG
placement), so a restarted simulated driver sees the same GPUs, as a real one would. The
layout is validated like the hardware would: unknown models or profiles, placements the
profile does not allow, overlapping or over-subscribed MIG devices are errors naming the entry.

MIG GPUs also report the profiles they can create (dynamic MIG), from the profile tables; with ``mig_state``
(the simulated partitioner's file, ``migstate.py``) a GPU the partitioner changed reports the instances it
holds now, as NVML would after instances were created or destroyed.
"""

from __future__ import annotations

import logging
import uuid
from contextlib import suppress
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cdi.yamlload import load_yaml
from driver.gpu.discovery.inventory import GpuInfo, MigInstance, MigProfileInfo, NodeInventory, mig_memory_slices
from driver.simulation.gpus import GpuModel, MigProfileSpec, SimulationError, gpu_models
from driver.simulation.migstate import MigState, MigStateFile, SimulatedGi
from driver.units import MIB

log = logging.getLogger(__name__)

SIMULATED_DRIVER_VERSION = "580.95.05"
SIMULATED_CUDA_DRIVER_VERSION = "13.0"
# A node with kernel memory limits (layout option kernelMemoryLimits) runs an R615 driver with CUDA 13.4,
# the first with MPS v3 memory partitioning (nvidia-gpu reference 6.3); the build number is made up.
SIMULATED_R615_DRIVER_VERSION = "615.10.01"
SIMULATED_R615_CUDA_DRIVER_VERSION = "13.4"
_LAYOUTS_FILE = "layouts.yaml"
_UUID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://gpu.tessera.dev/simulation")


class SimulatedMig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    profile: str
    start: int = Field(ge=0)


class SimulatedGpu(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    model: str
    mig: tuple[SimulatedMig, ...] | None = None  # present (even empty) = MIG mode enabled
    # The other MIG mode set but not in effect yet (nvidia-smi -mig run, no reset or the GPU busy since).
    mig_mode_pending: bool = Field(default=False, alias="migModePending")


class SimulatedNode(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    description: str = ""
    # How the driver is installed, which decides where the host tree keeps it (hostroot.py).
    driver_layout: Literal["host", "gpu-operator"] = Field(default="host", alias="driverLayout")
    # True: the node can hard-limit a container's GPU memory (R615 driver, cgroup v2 with dmem, a
    # toolkit with the apply-cuda-memory-limits hook); hostroot.py builds the host tree to match.
    kernel_memory_limits: bool = Field(default=False, alias="kernelMemoryLimits")
    gpus: tuple[SimulatedGpu, ...] = ()


def _builtin_layouts() -> dict[str, Any]:
    text = resources.files("driver.simulation").joinpath(_LAYOUTS_FILE).read_text()
    layouts = load_yaml(text)
    if not isinstance(layouts, dict):
        raise SimulationError(f"{_LAYOUTS_FILE} must map layout names to layouts")
    return layouts


def available_layouts() -> list[str]:
    """Names of the built-in simulated nodes."""
    return sorted(_builtin_layouts())


def load_layout(layout_name_or_path: str) -> tuple[str, SimulatedNode]:
    """(label for messages, parsed layout) for a built-in layout name or a YAML file path."""
    builtin = _builtin_layouts()
    if layout_name_or_path in builtin:
        label, raw = f"layout {layout_name_or_path!r}", builtin[layout_name_or_path]
    else:
        path = Path(layout_name_or_path)
        if not path.is_file():
            raise SimulationError(
                f"unknown simulated layout {layout_name_or_path!r}: not a built-in layout "
                f"({', '.join(sorted(builtin))}) and not a file"
            )
        label = f"layout file {str(path)!r}"
        try:
            raw = load_yaml(path.read_text())
        except (OSError, yaml.YAMLError) as err:
            raise SimulationError(f"{label}: cannot read it as YAML: {err}") from err
    try:
        return label, SimulatedNode.model_validate(raw)
    except ValidationError as err:
        raise SimulationError(f"{label} is not a valid simulated node: {err}") from err


def simulated_gpu_uuid(node_name: str, minor: int) -> str:
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'{node_name}/gpu/{minor}')}"


def simulated_mig_uuid(node_name: str, minor: int, gi_profile_id: int, placement_start: int) -> str:
    return f"MIG-{uuid.uuid5(_UUID_NAMESPACE, f'{node_name}/gpu/{minor}/mig/{gi_profile_id}/{placement_start}')}"


def simulated_pci_bus_id(minor: int) -> tuple[str, str]:
    """(PCI bus id, PCIe root) of simulated GPU ``minor``: eight GPUs per PCI domain, one root each."""
    domain, slot = divmod(minor, 8)
    bus = 0x18 + 0x1C * slot
    return f"{domain:04x}:{bus:02x}:00.0", f"pci{domain:04x}:{bus - 1:02x}"


def _validated_profiles(where: str, model: GpuModel, migs: tuple[SimulatedMig, ...]) -> list[MigProfileSpec]:
    if not model.mig_profiles:
        raise SimulationError(f"{where}: model {model.name} does not support MIG; remove its 'mig' list")
    specs: list[MigProfileSpec] = []
    owner_of_slice: dict[int, str] = {}
    for position, mig in enumerate(migs):
        entry = f"{where} mig[{position}] ({mig.profile}@{mig.start})"
        spec = model.profile(mig.profile)
        if spec is None:
            known = ", ".join(p.name for p in model.mig_profiles)
            raise SimulationError(f"{entry}: {model.name} has no MIG profile {mig.profile!r}; known: {known}")
        if mig.start not in spec.placement_starts:
            starts = ", ".join(str(s) for s in spec.placement_starts)
            raise SimulationError(f"{entry}: {mig.profile} cannot start at {mig.start}; valid starts: {starts}")
        for memory_slice in range(mig.start, mig.start + spec.memory_slices):
            if memory_slice in owner_of_slice:
                raise SimulationError(
                    f"{entry}: overlaps {owner_of_slice[memory_slice]} on memory slice {memory_slice}"
                )
            owner_of_slice[memory_slice] = f"mig[{position}] ({mig.profile}@{mig.start})"
        if sum(1 for s in specs if s.name == spec.name) + 1 > spec.max_instances:
            raise SimulationError(f"{entry}: {model.name} allows at most {spec.max_instances} x {spec.name}")
        specs.append(spec)
    return specs


def _mig_instance(spec: MigProfileSpec, uuid: str, start: int, gi_id: int, ci_id: int) -> MigInstance:
    return MigInstance(
        uuid=uuid,
        profile=spec.name,
        gi_profile_id=spec.gi_profile_id,
        placement_start=start,
        placement_size=spec.memory_slices,
        gi_id=gi_id,
        ci_id=ci_id,
        memory_bytes=spec.memory_mib * MIB,
        multiprocessors=spec.multiprocessors,
        **spec.engines.model_dump(),
    )


def _mig_instances(
    where: str, node_name: str, minor: int, model: GpuModel, migs: tuple[SimulatedMig, ...]
) -> tuple[MigInstance, ...]:
    specs = _validated_profiles(where, model, migs)
    instances = [
        # NVML hands out GI ids in creation order; layout order stands in for it.
        _mig_instance(spec, simulated_mig_uuid(node_name, minor, spec.gi_profile_id, mig.start), mig.start,
                      gi_id=position + 1, ci_id=0)
        for position, (mig, spec) in enumerate(zip(migs, specs, strict=True))
    ]
    return tuple(sorted(instances, key=lambda m: m.placement_start))


def _created_instances(model: GpuModel, gis: list[SimulatedGi]) -> tuple[MigInstance, ...]:
    """The MIG devices the simulated partitioner left on a GPU: GIs with a compute instance (a bare GI is no
    MIG device: NVML has no MIG device handle for it)."""
    by_id = {spec.gi_profile_id: spec for spec in model.mig_profiles}
    return tuple(_mig_instance(by_id[g.gi_profile_id], g.uuid, g.placement_start, g.gi_id, g.ci_id)
                 for g in sorted(gis, key=lambda g: g.placement_start)
                 if g.ci_id is not None and g.uuid is not None and g.gi_profile_id in by_id)


def mig_profile_infos(specs: tuple[MigProfileSpec, ...]) -> tuple[MigProfileInfo, ...]:
    """What a GPU with these MIG profiles can create in MIG mode, as NVML's profile and placement queries say."""
    return tuple(
        MigProfileInfo(name=spec.name, gi_profile_id=spec.gi_profile_id, ci_profile_id=spec.ci_profile_enum,
                       compute_slices=spec.compute_slices, memory_slices=spec.memory_slices,
                       memory_bytes=spec.memory_mib * MIB, multiprocessors=spec.multiprocessors,
                       **spec.engines.model_dump(),
                       placement_starts=spec.placement_starts)
        for spec in sorted(specs, key=lambda p: p.gi_profile_id)
    )


def _pending_mode(where: str, entry: SimulatedGpu, capable: bool) -> Literal["enable", "disable"] | None:
    if not entry.mig_mode_pending:
        return None
    if not capable:
        raise SimulationError(f"{where}: migModePending on a GPU without MIG (NVML answers NOT_SUPPORTED)")
    return "disable" if entry.mig is not None else "enable"


def build_inventory(label: str, node: SimulatedNode, node_name: str, mig: MigState | None = None) -> NodeInventory:
    """The inventory a simulated node reports; SimulationError naming the entry if the layout is wrong.

    ``mig``: the simulated partitioner's state; a MIG GPU it has changed holds the instances it says, not the
    layout's.
    """
    models = gpu_models()
    gpus: list[GpuInfo] = []
    for minor, entry in enumerate(node.gpus):
        where = f"{label} gpu {minor} ({entry.model})"
        model = models.get(entry.model)
        if model is None:
            raise SimulationError(f"{where}: unknown GPU model; known models: {', '.join(sorted(models))}")
        pci_bus_id, pcie_root = simulated_pci_bus_id(minor)
        mig_enabled = entry.mig is not None
        gpu_uuid = simulated_gpu_uuid(node_name, minor)
        instances = _mig_instances(where, node_name, minor, model, entry.mig) if entry.mig is not None else ()
        created = mig.gpus.get(gpu_uuid) if mig is not None and mig_enabled else None
        if created is not None:
            instances = _created_instances(model, created.gis)
        profiles = mig_profile_infos(model.mig_profiles) if mig_enabled else ()
        gpus.append(
            GpuInfo(
                minor=minor,
                index=minor,
                uuid=gpu_uuid,
                product_name=model.product_name,
                brand=model.brand,
                architecture=model.architecture,
                cuda_compute_capability=model.compute_capability,
                memory_bytes=model.memory_bytes,
                multiprocessors=model.multiprocessors,
                pci_bus_id=pci_bus_id,
                pcie_root=pcie_root,
                mig_capable=bool(model.mig_profiles),
                mig_enabled=mig_enabled,
                mig_mode_pending=_pending_mode(where, entry, bool(model.mig_profiles)),
                mig_instances=instances,
                mig_memory_slices=mig_memory_slices(profiles),
                mig_profiles=profiles,
            )
        )
    if node.kernel_memory_limits:
        return NodeInventory(driver_version=SIMULATED_R615_DRIVER_VERSION,
                             cuda_driver_version=SIMULATED_R615_CUDA_DRIVER_VERSION, gpus=tuple(gpus))
    return NodeInventory(
        driver_version=SIMULATED_DRIVER_VERSION, cuda_driver_version=SIMULATED_CUDA_DRIVER_VERSION, gpus=tuple(gpus)
    )


class SimulatedDiscovery:
    """SIMULATION: :class:`~driver.gpu.discovery.inventory.Discovery` reporting a simulated node.

    ``layout_name_or_path`` is a built-in layout name (see :func:`available_layouts`) or a YAML
    file with one layout; the layout is read and validated here, so a bad one fails at startup.
    A layout file is read again at every ``discover()``, so editing it simulates a hardware change
    (e.g. MIG instances re-created); an edit that does not validate is logged and ignored.
    """

    simulated = True

    def __init__(self, layout_name_or_path: str, node_name: str, mig_state: Path | None = None) -> None:
        label, node = load_layout(layout_name_or_path)
        self.description = node.description
        self.driver_layout = node.driver_layout
        self._source = layout_name_or_path
        self._node_name = node_name
        self._rereads = layout_name_or_path not in _builtin_layouts()
        self._mig_state = MigStateFile(mig_state) if mig_state is not None else None
        self._label, self._node = label, node
        self._inventory = build_inventory(label, node, node_name, self._read_mig())

    def discover(self) -> NodeInventory:
        if not self._rereads and self._mig_state is None:
            return self._inventory
        label, node = self._label, self._node
        try:
            if self._rereads:
                label, node = load_layout(self._source)
            inventory = build_inventory(label, node, self._node_name, self._read_mig())
        except SimulationError as err:
            log.warning("SIMULATION: the edited layout file or the MIG state file is invalid; keeping the "
                        "previous one", extra={"reason": str(err)})
            if (label, node) == (self._label, self._node):
                return self._inventory
            # The previous layout still holds; the partitioner's instances may have changed on it.
            with suppress(SimulationError):
                self._inventory = build_inventory(self._label, self._node, self._node_name, self._read_mig())
            return self._inventory
        self._label, self._node, self._inventory = label, node, inventory
        return inventory

    def _read_mig(self) -> MigState | None:
        """The simulated partitioner's instances (``migstate.py``), read at every discover() as NVML would be."""
        if self._mig_state is None:
            return None
        try:
            return self._mig_state.read()
        except ValueError as err:  # unreadable: a SimulationError, so the previous inventory stays
            raise SimulationError(str(err)) from err

    def close(self) -> None:
        """Nothing to release: no NVML session in a simulation."""
