"""SIMULATION: the GPU models a simulated node can hold, and their MIG profile tables.

Nothing here talks to hardware. The per-model facts (names, memory as NVML reports it, SM
counts) are those of the real parts; the MIG tables come from the packaged copy of the
reference ``mig-profiles.json``. Engine counts of MIG profiles are not in that table: they come
from NVIDIA's published profile tables (``mig-engines.json``, the MIG User Guide's "Hardware
Units" and "Copy Engines" columns), so a GPU's counter set holds its decoders, JPEG and OFA
engines and the simulated allocator and create refuse what NVIDIA refuses (a second ``+me``
instance: the GPU has one OFA). Where ``nvml-captures.json`` holds what NVML reported for a table
on a real GPU, its memory sizes, SM and engine counts are the captured ones (the H200's, read on
driver 580). A table with neither reports ``copy engines = compute slices`` and no other engines.

Memory: without a capture it is ``mig-profiles.json``'s, nvidia-smi's GiB x 1024 (NVIDIA's tables
give no MiB). The H200 capture shows NVML reporting 256 MiB more than that for every profile of
two or more memory slices; whether the H100 does the same on a given driver is not published
(``scripts/gpu-machine-check.sh`` records it), so the H100 keeps the published figures.

Only models whose whole-GPU facts are known are simulated: the table also holds A30 and B200, but
not B200's product name, memory total, SM count or compute capability, so B200 is there only as a
MIG table (:func:`mig_tables`) and as such can be tested. Rows the table has not captured (no
profile id, memory or SM count) are left out of every model and table.
"""

from __future__ import annotations

from importlib import resources
from typing import NamedTuple, TypeVar

from pydantic import BaseModel, ConfigDict

from driver.gpu.discovery.inventory import MigEngines
from driver.units import MIB

_PROFILE_TABLE = "mig-profiles.json"
_CAPTURES = "nvml-captures.json"
_ENGINES = "mig-engines.json"
_File = TypeVar("_File", bound=BaseModel)


class SimulationError(ValueError):
    """A simulated node description is wrong (unknown model, bad layout, ...)."""


class MigProfileSpec(BaseModel):
    """One GPU-instance profile of a simulated GPU model (a whole-GI compute instance)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str  # "1g.10gb"
    gi_enum: int  # NVML_GPU_INSTANCE_PROFILE_* value
    gi_profile_id: int  # device-specific id (nvidia-smi mig -lgip "ID")
    ci_profile_enum: int  # NVML_COMPUTE_INSTANCE_PROFILE_* of the compute instance spanning the GI
    compute_slices: int
    memory_slices: int  # placement size
    memory_mib: int
    multiprocessors: int
    max_instances: int
    placement_starts: tuple[int, ...]
    engines: MigEngines = MigEngines()


class GpuModel(BaseModel):
    """A simulated GPU model. ``mig_profiles`` is empty for GPUs without MIG."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str  # the key layouts use, e.g. "H100-80GB"
    product_name: str
    brand: str
    architecture: str
    compute_capability: str
    memory_bytes: int
    multiprocessors: int
    total_compute_slices: int = 0
    total_memory_slices: int = 0
    mig_profiles: tuple[MigProfileSpec, ...] = ()

    def profile(self, name: str) -> MigProfileSpec | None:
        return next((p for p in self.mig_profiles if p.name == name), None)


class _ModelFacts(NamedTuple):
    product_name: str
    architecture: str
    compute_capability: str
    memory_mib: int  # total as NVML reports it (less than the marketing figure)
    multiprocessors: int
    mig_table: str | None  # key in mig-profiles.json


# One row per model, in _ModelFacts' column order, so the models compare at a glance.
_MODELS: dict[str, _ModelFacts] = {
    "A100-40GB": _ModelFacts("NVIDIA A100-SXM4-40GB", "Ampere", "8.0", 40960, 108, "A100-SXM4-40GB"),
    "A100-80GB": _ModelFacts("NVIDIA A100-SXM4-80GB", "Ampere", "8.0", 81920, 108, "A100-80GB"),
    "H100-80GB": _ModelFacts("NVIDIA H100 80GB HBM3", "Hopper", "9.0", 81559, 132, "H100-80GB"),
    "H200": _ModelFacts("NVIDIA H200", "Hopper", "9.0", 143771, 132, "H200-141GB"),
    "L4": _ModelFacts("NVIDIA L4", "Ada Lovelace", "8.9", 23034, 58, None),
}


class _ProfileRow(BaseModel):
    """A row of mig-profiles.json; only the fields the simulation uses."""

    model_config = ConfigDict(extra="ignore")

    name: str
    nvml_profile_enum_value: int
    nvml_profile_id: int | None
    compute_slices: int
    placement_size: int
    memory_mib: int | None
    sm_count: int | None
    max_instances: int
    placement_starts: list[int]
    full_ci_profile_enum_value: int


class _ProfileTable(BaseModel):
    model_config = ConfigDict(extra="ignore")

    total_compute_slices: int
    total_memory_slices: int
    profiles: list[_ProfileRow]


class _ProfileFile(BaseModel):
    model_config = ConfigDict(extra="ignore")

    gpus: dict[str, _ProfileTable]


def _packaged(file: str, model: type[_File]) -> _File:
    return model.model_validate_json(resources.files("driver.simulation").joinpath(file).read_text())


