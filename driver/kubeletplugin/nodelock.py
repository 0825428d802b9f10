"""A node-wide lock shared by threads of this process and by other plugin pods on the node.

During a rolling update two plugin pods serve the same node and share the state directory;
``flock`` on a file in that directory serialises their state changes. The in-process mutex
keeps threads of one process from relying on flock semantics between their own descriptors.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class LockTimeout(Exception):
    pass


class NodeLock:
    def __init__(self, path: Path, timeout: float = 10.0):
        self.path = path
        self.timeout = timeout
        self._mutex = threading.Lock()

    @contextmanager
    def held(self) -> Iterator[None]:
        deadline = time.monotonic() + self.timeout
        if not self._mutex.acquire(timeout=self.timeout):
            raise LockTimeout(f"another operation in this driver held the node lock for over {self.timeout:.0f}s")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise LockTimeout(
                                f"another plugin process held {self.path} for over {self.timeout:.0f}s "
                                "(a rolling update in progress?); the kubelet will retry") from None
                        time.sleep(0.005)
                try:
                    yield
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        finally:
            self._mutex.release()
