"""The node sharing plan: which GPUs of a node are published as MPS, time-sliced or consumable shares,
or as dynamic MIG placements (the entry itself: ``dynamicmigplan.py``).

Operators write named plans in one YAML file (Helm renders it into a ConfigMap mounted at
``/etc/tessera/sharing-plans.yaml``); a node label (default ``gpu.tessera.dev/sharing-plan``)
names the plan a node uses. This module parses the file strictly (:func:`load_plans`), picks the
node's plan (:func:`select_plan`) and resolves it against the node's GPUs into a
:class:`~driver.gpu.sharelayout.SharingLayout` (:func:`resolve_layout`). A bad plan stops the driver
at start, so every error names the file, the entry and the GPU.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cdi.yamlload import load_yaml
from driver.gpu.claimconfig.api import ByteQuantity, ShmSize, describe_validation_error
from driver.gpu.consumable import UNDETECTED, KernelMemoryLimits, build_policy
from driver.gpu.discovery.inventory import GpuInfo, NodeInventory
from driver.gpu.dynamicmigplan import DynamicMigEntry, dynamic_mig_form
from driver.gpu.migplacement import OwnInstances
from driver.gpu.planmatch import Match
from driver.gpu.sharelayout import GpuShares, MpsClients, SharingLayout, TimeSliceInterval
from driver.units import MIB

DEFAULT_PLANS_PATH = Path("/etc/tessera/sharing-plans.yaml")

# Kubernetes label value syntax (the plan is selected by a label value), minus the empty value.
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


log = logging.getLogger(__name__)


class PlanError(ValueError):
    """A sharing plan that cannot be used; the message says where and what to fix."""


def _between(low: int, high: int, value: int | None) -> int | None:
    if value is not None and not low <= value <= high:
        raise ValueError(f"must be between {low} and {high}, got {value}")
    return value


class _PlanObject(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class MpsShares(_PlanObject):
    """Split a GPU into ``shares`` MPS shares, each with an enforced thread and memory limit."""

    shares: int
    activeThreadPercentage: int | None = None  # default floor(100 / shares)
    pinnedMemoryLimit: ByteQuantity | None = None  # per share; default GPU memory / shares
    # Who may hold a share: nonRoot refuses, at prepare, claims whose pods could run as host root (and so
    # control the daemon all shares of the GPU go through); any admits them, and the limits are advisory.
    clients: MpsClients = "nonRoot"
    # The GPU's daemon's own /dev/shm tmpfs, which every share's containers use with it: size it for
    # all the shares. Default: the node's --mps-shm-size.
    shmSize: ShmSize | None = None

    @field_validator("shares")
    @classmethod
    def _shares_range(cls, value: int) -> int:
        _between(2, 48, value)
        return value

    @field_validator("activeThreadPercentage")
    @classmethod
    def _percentage_range(cls, value: int | None) -> int | None:
        return _between(1, 100, value)


class TimeSlicingShares(_PlanObject):
    """Publish a GPU ``shares`` times; the shares take turns, and memory is an entitlement only."""

    shares: int
    interval: TimeSliceInterval = "Default"
    memoryPerShare: ByteQuantity | None = None  # not enforced; default GPU memory / shares

    @field_validator("shares")
    @classmethod
    def _shares_range(cls, value: int) -> int:
        _between(2, 48, value)
        return value


class ConsumableFallback(_PlanObject):
    """How a consumable GPU is published where the API server would drop consumable capacity."""

    mps: MpsShares | None = None
    timeSlicing: TimeSlicingShares | None = None

    @model_validator(mode="after")
    def _at_most_one_form(self) -> ConsumableFallback:
        if self.mps is not None and self.timeSlicing is not None:
            raise ValueError("set at most one of mps, timeSlicing (neither: the GPU is published whole)")
        return self


class ConsumableShares(_PlanObject):
    """Publish a GPU once for many claims, each consuming memory (whole GiB) and SMs (docs/sharing.md)."""

    memoryMin: ByteQuantity | None = None  # default 1Gi; a whole number of GiB
    memoryDefault: ByteQuantity | None = None  # what a claim that names no memory consumes; default memoryMin
    multiprocessorsStep: int | None = None  # default 1
    multiprocessorsMin: int | None = None  # default the fewest SMs worth 1 percent of the GPU's threads
    multiprocessorsDefault: int | None = None  # default multiprocessorsMin
    fallback: ConsumableFallback | None = None  # where the API server lacks consumable capacity; None: whole
    # Each claim's own daemon's /dev/shm tmpfs; default the node's --mps-shm-size.
    shmSize: ShmSize | None = None


class PlanEntry(_PlanObject):
    match: Match
    mps: MpsShares | None = None
    timeSlicing: TimeSlicingShares | None = None
    consumable: ConsumableShares | None = None
    dynamicMig: DynamicMigEntry | None = None
    whole: bool | None = None
    allowMultipleSharesPerClaim: bool = False

    @model_validator(mode="after")
    def _exactly_one_form(self) -> PlanEntry:
        given = [name for name, value in self.forms().items() if value is not None]
        if len(given) != 1:
            raise ValueError("set exactly one of mps, timeSlicing, consumable, dynamicMig, whole: true "
                             f"(got {', '.join(given) or 'none'})")
        if self.whole is False:
            raise ValueError("whole: false is not a publishing form; use whole: true, mps, timeSlicing, consumable "
                             "or dynamicMig")
        if (self.whole or self.consumable or self.dynamicMig) and self.allowMultipleSharesPerClaim:
            raise ValueError("allowMultipleSharesPerClaim applies only to mps or timeSlicing entries")
        return self

    def forms(self) -> dict[str, object]:
        return {"mps": self.mps, "timeSlicing": self.timeSlicing, "consumable": self.consumable,
                "dynamicMig": self.dynamicMig, "whole": self.whole}


class SharingPlan(_PlanObject):
    gpus: list[PlanEntry] = Field(default_factory=list)  # first matching entry wins


class SharingPlans(_PlanObject):
    """The whole plans file."""

    defaultPlan: str | None = None  # plan for nodes without the label; None: every GPU whole
    # The cluster runs Kubernetes 1.34/1.35 with the DRAConsumableCapacity gate on (API server and
    # scheduler), so consumable entries may publish there; from 1.36 they always do.
    consumableCapacityGate: bool = False
    # The same for DRAPartitionableDevices (dynamicMig entries); from 1.36 they always publish.
    partitionableDevicesGate: bool = False
    plans: dict[str, SharingPlan] = Field(default_factory=dict)

    @field_validator("plans")
    @classmethod
    def _plan_names_are_label_values(cls, plans: dict[str, SharingPlan]) -> dict[str, SharingPlan]:
        for name in plans:
            if not _LABEL_VALUE.fullmatch(name):
                raise ValueError(
                    f'plan name "{name}" is not a valid label value (at most 63 characters: letters, digits, '
                    "'-', '_', '.', starting and ending with a letter or digit); nodes select plans by label value"
                )
        return plans

    @model_validator(mode="after")
    def _default_plan_exists(self) -> SharingPlans:
        if self.defaultPlan is not None and self.defaultPlan not in self.plans:
            raise ValueError(f'defaultPlan "{self.defaultPlan}" is not defined; known plans: {_names(self.plans)}')
        return self


def load_plans(path: Path) -> SharingPlans:
    """Read and validate the plans file; an empty file means no plans. Raises PlanError."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PlanError(f"{path}: cannot read the sharing plans file: {exc.strerror or exc}") from None
    try:
        data = load_yaml(text, str(path))
    except yaml.YAMLError as exc:
        # PyYAML's message spans lines ("while parsing ... in <file>, line 3"); errors here are one line.
        raise PlanError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if data is None:
        return SharingPlans()
    try:
        return SharingPlans.model_validate(data)
    except ValidationError as exc:
        raise PlanError("\n".join(f"{path}: {line}" for line in describe_validation_error(exc, SharingPlans))) from None