class _CapturedProfile(MigEngines):
    """What NVML's GPU-instance profile info said for one profile id on a real GPU (engines included)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    memory_mib: int
    multiprocessors: int
    placements: list[int]


class _CapturedTable(BaseModel):
    model_config = ConfigDict(extra="ignore")

    profiles: dict[int, _CapturedProfile]


class _CaptureFile(BaseModel):
    model_config = ConfigDict(extra="ignore")

    tables: dict[str, _CapturedTable]


class _EngineFile(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # table key -> profile name -> [copy engines, decoders, encoders, JPEG engines, OFA engines]
    tables: dict[str, dict[str, tuple[int, int, int, int, int]]]


def _load_published_engines() -> dict[str, dict[str, MigEngines]]:
    return {key: {name: MigEngines(copy_engines=c, decoders=d, encoders=e, jpeg_engines=j, ofa_engines=o)
                  for name, (c, d, e, j, o) in rows.items()}
            for key, rows in _packaged(_ENGINES, _EngineFile).tables.items()}


def _engines(row: _ProfileRow, captured: _CapturedProfile | None, published: MigEngines | None) -> MigEngines:
    if captured is not None:
        return captured.engines()
    return published if published is not None else MigEngines(copy_engines=row.compute_slices)


def _profile(row: _ProfileRow, captured: _CapturedProfile | None,
             published: MigEngines | None = None) -> MigProfileSpec:
    assert row.nvml_profile_id is not None and row.memory_mib is not None and row.sm_count is not None
    if captured is not None and captured.placements != row.placement_starts:
        raise SimulationError(f"{_CAPTURES} and {_PROFILE_TABLE} disagree on the placements of {row.name}: "
                              f"{captured.placements} vs {row.placement_starts}")
    return MigProfileSpec(
        name=row.name,
        gi_enum=row.nvml_profile_enum_value,
        gi_profile_id=row.nvml_profile_id,
        ci_profile_enum=row.full_ci_profile_enum_value,
        compute_slices=row.compute_slices,
        memory_slices=row.placement_size,
        memory_mib=captured.memory_mib if captured else row.memory_mib,
        multiprocessors=captured.multiprocessors if captured else row.sm_count,
        max_instances=row.max_instances,
        placement_starts=tuple(row.placement_starts),
        engines=_engines(row, captured, published),
    )


def _profiles(table: _ProfileTable, captured: _CapturedTable | None = None,
              published: dict[str, MigEngines] | None = None) -> tuple[MigProfileSpec, ...]:
    found = captured.profiles if captured else {}
    engines = published or {}
    return tuple(
        _profile(row, found.get(row.nvml_profile_id), engines.get(row.name))
        for row in table.profiles
        # A profile with uncaptured facts cannot be simulated faithfully; leave it out.
        if row.nvml_profile_id is not None and row.memory_mib is not None and row.sm_count is not None
    )


class MigTable(BaseModel):
    """One GPU's MIG profile table (a key of mig-profiles.json): what its MIG devices can be, and where."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    total_compute_slices: int
    total_memory_slices: int
    profiles: tuple[MigProfileSpec, ...]

    def by_id(self, gi_profile_id: int) -> MigProfileSpec | None:
        return next((p for p in self.profiles if p.gi_profile_id == gi_profile_id), None)


def mig_tables() -> dict[str, MigTable]:
    """Every MIG table of mig-profiles.json by its key (``H100-80GB``, ``B200-180GB``, ...)."""
    captures = _packaged(_CAPTURES, _CaptureFile).tables
    engines = _load_published_engines()
    return {key: MigTable(total_compute_slices=table.total_compute_slices,
                          total_memory_slices=table.total_memory_slices,
                          profiles=_profiles(table, captures.get(key), engines.get(key)))
            for key, table in _packaged(_PROFILE_TABLE, _ProfileFile).gpus.items()}


def mig_table_of(model: GpuModel) -> MigTable:
    return MigTable(total_compute_slices=model.total_compute_slices, total_memory_slices=model.total_memory_slices,
                    profiles=model.mig_profiles)


def gpu_models() -> dict[str, GpuModel]:
    """Every simulated GPU model by name (``A100-40GB``, ``A100-80GB``, ``H100-80GB``, ``H200``, ``L4``)."""
    tables = _packaged(_PROFILE_TABLE, _ProfileFile).gpus
    captures = _packaged(_CAPTURES, _CaptureFile).tables
    engines = _load_published_engines()
    models: dict[str, GpuModel] = {}
    for name, spec in _MODELS.items():
        table: _ProfileTable | None = None
        if spec.mig_table is not None:
            table = tables.get(spec.mig_table)
            if table is None:
                raise SimulationError(f"{_PROFILE_TABLE} has no MIG table {spec.mig_table!r} for model {name}")
        models[name] = GpuModel(
            name=name,
            product_name=spec.product_name,
            brand="Nvidia",
            architecture=spec.architecture,
            compute_capability=spec.compute_capability,
            memory_bytes=spec.memory_mib * MIB,
            multiprocessors=spec.multiprocessors,
            total_compute_slices=table.total_compute_slices if table else 0,
            total_memory_slices=table.total_memory_slices if table else 0,
            mig_profiles=_profiles(table, captures.get(spec.mig_table or ""),
                                   engines.get(spec.mig_table or "")) if table else (),
        )
    return models


def gpu_model(name: str) -> GpuModel:
    models = gpu_models()
    if name not in models:
        raise SimulationError(f"unknown simulated GPU model {name!r}; known models: {', '.join(sorted(models))}")
    return models[name]
