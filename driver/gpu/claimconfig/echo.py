"""How a value a tenant wrote is echoed in an error: on one line, short, never spliced in raw.

Errors reach the kubelet (the pod's events) and the logs. A raw echo of ``"64Mi\\n..."`` would let a
claim's value start a line of its own there, looking like the driver's. Strings are shown as JSON
strings (ASCII only: control characters, line and paragraph separators and every non-ASCII character
escaped), anything else as JSON, each cut to a few dozen characters.
"""

from __future__ import annotations

import json


def show(value: object, limit: int = 80) -> str:
    """``value`` as a one-line, ASCII-only quote of at most about ``limit`` characters of it."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        # repr() and json.dumps() of an int past 4300 digits raise; the size is what matters here.
        return f"an integer of {value.bit_length()} bits"
    if isinstance(value, str):
        text = json.dumps(value[:limit])
        return text if len(value) <= limit else f"{text}... ({len(value)} characters)"
    try:
        text = json.dumps(value, default=str)
    except ValueError:  # a structure too deep or with a cycle: its type is enough
        text = type(value).__name__
    return text if len(text) <= limit else f"{json.dumps(text[:limit])}... ({len(text)} characters)"


def show_path_part(part: str) -> str:
    """A mapping key as a part of a field path: as is when it prints on one line, else quoted."""
    return part if part and part.isprintable() and len(part) <= 64 else show(part, 20)
