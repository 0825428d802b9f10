"""DRA calls that arrive while the driver is still initialising wait for it instead of failing.

The plugin opens its sockets and registers first (the kubelet sends nothing before registration),
then the driver initialises behind them: imports, the API client, discovery, recovery of interrupted
work. A prepare or unprepare the kubelet sends in that window waits here until the driver is ready,
bounded by the call's own deadline (less a margin to answer) and abandoned if the kubelet cancels it;
if the time runs out, or initialisation failed, each claim is answered with an error the kubelet
retries. A request without claims (the liveness probe's) never waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

from driver.kubeletplugin.activity import CallActivity
from driver.kubeletplugin.calls import DEFAULT_PREPARE_DEADLINE, ClaimRef, PrepareResult
from driver.kubeletplugin.service import ClaimCalls

# Left of the kubelet's deadline to send the answer once the wait gives up.
ANSWER_MARGIN_S = 1.0
# A waiting call checks this often whether the kubelet cancelled it.
_POLL_S = 0.5


class StartGate:
    """:class:`ClaimCalls` that wait until :meth:`open` (or :meth:`fail`) and then go to the driver's calls."""

    def __init__(self, activity: CallActivity, max_wait_s: float = DEFAULT_PREPARE_DEADLINE,
                 clock: Callable[[], float] = time.monotonic):
        """``max_wait_s`` bounds the wait of a call without a deadline; waiting calls count in ``activity``."""
        self._activity = activity
        self._max_wait_s = max_wait_s
        self._clock = clock
        self._decided = threading.Event()
        self._calls: ClaimCalls | None = None
        self._failure: str | None = None

    @property
    def ready(self) -> bool:
        """Whether calls now go to the driver."""
        return self._calls is not None

    def open(self, calls: ClaimCalls) -> None:
        """The driver is initialised: waiting and later calls go to ``calls``."""
        self._calls = calls
        self._decided.set()

    def fail(self, reason: str) -> None:
        """Initialisation failed (the process is about to exit): waiting and later calls get ``reason``."""
        self._failure = reason
        self._decided.set()

    def prepare(self, refs: Sequence[ClaimRef], is_active: Callable[[], bool],
                time_remaining: float | None = None) -> Mapping[str, PrepareResult]:
        calls, time_remaining = self._wait(refs, is_active, time_remaining)
        if calls is None:
            return {ref.uid: PrepareResult(error=self._refusal()) for ref in refs}
        return calls.prepare(refs, is_active, time_remaining)

    def unprepare(self, refs: Sequence[ClaimRef], is_active: Callable[[], bool],
                  time_remaining: float | None = None) -> Mapping[str, str | None]:
        calls, time_remaining = self._wait(refs, is_active, time_remaining)
        if calls is None:
            return {ref.uid: self._refusal() for ref in refs}
        return calls.unprepare(refs, is_active, time_remaining)

    def _wait(self, refs: Sequence[ClaimRef], is_active: Callable[[], bool],
              time_remaining: float | None) -> tuple[ClaimCalls | None, float | None]:
        """The driver's calls once ready (None if not ready within the call's deadline), and the time left then.

        Without claims there is nothing to wait for: an empty request is answered empty at once."""
        if self._decided.is_set() or not refs:
            return self._calls, time_remaining
        started = self._clock()
        bound = self._max_wait_s if time_remaining is None else min(self._max_wait_s,
                                                                    time_remaining - ANSWER_MARGIN_S)
        with self._activity.track():
            while not self._decided.is_set() and is_active():
                left = bound - (self._clock() - started)
                if left <= 0:
                    break
                self._decided.wait(min(_POLL_S, left))
        if time_remaining is not None:
            time_remaining -= self._clock() - started
        return self._calls, time_remaining

    def _refusal(self) -> str:
        if self._failure is not None:
            return f"the DRA driver failed to start ({self._failure}); it is restarting, the kubelet will retry"
        return ("the DRA driver is still starting (it registered and is initialising: discovery and recovery of "
                "interrupted work) and was not ready within this call's deadline; the kubelet will retry")

