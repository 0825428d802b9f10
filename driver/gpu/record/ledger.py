"""The checkpoint behind the node lock, with group commit: one durable write for the changes that arrive together.

Every durable change (a claim completed, a claim forgotten, a daemon recorded) goes through
:meth:`NodeLedger.commit`. Callers queue their change; whichever caller finds no write in
progress becomes the leader, takes the node lock, applies every queued change to the checkpoint
and writes it once (file fsync, rename, directory fsync); the others wait for that write and
return with it. With one caller this is one write per change, as before; with claims arriving
together it is one pair of fsyncs for all of them. No caller returns before its change is
durable, so a claim answered as prepared survives a crash right after the answer.

The file is always current under the node lock (the leader renames it into place before releasing
it), so the other plugin pod of a rolling update, which reads it under the same lock, never misses a
change; the directory fsync that makes the rename durable follows outside the lock, before any caller
of the group returns.

A change is a function of the checkpoint, named and at module level, its other arguments bound by keyword:
``ledger.commit(partial(forget_claim, uid=uid))``. The common ones are in ``changes.py``; one that needs
a layer's knowledge lives beside that layer's code. It returns what the caller needs to know, as an
:class:`Unchanged` when it looked and changed nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from driver.gpu.record.checkpoint import Checkpoint, CheckpointCorrupt, CheckpointStore
from driver.kubeletplugin.nodelock import NodeLock

R = TypeVar("R")


class Unchanged:
    """The base of what a change returns when it looked and changed nothing: a group of such changes writes nothing."""


@dataclass
class _Pending(Generic[R]):
    change: Callable[[Checkpoint], R]
    durable: bool
    done: bool = False
    error: BaseException | None = None
    outcome: R = field(init=False, repr=False)  # set once the change ran


class NodeLedger:
    """The checkpoint behind the node lock: every read and write holds it only for the file access."""

    def __init__(self, store: CheckpointStore, lock: NodeLock, rebuild: Callable[[], Checkpoint]):
        self.store = store
        self.lock = lock
        self._rebuild = rebuild
        self._queue: list[_Pending[Any]] = []
        self._queue_lock = threading.Lock()
        self._writer = threading.Lock()  # held by the leader of one group write

    def load_locked(self, shared: bool = False) -> Checkpoint:
        """Load with the node lock already held; a corrupt file is rebuilt from the CDI specs.

        ``shared``: read-only use (see :meth:`CheckpointStore.load`)."""
        try:
            return self.store.load(shared)
        except CheckpointCorrupt:
            cp = self._rebuild()
            self.store.save(cp)
            return cp

    def read(self) -> Checkpoint:
        """The current checkpoint, shared with the cache: read it, never change it.

        Without the node lock when the cache is current (a prepare reads the checkpoint three times,
        and each wait for the lock could be a wait behind another claim's write); otherwise under it."""
        current = self.store.current()
        if current is not None:
            return current
        with self.lock.held():
            return self.load_locked(shared=True)

    def commit(self, change: Callable[[Checkpoint], R], durable: bool = True) -> R:
        """Apply ``change`` and return what it returned once it is written (and durable, unless
        ``durable=False``).

        ``change`` runs under the node lock, with the changes of the other callers that arrived
        together; it may check the checkpoint and raise, and returns an :class:`Unchanged` if it changed
        nothing. An exception from ``change`` itself is raised to its caller only; the other changes of
        the group are still written. A failed write is raised to every caller of the group.

        ``durable=False`` (a claim's reservation, see ``driver/gpu/state.py``): the file is replaced whole
        and visible at once, but only a group with a durable change also fsyncs the directory.
        """
        mine = _Pending(change, durable)
        with self._queue_lock:
            self._queue.append(mine)
        with self._writer:
            if not mine.done:
                with self._queue_lock:
                    group, self._queue = self._queue, []
                self._write_group(group)
        if mine.error is not None:
            raise mine.error
        return mine.outcome

    def _write_group(self, group: list[_Pending[Any]]) -> None:
        try:
            changed = False
            durable = any(pending.durable for pending in group)
            with self.lock.held():
                cp = self.load_locked()
                for pending in group:
                    try:
                        pending.outcome = pending.change(cp)
                        changed = not isinstance(pending.outcome, Unchanged) or changed
                    except Exception as exc:
                        pending.error = exc
                if changed:
                    # Whole on disk (data synced, then swapped or renamed into place) and current for every
                    # reader under the lock.
                    self.store.save(cp, adopt=True, durable=durable, defer_directory_sync=True)
            if changed and durable:
                # The swap is made durable after the node lock is released, so the other claims' planning
                # and reservations need not wait for this fsync too. Nothing depends on it yet: the callers
                # of this group return only after it, and a later group's leader starts only after it
                # (self._writer).
                self.store.sync_directory()
        except BaseException as exc:
            for pending in group:
                pending.error = pending.error or exc
                pending.done = True
            raise
        for pending in group:
            pending.done = True
