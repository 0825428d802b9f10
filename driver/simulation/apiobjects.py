"""SIMULATION: what the API server double serves, as plain data: its resources, its error answers,
selectors, and the server-side ResourceSlice rules it enforces (pure functions over dicts).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from driver.simulation.capacitypolicy import request_policy_errors, strip_consumable
from driver.simulation.counterrules import counter_errors, strip_partitionable

Obj = dict[str, Any]

_GROUP = "resource.k8s.io"
RESOURCE_API = f"{_GROUP}/v1"
EVENTS_API = "events.k8s.io/v1"
# events.k8s.io/v1 Event limits (k8s.io/kubernetes pkg/apis/core/validation/events.go).
_EVENT_NOTE_MAX = 1024
_EVENT_FIELD_MAX = 128
_QUALIFIED_NAME = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_ATTRIBUTE_VALUE_FIELDS = ("int", "bool", "string", "version", "ints", "bools", "strings", "versions")
_NODE_SELECTION_FIELDS = ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
_NAME_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_MAX_GENERATE_NAME_BASE = 58

@dataclass(frozen=True)
class Resource:
    plural: str
    kind: str
    api_version: str
    namespaced: bool
    field_labels: tuple[str, ...]


RESOURCES = {
    r.plural: r for r in (
        Resource("nodes", "Node", "v1", False, ("metadata.name",)),
        Resource("resourceslices", "ResourceSlice", RESOURCE_API, False,
                  ("metadata.name", "spec.driver", "spec.nodeName", "spec.pool.name")),
        Resource("resourceclaims", "ResourceClaim", RESOURCE_API, True, ("metadata.name", "metadata.namespace")),
        Resource("deviceclasses", "DeviceClass", RESOURCE_API, False, ("metadata.name",)),
        Resource("pods", "Pod", "v1", True, ("metadata.name", "metadata.namespace")),
        Resource("events", "Event", EVENTS_API, True,
                 ("metadata.name", "metadata.namespace", "regarding.name", "regarding.uid", "reason", "type")),
    )
}


class ApiError(Exception):
    """An error answer: HTTP status plus the Kubernetes ``Status`` reason and message."""

    def __init__(self, code: int, reason: str, message: str, causes: list[Obj] | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.causes = code, reason, message, causes or []

    def status_body(self) -> Obj:
        body: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                     "message": self.message, "reason": self.reason, "code": self.code}
        if self.causes:
            body["details"] = {"causes": self.causes}
        return body


def slice_errors(obj: Obj, old: Obj | None, minor_version: int) -> list[tuple[str, str]]:
    """(field, problem) pairs for the server-side ResourceSlice rules this double enforces."""
    errors: list[tuple[str, str]] = []
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [("spec", "Required value")]
    if not spec.get("driver"):
        errors.append(("spec.driver", "Required value"))
    pool = spec.get("pool") or {}
    if not pool.get("name"):
        errors.append(("spec.pool.name", "Required value"))
    if int(pool.get("generation", 0)) < 0:
        errors.append(("spec.pool.generation", "Invalid value: must be greater than or equal to 0"))
    if int(pool.get("resourceSliceCount", 0)) <= 0:
        errors.append(("spec.pool.resourceSliceCount", "Invalid value: must be greater than zero"))
    selected = [f for f in _NODE_SELECTION_FIELDS if spec.get(f) not in (None, False, "")]
    if len(selected) != 1:
        errors.append(("spec", "Invalid value: exactly one of `nodeName`, `nodeSelector`, `allNodes`, "
                               f"`perDeviceNodeSelection` is required (found {len(selected)})"))
    if old is not None:
        for path in (("driver",), ("pool", "name"), ("nodeName",)):
            if dig(spec, path) != dig(old["spec"], path):
                errors.append(("spec." + ".".join(path), "Invalid value: field is immutable"))
    devices = spec.get("devices") or []
    restricted = any(d.get("consumesCounters") or (d.get("taints") and minor_version >= 35)
                     or (minor_version >= 36 and any(k in a for a in (d.get("attributes") or {}).values()
                                                    for k in ("ints", "bools", "strings", "versions")))
                     for d in devices)
    limit = 64 if restricted and minor_version >= 35 else 128
    if len(devices) > limit:
        errors.append(("spec.devices", f"Too many: {len(devices)}: must have at most {limit} items"))
    seen: set[str] = set()
    for i, device in enumerate(devices):
        name = str(device.get("name", ""))
        field = f"spec.devices[{i}]"
        if not name:
            errors.append((field + ".name", "Required value"))
        elif len(name) > 63 or not _DNS_LABEL.match(name):
            errors.append((field + ".name", f'Invalid value: "{name}": a lowercase RFC 1123 label must consist of '
                                            "lower case alphanumeric characters or '-'"))
        elif name in seen:
            errors.append((field + ".name", f'Duplicate value: "{name}"'))
        seen.add(name)
        for key, value in (device.get("attributes") or {}).items():
            where = f"{field}.attributes[{key}]"
            present = [k for k in _ATTRIBUTE_VALUE_FIELDS if k in value]
            if len(present) != 1:
                errors.append((where, f"Invalid value: exactly one value must be specified (found {len(present)})"))
            if isinstance(value.get("string"), str) and len(value["string"].encode()) > 64:
                errors.append((where + ".string", "Too long: may not be more than 64 bytes"))
        errors.extend(request_policy_errors(device, field))
    errors.extend(counter_errors(spec, minor_version))
    return errors


def drop_disabled_fields(obj: Obj, dropped_device_fields: tuple[str, ...], *, consumable_capacity: bool,
                         partitionable_devices: bool) -> None:
    """What a server stores of a ResourceSlice: fields of disabled feature gates are dropped silently."""
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return
    for device in spec.get("devices") or []:
        if isinstance(device, dict):
            for field in dropped_device_fields:
                device.pop(field, None)
            if not consumable_capacity:
                strip_consumable(device)
    if not partitionable_devices:
        strip_partitionable(spec)


def dig(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def group_of(resource: Resource) -> str:
    return resource.api_version.split("/")[0] if "/" in resource.api_version else ""


def event_errors(obj: Obj, namespace: str) -> list[tuple[str, str]]:
    """(field, problem) pairs for the rules the API server applies to a new events.k8s.io/v1 Event."""
    errors: list[tuple[str, str]] = []
    if not obj.get("eventTime"):
        errors.append(("eventTime", "Required value"))
    if obj.get("type") not in ("Normal", "Warning"):
        errors.append(("type", f"Unsupported value: {obj.get('type')!r}: supported values: \"Normal\", \"Warning\""))
    if not _QUALIFIED_NAME.fullmatch(str(obj.get("reportingController") or "")):
        errors.append(("reportingController", "Invalid value: must be a qualified name"))
    for field in ("reportingInstance", "action", "reason"):
        value = str(obj.get(field) or "")
        if not value or len(value) > _EVENT_FIELD_MAX:
            errors.append((field, f"Invalid value: must be 1 to {_EVENT_FIELD_MAX} characters"))
    if len(str(obj.get("note") or "")) > _EVENT_NOTE_MAX:
        errors.append(("note", f"Too long: may not be more than {_EVENT_NOTE_MAX} bytes"))
    regarding = obj.get("regarding") or {}
    # A cluster-scoped object's (a Node's) Event, eventTime set, lives in default or kube-system (ValidateEventCreate).
    allowed = ("", namespace) if namespace in ("default", "kube-system") else (namespace,)
    if regarding.get("namespace", namespace) not in allowed:
        errors.append(("regarding.namespace", "Invalid value: does not match event.namespace"))
    return errors


def check_kind(resource: Resource, obj: Obj) -> None:
    kind = obj.get("kind")
    if kind and kind != resource.kind:
        raise ApiError(400, "BadRequest", f"the body kind {kind} does not match the resource kind {resource.kind}")


def invalid_error(resource: Resource, name: str, errors: list[tuple[str, str]]) -> ApiError:
    details = [f"{field}: {problem}" for field, problem in errors]
    message = f'{resource.kind}.{group_of(resource)} "{name}" is invalid: ' + (
        details[0] if len(details) == 1 else "[" + ", ".join(details) + "]")
    causes = [{"reason": "FieldValueInvalid", "message": problem, "field": field} for field, problem in errors]
    return ApiError(422, "Invalid", message, causes)


def field_selector(resource: Resource, text: str) -> Callable[[Obj], bool]:
    """``a=b,c!=d`` on the resource's supported field labels."""
    terms: list[tuple[tuple[str, ...], str, bool]] = []
    for term in filter(None, text.split(",")):
        negate = "!=" in term
        key, _, value = term.partition("!=" if negate else "=")
        value = value.removeprefix("=")
        if key not in resource.field_labels:
            raise ApiError(400, "BadRequest", f'field label not supported: "{key}"')
        terms.append((tuple(key.split(".")), value, negate))
    return lambda obj: all((str(dig(obj, path) or "") == value) != negate for path, value, negate in terms)


