"""CDI names as the reference loader checks them: ``vendor/class`` kinds, device names, qualified IDs.

The rules (and the messages) follow the Go library every runtime vendors, so a name refused here
is one a runtime would refuse at container creation.
"""

from __future__ import annotations

import json
import re

_VENDOR_OR_CLASS = re.compile(r"[A-Za-z][A-Za-z0-9_.-]*[A-Za-z0-9]")
_VENDOR_OR_CLASS_CHARS = re.compile(r"[A-Za-z0-9_.-]*")
_DEVICE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")
_DEVICE_NAME_CHARS = re.compile(r"[A-Za-z0-9_.:-]*")


def quoted(value: object) -> str:
    """``value`` as the loader's messages show it: JSON, so an empty or odd name stays visible."""
    return json.dumps(value)


def _vendor_or_class_problem(what: str, name: str) -> str | None:
    if _VENDOR_OR_CLASS.fullmatch(name):
        return None
    if not name:
        return f"{what} is empty"
    if not ("A" <= name[0] <= "Z" or "a" <= name[0] <= "z"):
        return f"{what} {quoted(name)} must start with a letter"
    if not _VENDOR_OR_CLASS_CHARS.fullmatch(name):
        return f"{what} {quoted(name)} may contain only letters, digits, '_', '.' and '-'"
    if len(name) == 1:
        # Loader releases before the fix slice name[1:len-1] and panic on a one-character name.
        return f"{what} {quoted(name)} is too short: older runtimes' CDI loaders crash on 1-character names"
    return f"{what} {quoted(name)} must end with a letter or digit"


def split_kind(kind: str) -> tuple[str, str]:
    """``vendor/class`` split at the first '/', both parts checked against the loader's name rules."""
    vendor, slash, device_class = kind.partition("/")
    if not slash:
        raise ValueError(f"{quoted(kind)} is not <vendor>/<class>")
    for what, name in (("vendor", vendor), ("class", device_class)):
        problem = _vendor_or_class_problem(what, name)
        if problem is not None:
            raise ValueError(f"{quoted(kind)}: {problem}")
    return vendor, device_class


def check_device_name(name: str) -> str:
    """Return ``name`` if the loader accepts it as a device name, else raise ValueError saying why."""
    if _DEVICE_NAME.fullmatch(name):
        return name
    if not name:
        raise ValueError("device name is empty")
    if not _DEVICE_NAME_CHARS.fullmatch(name):
        raise ValueError(f"{quoted(name)} may contain only letters, digits, '_', '.', ':' and '-'")
    raise ValueError(f"{quoted(name)} must start and end with a letter or digit")


def qualified_device_name(kind: str, name: str) -> str:
    """The fully qualified CDI device ID ``vendor/class=name`` a runtime resolves."""
    split_kind(kind)
    check_device_name(name)
    return f"{kind}={name}"


def parse_qualified_name(device_id: str) -> tuple[str, str, str]:
    """Split ``vendor/class=name`` into its parts: first at '=', then at '/'; a leading '/' is a path."""
    if device_id.startswith("/"):
        raise ValueError(f"{quoted(device_id)} is a path, not a CDI device ID")
    kind, equals, name = device_id.partition("=")
    if not equals or not kind or not name:
        raise ValueError(f"{quoted(device_id)} is not <vendor>/<class>=<name>")
    try:
        vendor, device_class = split_kind(kind)
        check_device_name(name)
    except ValueError as exc:
        raise ValueError(f"invalid CDI device ID {quoted(device_id)}: {exc}") from exc
    return vendor, device_class, name
