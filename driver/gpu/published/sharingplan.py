"""The node sharing plan: which GPUs of a node are published as MPS, time-sliced or consumable shares,
or as dynamic MIG placements (the entry itself: ``dynamicmigplan.py``), and which MIG instances as MPS or
time-sliced shares (``match.migProfile``: ``migshareplan.py``).

Operators write named plans in one YAML file (Helm renders it into a ConfigMap mounted at
``/etc/tessera/sharing-plans.yaml``); a node label (default ``gpu.tessera.dev/sharing-plan``)
names the plan a node uses. This module parses the file strictly (:func:`load_plans`), picks the
node's plan (:func:`select_plan`) and resolves it against the node's GPUs into a
:class:`~driver.gpu.published.sharelayout.SharingLayout` (:func:`resolve_layout`). A bad plan stops the driver
at start, so every error names the file, the entry and the GPU.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from cdi.yamlload import load_yaml
from driver.gpu.claimconfig.api import ByteQuantity, ShmSize, describe_validation_error
from driver.gpu.discovery.inventory import GpuInfo, MigInstance, NodeInventory
from driver.gpu.discovery.migplacement import OwnInstances
from driver.gpu.errors import DriverError
from driver.gpu.published.consumable import UNDETECTED, KernelMemoryLimits, build_policy
from driver.gpu.published.dynamicmigplan import DynamicMigEntry, dynamic_mig_form
from driver.gpu.published.migshareplan import check_instance_entry, instance_shares, named_instances
from driver.gpu.published.planmatch import Match
from driver.gpu.published.shareforms import (
    MpsShares,
    PlanObject,
    ShareUnit,
    TimeSlicingShares,
    mps_shares,
    time_slicing_shares,
)
from driver.gpu.published.sharelayout import GpuForm, SharingLayout

# Kubernetes label value syntax (the plan is selected by a label value), minus the empty value.
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")


log = logging.getLogger(__name__)


class PlanError(DriverError, ValueError):
    """A sharing plan that cannot be used; the message says where and what to fix."""


class ConsumableFallback(PlanObject):
    """How a consumable GPU is published where the API server would drop consumable capacity."""

    mps: MpsShares | None = None
    timeSlicing: TimeSlicingShares | None = None

    @model_validator(mode="after")
    def _at_most_one_form(self) -> ConsumableFallback:
        if self.mps is not None and self.timeSlicing is not None:
            raise ValueError("set at most one of mps, timeSlicing (neither: the GPU is published whole)")
        return self


class ConsumableShares(PlanObject):
    """Publish a GPU once for many claims, each consuming memory (whole GiB) and SMs (docs/sharing.md)."""

    memoryMin: ByteQuantity | None = None  # default 1Gi; a whole number of GiB
    memoryDefault: ByteQuantity | None = None  # what a claim that names no memory consumes; default memoryMin
    multiprocessorsStep: int | None = None  # default 1
    multiprocessorsMin: int | None = None  # default the fewest SMs worth 1 percent of the GPU's threads
    multiprocessorsDefault: int | None = None  # default multiprocessorsMin
    fallback: ConsumableFallback | None = None  # where the API server lacks consumable capacity; None: whole
    # Each claim's own daemon's /dev/shm tmpfs; default the node's --mps-shm-size.
    shmSize: ShmSize | None = None


class PlanEntry(PlanObject):
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
        if self.match.for_instances:
            check_instance_entry(given[0], self.timeSlicing)
        return self

    def forms(self) -> dict[str, object]:
        return {"mps": self.mps, "timeSlicing": self.timeSlicing, "consumable": self.consumable,
                "dynamicMig": self.dynamicMig, "whole": self.whole}


class SharingPlan(PlanObject):
    gpus: list[PlanEntry] = Field(default_factory=list)  # first matching entry wins


class SharingPlans(PlanObject):
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
    """GPU UUID -> shares for every GPU the plan splits, MIG UUID -> shares for every MIG instance it splits.

    Entries without ``migProfile`` are matched against GPUs, those with it against the MIG instances of GPUs
    in MIG mode; in each, the first matching entry wins, and what none matches stays whole (a MIG instance:
    a MIG device). A GPU the plan makes dynamic MIG keeps its instances to itself: no ``migProfile`` entry
    applies to them (said in ``notes``).

    ``consumable_supported``: the API server keeps consumable capacity
    (:func:`driver.gpu.published.consumable.consumable_supported`); where it does not, a consumable entry is
    published as its fallback, with a log line, never as a device whose fields the server drops.
    ``partitionable_supported``: the same for counters
    (:func:`driver.gpu.discovery.migplacement.partitionable_supported`); where it is False, or a GPU cannot be
    dynamic MIG, a ``dynamicMig`` entry's GPU is published as without the entry and the reason is in ``notes``.
    ``own_instances``: MIG instances Tessera created for claims, which keep their GPU dynamic.
    """
    layout: SharingLayout = {}
    notes: dict[str, str] = {}
    problems: dict[tuple[int, str], list[GpuInfo]] = {}  # (entry, problem) -> the GPUs it has it on
    instance_problems: list[str] = []
    kernel = kernel or UNDETECTED
    for gpu in inventory.gpus:
        index, entry = first_match(plan, gpu)
        shares: GpuForm | None = None
        if entry is not None and _spares_mig_gpu(entry, gpu):
            # As NVIDIA's device plugin under migStrategy mixed: a shared `nvidia.com/gpu` is the non-MIG GPUs.
            notes[gpu.uuid] = (f"{entry_path(plan_name, index)} (match {entry.match.describe()}) does not split a "
                               "MIG-enabled GPU: its MIG instances are published (an entry with match.migProfile "
                               "shares them)")
        elif entry is not None and not entry.whole:
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
                log.warning("the API server does not support consumable capacity (Kubernetes 1.36+, or 1.34/1.35 "
                            "with the DRAConsumableCapacity gate); publishing the plan's fallback instead",
                            extra={"entry": entry_path(plan_name, index), "gpu_uuid": gpu.uuid,
                                   "fallback": shares.strategy if shares is not None else "whole"})
        if shares is not None:
            layout[gpu.uuid] = shares
        if shares is not None and shares.dynamic_mig is not None:
            skipped = [entry_path(plan_name, i) for i, e in _instance_entries(plan, gpu)]
            if skipped:
                notes[gpu.uuid] = "; ".join([*([notes[gpu.uuid]] if gpu.uuid in notes else []),
                                            f"{', '.join(skipped)} (migProfile) not applied: the GPU is dynamic "
                                            "MIG, its instances are created for claims"])
        elif gpu.mig_enabled:
            layout.update(_instance_layout(plan, plan_name, gpu, instance_problems))
    if problems or instance_problems:
        # One line per entry and problem: eight identical GPUs are one mistake, not eight.
        raise PlanError("\n".join([*(f"{entry_path(plan_name, index)} ({_describe_gpus(gpus)}): {problem}"
                                    for (index, problem), gpus in problems.items()), *instance_problems]))
    return ResolvedPlan(layout, notes)


def _instance_entries(plan: SharingPlan, gpu: GpuInfo) -> list[tuple[int, PlanEntry]]:
    """The plan's ``migProfile`` entries that match an instance of ``gpu``."""
    return [(i, e) for i, e in enumerate(plan.gpus)
            if any(e.match.matches_instance(gpu, m) for m in gpu.mig_instances)]


