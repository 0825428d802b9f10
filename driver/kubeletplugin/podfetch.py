"""Reading the pods a ResourceClaim is reserved for, by name (RBAC: ``get`` on pods).

Only a driver that needs to know who will use a claim's devices asks (through
:meth:`driver.kubeletplugin.claimmodel.ResourceClaim.reserved_pods`), so plain claims cost no
request. A pod that is gone (404) is answered as None; what a pod under the entry's name but with
another UID means is decided in :mod:`driver.kubeletplugin.reservedpods`. Any other failure to read
a pod is an error, since whatever the pod is allowed to do could then not be checked.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from urllib.parse import quote

from pydantic import ValidationError

from driver.kubeletplugin.kubeclient import KubeApiError, KubeClient, send
from driver.kubeletplugin.podsecurity import pod_name, shown
from driver.kubeletplugin.podspec import Pod
from driver.kubeletplugin.reservedpods import PodRef, PodsUnreadable

log = logging.getLogger(__name__)

# As for claim reads (claimfetch.py): most of the kubelet's 45 s must stay with the driver.
DEFAULT_CONNECT_TIMEOUT_S = 3.0
DEFAULT_READ_TIMEOUT_S = 10.0
# Fewer than a second left is not enough for a round trip worth making; the caller's deadline wins.
_MIN_TIMEOUT_S = 0.5


class PodFetcher:
    """Implements :class:`driver.kubeletplugin.reservedpods.PodReader` against the API server."""

    def __init__(self, api: KubeClient, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S):
        self._api = api
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s

    def read_pods(self, refs: Sequence[PodRef], timeout_s: float) -> list[Pod | None]:
        found = [self._read(namespace, name, timeout_s) for namespace, name, _ in refs]
        for (namespace, name, _), pod in zip(refs, found, strict=True):
            if pod is None:
                log.info("a pod the claim is reserved for is gone: it cannot run with the claim",
                         extra={"pod": pod_name(namespace, name)})
        return found

    def _read(self, namespace: str, name: str, timeout_s: float) -> Pod | None:
        shown_pod = pod_name(namespace, name)
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}"
        bound = max(_MIN_TIMEOUT_S, timeout_s)
        timeouts = (min(self._connect_timeout_s, bound), min(self._read_timeout_s, bound))
        try:
            response = send(self._api, "GET", path, timeouts=timeouts)
        except KubeApiError as err:
            raise PodsUnreadable(f"cannot read pod {shown_pod} from the API server ({err}); "
                                 "the kubelet will retry") from err
        if response.status == 404:
            return None
        if not 200 <= response.status <= 299:
            reason, message = _status_details(response.reason or "Error", response.data)
            hint = ("grant the driver's service account 'get' on pods" if response.status == 403
                    else "the kubelet will retry")
            raise PodsUnreadable(f"reading pod {shown_pod} failed: HTTP {response.status} {reason}: "
                                 f"{message}; {hint}")
        try:
            return Pod.model_validate_json(response.data)
        except ValidationError as err:
            first = err.errors()[0]
            where = shown(".".join(str(p) for p in first["loc"]) or "body")
            raise PodsUnreadable(f"pod {shown_pod}: the API server returned an object this driver cannot "
                                 f"read (at {where}: {first['msg']})") from err


def _status_details(http_reason: str, body: bytes) -> tuple[str, str]:
    """Reason and message of the server's Status object, else the HTTP reason and the body's start."""
    try:
        status = json.loads(body.decode("utf-8", errors="replace") or "null")
    except ValueError:
        status = None
    if not isinstance(status, dict):
        return http_reason, " ".join(body.decode("utf-8", errors="replace").split())[:200] or "no details"
    # The message is the server's (or a proxy's) text: one line, cut, as every echoed value.
    message = " ".join(str(status.get("message") or "no details").split())
    return " ".join(str(status.get("reason") or http_reason).split())[:100], message[:300]
