"""Book-keeping of the DRA calls a plugin is serving, so that the liveness probe, which must not queue behind
them, can tell "busy" from "wedged" without making a call (:mod:`.liveness`).
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