def select_plan(plans: SharingPlans, node_labels: Mapping[str, str], label_key: str) -> tuple[str | None, SharingPlan]:
    """The plan this node uses: the one its label names, else ``defaultPlan``, else an empty plan (name None)."""
    name = node_labels.get(label_key)
    if name is None:
        name = plans.defaultPlan
        return (None, SharingPlan()) if name is None else (name, plans.plans[name])
    plan = plans.plans.get(name)
    if plan is None:
        raise PlanError(f'node label {label_key}="{name}" names no sharing plan; known plans: {_names(plans.plans)}')
    return name, plan


@dataclass(frozen=True)
class ResolvedPlan:
    layout: SharingLayout
    # GPU UUID -> one line for the log: why its entry's form is not used (and what it is published as
    # instead), or what of the entry was ignored.
    notes: dict[str, str] = field(default_factory=dict)


def resolve_layout(plan: SharingPlan, inventory: NodeInventory, plan_name: str | None, *,
                   consumable_supported: bool = True,
                   kernel: KernelMemoryLimits | None = None) -> SharingLayout:
    """:func:`resolve_plan`'s layout alone."""
    return resolve_plan(plan, inventory, plan_name, consumable_supported=consumable_supported, kernel=kernel).layout


def resolve_plan(plan: SharingPlan, inventory: NodeInventory, plan_name: str | None, *,
                 consumable_supported: bool = True, kernel: KernelMemoryLimits | None = None,
                 partitionable_supported: bool = True, own_instances: OwnInstances = ()) -> ResolvedPlan:
    """GPU UUID -> shares for every GPU the plan splits; the first matching entry wins, others stay whole.

    ``consumable_supported``: the API server keeps consumable capacity
    (:func:`driver.gpu.consumable.consumable_supported`); where it does not, a consumable entry is
    published as its fallback, with a log line, never as a device whose fields the server drops.
    ``partitionable_supported``: the same for counters (:func:`driver.gpu.migplacement.partitionable_supported`);
    where it is False, or a GPU cannot be dynamic MIG, a ``dynamicMig`` entry's GPU is published as
    without the entry and the reason is in ``notes``. ``own_instances``: MIG instances Tessera
    created for claims, which keep their GPU dynamic.
    """
    layout: SharingLayout = {}
    notes: dict[str, str] = {}
    problems: dict[tuple[int, str], list[GpuInfo]] = {}  # (entry, problem) -> the GPUs it has it on
    kernel = kernel or UNDETECTED
    for gpu in inventory.gpus:
        index, entry = first_match(plan, gpu)
        if entry is None or entry.whole:
            continue
        try:
            if entry.dynamicMig is not None:
                shares, note = dynamic_mig_form(entry.dynamicMig, gpu, supported=partitionable_supported,
                                                own=own_instances)
                if note is not None:
                    notes[gpu.uuid] = note
            else:
                shares = _shares_for(entry, gpu, consumable_supported, kernel)
        except ValueError as exc:
            problems.setdefault((index, str(exc)), []).append(gpu)
            continue
        if entry.consumable is not None and not consumable_supported:
            log.warning("the API server does not support consumable capacity (Kubernetes 1.36+, or 1.34/1.35 with "
                        "the DRAConsumableCapacity gate); publishing the plan's fallback instead",
                        extra={"entry": entry_path(plan_name, index), "gpu_uuid": gpu.uuid,
                               "fallback": shares.strategy if shares is not None else "whole"})
        if shares is not None:
            layout[gpu.uuid] = shares
    if problems:
        # One line per entry and problem: eight identical GPUs are one mistake, not eight.
        raise PlanError("\n".join(f"{entry_path(plan_name, index)} ({_describe_gpus(gpus)}): {problem}"
                                  for (index, problem), gpus in problems.items()))
    return ResolvedPlan(layout, notes)


