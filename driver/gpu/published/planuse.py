"""Which sharing plan a node uses and what it makes of each GPU: for the start log, ``inspect`` and ``check-plan``.

Pure over the plan, the inventory and the resolved layout. The driver writes the result to
``<state dir>/sharing-plan.json`` when it applies a layout, so ``inspect`` (which has no API access
to read the node's label) can show the plan the running driver chose.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from driver.gpu.discovery.inventory import GpuInfo, MigInstance, NodeInventory
from driver.gpu.discovery.migplacement import counter_values, placements
from driver.gpu.published.devicenames import counter_set_name
from driver.gpu.published.devices import quantity_from_bytes
from driver.gpu.published.migshareplan import named_instances
from driver.gpu.published.sharelayout import GpuForm, SharingLayout
from driver.gpu.published.sharingplan import (
    PlanError,
    SharingPlan,
    entries_matching_no_gpu,
    entry_path,
    first_instance_match,
    first_match,
    load_plans,
)

PLAN_USE_FILE = "sharing-plan.json"


class GpuPlanUse(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    minor: int
    uuid: str
    product: str
    # The plan entry that matched (e.g. plans.demo.gpus[0]), then those that split its MIG instances; None: none did.
    entry: str | None
    published: str  # one line: what the GPU is published as
    note: str | None = None  # why the entry's form is not used (and what it is published as), or what was ignored


class PlanUse(BaseModel):
    """The plan in use on a node: where it came from, its name, and each GPU's entry."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str | None  # None: no plans file configured
    plan: str | None  # None: no plan (the file has no defaultPlan and the node no label): every GPU whole
    how: str  # how the plan was chosen, e.g. 'node label gpu.tessera.dev/sharing-plan=demo'
    gpus: list[GpuPlanUse]
    unmatched_entries: list[str]  # entries no GPU of this node matched

    def note_lines(self) -> list[str]:
        """One warning per GPU whose entry could not be applied as written: ``gpu-2 (NVIDIA L4): <why>``."""
        return [f"{gpu_label_of(g)}: {g.note}" for g in self.gpus if g.note is not None]

    def summary(self) -> str:
        """One line for the log and ``inspect``."""
        if self.file is None:
            return "no sharing plans file: every GPU is published whole (or as its MIG devices)"
        name = f"plan {self.plan!r}" if self.plan is not None else "no plan"
        return f"{name} from {self.file} ({self.how})"


def gpu_label_of(g: GpuPlanUse) -> str:
    return f"gpu-{g.minor} ({g.product})"


def describe_shares(shares: GpuForm | None, gpu: GpuInfo, layout: SharingLayout | None = None) -> str:
    """What one GPU is published as under ``shares`` (a GPU in MIG mode: each instance under ``layout``), in the
    units a claim's selector would use."""
    if shares is None:
        if gpu.mig_enabled:
            instances = named_instances(gpu)
            described = [_describe_instance(m, (layout or {}).get(m.uuid)) for m in instances]
            return f"its {len(instances)} MIG device(s) ({'; '.join(described) or 'none'})"
        memory = quantity_from_bytes(gpu.memory_bytes) if gpu.memory_bytes else "memory unknown"
        return f"whole (memory {memory})"
    if shares.dynamic_mig is not None:
        return _describe_dynamic_mig(shares, gpu)
    if shares.consumable is not None:
        c = shares.consumable
        return (f"one consumable device: memory {quantity_from_bytes(c.memory_bytes)} (claims take "
                f"{quantity_from_bytes(c.memory_min_bytes)} to {quantity_from_bytes(c.memory_max_bytes)} in steps of "
                f"{quantity_from_bytes(c.memory_step_bytes)}), {c.multiprocessors} multiprocessors (claims take "
                f"{c.multiprocessors_min} to {c.multiprocessors_max} in steps of {c.multiprocessors_step}), "
                f"memory enforcement {c.memory_enforcement.value}")
    return _describe_split(shares)


def _describe_split(shares: GpuForm) -> str:
    memory = quantity_from_bytes(shares.memory_bytes_per_share)
    if shares.strategy == "MPS":
        return (f"{shares.count} MPS shares, each memory {memory} (pinned limit), "
                f"{shares.active_thread_percentage}% of the SMs, clients {shares.mps_clients}")
    interval = f", time slice {shares.interval}" if shares.interval and shares.mig_profile is None else ""
    return f"{shares.count} time-sliced shares, each memory {memory} (not enforced){interval}"


