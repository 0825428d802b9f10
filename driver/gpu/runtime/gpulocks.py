"""Per-GPU locks: the slow work on one GPU (MPS daemons, nvidia-smi) never waits for another GPU's.

The node lock (``driver/kubeletplugin/nodelock.py``) guards only the checkpoint. Everything that
runs a process on behalf of a GPU runs under that GPU's lock instead, so two claims on one GPU
serialise their daemon, compute-mode and time-slice work, and a claim on another GPU never waits.
Like the node lock, each lock is a ``flock`` on a file in the state directory (shared with the
other plugin pod of a rolling update) plus an in-process mutex. Locks are always taken in sorted
UUID order, and never while the node lock is held, so no two holders can deadlock.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from driver.gpu.errors import NodeBusy
from driver.kubeletplugin.nodelock import LockFile

_LOCK_NAME = re.compile(r"^GPU-[A-Za-z0-9-]{1,80}$")

# How long a rescan or the daemon watcher waits for a GPU another operation holds before leaving it to
# the next round.
RESCAN_GPU_WAIT = 1.0


class GpuBusy(NodeBusy):
    """A GPU's lock was not free within the time allowed; the message names the GPU."""


class GpuLocks:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._files: dict[str, LockFile] = {}
        self._table_lock = threading.Lock()

    def _file(self, uuid: str) -> LockFile:
        with self._table_lock:
            found = self._files.get(uuid)
            if found is None:
                found = self._files[uuid] = LockFile(self.directory / f"{uuid}.lock")
            return found

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

        def timed_out(by_other_process: bool) -> Exception:
            if by_other_process:
                return GpuBusy(f"GPU {uuid} stayed busy with another plugin process (a rolling update "
                               f"in progress?); gave up {purpose}")
            return GpuBusy(f"GPU {uuid} stayed busy with another operation of this driver; gave up {purpose}")

        with self._file(uuid).held(deadline, timed_out):
            yield
