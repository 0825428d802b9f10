"""Byte units, defined once: NVML, MPS and Kubernetes quantities all count in binary units."""

from __future__ import annotations

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
TIB = 1 << 40
