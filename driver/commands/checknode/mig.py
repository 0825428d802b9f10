"""check-node's dynamic MIG lines: for each GPU that has MIG, whether dynamic MIG can serve it and why not.

One line per MIG-capable GPU, from the inventory and the checkpoint (read only: the instances Tessera
created for claims are its own, not in the way): MIG mode off (an operator's step, named), in MIG mode
with instances Tessera did not create (published as those static MIG devices, never touched), or in MIG
mode and free of others' instances, which a plan entry ``dynamicMig`` can serve. None of these is a
failure: static MIG and whole GPUs are served as before.
"""

from __future__ import annotations

from driver.commands.checknode.result import CheckResult, ok
from driver.config import Settings
from driver.gpu.discovery.inventory import NodeInventory
from driver.gpu.published.dynamicmigplan import pending_mig_mode, unavailable_reason
from driver.gpu.record.checkpoint import CheckpointStore
from driver.gpu.runtime.migclaims import own_instances


def dynamic_mig_checks(settings: Settings, inventory: NodeInventory | None) -> list[CheckResult]:
    try:
        cp = CheckpointStore(settings.state_dir / "checkpoint.json").peek()
    except (ValueError, OSError):
        cp = None  # an unreadable checkpoint: every instance counts as someone else's here
    own = own_instances(cp) if cp is not None else set()
    lines = []
    for gpu in inventory.gpus if inventory is not None else ():
        if not gpu.mig_capable:
            continue
        check = f"dynamic MIG GPU {gpu.minor}"
        mine = sum(1 for m in gpu.mig_instances if (gpu.uuid, m.gi_id) in own)
        # The server's support is the publisher's business (logged at start); here only what the GPU allows.
        reason = unavailable_reason(gpu, own, supported=True)
        if reason is None:
            held = f"; {mine} instance(s) created by Tessera for claims" if mine else ""
            pending = f"; {text}" if (text := pending_mig_mode(gpu)) else ""
            lines.append(ok(check, f"MIG mode on, no instances Tessera did not create{held}: dynamic MIG can serve "
                                   f"it ({len(gpu.mig_profiles)} profiles; a sharing-plan entry dynamicMig){pending}"))
        else:
            lines.append(ok(check, f"dynamic MIG cannot serve it: {reason}"))
    return lines