def _instance_layout(plan: SharingPlan, plan_name: str | None, gpu: GpuInfo, problems: list[str]) -> SharingLayout:
    """MIG UUID -> shares for each published instance of ``gpu`` a ``migProfile`` entry matches first."""
    layout: SharingLayout = {}
    for instance in named_instances(gpu):
        index, entry = first_instance_match(plan, gpu, instance)
        if entry is None:
            continue
        try:
            layout[instance.uuid] = instance_shares(entry.mps, entry.timeSlicing, entry.allowMultipleSharesPerClaim,
                                                    gpu, instance)
        except ValueError as exc:
            problems.append(f"{entry_path(plan_name, index)} ({_describe_gpus([gpu])}, MIG instance {instance.profile} "
                            f"at {instance.placement_start}, {instance.uuid}): {exc}")
    return layout


def entries_matching_no_gpu(plan: SharingPlan, inventory: NodeInventory, plan_name: str | None) -> list[str]:
    """Paths of entries no GPU (``migProfile``: no MIG instance) on this node matched (fine, plans are shared by
    nodes; worth a log line)."""
    return [f"{entry_path(plan_name, index)} (match {entry.match.describe()})"
            for index, entry in enumerate(plan.gpus) if not any(_takes(entry.match, gpu) for gpu in inventory.gpus)]


