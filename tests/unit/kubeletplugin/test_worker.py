"""The plugin's worker base (driver.kubeletplugin.worker): one named daemon thread, started once, ended by stop."""

from __future__ import annotations

import threading

import pytest

from driver.kubeletplugin.worker import Worker


class _Waiter(Worker):
    """Waits on its condition until stopped, as the plugin's workers do between rounds."""

    def __init__(self) -> None:
        super().__init__("test-waiter")
        self.running = threading.Event()

    def _run(self) -> None:
        with self._cond:
            self.running.set()
            while not self._stopping:
                self._cond.wait()


def test_a_worker_runs_one_named_daemon_thread_until_stopped() -> None:
    worker = _Waiter()
    worker.start()
    assert worker.running.wait(30)
    [thread] = [t for t in threading.enumerate() if t.name == "test-waiter"]
    assert thread.daemon, "a worker never holds the process up at exit"
    assert worker.stop(30) is True
    assert not thread.is_alive()


def test_a_worker_starts_once() -> None:
    worker = _Waiter()
    worker.start()
    try:
        with pytest.raises(RuntimeError, match="_Waiter already started"):
            worker.start()
    finally:
        assert worker.stop(30)


def test_stopping_a_worker_that_never_started_is_done_at_once() -> None:
    assert _Waiter().stop(0) is True