def entries_matching_no_gpu(plan: SharingPlan, inventory: NodeInventory, plan_name: str | None) -> list[str]:
    """Paths of entries no GPU on this node matched (fine, plans are shared by nodes; worth a log line)."""
    return [
        f"{entry_path(plan_name, index)} (match {entry.match.describe()})"
        for index, entry in enumerate(plan.gpus)
        if not any(entry.match.matches(gpu) for gpu in inventory.gpus)
    ]


def layout_changes(old: SharingLayout, new: SharingLayout) -> set[str]:
    """UUIDs of GPUs published differently under ``new`` than under ``old`` (including whole <-> shared)."""
    return {uuid for uuid in old.keys() | new.keys() if old.get(uuid) != new.get(uuid)}


def first_match(plan: SharingPlan, gpu: GpuInfo) -> tuple[int, PlanEntry | None]:
    return next(((i, entry) for i, entry in enumerate(plan.gpus) if entry.match.matches(gpu)), (-1, None))


def _shares_for(entry: PlanEntry, gpu: GpuInfo, consumable_supported: bool,
                kernel: KernelMemoryLimits) -> GpuShares | None:
    if entry.consumable is not None:
        c = entry.consumable
        if consumable_supported:
            policy = build_policy(gpu, memory_min=c.memoryMin, memory_default=c.memoryDefault,
                                  multiprocessors_step=c.multiprocessorsStep, multiprocessors_min=c.multiprocessorsMin,
                                  multiprocessors_default=c.multiprocessorsDefault, kernel=kernel)
            return GpuShares(strategy="Consumable", count=1, memory_bytes_per_share=policy.memory_bytes,
                             consumable=policy, shm_size_bytes=c.shmSize)
        fallback = c.fallback or ConsumableFallback()
        if fallback.mps is None and fallback.timeSlicing is None:
            return None
        entry = PlanEntry(match=entry.match, mps=fallback.mps, timeSlicing=fallback.timeSlicing)
    if entry.mps is not None:
        return _mps_shares(entry.mps, gpu, entry.allowMultipleSharesPerClaim)
    assert entry.timeSlicing is not None  # PlanEntry validation: exactly one form
    return _time_slicing_shares(entry.timeSlicing, gpu, entry.allowMultipleSharesPerClaim)