def _takes(match: Match, gpu: GpuInfo) -> bool:
    if match.for_instances:
        return any(match.matches_instance(gpu, m) for m in gpu.mig_instances)
    return match.matches(gpu)


def first_match(plan: SharingPlan, gpu: GpuInfo) -> tuple[int, PlanEntry | None]:
    """The first entry for whole GPUs (no ``migProfile``) that matches ``gpu``, and its index; (-1, None): none."""
    return next(((i, entry) for i, entry in enumerate(plan.gpus)
                 if not entry.match.for_instances and entry.match.matches(gpu)), (-1, None))


def first_instance_match(plan: SharingPlan, gpu: GpuInfo, instance: MigInstance) -> tuple[int, PlanEntry | None]:
    """The first ``migProfile`` entry that matches ``instance`` of ``gpu``, and its index; (-1, None): none."""
    return next(((i, entry) for i, entry in enumerate(plan.gpus) if entry.match.matches_instance(gpu, instance)),
                (-1, None))


def _shares_for(entry: PlanEntry, gpu: GpuInfo, consumable_supported: bool,
                kernel: KernelMemoryLimits) -> GpuForm | None:
    if entry.consumable is not None:
        c = entry.consumable
        if consumable_supported:
            policy = build_policy(gpu, memory_min=c.memoryMin, memory_default=c.memoryDefault,
                                  multiprocessors_step=c.multiprocessorsStep, multiprocessors_min=c.multiprocessorsMin,
                                  multiprocessors_default=c.multiprocessorsDefault, kernel=kernel)
            return GpuForm(strategy="Consumable", count=1, memory_bytes_per_share=policy.memory_bytes,
                             consumable=policy, shm_size_bytes=c.shmSize)
        fallback = c.fallback or ConsumableFallback()
        if fallback.mps is None and fallback.timeSlicing is None:
            return None
        entry = PlanEntry(match=entry.match, mps=fallback.mps, timeSlicing=fallback.timeSlicing)
    unit = ShareUnit("GPU", gpu.memory_bytes)
    if entry.mps is not None:
        _refuse_mig(gpu, "MPS")
        return mps_shares(entry.mps, unit, entry.allowMultipleSharesPerClaim)
    assert entry.timeSlicing is not None  # PlanEntry validation: exactly one form
    _refuse_mig(gpu, "time slicing")
    return time_slicing_shares(entry.timeSlicing, unit, entry.allowMultipleSharesPerClaim)


def _spares_mig_gpu(entry: PlanEntry, gpu: GpuInfo) -> bool:
    """An entry for a family of GPUs (product, all) passes over the MIG-enabled ones: plans are shared by nodes, and
    one GPU in MIG mode must not make the whole plan invalid. One named by minor or UUID is an error instead."""
    splits = entry.mps is not None or entry.timeSlicing is not None or entry.consumable is not None
    return gpu.mig_enabled and splits and not entry.match.names_one_gpu


def _refuse_mig(gpu: GpuInfo, strategy: str) -> None:
    if gpu.mig_enabled:
        raise ValueError(
            f"{strategy} sharing is not possible on a MIG-enabled GPU; share its MIG instances instead (an entry "
            "with match.migProfile), publish it whole (its MIG devices are published instead), narrow the match, "
            "or disable MIG on this GPU"
        )


def entry_path(plan_name: str | None, index: int) -> str:
    return f"plans.{plan_name}.gpus[{index}]" if plan_name is not None else f"gpus[{index}]"


def _describe_gpus(gpus: Sequence[GpuInfo]) -> str:
    if len(gpus) == 1:
        return f"GPU minor {gpus[0].minor}, {gpus[0].uuid}, {gpus[0].product_name}"
    products = ", ".join(dict.fromkeys(gpu.product_name for gpu in gpus))
    return f"{len(gpus)} GPUs, minors {', '.join(str(gpu.minor) for gpu in gpus)}, {products}"


def _names(plans: Mapping[str, object]) -> str:
    return ", ".join(sorted(plans)) or "(none)"
