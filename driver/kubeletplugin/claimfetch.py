"""Fetching the ResourceClaim behind a kubelet prepare request, with errors a user can act on.

The kubelet sends only namespace, name and UID; the plugin must read the claim itself, check it
is the same object (UID) and that it is allocated. The claim is one plain GET through the
``kubernetes`` client's REST layer (kept-alive connections, its TLS and retries;
:mod:`driver.kubeletplugin.kubeclient`) and its JSON body is parsed once, into
:class:`driver.kubeletplugin.claimmodel.ResourceClaim`: the generated ``ResourceV1Api`` would add
argument validation, its own models and ~0.3 s of imports at start for nothing the driver uses.
"""

from __future__ import annotations

import json
import re
from typing import Protocol
from urllib.parse import quote

from pydantic import ValidationError

from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.kubeclient import KubeApiError, KubeClient, send
from driver.kubeletplugin.podfetch import PodFetcher
from driver.kubeletplugin.reservedpods import PodReader
from driver.kubeletplugin.types import ClaimRef

# The kubelet gives a whole prepare call 45 s and a claim read must leave most of that to the
# driver. A client from load_api_client retries a failed connect twice and never retries a read,
# so a claim read takes at most 3 connect timeouts plus one read timeout.
DEFAULT_CONNECT_TIMEOUT_S = 3.0
DEFAULT_READ_TIMEOUT_S = 10.0

# The form the API server gives every object's metadata.uid (a random UUID in its canonical
# lower-case RFC 4122 text). Claim UIDs become parts of file names (CDI specs, MPS daemon
# directories), so nothing else may reach them: no '/', no '..', no NUL, no unbounded length.
_UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class ClaimError(Exception):
    """A claim cannot be prepared; the message is shown to the user in the pod's events."""


class ClaimSource(Protocol):
    """Anything that can turn a kubelet claim reference into the checked, allocated claim."""

    def fetch(self, ref: ClaimRef) -> ResourceClaim:
        """Return the claim, or raise :class:`ClaimError` saying what is wrong."""
        ...


class ClaimFetcher:
    """Reads ResourceClaims (resource.k8s.io/v1) from the API server; needs RBAC ``get`` on them.

    It uses ``api`` as it is: build it with :func:`driver.kubeletplugin.kubeclient.load_api_client`
    so a hung server costs one read timeout, not one per urllib3 retry.
    """

    def __init__(self, api: KubeClient, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, pods: PodReader | None = None):
        """``pods``: how claims read their reserved pods (default: a ``PodFetcher`` on ``api``)."""
        self._api = api
        self._timeouts = (connect_timeout_s, read_timeout_s)
        self._pods = pods if pods is not None else PodFetcher(api, connect_timeout_s, read_timeout_s)

    def fetch(self, ref: ClaimRef) -> ResourceClaim:
        """GET the claim and check it is the one the kubelet means and that it is allocated."""
        check_claim_uid(ref)
        body = self._read(ref)
        try:
            claim = ResourceClaim.model_validate_json(body)
        except ValidationError as err:
            if any(e["type"] == "json_invalid" and "recursion limit" in e["msg"] for e in err.errors()):
                # The server accepts any depth in opaque parameters (any driver's): the claim's author can fix this,
                # not the cluster's operator.
                raise ClaimError(
                    f"ResourceClaim {ref.namespace}/{ref.name} nests its JSON deeper than this driver reads (about "
                    "200 levels, e.g. in a config's opaque parameters); flatten the parameters") from err
            raise ClaimError(
                f"ResourceClaim {ref.namespace}/{ref.name}: the API server returned an object this driver "
                f"cannot read ({_describe(err)}); check that the cluster serves resource.k8s.io/v1"
            ) from err
        return check_claim(ref, claim).with_pod_reader(self._pods)

    def _read(self, ref: ClaimRef) -> bytes:
        path = (f"/apis/resource.k8s.io/v1/namespaces/{quote(ref.namespace, safe='')}"
                f"/resourceclaims/{quote(ref.name, safe='')}")
        try:
            response = send(self._api, "GET", path, timeouts=self._timeouts)
        except KubeApiError as err:
            raise ClaimError(
                f"ResourceClaim {ref.namespace}/{ref.name}: cannot reach the API server ({err}); "
                "the kubelet will retry, check the node's connectivity to the control plane"
            ) from err
        if not 200 <= response.status <= 299:
            raise _api_error(ref, response.status, response.reason, response.data)
        return response.data


def claim_uid_problem(uid: str) -> str | None:
    """Why ``uid`` is not a Kubernetes object UID, or None if it is one."""
    if _UID.fullmatch(uid):
        return None
    shown = json.dumps(uid[:64] + "..." if len(uid) > 64 else uid)
    return (f"claim uid {shown} is not a Kubernetes UID; expected the API server's form, 36 characters "
            "of lower-case hex digits and dashes (8-4-4-4-12)")


def check_claim_uid(ref: ClaimRef) -> None:
    """Raise :class:`ClaimError` unless ``ref.uid`` is a UID; call before a path is built from it."""
    problem = claim_uid_problem(ref.uid)
    if problem is not None:
        raise ClaimError(f"ResourceClaim {ref.namespace}/{ref.name}: {problem}; refusing to prepare it")


def check_claim(ref: ClaimRef, claim: ResourceClaim) -> ResourceClaim:
    """Raise :class:`ClaimError` unless ``claim`` is the object ``ref`` names and it is allocated."""
    check_claim_uid(ref)
    found_uid = claim.metadata.uid
    if found_uid != ref.uid:
        raise ClaimError(
            f"ResourceClaim {ref.namespace}/{ref.name} got replaced: the kubelet asked for uid {ref.uid} but the "
            f"API server has uid {found_uid}; the pod refers to a claim that was deleted and recreated, "
            "so delete and recreate the pod"
        )
    if claim.allocation is None:
        raise ClaimError(
            f"ResourceClaim {ref.namespace}/{ref.name} (uid {ref.uid}) is not allocated: status.allocation is "
            "empty; the scheduler allocates claims before the pod reaches a node, so check the claim's status"
        )
    return claim


def _api_error(ref: ClaimRef, status: int, http_reason: str, body: bytes) -> ClaimError:
    if status == 404:
        return ClaimError(
            f"ResourceClaim {ref.namespace}/{ref.name} not found: it was deleted; "
            "the kubelet will retry once it is recreated"
        )
    reason, message = _status_details(http_reason, body)
    hint = {
        401: "the driver's service account token was rejected",
        403: "grant the driver's service account 'get' on resourceclaims.resource.k8s.io",
    }.get(status, "the kubelet will retry")
    return ClaimError(
        f"reading ResourceClaim {ref.namespace}/{ref.name} failed: HTTP {status} {reason}: {message}; {hint}"
    )


def _status_details(http_reason: str, body: bytes) -> tuple[str, str]:
    """Reason and message of the server's Status object, falling back to the HTTP reason phrase."""
    fallback_reason = http_reason.strip() or "Error"
    text = body.decode("utf-8", errors="replace")
    try:
        status = json.loads(text) if text else None
    except ValueError:
        status = None
    if not isinstance(status, dict):
        return fallback_reason, text.strip()[:200] or "no details"
    reason = str(status.get("reason") or fallback_reason)
    message = str(status.get("message") or "no details")
    return reason, message


def _describe(err: ValidationError) -> str:
    """The first few invalid fields as ``path: problem``, e.g. ``metadata.uid: Field required``."""
    problems = [f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in err.errors()[:3]]
    return "; ".join(problems)
