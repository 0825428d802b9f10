"""SIMULATION: the API server double's event history and watch streams.

Every stored change is kept as an event with its resourceVersion (up to ``_WATCH_HISTORY``), so a
watch resumes from any resourceVersion still in the history and gets ``410 Gone`` for an older one,
as a real API server's watch cache answers. A watch that asked for bookmarks (``allowWatchBookmarks``)
gets a ``BOOKMARK`` carrying the latest resourceVersion before the server ends it at its timeout, as
the real watch cache sends one shortly before a watch expires, so the client resumes without a list.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from driver.simulation.apiobjects import ApiError, Obj

_WATCH_HISTORY = 10_000


@dataclass
class Event:
    rv: int
    plural: str
    type: str
    obj: Obj


class EventLog:
    """The history of changes; guarded by the server's condition, which every store change notifies."""

    def __init__(self, cond: threading.Condition):
        self._cond = cond
        self._events: list[Event] = []
        self._oldest_watchable_rv = 0
        self.stopping = False

    def record(self, plural: str, event_type: str, obj: Obj) -> None:
        """Caller holds the condition."""
        self._events.append(Event(int(obj["metadata"]["resourceVersion"]), plural, event_type, copy.deepcopy(obj)))
        if len(self._events) > _WATCH_HISTORY:
            dropped = self._events.pop(0)
            self._oldest_watchable_rv = dropped.rv
        self._cond.notify_all()

    def expire(self, current_rv: int) -> None:
        """Forget past events: watches from an older resourceVersion get 410 Gone. Caller holds the condition."""
        self._events.clear()
        self._oldest_watchable_rv = current_rv

    def watch(self, plural: str, namespace: str | None, selector: Callable[[Obj], bool], resource_version: str,
              timeout_s: float, write: Callable[[Obj], bool], *, current_rv: Callable[[], int],
              stored: Callable[[], list[Obj]], bookmarks: bool, shape: Callable[[Obj], Obj]) -> None:
        """Stream events until the timeout, the server stops, or the client goes away.

        ``current_rv`` and ``stored`` (called with the condition held) give the latest resourceVersion and the
        stored objects of ``plural`` (a watch from "" or "0" starts with them as ADDED); ``shape`` turns a stored
        object into what the client asked for (e.g. its metadata only).
        """
        deadline = time.monotonic() + timeout_s

        def wanted(event: Event) -> bool:
            ns = event.obj["metadata"].get("namespace", "")
            return event.plural == plural and (namespace is None or ns == namespace) and selector(event.obj)

        with self._cond:
            if resource_version in ("", "0"):
                cursor, objects = current_rv(), stored()
                initial = [Event(cursor, plural, "ADDED", o) for o in objects
                           if (namespace is None or o["metadata"].get("namespace", "") == namespace) and selector(o)]
            else:
                cursor = int(resource_version)
                initial = []
                if cursor < self._oldest_watchable_rv:
                    expired = ApiError(410, "Expired", f"too old resource version: {cursor} "
                                                       f"({self._oldest_watchable_rv})").status_body()
                    write({"type": "ERROR", "object": expired})
                    return
        for event in initial:
            if not write({"type": event.type, "object": shape(event.obj)}):
                return
        while True:
            with self._cond:
                pending = [e for e in self._events if e.rv > cursor]
                if not pending and not self.stopping:
                    self._cond.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
                    pending = [e for e in self._events if e.rv > cursor]
                stopping = self.stopping
                latest = current_rv()
            for event in pending:
                cursor = event.rv
                if wanted(event) and not write({"type": event.type, "object": shape(event.obj)}):
                    return
            if stopping or time.monotonic() >= deadline:
                if bookmarks and not stopping:
                    write({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": str(latest)}}})
                return
            if not pending and not write({}):
                return
