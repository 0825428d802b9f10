"""Crash-safety review: what a kill -9 or a power failure at one precise point leaves, and what the next
start makes of it. Each test puts the disk in the state the crash leaves and runs the next start."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from cdi import atomicfile, atomicswap
from driver.gpu.record.checkpoint import Checkpoint, CheckpointCorrupt, CheckpointStore
from driver.gpu.recovery import RecoveryReport, recover
from tests.support.statenode import StateNode, claim, gpu_config, ref


def test_a_kill_between_setting_aside_a_corrupt_checkpoint_and_saving_the_rebuilt_one_loses_no_claim(
        state_node: StateNode) -> None:
    state_node.state().prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    [daemon_id] = state_node.mps.started()
    (state_node.paths.state_dir / "checkpoint.json").write_text("{garbage")
    # The start that found it corrupt set it aside, then died (kill -9) while rebuilding from the specs:
    # the disk holds the set-aside file and no checkpoint.
    with pytest.raises(CheckpointCorrupt):
        state_node.store.load()
    assert not (state_node.paths.state_dir / "checkpoint.json").exists()

    restarted = state_node.state()
    report = recover(restarted)
    assert report.rebuilt_from_cdi, "the interrupted rebuild is done again"
    assert [r.uid for r in restarted.prepared_claims()] == ["u1"]
    assert state_node.spec_path("u1").exists(), "the running claim's spec is not an orphan"
    assert daemon_id in state_node.mps.running, "nor is its MPS daemon"


def test_a_symlink_put_in_place_of_a_claims_spec_is_replaced_by_the_claims_own_spec(state_node: StateNode) -> None:
    state_node.state().prepare(claim("u1", "gpu-0"))
    own = state_node.spec_json("u1")
    # Whole JSON somewhere else, naming another GPU: what the runtime would inject if the link were kept.
    forged = state_node.root / "forged.json"
    forged.write_text(state_node.spec_path("u1").read_text().replace("/dev/nvidia0", "/dev/nvidia2"))
    state_node.spec_path("u1").unlink()
    state_node.spec_path("u1").symlink_to(forged)

    report = recover(state_node.state())
    assert report.cdi_recreated == ["u1"]
    assert not state_node.spec_path("u1").is_symlink(), "the link is not trusted as the claim's spec"
    assert state_node.spec_json("u1") == own
    assert "/dev/nvidia2" in forged.read_text(), "nor is its target written through"


def test_a_fifo_in_place_of_a_claims_spec_does_not_hang_the_start(state_node: StateNode) -> None:
    state_node.state().prepare(claim("u1", "gpu-0"))
    own = state_node.spec_json("u1")
    state_node.spec_path("u1").unlink()
    os.mkfifo(state_node.spec_path("u1"))
    done = threading.Event()
    reports: list[RecoveryReport] = []

    def start() -> None:
        reports.append(recover(state_node.state()))
        done.set()

    threading.Thread(target=start, daemon=True).start()
    finished = done.wait(timeout=10)
    if not finished:  # let the blocked read of the FIFO return, so the thread ends with the test
        with open(os.open(state_node.spec_path("u1"), os.O_WRONLY | os.O_NONBLOCK), "wb"):
            pass
    assert finished, "recovery blocked reading a FIFO as a spec: the driver never starts serving"
    assert reports[0].cdi_recreated == ["u1"] and state_node.spec_json("u1") == own


def _record_companion_writes(monkeypatch: pytest.MonkeyPatch, directory: Path) -> list[str]:
    """Directory syncs and opens of the checkpoint's swap companion, in order."""
    events: list[str] = []
    real_sync, real_open = atomicfile.fsync_directory, os.open

    def sync(path: Path) -> None:
        events.append("sync")
        real_sync(path)

    def opened(path: object, *args: object) -> int:
        if Path(str(path)).name == ".checkpoint.json.swap.tmp":
            events.append("open companion")
        return real_open(path, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(atomicswap, "fsync_directory", sync)
    monkeypatch.setattr(os, "open", opened)
    return events


def test_the_other_pods_unsynced_swap_is_made_durable_before_its_companion_is_overwritten(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "checkpoint.json"
    old_pod, new_pod = CheckpointStore(path), CheckpointStore(path)  # a rolling update: both pods on the node
    old_pod.save(Checkpoint(boot_id="1"))
    new_pod.save(new_pod.load().model_copy(update={"boot_id": "2"}))
    old_pod.save(old_pod.load().model_copy(update={"boot_id": "3"}))  # both pods have swapped durably once
    # The old pod's group commit: swapped under the node lock, its directory sync after the lock is released.
    old_pod.save(old_pod.load().model_copy(update={"boot_id": "4"}), defer_directory_sync=True)
    # The new pod takes the lock in between. Until that sync the directory on disk may still call the
    # companion the checkpoint: overwriting it in place now, a power failure would find the checkpoint torn.
    events = _record_companion_writes(monkeypatch, tmp_path)
    new_pod.save(new_pod.load().model_copy(update={"boot_id": "5"}))
    assert events[:2] == ["sync", "open companion"], events
    monkeypatch.undo()
    assert CheckpointStore(path).load().boot_id == "5"


def test_a_restarted_driver_syncs_the_directory_before_it_first_overwrites_the_companion(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "checkpoint.json"
    killed = CheckpointStore(path)
    killed.save(Checkpoint(boot_id="1"))
    killed.save(Checkpoint(boot_id="2"))
    killed.save(Checkpoint(boot_id="3"), defer_directory_sync=True)  # then kill -9, before the directory sync
    restarted = CheckpointStore(path)
    events = _record_companion_writes(monkeypatch, tmp_path)
    restarted.save(restarted.load().model_copy(update={"boot_id": "4"}))
    assert events[:2] == ["sync", "open companion"], events


def test_the_checkpoints_own_companion_is_not_reported_or_removed_as_an_orphan(state_node: StateNode) -> None:
    state = state_node.state()
    state.prepare(claim("u1", "gpu-0"))
    state.unprepare(ref("u1"))  # durable writes go through the companion
    companion = atomicswap.swap_name(state_node.paths.state_dir / "checkpoint.json")
    assert companion.exists()
    report = recover(state_node.state())
    assert not any("swap" in o for o in report.orphans_removed), report.orphans_removed
    assert companion.exists()


def test_a_claims_own_daemon_is_adopted_and_watched_again_after_a_rebuild(state_node: StateNode) -> None:
    # A rebuild from the CDI specs used to know a per-claim daemon by id only: no record, so the watcher never
    # checked its limits or restarted it again. The spec carries the daemon's settings; the live daemon is adopted.
    state_node.state().prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    [daemon_id] = state_node.mps.started()
    (state_node.paths.state_dir / "checkpoint.json").write_text("{garbage")
    restarted = state_node.state()
    assert recover(restarted).rebuilt_from_cdi
    assert daemon_id in restarted.ledger.read().mps_daemons, "the live daemon has a record again"
    assert state_node.mps.started() == [daemon_id], "adopted, not started again under its clients"