def _mps_shares(mps: MpsShares, gpu: GpuInfo, allow_multiple: bool) -> GpuShares:
    _refuse_mig(gpu, "MPS")
    # MPS enforces whole MiB, so check and publish what will be enforced.
    explicit = None if mps.pinnedMemoryLimit is None else mps.pinnedMemoryLimit // MIB * MIB
    if explicit == 0:
        raise ValueError("mps.pinnedMemoryLimit is less than 1 MiB; MPS limits are set in whole MiB")
    per_share = _memory_per_share(gpu, mps.shares, explicit, "mps.pinnedMemoryLimit")
    return GpuShares(
        strategy="MPS",
        count=mps.shares,
        active_thread_percentage=(
            mps.activeThreadPercentage if mps.activeThreadPercentage is not None else 100 // mps.shares
        ),
        memory_bytes_per_share=per_share,
        allow_multiple_shares_per_claim=allow_multiple,
        mps_clients=mps.clients,
        shm_size_bytes=mps.shmSize,
    )


def _time_slicing_shares(ts: TimeSlicingShares, gpu: GpuInfo, allow_multiple: bool) -> GpuShares:
    _refuse_mig(gpu, "time slicing")
    per_share = _memory_per_share(gpu, ts.shares, ts.memoryPerShare, "timeSlicing.memoryPerShare")
    if per_share == 0:
        raise ValueError("timeSlicing.memoryPerShare must be more than 0 bytes")
    return GpuShares(
        strategy="TimeSlicing",
        count=ts.shares,
        memory_bytes_per_share=per_share,
        interval=ts.interval,
        allow_multiple_shares_per_claim=allow_multiple,
    )


def _refuse_mig(gpu: GpuInfo, strategy: str) -> None:
    if gpu.mig_enabled:
        raise ValueError(
            f"{strategy} sharing is not possible on a MIG-enabled GPU; publish it whole (its MIG devices "
            "are published instead), narrow the match, or disable MIG on this GPU"
        )


def _memory_per_share(gpu: GpuInfo, shares: int, explicit: int | None, field: str) -> int:
    if explicit is None:
        if gpu.memory_bytes is None:
            raise ValueError(f"the GPU's memory size is unknown; set {field} explicitly")
        per_share = gpu.memory_bytes // shares // MIB * MIB
        if per_share == 0:
            raise ValueError(
                f"the GPU's {gpu.memory_bytes} bytes of memory give less than 1 MiB to each of {shares} shares"
            )
        return per_share
    if gpu.memory_bytes is not None and explicit * shares > gpu.memory_bytes:
        raise ValueError(
            f"{shares} shares x {field} {explicit // MIB} MiB is more than the GPU's "
            f"{gpu.memory_bytes // MIB} MiB; lower {field} or the number of shares"
        )
    return explicit


def entry_path(plan_name: str | None, index: int) -> str:
    return f"plans.{plan_name}.gpus[{index}]" if plan_name is not None else f"gpus[{index}]"


def _describe_gpus(gpus: Sequence[GpuInfo]) -> str:
    if len(gpus) == 1:
        return f"GPU minor {gpus[0].minor}, {gpus[0].uuid}, {gpus[0].product_name}"
    products = ", ".join(dict.fromkeys(gpu.product_name for gpu in gpus))
    return f"{len(gpus)} GPUs, minors {', '.join(str(gpu.minor) for gpu in gpus)}, {products}"


def _names(plans: Mapping[str, object]) -> str:
    return ", ".join(sorted(plans)) or "(none)"