def _describe_instance(instance: MigInstance, shares: GpuForm | None) -> str:
    where = f"{instance.profile} at {instance.placement_start}"
    if shares is None:
        return where
    # A MIG instance's MPS limits hold only for clients that stay with its daemon: its GPU is in DEFAULT.
    advisory = ", limits advisory" if shares.strategy == "MPS" else ""
    return f"{where} as {_describe_split(shares)}{advisory}"


def _describe_dynamic_mig(shares: GpuForm, gpu: GpuInfo) -> str:
    assert shares.dynamic_mig is not None
    found = placements(gpu, shares.dynamic_mig.profiles)
    counts = ", ".join(f"{name} x{sum(1 for p in found if p.profile.name == name)}"
                       for name in shares.dynamic_mig.profiles)
    whole = "the whole GPU and " if shares.dynamic_mig.also_whole_gpu else ""
    return (f"dynamic MIG: {whole}{len(found)} placements ({counts}), created at prepare; counter set "
            f"{counter_set_name(gpu.minor)} ({len(counter_values(gpu))} counters)")


def plan_use(plan: SharingPlan, plan_name: str | None, file: Path | None, how: str, inventory: NodeInventory,
             layout: SharingLayout, notes: dict[str, str] | None = None) -> PlanUse:
    """``notes``: GPU UUID -> why its entry is not applied as written (``ResolvedPlan.notes``)."""
    gpus = []
    for gpu in sorted(inventory.gpus, key=lambda g: g.minor):
        index, entry = first_match(plan, gpu)
        # Then the migProfile entries that split its instances (in the plan's order).
        used = sorted({i for m in gpu.mig_instances if m.uuid in layout
                       for i, e in [first_instance_match(plan, gpu, m)] if e is not None})
        paths = [entry_path(plan_name, i) for i in ([index] if entry is not None else []) + used]
        gpus.append(GpuPlanUse(minor=gpu.minor, uuid=gpu.uuid, product=gpu.product_name,
                               entry=", ".join(paths) or None,
                               published=describe_shares(layout.get(gpu.uuid), gpu, layout),
                               note=(notes or {}).get(gpu.uuid)))
    return PlanUse(file=str(file) if file is not None else None, plan=plan_name, how=how, gpus=gpus,
                   unmatched_entries=entries_matching_no_gpu(plan, inventory, plan_name))


def chosen_how(label_key: str, label_value: str | None, plan_name: str | None) -> str:
    """How a node came to use ``plan_name``, as :func:`~driver.gpu.published.sharingplan.select_plan` chose it."""
    if label_value is not None:
        return f"node label {label_key}={label_value}"
    if plan_name is not None:
        return f"defaultPlan: the node has no label {label_key}"
    return f"the node has no label {label_key} and the file no defaultPlan: every GPU whole"


def gpu_lines(use: PlanUse) -> list[str]:
    """One line per GPU: its entry (or none) and what it is published as."""
    return [f"GPU {g.minor} {g.uuid} {g.product}: {g.entry or 'no entry matches'} -> {g.published}"
            for g in use.gpus]


def write_plan_use(path: Path, use: PlanUse) -> None:
    """Replace ``path`` atomically: ``inspect`` may read it at any moment."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(use.model_dump(), indent=2) + "\n")
    os.replace(temporary, path)


def read_plan_use(path: Path) -> PlanUse | None:
    """The plan the running driver last applied; None if it has written none (or it cannot be read)."""
    try:
        return PlanUse.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None


def add_to_inspect(report: dict[str, Any], path: Path, plans_file: Path | None) -> None:
    """The plan the running driver applied (``report['sharing_plan']``); a plans file that does not load is a
    problem."""
    use = read_plan_use(path)
    report["sharing_plan"] = use.model_dump() if use is not None else None
    if plans_file is not None:
        try:
            load_plans(plans_file)
        except PlanError as exc:
            # The driver refuses such a file at start and keeps its last good plan on a rescan.
            report["problems"].extend(f"sharing plans: {line}" for line in str(exc).splitlines())


def render_plan(report: dict[str, Any]) -> list[str]:
    raw = report.get("sharing_plan")
    if raw is None:
        return ["sharing plan: not known (the driver has not written one: not started yet, or an older version)"]
    use = PlanUse.model_validate(raw)
    return [f"sharing plan: {use.summary()}", *(f"  {line}" for line in gpu_lines(use)),
            *(f"  note: {line}" for line in use.note_lines())]
