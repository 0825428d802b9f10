"""The health monitor: runs a health source on its own thread and keeps every device's health.

Listeners are called (on the source's thread) after every change, with the new health; they
re-publish taints and the kubelet's health stream. XIDs are counted by code whatever their
classification, for the metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
from typing import Protocol

from driver.gpu.health.model import EventKind, Health, HealthEvent, UuidHealth, apply_event

log = logging.getLogger(__name__)

Emit = Callable[[HealthEvent], None]
Listener = Callable[[Health], None]


class HealthSource(Protocol):
    """Reports events until ``stop`` is set; NVML on real nodes, an event file in the simulation."""

    def run(self, emit: Emit, stop: threading.Event) -> None: ...

    def describe(self) -> str: ...


class HealthMonitor:
    def __init__(self, ignored_xids: Collection[int] = (), clock: Callable[[], float] = time.time):
        self._ignored = frozenset(ignored_xids)
        self._clock = clock
        self._lock = threading.Lock()
        self._health: dict[str, UuidHealth] = {}
        self._xid_counts: Counter[int] = Counter()
        self._listeners: list[Listener] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failed: str | None = None

    @property
    def ignored_xids(self) -> frozenset[int]:
        return self._ignored

    def add_listener(self, listener: Listener) -> None:
        with self._lock:
            self._listeners.append(listener)

    def health(self) -> dict[str, UuidHealth]:
        """Every unhealthy GPU or MIG UUID and why."""
        with self._lock:
            return dict(self._health)

    @property
    def failed(self) -> str | None:
        """Why health is no longer watched (the source died), None while it is."""
        with self._lock:
            return self._failed

    def xid_counts(self) -> dict[int, int]:
        with self._lock:
            return dict(self._xid_counts)

    def handle(self, event: HealthEvent) -> None:
        """Apply one event; listeners hear about it when it changed anything."""
        with self._lock:
            if event.kind is EventKind.XID and event.xid is not None:
                self._xid_counts[event.xid] += 1
            before = self._health
            after = apply_event(before, event, self._ignored, self._clock())
            changed = after != before
            self._health = after
            listeners = list(self._listeners)
        self._log(event, before, after)
        if changed:
            for listener in listeners:
                try:
                    listener(dict(after))
                except Exception:
                    log.exception("a health listener failed", extra={"uuid": event.uuid, "event": event.kind.value})

    def start(self, source: HealthSource) -> None:
        if self._thread is not None:
            raise RuntimeError("the health monitor is already running")
        self._thread = threading.Thread(target=self._run, args=(source,), name="health-monitor", daemon=True)
        self._thread.start()
        log.info("device health monitor started", extra={"source": source.describe(),
                                                         "ignored_xids": sorted(self._ignored)})

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self, source: HealthSource) -> None:
        try:
            source.run(self.handle, self._stop)
        except Exception as exc:
            # Health is then unknown, not healthy: listeners report every device as Unknown.
            log.exception("the device health source failed; device health is no longer watched")
            with self._lock:
                self._failed = f"device health is not watched any more ({source.describe()} failed: {exc})"
                listeners, health = list(self._listeners), dict(self._health)
            for listener in listeners:
                try:
                    listener(health)
                except Exception:
                    log.exception("a health listener failed")

    def _log(self, event: HealthEvent, before: Health, after: Health) -> None:
        extra = {"uuid": event.uuid, "event": event.kind.value, "xid": event.xid, "detail": event.detail}
        if event.uuid in after and event.uuid not in before:
            log.error("device became unhealthy", extra={**extra, "reason": after[event.uuid].reason,
                                                         "health_message": after[event.uuid].message})
        elif event.kind is EventKind.RECOVERED and len(after) < len(before):
            log.warning("device is healthy again", extra=extra)
        elif event.kind is EventKind.XID:
            log.warning("XID reported; device health unchanged", extra=extra)
