"""``python -m driver check-plan FILE``: check a sharing plans file offline, no cluster needed.

Validates the file as the driver does at start (the same one-line errors, naming the entry) and,
with ``--simulate LAYOUT``, resolves the plan a node would use against that simulated node's GPUs
and prints what each GPU would publish. The plan is the one ``--plan`` names, or the one a node
labelled ``--node-label VALUE`` would use, or else the file's ``defaultPlan`` (a node without the label).

Exit status: 0 valid, 1 the plan has problems, 2 a usage error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from driver.cliparser import USAGE_ERROR
from driver.config import DEFAULT_PLAN_LABEL
from driver.gpu.published.planuse import chosen_how, gpu_lines, plan_use
from driver.gpu.published.sharingplan import PlanError, SharingPlan, SharingPlans, load_plans, resolve_plan, select_plan
from driver.nodelayout import SIMULATED_NODE_NAME

PROG = "python -m driver check-plan"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="the sharing plans file (YAML), as given to --sharing-plans")
    parser.add_argument("--simulate", metavar="LAYOUT", default=None,
                        help="SIMULATION: also show what each GPU of this simulated node would publish (a layout "
                             "name, as python -m driver demo --help lists them, or a layout YAML file); "
                             "default: validate the file only")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--plan", metavar="NAME", default=None, help="the plan to resolve (default: defaultPlan)")
    which.add_argument("--node-label", metavar="VALUE", default=None,
                       help=f"resolve the plan a node whose {DEFAULT_PLAN_LABEL} label is VALUE would use")


class _Usage(ValueError):
    """A flag that cannot be used; one line naming it."""


def main(args: argparse.Namespace) -> int:
    path = Path(args.file)
    try:
        plans = load_plans(path)
    except PlanError as exc:
        for line in str(exc).splitlines():
            print(f"{PROG}: {line}", file=sys.stderr)
        return 1
    try:
        name, plan, how = _chosen(plans, args.plan, args.node_label)
        lines = _summary(path, plans)
        if args.simulate is not None:
            lines += _resolved(plans, plan, name, path, how, args.simulate)
        elif plan.gpus:
            lines.append(f"Pass --simulate LAYOUT to see what each GPU of a node would publish under plan {name!r}.")
    except _Usage as exc:
        print(f"{PROG}: {exc} ({PROG} --help lists the flags)", file=sys.stderr)
        return USAGE_ERROR
    except PlanError as exc:
        for line in str(exc).splitlines():
            print(f"{PROG}: {path}: {line}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


def _chosen(plans: SharingPlans, plan: str | None, label: str | None) -> tuple[str | None, SharingPlan, str]:
    if plan is not None:
        if plan not in plans.plans:
            raise _Usage(f"--plan {plan!r}: no such plan in the file; known plans: {_names(plans)}")
        return plan, plans.plans[plan], f"--plan {plan}"
    if label is not None and label not in plans.plans:
        raise _Usage(f"--node-label {label!r}: names no sharing plan; known plans: {_names(plans)}")
    labels = {DEFAULT_PLAN_LABEL: label} if label is not None else {}
    name, chosen = select_plan(plans, labels, DEFAULT_PLAN_LABEL)
    return name, chosen, chosen_how(DEFAULT_PLAN_LABEL, label, name)


def _summary(path: Path, plans: SharingPlans) -> list[str]:
    lines = [f"{path}: valid; {len(plans.plans)} plan(s), defaultPlan {plans.defaultPlan or 'none'}, "
             f"consumableCapacityGate {str(plans.consumableCapacityGate).lower()}, "
             f"partitionableDevicesGate {str(plans.partitionableDevicesGate).lower()}"]
    for plan_name, plan in sorted(plans.plans.items()):
        lines.append(f"  plan {plan_name}: {len(plan.gpus)} entr{'y' if len(plan.gpus) == 1 else 'ies'}")
        for index, entry in enumerate(plan.gpus):
            form = next(k for k, v in entry.forms().items() if v)
            lines.append(f"    plans.{plan_name}.gpus[{index}]: match {entry.match.describe()} -> {form}")
    return lines


def _resolved(plans: SharingPlans, plan: SharingPlan, name: str | None, path: Path, how: str,
              layout_name: str) -> list[str]:
    from driver.simulation.discovery import SimulatedDiscovery, available_layouts

    try:
        discovery = SimulatedDiscovery(layout_name, SIMULATED_NODE_NAME)
        inventory = discovery.discover()
    except (ValueError, OSError) as exc:
        raise _Usage(f"--simulate {layout_name!r}: {exc} (layouts: {', '.join(available_layouts())})") from None
    # Offline there is no API server to ask: assume one that keeps consumable capacity and counters (1.36+).
    resolved = resolve_plan(plan, inventory, name, consumable_supported=True, partitionable_supported=True)
    use = plan_use(plan, name, path, how, inventory, resolved.layout, resolved.notes)
    lines = ["", f"SIMULATION: layout {layout_name!r} ({len(inventory.gpus)} GPUs); {use.summary()}; assuming "
                 "Kubernetes 1.36+ (on 1.34/1.35 without consumableCapacityGate, consumable entries publish their "
                 "fallback; without partitionableDevicesGate, dynamicMig entries publish no placements)"]
    lines += gpu_lines(use)
    lines += [f"NOTE: {line}" for line in use.note_lines()]
    if use.unmatched_entries:
        lines.append(f"Entries matching no GPU of this node: {', '.join(use.unmatched_entries)}")
    if name is not None and plan.gpus and all(g.entry is None for g in use.gpus):
        lines.append(f"WARNING: plan {name!r} matches no GPU of this node: every GPU is published whole")
    return lines


def _names(plans: SharingPlans) -> str:
    return ", ".join(sorted(plans.plans)) or "(none)"

