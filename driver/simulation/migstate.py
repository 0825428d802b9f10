"""SIMULATION: the MIG instances of the simulated node's GPUs, in one JSON file every process shares.

The simulated partitioner (``migengine.py``) writes it; the simulated discovery reads it, so the driver process,
``inspect`` and the tests see the same instances, as processes on a real node see the same NVML state. A GPU with
no entry holds what its layout gives it at boot (the layout's ``mig`` list); an entry, once the engine touched
the GPU, is the whole truth for it. The file also holds the failures tests inject (:class:`Fault`).

Instances do not survive a reboot (the MIG user guide: GPU and compute instances are not persistent across
reboots or GPU resets): the boot ID is kept in the file, and a file written in another boot reads as empty, every
GPU back to its layout; :func:`reboot` does the same on demand. Changes are made under ``<state>.lock`` (flock,
since the driver and a test may change it at once) and written atomically.

Where: TESSERA_SIM_MIG_STATE, else ``<driver root>/var/lib/tessera-sim-mig.json``.
"""

from __future__ import annotations

import fcntl
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cdi.atomicfile import write_atomic

STATE_ENV = "TESSERA_SIM_MIG_STATE"
DEFAULT_STATE = "var/lib/tessera-sim-mig.json"  # under the driver root
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")

FaultCall = Literal["create-gi", "create-ci", "destroy-ci", "destroy-gi"]
# What an injected fault does: the call fails (NVML_ERROR_UNKNOWN); or it blocks (a hung NVML call, so a test can
# kill -9 the driver at that point), before its step (``hang``) or once its step is done and saved (``hang-after``).
FaultEffect = Literal["fail", "hang", "hang-after"]


def real_boot_id() -> str | None:
    try:
        return BOOT_ID.read_text().strip() or None
    except OSError:
        return None


def state_path(driver_root: Path, environ: Mapping[str, str]) -> Path:
    """The state file of the simulated node whose driver root is ``driver_root``."""
    return Path(environ.get(STATE_ENV) or driver_root / DEFAULT_STATE)


class SimulatedGi(BaseModel):
    """One GPU instance and the compute instance inside it, if it has one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gi_id: int
    gi_profile_id: int
    placement_start: int
    placement_size: int
    ci_id: int | None = None
    ci_profile_enum: int | None = None
    uuid: str | None = None  # the MIG device's, while it has a compute instance


class SimulatedMigGpuState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    gis: list[SimulatedGi] = []


class Fault(BaseModel):
    """A failure to inject: the next matching ``call`` (or every one, ``times`` None) answers NVML_ERROR_UNKNOWN,
    or (``effect`` ``hang``/``hang-after``, creates only) blocks for ``seconds`` or until the caller's deadline.

    ``gpu``, ``profile`` (a profile name) and ``placement`` (a placement start) narrow what matches; None
    matches anything.
    """

    model_config = ConfigDict(extra="forbid")

    call: FaultCall
    gpu: str | None = None
    profile: str | None = None
    placement: int | None = None
    times: int | None = Field(default=1, ge=1)
    effect: FaultEffect = "fail"
    seconds: float = Field(default=300.0, gt=0)

    @model_validator(mode="after")
    def _hangs_only_creates(self) -> Fault:
        if self.effect != "fail" and self.call not in ("create-gi", "create-ci"):
            raise ValueError(f"only creates can hang, not {self.call}")
        return self

    def matches(self, call: FaultCall, gpu: str, profile: str | None, placement: int | None) -> bool:
        return (self.call == call and self.gpu in (None, gpu) and self.profile in (None, profile)
                and self.placement in (None, placement))


class MigState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    boot_id: str | None = None
    gpus: dict[str, SimulatedMigGpuState] = {}
    faults: list[Fault] = []
    instances_created: int = 0  # node-wide count of MIG devices made: each gets a UUID of its own, as on hardware
    # How MIG UUIDs are made (``migengine.simulated_mig_device_uuid``): "per-create", a new one for every compute
    # instance; "name-derived", the same for every instance at the same GPU, GI and CI ids (version-5 UUIDs as
    # published MIG UUIDs are, possibly derived from those ids alone). A test's choice, kept like its faults.
    uuid_mode: Literal["per-create", "name-derived"] = "per-create"

    def take_fault(self, call: FaultCall, gpu: str, profile: str | None, placement: int | None) -> Fault | None:
        """The first fault matching the call, used up once (a ``times`` fault goes when it reaches 0)."""
        for position, fault in enumerate(self.faults):
            if fault.matches(call, gpu, profile, placement):
                if fault.times is not None:
                    if fault.times == 1:
                        del self.faults[position]
                    else:
                        self.faults[position] = fault.model_copy(update={"times": fault.times - 1})
                return fault
        return None


class MigStateFile:
    """The state file: read and changed under its lock, so concurrent processes never see half a change."""

    def __init__(self, path: Path, boot_id: Callable[[], str | None] = real_boot_id) -> None:
        self.path = path
        self._boot_id = boot_id
        self._mutex = threading.Lock()  # one change at a time within this process, too

    def read(self) -> MigState:
        """The state as of now (every GPU back to its layout if it was written in another boot)."""
        if not self.path.exists():
            # Nothing changed yet: every GPU holds its layout's. Read-only users (discovery, inspect) then need
            # no write access where the file would go.
            return MigState(boot_id=self._boot_id())
        with self.changing() as state:
            return state.model_copy(deep=True)

    @contextmanager
    def changing(self) -> Iterator[MigState]:
        """The state under the lock; written back (atomically) when the block ends, also by raising."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._mutex, open(self.path.with_name(self.path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state = self._load()
                before = state.model_dump_json()
                try:
                    yield state
                finally:
                    if state.model_dump_json() != before:
                        write_atomic(self.path, state.model_dump_json(indent=1).encode(), mode=0o644,
                                     durable=False)
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _load(self) -> MigState:
        boot = self._boot_id()
        try:
            state = MigState.model_validate_json(self.path.read_bytes())
        except FileNotFoundError:
            return MigState(boot_id=boot)
        except (OSError, ValidationError) as err:
            raise ValueError(f"SIMULATION: the MIG state file {self.path} is unreadable: {err}") from err
        if boot is not None and state.boot_id is not None and state.boot_id != boot:
            # A reboot since it was written: no instance survives it; injected faults are the tests', they stay.
            return MigState(boot_id=boot, faults=state.faults, uuid_mode=state.uuid_mode)
        if state.boot_id is None:
            state.boot_id = boot
        return state


def reboot(state_file: MigStateFile) -> None:
    """SIMULATION: what a node reboot does to MIG: every created instance gone, each GPU back to its layout."""
    with state_file.changing() as state:
        state.gpus.clear()
