"""One background thread that runs until told to stop: the start and stop the plugin's workers share.

A subclass guards its state with ``_cond`` (its thread waits on it), returns from ``_run`` once
``_stopping`` is set, and sets ``_stream`` (under ``_cond``) while its thread reads one, so that a
stop, or the subclass through :meth:`Worker._interrupt`, can break that read.
"""

from __future__ import annotations

import threading

from driver.kubeletplugin.kubeclient import JsonLineStream


class Worker:
    def __init__(self, thread_name: str) -> None:
        self._cond = threading.Condition()
        self._stopping = False
        self._stream: JsonLineStream | None = None
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
        """Wake the thread if it is blocked reading ``_stream``. Caller holds ``_cond``.

        Under the lock the stream cannot be closed meanwhile: the thread clears ``_stream`` under
        the same lock before it closes the stream.
        """
        if self._stream is not None:
            self._stream.interrupt()

    def _run(self) -> None:
        raise NotImplementedError("a Worker's subclass runs its thread's body here")
