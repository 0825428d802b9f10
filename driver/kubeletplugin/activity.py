"""Book-keeping of the DRA calls a plugin is serving, for a liveness probe that must not queue behind them.

A probe that sends its own call through the DRA server's worker pool waits behind every call in
flight; under load (each prepare can wait seconds on the node lock or a daemon start) it times
out and the kubelet restarts a healthy container. Knowing how many calls are in flight and when
one last started or finished lets the probe tell "busy" from "wedged" without making a call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple


class DraActivity(NamedTuple):
    """How busy the DRA server is: calls being served now, and seconds since one started or finished."""

    in_flight: int
    seconds_since_progress: float


class CallActivity:
    """Thread-safe count of calls in flight and the monotonic time of the last start or finish."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._in_flight = 0
        # Until the first call, "progress" dates from creation: an idle plugin has made none.
        self._last_progress = clock()

    @contextmanager
    def track(self) -> Iterator[None]:
        """Count the enclosed block as one call in flight; starting and finishing it are progress."""
        with self._lock:
            self._in_flight += 1
            self._last_progress = self._clock()
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                self._last_progress = self._clock()

    def snapshot(self) -> DraActivity:
        with self._lock:
            return DraActivity(self._in_flight, max(0.0, self._clock() - self._last_progress))
