"""Per-GPU locks: the slow work on one GPU (MPS daemons, nvidia-smi) never waits for another GPU's.

The node lock (``driver/kubeletplugin/nodelock.py``) guards only the checkpoint. Everything that
runs a process on behalf of a GPU runs under that GPU's lock instead, so two claims on one GPU
serialise their daemon, compute-mode and time-slice work, and a claim on another GPU never waits.
Like the node lock, each lock is a ``flock`` on a file in the state directory (shared with the
other plugin pod of a rolling update) plus an in-process mutex. Locks are always taken in sorted
UUID order, and never while the node lock is held, so no two holders can deadlock.
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

_LOCK_NAME = re.compile(r"^GPU-[A-Za-z0-9-]{1,80}$")


class GpuBusy(Exception):
    """A GPU's lock was not free within the time allowed; the message names the GPU."""


class GpuLocks:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._mutexes: dict[str, threading.Lock] = {}
        self._table_lock = threading.Lock()

    def _mutex(self, uuid: str) -> threading.Lock:
        with self._table_lock:
            return self._mutexes.setdefault(uuid, threading.Lock())

    @contextmanager
    def held(self, gpu_uuids: Iterable[str], timeout: float, purpose: str) -> Iterator[None]:
        """Hold the locks of ``gpu_uuids`` (all or none); :class:`GpuBusy` after ``timeout`` seconds."""
        deadline = time.monotonic() + max(0.0, timeout)
        with ExitStack() as stack:
            for uuid in sorted(set(gpu_uuids)):
                stack.enter_context(self._one(uuid, deadline, purpose))
            yield

    @contextmanager
    def _one(self, uuid: str, deadline: float, purpose: str) -> Iterator[None]:
        if not _LOCK_NAME.fullmatch(uuid):
            raise ValueError(f"GPU lock name must be a GPU-... UUID, got {uuid!r}")
        mutex = self._mutex(uuid)
        if not mutex.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise GpuBusy(f"GPU {uuid} stayed busy with another operation of this driver; gave up {purpose}")
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(self.directory / f"{uuid}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise GpuBusy(f"GPU {uuid} stayed busy with another plugin process (a rolling update "
                                          f"in progress?); gave up {purpose}") from None
                        time.sleep(0.005)
                try:
                    yield
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        finally:
            mutex.release()
