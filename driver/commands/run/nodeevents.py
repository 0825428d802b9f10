"""Kubernetes Events about this node itself (``kubectl describe node`` shows them), posted best effort."""

from __future__ import annotations

import logging
from urllib.parse import quote

from driver.kubeletplugin.events import EventRecorder, EventSpec, ObjectRef
from driver.kubeletplugin.kubeclient import KubeApiError, KubeClient, request_json

log = logging.getLogger(__name__)


def post_node_event(events: EventRecorder, api: KubeClient, node_name: str, reason: str, action: str,
                    note: str) -> None:
    """Queue a Warning Event regarding Node ``node_name`` (its UID read from the API server first)."""
    try:
        node = request_json(api, "GET", f"/api/v1/nodes/{quote(node_name, safe='')}", timeout=10)
    except KubeApiError as exc:  # the log line carries the same facts
        log.warning("could not read the Node to post an event about it", extra={"reason": reason, "error": str(exc)})
        return
    uid = str((node.get("metadata") or {}).get("uid") or "")
    events.post(EventSpec(regarding=ObjectRef(apiVersion="v1", kind="Node", namespace="", name=node_name, uid=uid),
                          reason=reason, action=action, note=note))
