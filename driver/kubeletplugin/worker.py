"""One background thread that runs until told to stop: the start and stop the plugin's workers share.

A subclass guards its state with ``_cond`` (its thread waits on it), returns from ``_run`` once
``_stopping`` is set, and overrides ``_interrupt`` where its thread can block elsewhere (a watch stream).
"""

from __future__ import annotations

import threading


class Worker:
    def __init__(self, thread_name: str) -> None:
        self._cond = threading.Condition()
        self._stopping = False
        self._thread_name = thread_name
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread, once; a daemon thread, so it never holds the process up at exit."""
        if self._thread is not None:
            raise RuntimeError(f"{type(self).__name__} already started")
        self._thread = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> bool:
        """Tell the thread to stop and wait for it up to ``timeout``; True if it ended (or never started)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            self._interrupt()
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _interrupt(self) -> None:
        """Break a wait of the thread outside ``_cond``; the caller holds ``_cond``. None by default."""

    def _run(self) -> None:
        raise NotImplementedError("a Worker's subclass runs its thread's body here")
