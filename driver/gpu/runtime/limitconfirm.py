"""When each MPS daemon's limits were last read back as promised, and which count as drifted for want of it.

A prepare that joins a running daemon needs no control command when the watcher (or a start) read its
limits back within the last watch interval: a tenant that keeps the control socket busy then cannot
fail or slow that prepare. Limits that could not be read back for longer than the interval (a client
holds the daemon's control session, or holds its socket silent) count as drift: the caller reports
the episode once, tells each claim the daemon serves (and each that joins meanwhile) once, and
reports again when a read-back confirms the limits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class _Status:
    confirmed_at: float | None = None  # monotonic
    failing_since: float | None = None  # first failed read-back since the last confirmation
    reason: str = ""
    drifted: bool = False  # the episode was reported
    told: set[str] = field(default_factory=set)  # claims told about this episode


class LimitConfirmations:
    """Thread-safe: the watcher and prepares update it. ``fresh_for`` is the watch interval (0: every prepare
    reads back), ``round_s`` how long one watcher round may take on top of it."""

    def __init__(self, fresh_for: float = 0.0, round_s: float = 0.0) -> None:
        self.fresh_for = fresh_for
        self.round_s = round_s
        self._lock = threading.Lock()
        self._status: dict[str, _Status] = {}

    def confirmed(self, daemon_id: str) -> bool:
        """The daemon's limits read back as promised just now; True if that ends a reported episode."""
        with self._lock:
            status = self._status.setdefault(daemon_id, _Status())
            ended = status.drifted
            self._status[daemon_id] = _Status(confirmed_at=time.monotonic())
            return ended

    def fresh(self, daemon_id: str) -> bool:
        """Whether the limits were confirmed within the watch interval (then no read-back is needed)."""
        with self._lock:
            status = self._status.get(daemon_id)
            return (status is not None and status.confirmed_at is not None and status.failing_since is None
                    and time.monotonic() - status.confirmed_at <= self.fresh_for + self.round_s)

    def failed(self, daemon_id: str, reason: str) -> bool:
        """A read-back got no answer; True if the limits now count as drifted (first time this episode)."""
        now = time.monotonic()
        with self._lock:
            status = self._status.setdefault(daemon_id, _Status())
            status.failing_since = status.failing_since or now
            status.reason = reason
            since = status.confirmed_at if status.confirmed_at is not None else status.failing_since
            if status.drifted or now - since <= self.fresh_for:
                return False
            status.drifted = True
            return True

    def failing(self, daemon_id: str) -> bool:
        """Whether the last read-back failed (and none has confirmed the limits since)."""
        with self._lock:
            status = self._status.get(daemon_id)
            return status is not None and status.failing_since is not None

    def drifted(self, daemon_id: str) -> str | None:
        """Why the daemon's limits count as drifted, or None."""
        with self._lock:
            status = self._status.get(daemon_id)
            return status.reason if status is not None and status.drifted else None

    def not_yet_told(self, daemon_id: str, claim_uids: Iterable[str]) -> list[str]:
        """The claims not yet told about the current episode, now counted as told."""
        with self._lock:
            status = self._status.setdefault(daemon_id, _Status())
            new = [uid for uid in claim_uids if uid not in status.told]
            status.told.update(new)
            return new

    def forget(self, daemon_id: str) -> None:
        with self._lock:
            self._status.pop(daemon_id, None)
