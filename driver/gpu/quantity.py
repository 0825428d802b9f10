"""Kubernetes resource quantities ("10Gi", "1.5G", "1e9") as whole bytes, and MiB strings for MPS.

Memory limits arrive as quantities in the opaque config and in the sharing plan file. The grammar
is Kubernetes' own (apimachinery ``resource.Quantity``); it is parsed here with a strict regex and
exact rational arithmetic instead of ``Decimal(text)``, which would also accept "NaN", "1_000" and
surrounding whitespace.
"""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction

MIB = 1024 * 1024

# Kubernetes' limit: a quantity must fit in a signed 64-bit integer.
_MAX_BYTES = 2**63 - 1

_QUANTITY = re.compile(
    r"(?P<number>[+-]?(?:\d+(?:\.\d*)?|\.\d+))"
    r"(?:(?P<binary>Ki|Mi|Gi|Ti|Pi|Ei)|[eE](?P<exponent>[+-]?\d+)|(?P<decimal>[numkMGTPE]))?"
)

_BINARY_POWERS = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL_POWERS = {"n": -9, "u": -6, "m": -3, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}

_EXAMPLE = 'a quantity such as "10Gi", "512Mi", "1.5G" or 1073741824'


def parse_quantity(value: str | int, field: str) -> int:
    """Return ``value`` in whole bytes (fractions round down); ``field`` names the setting in errors."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{field}: expected {_EXAMPLE}, got {_show(value)}")
    amount = Fraction(value) if isinstance(value, int) else _parse_text(value, field)
    if amount < 0:
        raise ValueError(f"{field}: {_show(value)} is negative; expected {_EXAMPLE}")
    if amount > _MAX_BYTES:
        raise ValueError(f"{field}: {_show(value)} is too large; expected {_EXAMPLE}")
    return int(amount)  # int() truncates, which is rounding down for non-negative values


def _parse_text(text: str, field: str) -> Fraction:
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise ValueError(f"{field}: {_show(text)} is not a valid quantity; expected {_EXAMPLE}")
    number = Fraction(Decimal(match["number"]))
    if match["binary"]:
        return number * Fraction(1024) ** _BINARY_POWERS[match["binary"]]
    if match["exponent"]:
        exponent = int(match["exponent"])
        # Bounded so that "1e999999999" is rejected instead of computing a huge power.
        if abs(exponent) > 64:
            raise ValueError(f"{field}: {_show(text)} is out of range; expected {_EXAMPLE}")
        return number * Fraction(10) ** exponent
    if match["decimal"]:
        return number * Fraction(10) ** _DECIMAL_POWERS[match["decimal"]]
    return number


def _show(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def format_mib(value_bytes: int) -> str:
    """``value_bytes`` as whole MiB (rounded down) in MPS control syntax, e.g. ``"10240M"``."""
    if value_bytes < 0:
        raise ValueError(f"a memory size cannot be negative, got {value_bytes}")
    return f"{value_bytes // MIB}M"
