"""Start-up recovery: finish or roll back what a crash or a reboot interrupted.

Runs once, before this process serves the kubelet. It holds the locks of every GPU of the node
while it works, so it never rolls back a prepare that the other plugin pod of a rolling update
is still doing (that pod holds its claim's GPU locks from ``PrepareStarted`` to
``PrepareCompleted``); the node lock is taken only for checkpoint reads and writes. Best effort
per item: one stuck daemon or one failing GPU is logged and retried later, it never keeps the
driver from serving the node.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import cdi
from cdi.atomicswap import swap_name
from driver.gpu.claim.rebuild import daemon_specs, rebuild_checkpoint
from driver.gpu.published.devices import make_view
from driver.gpu.published.targets import drop_unfit
from driver.gpu.record.changes import forget_claim, record_boot, record_daemon
from driver.gpu.record.checkpoint import Checkpoint, CheckpointCorrupt, ClaimPhase, current_boot_id
from driver.gpu.state import DeviceState
from driver.units import now

log = logging.getLogger(__name__)

# Longer than any prepare of the other plugin pod can hold a GPU (its deadline plus one step).
RECOVERY_GPU_WAIT = 60.0


@dataclass
class RecoveryReport:
    rolled_back: list[str] = field(default_factory=list)
    cdi_recreated: list[str] = field(default_factory=list)
    daemons_restarted: list[str] = field(default_factory=list)
    orphans_removed: list[str] = field(default_factory=list)
    rebuilt_from_cdi: bool = False


def recover(state: DeviceState) -> RecoveryReport:
    report = RecoveryReport()
    ledger = state.ledger
    with state.node_lock.held():
        try:
            loaded: Checkpoint | None = ledger.store.load()
        except CheckpointCorrupt:
            loaded = None
        if loaded is None or _rebuild_interrupted(ledger.store.path) or _checkpoint_lost(state):
            cp = rebuild_checkpoint(state.paths.cdi_root, state.names, state.pool_name, now())
            ledger.store.save(cp)
            report.rebuilt_from_cdi = True
        else:
            cp = loaded
        # Publish what the previous process published until apply_layout decides otherwise.
        inventory = state.view.inventory
        present = {g.uuid for g in inventory.gpus}
        # A GPU switched to MIG since cannot be published as shares, nor one switched out of MIG as dynamic
        # MIG; apply_layout sorts them out.
        state.set_view(make_view(inventory, drop_unfit(cp.layout, {}, inventory)[0], state.mps_multi_user))
    gpus = present | {g for r in cp.claims.values() for g in r.gpu_uuids} | set(cp.compute_modes) \
        | set(cp.plan_timeslices)
    with state.gpu_locks.held(gpus, RECOVERY_GPU_WAIT, "recovering the node's state at start"):
        _recover_holding(state, report)
    log.info("state recovered", extra={"rolled_back": report.rolled_back, "cdi_recreated": report.cdi_recreated,
                                       "daemons_restarted": report.daemons_restarted,
                                       "orphans_removed": report.orphans_removed,
                                       "rebuilt_from_cdi": report.rebuilt_from_cdi})
    return report


def _recover_holding(state: DeviceState, report: RecoveryReport) -> None:
    ledger = state.ledger
    cp = ledger.read()
    boot_id = current_boot_id(state.paths.host_root)
    if cp.boot_id is not None and boot_id is not None and boot_id != cp.boot_id:
        log.info("the node rebooted since the last run; re-applying GPU settings")
        state.sharing.after_reboot()
        # No MIG instance survives a reboot: prepared claims get theirs created again below (ensure_claim_runtime).
        state.mig.after_reboot()
    for record in [r for r in cp.claims.values() if r.phase == ClaimPhase.PREPARE_STARTED]:
        try:
            state.undo(record)
        except Exception:
            log.exception("rolling back an interrupted prepare failed; retried at the next start",
                          extra={"claim_uid": record.uid})
            continue
        ledger.commit(partial(forget_claim, uid=record.uid))
        report.rolled_back.append(record.uid)
    if report.rebuilt_from_cdi:
        _adopt_daemons(state)
    for record in ledger.read().claims.values():
        if record.phase != ClaimPhase.PREPARE_COMPLETED:
            continue
        try:
            recreated, restarted = state.ensure_claim_runtime(record)
        except Exception:
            log.exception("could not restore a prepared claim; its containers may fail to start",
                          extra={"claim_uid": record.uid})
            continue
        if recreated:
            report.cdi_recreated.append(record.uid)
        report.daemons_restarted.extend(restarted)
    report.orphans_removed.extend(state.sharing.sweep_orphans())
    state.sharing.reconcile_compute_modes(rebuilt=report.rebuilt_from_cdi)
    report.orphans_removed.extend(_remove_orphan_files(state))
    ledger.commit(partial(record_boot, boot_id=boot_id))


def _rebuild_interrupted(path: Path) -> bool:
    """Whether a corrupt checkpoint was set aside and no rebuilt one saved after it: the process died while
    rebuilding. Loading the missing file as an empty checkpoint would make every running claim's spec and daemon
    an orphan; its specs are still there to rebuild from."""
    return not path.exists() and any(path.parent.glob(f"{path.name}.corrupt-*"))


def _checkpoint_lost(state: DeviceState) -> bool:
    """Whether the checkpoint is missing while claims' CDI specs are there (it was deleted): loading it as
    empty would make each of those claims an orphan, its spec removed and its MPS daemon stopped under
    its running clients. A first start has neither."""
    return not state.ledger.store.path.exists() and bool(cdi.list_specs(state.paths.cdi_root,
                                                                         state.names.spec_prefix))


def _adopt_daemons(state: DeviceState) -> None:
    """After a rebuild from the CDI specs: each live daemon they name gets its record back (its limits read back
    first), so the watcher checks its limits and restarts it again. GPU locks held."""
    for spec in daemon_specs(state.paths.cdi_root, state.names).values():
        if spec.daemon_id in state.ledger.read().mps_daemons:
            continue
        try:
            record = state.sharing.mps.adopt(spec, restore=True)
        except Exception:
            log.exception("adopting an MPS daemon after the rebuild failed", extra={"daemon_id": spec.daemon_id})
            continue
        if record is not None:
            state.ledger.commit(partial(record_daemon, daemon_id=record.spec.daemon_id, record=record))


def _remove_orphan_files(state: DeviceState) -> list[str]:
    removed: list[str] = []
    known_files = {r.cdi_spec_file for r in state.ledger.read().claims.values()}
    for path in cdi.list_specs(state.paths.cdi_root, state.names.spec_prefix):
        if path.name not in known_files:
            cdi.remove_spec(state.paths.cdi_root, path.name)
            removed.append(f"cdi spec {path.name}")
    # Temporary files of writes a crash interrupted (runtimes ignore them, nothing else removes them).
    for tmp in state.paths.cdi_root.glob(f".{state.names.spec_prefix}*.tmp"):
        tmp.unlink(missing_ok=True)
        removed.append(f"temporary file {tmp.name}")
    # Checkpoint writes hold only the node lock: without it, this could delete the temporary file of
    # the other plugin pod's write in progress during a rolling update.
    with state.node_lock.held():
        companion = swap_name(state.ledger.store.path)  # the checkpoint's own, kept between writes
        for tmp in state.paths.state_dir.glob(".checkpoint.json.*.tmp"):
            if tmp == companion:
                continue
            tmp.unlink(missing_ok=True)
            removed.append(f"temporary file {tmp.name}")
    return removed
