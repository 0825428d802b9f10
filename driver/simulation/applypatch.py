"""SIMULATION: server-side apply of a ResourceClaim's ``status.devices``, as the API server double does it.

Enough of Kubernetes' server-side apply (structured-merge-diff) to show what a driver's apply does to
other writers' entries: ``status.devices`` is a list-map keyed by driver, pool, device and shareID
(``+listType=map``), so an apply sets the entries it sends and removes the entries the same field
manager sent before and no longer sends; entries other managers own are never touched. An entry another
manager owns is a conflict (409) unless the apply forces, which moves its ownership. Ownership is kept in
``metadata.managedFields`` in the real ``FieldsV1`` form (``k:{...}`` keys), one Apply entry per manager
for the ``status`` subresource.

The entries are checked as the real server's validation does for the rules a driver can break (Kubernetes
``pkg/apis/resource/validation``: an entry must name an allocated device; at most 8 conditions, each a
``metav1.Condition``; ``data`` at most 10 KiB). Pure functions over dicts.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

from driver.simulation.apiobjects import ApiError, Obj

MAX_CONDITIONS = 8
MAX_DATA_BYTES = 10 * 1024
_CONDITION_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
_CONDITION_STATUSES = ("True", "False", "Unknown")
_MAX_MESSAGE = 32768
_KEY_FIELDS = ("driver", "pool", "device", "shareID")

Key = tuple[str, str, str, str]


def device_key(entry: Obj) -> Key:
    return (str(entry.get("driver", "")), str(entry.get("pool", "")), str(entry.get("device", "")),
            str(entry.get("shareID") or ""))


def fields_key(key: Key) -> str:
    """The ``k:{...}`` member name of a list-map item in FieldsV1 (keys sorted, empty shareID left out)."""
    present = {name: value for name, value in zip(_KEY_FIELDS, key, strict=True) if value}
    return "k:" + json.dumps(present, sort_keys=True, separators=(",", ":"))


def owned_keys(meta: Obj, manager: str) -> set[str]:
    """The ``k:{...}`` names of the status.devices entries ``manager`` owns by apply."""
    for entry in meta.get("managedFields") or []:
        if entry.get("manager") == manager and entry.get("operation") == "Apply" \
                and entry.get("subresource") == "status":
            devices = ((entry.get("fieldsV1") or {}).get("f:status") or {}).get("f:devices") or {}
            return set(devices)
    return set()


def _managers(meta: Obj) -> list[str]:
    return [str(e.get("manager")) for e in meta.get("managedFields") or []
            if e.get("operation") == "Apply" and e.get("subresource") == "status"]


def device_status_errors(devices: Any, allocation: Obj | None) -> list[tuple[str, str]]:
    """(field, problem) pairs for ``status.devices`` against the claim's allocation."""
    if not isinstance(devices, list):
        return [("status.devices", "Invalid value: must be a list")]
    allocated = {device_key(r) for r in ((allocation or {}).get("devices") or {}).get("results") or []}
    errors: list[tuple[str, str]] = []
    seen: set[Key] = set()
    for i, entry in enumerate(devices):
        field = f"status.devices[{i}]"
        if not isinstance(entry, dict):
            errors.append((field, "Invalid value: must be an object"))
            continue
        for name in ("driver", "pool", "device"):
            if not entry.get(name):
                errors.append((f"{field}.{name}", "Required value"))
        key = device_key(entry)
        if key in seen:
            errors.append((field, f"Duplicate value: {fields_key(key)[2:]}"))
        seen.add(key)
        if key not in allocated:
            errors.append((field, "Invalid value: must be an allocated device in the claim"))
        conditions = entry.get("conditions") or []
        if len(conditions) > MAX_CONDITIONS:
            errors.append((f"{field}.conditions", f"Too many: {len(conditions)}: must have at most "
                                                  f"{MAX_CONDITIONS} items"))
        errors.extend(_condition_errors(conditions, f"{field}.conditions"))
        if "data" in entry:
            size = len(json.dumps(entry["data"], separators=(",", ":")).encode())
            if not isinstance(entry["data"], dict):
                errors.append((f"{field}.data", "Invalid value: must be an object"))
            elif size > MAX_DATA_BYTES:
                errors.append((f"{field}.data", f"Too long: must have at most {MAX_DATA_BYTES} bytes"))
    return errors


