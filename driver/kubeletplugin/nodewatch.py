"""The node's own Node object, as its metadata only (labels and UID), kept current by a long watch.

A node plugin needs its Node's UID (the owner reference of its ResourceSlices) and perhaps its labels,
but never the rest of the object (a Node carries its image list: tens of KiB), and polling would cost
every node a request per poll. Instead: one list of that one Node as ``PartialObjectMetadataList``, then
watches of it as ``PartialObjectMetadata`` with bookmarks, each resuming from the last resourceVersion
seen and lasting 5 to 10 minutes (as client-go's reflectors do); it lists again only when a watch cannot
resume (410 Gone, or no resourceVersion). The costs: docs/operations.md, "What the driver costs the API server".
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from driver.kubeletplugin.kubeclient import (
    METADATA_LIST_ONLY,
    METADATA_ONLY,
    KubeApiError,
    KubeClient,
    open_json_lines,
    request_json,
)
from driver.kubeletplugin.worker import Worker

log = logging.getLogger(__name__)

NODES_PATH = "/api/v1/nodes"
MIN_WATCH_SECONDS = 300
_REQUEST_TIMEOUT_S = 15.0
# A watch that ends sooner than this is treated as a failure (with backoff), so a proxy that closes watches
# at once cannot make a hot loop.
_MIN_WATCH_LIFETIME_S = 1.0


@dataclass(frozen=True)
class NodeMeta:
    """What the watch knows of the Node; ``uid`` None: no such Node (yet)."""

    uid: str | None = None
    labels: dict[str, str] = field(default_factory=dict)


class NodeWatch(Worker):
    """Keeps :attr:`meta` equal to the Node's metadata; :meth:`sync` lists once, :meth:`start` keeps watching."""

    def __init__(self, api: KubeClient, node_name: str, *, min_watch_seconds: int = MIN_WATCH_SECONDS,
                 initial_backoff: float = 1.0, max_backoff: float = 60.0):
        super().__init__("node-watch")
        self._api = api
        self._node = node_name
        self._min_watch = min_watch_seconds
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._selector = f"metadata.name={node_name}"
        self._meta: NodeMeta | None = None
        self._rv: str | None = None
        self._listeners: list[Callable[[NodeMeta], None]] = []

    @property
    def node_name(self) -> str:
        return self._node

    def meta(self) -> NodeMeta:
        """The Node's metadata; raises :class:`KubeApiError` before a list succeeded or while there is no Node."""
        with self._cond:
            meta = self._meta
        if meta is None:
            raise KubeApiError(0, "NotSynced", f"Node {self._node} has not been read yet")
        if meta.uid is None:
            raise KubeApiError(404, "NotFound", f'nodes "{self._node}" not found')
        return meta

    def uid(self) -> str | None:
        """The Node's UID, None while unknown."""
        with self._cond:
            return self._meta.uid if self._meta is not None else None

    def add_listener(self, listener: Callable[[NodeMeta], None]) -> None:
        """Called (on the watch thread) with the new metadata whenever the labels or the UID change."""
        self._listeners.append(listener)

    def sync(self) -> NodeMeta:
        """List the Node now; raises :class:`KubeApiError` when that fails."""
        answer = request_json(self._api, "GET", NODES_PATH, query=[("fieldSelector", self._selector)],
                              accept=METADATA_LIST_ONLY, timeout=_REQUEST_TIMEOUT_S)
        items = answer.get("items") or []
        self._set(items[0].get("metadata") or {} if items else None,
                  str((answer.get("metadata") or {}).get("resourceVersion") or "") or None)
        with self._cond:
            assert self._meta is not None
            return self._meta

    def _set(self, metadata: dict[str, object] | None, resource_version: str | None) -> None:
        labels = metadata.get("labels") if metadata is not None else None
        meta = NodeMeta(uid=str(metadata.get("uid") or "") or None if metadata is not None else None,
                        labels={str(k): str(v) for k, v in labels.items()} if isinstance(labels, dict) else {})
        with self._cond:
            before = self._meta
            self._meta = meta
            if resource_version:
                self._rv = resource_version
        if before != meta:  # the first read too, when it came late (the Node could not be read at first)
            log.info("Node %s changed", self._node, extra={"node": self._node, "uid": meta.uid})
            for listener in list(self._listeners):
                try:
                    listener(meta)
                except Exception:
                    log.exception("a Node change listener failed")

    def _run(self) -> None:
        backoff = self._initial_backoff
        while True:
            with self._cond:
                if self._stopping:
                    return
                rv = self._rv if self._meta is not None else None
            try:
                if rv is None:
                    self.sync()
                    continue
                outcome = self._watch(rv)
            except KubeApiError as err:
                log.warning("watching Node %s failed, retrying in %.0fs: %s", self._node, backoff, err,
                            extra={"node": self._node})
                outcome = "failed"
            if outcome == "failed":
                with self._cond:
                    if not self._stopping:
                        self._cond.wait(backoff)
                backoff = min(backoff * 2, self._max_backoff)
            else:
                backoff = self._initial_backoff

    def _watch(self, resource_version: str) -> str:
        """One watch; "ended", "expired" (relist), "failed" or "stopped"."""
        seconds = random.randint(self._min_watch, 2 * self._min_watch)
        query = [("fieldSelector", self._selector), ("watch", "true"), ("allowWatchBookmarks", "true"),
                 ("resourceVersion", resource_version), ("timeoutSeconds", str(seconds))]
        stream = open_json_lines(self._api, NODES_PATH, query=query, timeout=seconds + 30, accept=METADATA_ONLY)
        with self._cond:
            if self._stopping:
                stream.close()
                return "stopped"
            self._stream = stream
        opened = time.monotonic()
        try:
            for event in stream:
                kind, obj = event.get("type"), event.get("object") or {}
                metadata = obj.get("metadata") or {}
                if kind == "BOOKMARK":
                    with self._cond:
                        self._rv = str(metadata.get("resourceVersion") or "") or self._rv
                elif kind == "ERROR":
                    log.info("Node watch ended by the server: %s", obj.get("message", obj), extra={"node": self._node})
                    with self._cond:
                        self._rv = None
                    return "expired"
                elif kind == "DELETED":
                    self._set(None, str(metadata.get("resourceVersion") or "") or None)
                else:
                    self._set(metadata, str(metadata.get("resourceVersion") or "") or None)
        except KubeApiError as err:
            with self._cond:
                if self._stopping:
                    return "stopped"
            log.warning("Node watch broke: %s", err, extra={"node": self._node})
            return "failed"
        finally:
            with self._cond:
                self._stream = None
            stream.close()
        return "ended" if time.monotonic() - opened >= _MIN_WATCH_LIFETIME_S else "failed"
