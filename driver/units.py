"""Units, defined once: bytes count in binary units (NVML, MPS and Kubernetes quantities all do), times in UTC."""

from __future__ import annotations

from datetime import UTC, datetime

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
TIB = 1 << 40


def now() -> str:
    """Now, as the checkpoint and the MPS daemon records keep times: ISO 8601 in UTC, to the second."""
    return datetime.now(UTC).isoformat(timespec="seconds")
