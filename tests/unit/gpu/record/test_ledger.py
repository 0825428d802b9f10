"""NodeLedger group commit: concurrent changes share one durable write, and none returns before it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from driver.gpu.record.changes import record_plan_timeslice
from driver.gpu.record.checkpoint import Checkpoint, CheckpointStore
from driver.gpu.record.ledger import NodeLedger, Unchanged
from driver.kubeletplugin.nodelock import NodeLock


class CountingStore(CheckpointStore):
    """A real store that counts its writes and can hold the first one until released."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.saves: list[set[str]] = []
        self.first_write_started = threading.Event()
        self.release_first_write = threading.Event()
        self.release_first_write.set()
        self.fail_next = False

    def save(self, checkpoint: Checkpoint, *, durable: bool = True, adopt: bool = False,
             defer_directory_sync: bool = False) -> None:
        self.first_write_started.set()
        assert self.release_first_write.wait(10)
        if self.fail_next:
            self.fail_next = False
            raise OSError(28, "simulated: no space left on device")
        super().save(checkpoint, durable=durable, adopt=adopt, defer_directory_sync=defer_directory_sync)
        self.saves.append(set(checkpoint.plan_timeslices))


def _ledger(tmp_path: Path) -> tuple[NodeLedger, CountingStore]:
    store = CountingStore(tmp_path / "checkpoint.json")
    return NodeLedger(store, NodeLock(tmp_path / "state.lock"), Checkpoint), store


def _mark(key: str) -> Callable[[Checkpoint], None]:
    return partial(record_plan_timeslice, uuid=key, interval="Short")


@dataclass(frozen=True)
class _Found(Unchanged):
    keys: list[str]


def _look(cp: Checkpoint) -> _Found:
    return _Found(sorted(cp.plan_timeslices))


def test_one_commit_is_written_and_on_disk_when_it_returns(tmp_path: Path) -> None:
    ledger, store = _ledger(tmp_path)
    ledger.commit(_mark("GPU-a"))
    assert store.saves == [{"GPU-a"}]
    assert set(ledger.read().plan_timeslices) == {"GPU-a"}
    assert set(CheckpointStore(store.path).load().plan_timeslices) == {"GPU-a"}, "read back by another reader"


def test_a_change_that_changed_nothing_returns_what_it_found_and_writes_nothing(tmp_path: Path) -> None:
    ledger, store = _ledger(tmp_path)
    ledger.commit(_mark("GPU-a"))
    assert ledger.commit(_look) == _Found(["GPU-a"])
    assert store.saves == [{"GPU-a"}], "no second write"


def test_changes_that_arrive_during_a_write_share_the_next_write(tmp_path: Path) -> None:
    ledger, store = _ledger(tmp_path)
    store.release_first_write.clear()
    first = threading.Thread(target=ledger.commit, args=(_mark("GPU-first"),))
    first.start()
    assert store.first_write_started.wait(10)
    returned: list[str] = []

    def commit(key: str) -> None:
        ledger.commit(_mark(key))
        returned.append(key)

    waiting = [threading.Thread(target=commit, args=(f"GPU-{n}",)) for n in range(5)]
    for thread in waiting:
        thread.start()
    # Every waiting change is queued before the first write finishes (the queue is filled without
    # the writer's lock); none of them may return while that write, which lacks them, is in flight.
    while len(ledger._queue) < 5:
        threading.Event().wait(0.001)
    assert returned == []
    store.release_first_write.set()
    first.join(10)
    for thread in waiting:
        thread.join(10)
    assert sorted(returned) == [f"GPU-{n}" for n in range(5)]
    assert store.saves == [{"GPU-first"}, {"GPU-first"} | {f"GPU-{n}" for n in range(5)}], "one write for the five"


def test_a_failing_change_is_raised_to_its_caller_only(tmp_path: Path) -> None:
    ledger, store = _ledger(tmp_path)

    def broken(cp: Checkpoint) -> None:
        raise KeyError("no such claim")

    with pytest.raises(KeyError, match="no such claim"):
        ledger.commit(broken)
    ledger.commit(_mark("GPU-b"))
    assert set(CheckpointStore(store.path).load().plan_timeslices) == {"GPU-b"}


def test_a_failed_write_fails_its_change_and_keeps_the_previous_state(tmp_path: Path) -> None:
    ledger, store = _ledger(tmp_path)
    ledger.commit(_mark("GPU-kept"))
    store.fail_next = True
    with pytest.raises(OSError, match="no space left"):
        ledger.commit(_mark("GPU-lost"))
    assert set(ledger.read().plan_timeslices) == {"GPU-kept"}, "the cache holds what is on disk"
    assert set(CheckpointStore(store.path).load().plan_timeslices) == {"GPU-kept"}
