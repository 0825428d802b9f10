"""The prepare-time re-checks against prepared claims: no device (or GPU in another form) taken twice,
and consumable shares fit next to the prepared ones. Admin-access devices take part in neither.

The scheduler counts consumed capacity first; this second line refuses a share when the GPU's
prepared claims (the checkpoint) would then consume more than its capacity, or when a claim holds
the GPU in another form. Runs under the node lock, in the same section that records the claim.
"""

from __future__ import annotations

from driver.gpu.claim.claimplan import ClaimPlan
from driver.gpu.claimconfig.choices import DeviceKind
from driver.gpu.errors import PrepareError
from driver.gpu.published.consumable import ConsumedShare, HeldShare, check_fits
from driver.gpu.published.targets import DeviceTarget
from driver.gpu.record.checkpoint import Checkpoint


def check_shares_fit(cp: Checkpoint, claim_plan: ClaimPlan) -> None:
    """PrepareError naming the amounts unless each consumable share of ``claim_plan`` fits its GPU."""
    targets = {t.name: t for t in claim_plan.targets}
    for name, wanted in claim_plan.consumed:
        target = targets[name]
        policy = target.form.consumable if target.form is not None else None
        assert policy is not None  # plan_claim records consumption only for consumable devices
        held: list[HeldShare] = []
        for other in cp.claims.values():
            if other.uid == claim_plan.uid:
                continue
            for d in other.devices:
                if d.gpu_uuid != target.gpu.uuid or d.admin_access:  # admin access consumes nothing
                    continue
                label = f"{other.namespace}/{other.name}"
                if d.kind == DeviceKind.CONSUMABLE and d.consumed_memory_bytes is not None \
                        and d.consumed_multiprocessors is not None:
                    held.append(HeldShare(label, ConsumedShare(d.consumed_memory_bytes, d.consumed_multiprocessors,
                                                               0)))
                else:
                    held.append(HeldShare(label, None))
        check_fits(name, wanted, held, policy)


def check_no_overlap(cp: Checkpoint, claim_plan: ClaimPlan) -> None:
    """PrepareError unless every device of ``claim_plan`` but consumable shares is free of other claims.

    Devices with admin access are shared by design: never refused, and never in the way of others."""
    held_targets = claim_plan.held_targets
    for other in cp.claims.values():
        if other.uid == claim_plan.uid:
            continue
        held = [d for d in other.devices if not d.admin_access]
        taken = {d.device.device_name for d in held}
        # A GPU held in another form (whole next to a share, MPS next to time-slice shares): possible
        # when a view is stale, e.g. the other pod of a rolling update re-published the GPU. The instances
        # of a MIG GPU each have a form of their own (a MIG device, or its shares).
        forms = {(d.gpu_uuid, d.mig_uuid or ("" if d.dynamic_mig is not None else None), d.kind) for d in held}
        for t in held_targets:
            if t.kind == DeviceKind.CONSUMABLE:  # shares of a consumable GPU: check_shares_fit
                continue
            if t.name in taken or any(_other_form(t, instance, kind) for g, instance, kind in forms
                                      if g == t.gpu.uuid):
                raise PrepareError(
                    f"device {t.name!r} (or its GPU in another form) is already prepared for claim "
                    f"{other.namespace}/{other.name} ({other.uid}); the allocation is stale, delete the pod "
                    "so its claim is allocated again")


def _other_form(t: DeviceTarget, instance: str | None, kind: DeviceKind) -> bool:
    """Whether a device of ``t``'s GPU held as ``kind`` on MIG ``instance`` (its MIG UUID; "": a dynamic MIG
    instance not created yet; None: no MIG device or share) stands in ``t``'s way."""
    if DeviceKind.GPU in (kind, t.kind):
        return True
    mine = t.mig.uuid if t.mig is not None else ("" if t.creates_mig_instance else None)
    if (instance is None) != (mine is None):
        return True  # a whole GPU's share next to a MIG device or share of the same GPU: a stale view
    if instance is None:
        return kind != t.kind
    return instance == mine and kind != t.kind