def _condition_errors(conditions: list[Any], field: str) -> list[tuple[str, str]]:
    errors: list[tuple[str, str]] = []
    types: set[str] = set()
    for i, condition in enumerate(conditions):
        where = f"{field}[{i}]"
        if not isinstance(condition, dict):
            errors.append((where, "Invalid value: must be an object"))
            continue
        kind = str(condition.get("type") or "")
        if not kind:
            errors.append((f"{where}.type", "Required value"))
        elif kind in types:
            errors.append((f"{where}.type", f'Duplicate value: "{kind}"'))
        types.add(kind)
        if condition.get("status") not in _CONDITION_STATUSES:
            errors.append((f"{where}.status", f'Unsupported value: {condition.get("status")!r}: supported values: '
                                              '"False", "True", "Unknown"'))
        if not condition.get("lastTransitionTime"):
            errors.append((f"{where}.lastTransitionTime", "Required value"))
        reason = str(condition.get("reason") or "")
        if not reason:
            errors.append((f"{where}.reason", "Required value"))
        elif len(reason) > 1024 or not _CONDITION_REASON.match(reason):
            errors.append((f"{where}.reason", f'Invalid value: "{reason}": a condition reason must start with '
                                              "alphabetic character, optionally followed by a string of "
                                              "alphanumeric characters or '_,:', and must end with an alphanumeric "
                                              "character or '_'"))
        if len(str(condition.get("message") or "")) > _MAX_MESSAGE:
            errors.append((f"{where}.message", f"Too long: may not be more than {_MAX_MESSAGE} bytes"))
    return errors


def apply_device_status(stored: Obj, patch: Obj, manager: str, *, force: bool, gate_on: bool) -> Obj:
    """The claim after ``manager`` applied ``patch`` to its status; raises :class:`ApiError` on a conflict.

    ``gate_on`` False: the server runs without DRAResourceClaimDeviceStatus and drops ``status.devices``
    silently (nothing is stored, the answer lacks what was sent).
    """
    status = patch.get("status") or {}
    if not isinstance(status, dict):
        raise ApiError(400, "BadRequest", "status must be an object")
    unsupported = sorted(set(status) - {"devices"})
    if unsupported:
        raise ApiError(422, "Invalid", f"this test double applies only status.devices, not status.{unsupported[0]}")
    name = str(stored["metadata"]["name"])
    uid = (patch.get("metadata") or {}).get("uid")
    if uid and uid != stored["metadata"]["uid"]:
        raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on resourceclaims.resource.k8s.io "{name}": '
                                        f"Precondition failed: UID in precondition: {uid}, UID in object meta: "
                                        f"{stored['metadata']['uid']}")
    new = copy.deepcopy(stored)
    if not gate_on:
        return new
    # Leaving status.devices out of an apply gives up every entry the manager owned, as an empty list does.
    sent = status.get("devices") or []
    current = list((new.get("status") or {}).get("devices") or [])
    meta = new["metadata"]
    sent_keys = {fields_key(device_key(e)) for e in sent if isinstance(e, dict)}
    others = {m: owned_keys(meta, m) for m in _managers(meta) if m != manager}
    contested = sorted(k for k in sent_keys for m, keys in others.items() if k in keys)
    if contested and not force:
        owner = next(m for m, keys in others.items() if contested[0] in keys)
        raise ApiError(409, "Conflict", f'Apply failed with 1 conflict: conflict with "{owner}" using '
                                        f"resource.k8s.io/v1: .status.devices[{contested[0]}]")
    previous = owned_keys(meta, manager)
    still_owned = set().union(*others.values()) if others else set()
    if force:
        for m in others:
            _set_owned(meta, m, others[m] - sent_keys)
    kept = [e for e in current if fields_key(device_key(e)) in sent_keys
            or fields_key(device_key(e)) not in previous or fields_key(device_key(e)) in still_owned]
    by_key = {fields_key(device_key(e)): i for i, e in enumerate(kept)}
    for entry in sent:
        key = fields_key(device_key(entry))
        if key in by_key:
            kept[by_key[key]] = copy.deepcopy(entry)
        else:
            by_key[key] = len(kept)
            kept.append(copy.deepcopy(entry))
    new.setdefault("status", {})["devices"] = kept
    if not kept:
        del new["status"]["devices"]
    _set_owned(meta, manager, sent_keys)
    return new


def _set_owned(meta: Obj, manager: str, keys: set[str]) -> None:
    entries = [e for e in meta.get("managedFields") or []
               if not (e.get("manager") == manager and e.get("operation") == "Apply"
                       and e.get("subresource") == "status")]
    if keys:
        entries.append({"manager": manager, "operation": "Apply", "apiVersion": "resource.k8s.io/v1",
                        "subresource": "status", "fieldsType": "FieldsV1",
                        "fieldsV1": {"f:status": {"f:devices": {k: {} for k in sorted(keys)}}}})
    meta["managedFields"] = entries


def status_refused(name: str, code: int, reason: str) -> ApiError:
    """The answer of a server whose RBAC or admission refuses a claim status write."""
    return ApiError(code, reason, f'resourceclaims.resource.k8s.io "{name}" is forbidden: cannot patch resource '
                                  '"resourceclaims/status" in API group "resource.k8s.io"')