def label_selector(text: str) -> Callable[[Obj], bool]:
    """Equality-based label selectors: ``a=b``, ``a!=b``, ``a``, ``!a``."""
    terms: list[tuple[str, str | None, bool]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "!=" in term:
            key, _, value = term.partition("!=")
            terms.append((key, value, True))
        elif "=" in term:
            key, _, value = term.partition("=")
            terms.append((key, value.removeprefix("="), False))
        else:
            terms.append((term.removeprefix("!"), None, term.startswith("!")))

    def matches(obj: Obj) -> bool:
        labels = obj.get("metadata", {}).get("labels") or {}
        return all(
            ((key in labels) != negate) if value is None else ((labels.get(key) == value) != negate)
            for key, value, negate in terms)

    return matches


def unique_name(base: str, taken: Callable[[str], bool]) -> str:
    """A ``generateName`` name: the base (cut as the server cuts it) and five random characters."""
    base = base[:_MAX_GENERATE_NAME_BASE]
    while True:
        name = base + "".join(random.choice(_NAME_SUFFIX_ALPHABET) for _ in range(5))
        if not taken(name):
            return name


def kube_config_for(url: str) -> Obj:
    """A kubeconfig for a client of the double at ``url``."""
    return {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}


def metadata_only(obj: Obj) -> Obj:
    """What a client asking for ``as=PartialObjectMetadata`` gets of an object."""
    return {"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": obj.get("metadata", {})}
