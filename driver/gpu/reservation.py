"""Step 2 of a prepare (``state.py``): reserve the claim's devices in the checkpoint, or say why not.

:func:`reserve` is a change given to :meth:`NodeLedger.commit`: it runs under the node lock, so what it
finds in the checkpoint is current, and the record it adds is visible to every reader when it returns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from driver.gpu.claim.claimplan import ClaimPlan
from driver.gpu.claim.sharecheck import check_no_overlap, check_shares_fit
from driver.gpu.claim.tenancy import client_rules
from driver.gpu.claimcdi.kernelmemory import warn_if_shared_pod
from driver.gpu.record.checkpoint import Checkpoint, ClaimPhase, ClaimRecord
from driver.gpu.record.ledger import Unchanged
from driver.gpu.runtime.migclaims import check_placements_free


@dataclass(frozen=True)
class Replan(Unchanged):
    """The claim plan no longer matches the GPUs locked for it, or its clients setting changed since the pods
    were checked: plan, and check the pods, again."""


@dataclass(frozen=True)
class Prepared(Unchanged):
    """The claim is prepared already (the kubelet sends it again after its own restart); ``claim_plan``: made now."""

    record: ClaimRecord
    claim_plan: ClaimPlan


@dataclass(frozen=True)
class Interrupted(Unchanged):
    """A prepare of the claim was cut short (a crash, a rollback that failed): roll it back, then plan again."""

    record: ClaimRecord


@dataclass(frozen=True)
class Reserved:
    """The claim's PrepareStarted ``record``, made from ``claim_plan``, is in the checkpoint: do what it names."""

    claim_plan: ClaimPlan
    record: ClaimRecord


# Only Reserved changes the checkpoint: the others are Unchanged, and a group of those writes nothing.
Reservation = Replan | Prepared | Interrupted | Reserved


def reserve(cp: Checkpoint, uid: str, claim_plan: ClaimPlan | None, *, checked: ClaimPlan, gpus: list[str],
            check_health: Callable[[ClaimPlan], None],
            started: Callable[[ClaimPlan], ClaimRecord]) -> Reservation:
    """Reserve ``claim_plan`` (None: nothing left to prepare) for claim ``uid``, ``gpus`` locked; ``checked``: the
    claim plan the claim's pods were checked against.
    Raises PrepareError if another claim holds or fills its devices."""
    existing = cp.claims.get(uid)
    if claim_plan is None or sorted(set(claim_plan.gpu_uuids) | (existing.gpu_uuids if existing else set())) != gpus:
        return Replan()
    if client_rules(claim_plan) != client_rules(checked):
        return Replan()  # the plan's clients setting changed since the pods were checked: check again
    if existing is not None:
        return Prepared(existing,
                        claim_plan) if existing.phase == ClaimPhase.PREPARE_COMPLETED else Interrupted(existing)
    check_health(claim_plan)
    check_no_overlap(cp, claim_plan)
    check_placements_free(cp, claim_plan)  # dynamic MIG placements of other claims
    check_shares_fit(cp, claim_plan)
    record = started(claim_plan)
    warn_if_shared_pod(record, cp)  # kernel memory limits: one value per container (kernelmemory.py)
    cp.claims[uid] = record
    # Written before commit() returns, in one write with the changes of other claims that arrived
    # together: visible at once (to rescans and to the other pod of a rolling update, which read
    # the file under the node lock), whole (its data synced before the rename), but not durable
    # unless another change of the group is, so a power failure may undo it. Nothing recovery
    # needs is lost then: daemons, compute modes and time slices do not outlive the reboot, the
    # compute-mode record is a durable commit made before the mode changes (carrying this record
    # too), and a CDI spec written before PrepareCompleted is an orphan that recovery removes;
    # the kubelet got no answer and retries. kill -9 loses nothing (the page cache holds it).
    return Reserved(claim_plan, record)
