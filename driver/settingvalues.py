"""How each setting's text (a flag or an environment variable) becomes its value, or the one line that says why not.

Hand-written rather than a pydantic model: ``python -m driver run`` reads its settings before it
registers with the kubelet, and importing pydantic and building a model cost ~45 ms of the 0.25 s
that registration may take (docs/benchmarks.md, "Start-up"). The messages are the ones users saw
before ("expected a number at most 65535", "expected one of 'json' or 'text'").
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path

from driver.kubeletplugin.calls import DEFAULT_PREPARE_DEADLINE, KUBELET_PREPARE_TIMEOUT

Parse = Callable[[str], object]

_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
# What pydantic accepted as booleans, which the chart and users may already write.
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


class SettingValueError(ValueError):
    """The text of one setting cannot be its value; the message says what would be accepted."""


def text(value: str) -> object:
    return value


def boolean(value: str) -> object:
    lowered = value.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise SettingValueError("expected true or false")


def whole_number(low: int, high: int) -> Parse:
    def parse(value: str) -> object:
        try:
            number = int(value.strip())
        except ValueError:
            raise SettingValueError("expected a whole number") from None
        _check_bounds(number, ge=low, le=high)
        return number

    return parse


def number(*, gt: float | None = None, le: float | None = None) -> Parse:
    def parse(value: str) -> object:
        try:
            parsed = float(value.strip())
        except ValueError:
            raise SettingValueError("expected a number") from None
        _check_bounds(parsed, gt=gt, le=le)
        return parsed

    return parse


def _check_bounds(value: float, *, gt: float | None = None, ge: float | None = None,
                  le: float | None = None) -> None:
    # A NaN passes no bound, as with pydantic.
    if gt is not None and not value > gt:
        raise SettingValueError(f"expected a number greater than {gt:g}")
    if ge is not None and not value >= ge:
        raise SettingValueError(f"expected a number at least {ge:g}")
    if le is not None and not value <= le:
        raise SettingValueError(f"expected a number at most {le:g}")


def one_of(*choices: str) -> Parse:
    shown = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"

    def parse(value: str) -> object:
        if value not in choices:
            raise SettingValueError(f"expected one of {shown}")
        return value

    return parse


def dns_subdomain(value: str) -> object:
    if len(value) > 63 or "." not in value or not _DNS_SUBDOMAIN.fullmatch(value):
        raise SettingValueError(f"{value!r} is not a DNS subdomain of at most 63 characters (e.g. gpu.tessera.dev)")
    return value


def local_path(value: str) -> object:
    # Paths in this process's file system are made absolute against the working directory once, at
    # start: a relative socket path handed to gRPC, or a directory read after a chdir (the MPS
    # launcher runs daemons from /), would mean something else later. Symlinks are kept as given.
    return Path(os.path.abspath(value))


def local_path_text(value: str) -> object:
    return os.path.abspath(value)


def host_path(value: str) -> object:
    # A path on the node, not here: no working directory could make a relative one mean anything.
    path = Path(value)
    if not path.is_absolute():
        raise SettingValueError(f"{value!r} is not an absolute path (e.g. /run/nvidia/driver): it is the driver "
                                "root's path on the node, not in this container")
    return path


def prepare_deadline(value: str) -> object:
    seconds = number()(value)
    assert isinstance(seconds, float)
    # The kubelet cuts a prepare call off at 45 s; the driver must answer (and roll back) before that.
    if math.isnan(seconds) or not 0 < seconds < KUBELET_PREPARE_TIMEOUT:
        limit = f"{KUBELET_PREPARE_TIMEOUT:g}"
        raise SettingValueError(f"{seconds:g} is not between 0 and {limit} seconds exclusive (the kubelet gives up on "
                                f"a prepare after {limit} s); default {DEFAULT_PREPARE_DEADLINE:g}")
    return seconds


def ignored_xids(value: str) -> object:
    # Imported when the setting is given, never for the default: the XID table is not on the
    # registration path.
    from driver.gpu.health.xids import parse_ignored_xids

    try:
        parse_ignored_xids(value)
    except ValueError as exc:
        raise SettingValueError(str(exc)) from exc
    return value


def shm_size(value: str) -> object:
    # Imported when the setting is given, never for the default (as above): the MPS modules.
    from driver.gpu.mps.shmmount import parse_shm_size

    try:
        return parse_shm_size(value)
    except ValueError as exc:
        raise SettingValueError(str(exc)) from exc

