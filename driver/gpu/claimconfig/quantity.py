"""Kubernetes resource quantities ("10Gi", "1.5G", "1e9") as whole bytes, and MiB strings for MPS.

Memory limits arrive as quantities in the opaque config and in the sharing plan file. The grammar
is Kubernetes' own (apimachinery ``resource.Quantity``); it is parsed here with a strict regex and
exact rational arithmetic instead of ``Decimal(text)``, which would also accept "NaN", "1_000" and
surrounding whitespace. Digits are ASCII only, as in Kubernetes: Python's ``\\d``, ``int()`` and
``Decimal()`` also take other Unicode digits (Arabic-Indic "10Gi" would read as 10Gi), which the API
server refuses.
"""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction

from driver.gpu.claimconfig.echo import show
from driver.units import GIB, MIB, TIB

# Kubernetes' limit: a quantity must fit in a signed 64-bit integer.
_MAX_BYTES = 2**63 - 1

_QUANTITY = re.compile(
    r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<binary>Ki|Mi|Gi|Ti|Pi|Ei)|[eE](?P<exponent>[+-]?[0-9]+)|(?P<decimal>[numkMGTPE]))?"
)

_BINARY_POWERS = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL_POWERS = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}

# Any quantity that fits in int64 bytes is far shorter; the bound keeps exact arithmetic cheap.
_MAX_TEXT_CHARS = 64

# Each daemon's own /dev/shm tmpfs (docs/sharing.md, "The pipe directory and /dev/shm"). The floor is the 64 MiB that
# container runtimes give a container's /dev/shm by default, which CUDA workloads are known to run
# with; the ceiling only catches typos (a tmpfs takes memory as it is written, not at mount).
SHM_SIZE_MIN = 64 * MIB
SHM_SIZE_MAX = TIB
DEFAULT_SHM_SIZE = GIB


def check_shm_size(value: int) -> int:
    """``value`` (bytes) if it is a usable size for a daemon's /dev/shm, else ValueError saying the range."""
    if not SHM_SIZE_MIN <= value <= SHM_SIZE_MAX:
        raise ValueError(f"{value} bytes is out of range; expected a quantity from 64Mi to 1Ti")
    return value


_EXAMPLE = 'a quantity such as "10Gi", "512Mi", "1.5G" or 1073741824'


def parse_quantity(value: str | int, field: str) -> int:
    """Return ``value`` in whole bytes (fractions round down); ``field`` names the setting in errors."""
    return int(_exact(value, field))  # int() truncates, which is rounding down for non-negative values


def parse_whole_quantity(value: str | int, field: str) -> int:
    """Like :func:`parse_quantity`, but ValueError unless ``value`` is a whole number: for amounts another
    component counted exactly (a consumedCapacity), where rounding would make ours differ from its count."""
    amount = _exact(value, field)
    if amount.denominator != 1:
        raise ValueError(f"{field}: {show(value)} is not a whole number")
    return int(amount)


def _exact(value: str | int, field: str) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{field}: expected {_EXAMPLE}, got {show(value)}")
    amount = Fraction(value) if isinstance(value, int) else _parse_text(value, field)
    if amount < 0:
        raise ValueError(f"{field}: {show(value)} is negative; expected {_EXAMPLE}")
    if amount > _MAX_BYTES:
        raise ValueError(f"{field}: {show(value)} is too large; expected {_EXAMPLE}")
    return amount


def _parse_text(text: str, field: str) -> Fraction:
    foreign = next((c for c in text if not c.isascii()), None)
    if foreign is not None:
        raise ValueError(f"{field}: {show(text)} contains {foreign!r} (U+{ord(foreign):04X}), which is not an "
                         f"ASCII digit, sign, point or suffix; expected {_EXAMPLE}")
    if len(text) > _MAX_TEXT_CHARS:
        raise ValueError(f"{field}: {show(text)} is too long for a quantity (at most {_MAX_TEXT_CHARS} "
                         f"characters); expected {_EXAMPLE}")
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise ValueError(f"{field}: {show(text)} is not a valid quantity; expected {_EXAMPLE}")
    number = Fraction(Decimal(match["number"]))
    if match["binary"]:
        return number * Fraction(1024) ** _BINARY_POWERS[match["binary"]]
    if match["exponent"]:
        exponent = int(match["exponent"])
        # Bounded so that "1e999999999" is rejected instead of computing a huge power.
        if abs(exponent) > 64:
            raise ValueError(f"{field}: {show(text)} is out of range; expected {_EXAMPLE}")
        return number * Fraction(10) ** exponent
    if match["decimal"]:
        return number * Fraction(10) ** _DECIMAL_POWERS[match["decimal"]]
    return number
