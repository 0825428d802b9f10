"""``python -m driver demo --dynamic-mig`` (SIMULATION): MIG instances created for claims, on one simulated H100.

The node's MIG-mode GPUs without instances get a plan entry ``dynamicMig``, so they are published as every
placement of every profile, each consuming the GPU's counters. From the template of
``examples/resourceclaims/mig-dynamic.yaml`` (its profile changed per claim) the demo asks for two ``2g.20gb``
and a ``3g.40gb``; the allocator stand-in places them by the counters (first fit: 2g.20gb at 0 and 2,
3g.40gb at 4) and the driver creates each instance at prepare. A ``7g.80gb`` (the whole GPU's memory) is
then refused by the allocator stand-in; once the three are unprepared (their instances destroyed) it fits.
What the driver created is read from its checkpoint, as ``inspect`` reads it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from driver.commands.demo.args import DYNAMIC_MIG_EXAMPLE, EXAMPLES_DIR, PLAN_NAME, claim_documents
from driver.gpu.discovery.inventory import NodeInventory
from driver.gpu.record.checkpoint import CheckpointStore
from driver.kubeletplugin.types import ClaimRef
from driver.simulation.allocator import AllocationError, allocate, claim_from_template

# In this order the allocator stand-in's first fit puts them side by side: 2g.20gb at 0 and 2, 3g.40gb at 4.
MIX = ("2g.20gb", "2g.20gb", "3g.40gb")
FULL = "7g.80gb"

Say = Callable[[str], None]
# Allocates and prepares one claim document through the kubelet stand-in, showing what the container gets
# (scenario.py's ``_prepare_document``, bound to the demo's API server, kubelet and directories).
PrepareDocument = Callable[[dict[str, Any], str], ClaimRef | None]


def dynamic_mig_plan(inventory: NodeInventory) -> tuple[dict[str, Any], str]:
    """(sharing plans file content, one-line description): every MIG-mode GPU without instances dynamic."""
    gpus = [g for g in inventory.gpus if g.mig_enabled and not g.mig_instances and g.mig_profiles]
    plan = {"gpus": [{"match": {"minor": g.minor}, "dynamicMig": {}} for g in gpus]}
    what = ", ".join(f"gpu-{g.minor} ({g.product_name})" for g in gpus)
    return ({"defaultPlan": PLAN_NAME, "plans": {PLAN_NAME: plan}},
            f"{what} dynamic MIG: every placement of every profile, created at prepare" if gpus
            else "none (no GPU in MIG mode without instances: try --layout dynamic-mig)")


def claim_for(template: dict[str, Any], profile: str, suffix: str) -> dict[str, Any]:
    """The example's template asking for ``profile`` instead of its own, named ``<template>-<profile>-<suffix>``."""
    doc = copy.deepcopy(template)
    doc["metadata"]["name"] = f"{template['metadata']['name']}-{profile.replace('.', '')}-{suffix}"
    for request in doc["spec"]["spec"]["devices"]["requests"]:
        for selector in request["exactly"].get("selectors", []):
            expression = selector["cel"]["expression"]
            head, _, _ = expression.rpartition("profile == ")
            selector["cel"]["expression"] = f"{head}profile == '{profile}'"
    return doc


def template() -> dict[str, Any]:
    [doc] = claim_documents(EXAMPLES_DIR / DYNAMIC_MIG_EXAMPLE)
    return doc


def show_instances(state_dir: Path, say: Say) -> None:
    """Each MIG instance Tessera created, as the checkpoint records it (the same as ``inspect``)."""
    cp = CheckpointStore(state_dir / "checkpoint.json").peek()
    made = [(r, d) for r in (cp.claims.values() if cp else ()) for d in r.devices if d.dynamic_mig is not None]
    if not made:
        say("  MIG instances Tessera created: none")
    for record, dev in sorted(made, key=lambda rd: rd[1].dynamic_mig.placement_start if rd[1].dynamic_mig else 0):
        intent = dev.dynamic_mig
        assert intent is not None
        say(f"  MIG instance for claim {record.namespace}/{record.name}: {intent.profile} at placement "
            f"{intent.placement_start} (memory slices {intent.placement_start}-{intent.placement_end - 1}) on GPU "
            f"{dev.gpu_minor}, GI {dev.mig_gi_id} CI {dev.mig_ci_id}, {dev.mig_uuid}")


def prepare_mix(prepare: PrepareDocument, slices: Callable[[], list[dict[str, Any]]], taken: set[str],
                driver: str, state_dir: Path, say: Say) -> list[ClaimRef]:
    """Two 2g.20gb and a 3g.40gb created on one GPU; then a 7g.80gb the allocator stand-in refuses."""
    base = template()
    refs = []
    for index, profile in enumerate(MIX):
        say("")
        ref = prepare(claim_for(base, profile, "abc"[index]), DYNAMIC_MIG_EXAMPLE)
        if ref is not None:
            refs.append(ref)
    say("")
    show_instances(state_dir, say)
    say("")
    try:
        allocate(claim_from_template(claim_for(base, FULL, "a"), "probe"), slices(), driver, set(taken))
        say(f"A {FULL} claim would be allocated now: unexpected while the three instances hold the GPU")
    except AllocationError as exc:
        say(f"A {FULL} claim is refused by the allocator stand-in while they hold the GPU's memory slices: {exc}")
    return refs


def show_full_gpu_fits(prepare: PrepareDocument, unprepare: Callable[[list[ClaimRef]], dict[str, str | None]],
                       released: list[str], taken: set[str], state_dir: Path, say: Say) -> bool:
    """After the mix is unprepared (``released``: its devices, no longer taken), the 7g.80gb fits; it is
    prepared, shown and unprepared. False if its prepare failed."""
    taken.difference_update(released)
    show_instances(state_dir, say)
    say("")
    say(f"Their instances are destroyed, so the {FULL} fits now:")
    ref = prepare(claim_for(template(), FULL, "a"), DYNAMIC_MIG_EXAMPLE)
    if ref is None:
        return False
    show_instances(state_dir, say)
    answer = unprepare([ref])[ref.uid]
    say(f"NodeUnprepareResources {ref.namespace}/{ref.name}: {answer or 'ok'}")
    show_instances(state_dir, say)
    return answer is None
