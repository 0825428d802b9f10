"""Per-GPU readings for the metrics: temperature, power and memory in use."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from driver.gpu.health.monitor import HealthSource


@dataclass(frozen=True)
class DeviceSample:
    """One GPU's (or MIG device's) readings; None where the device cannot report it."""

    temperature_celsius: float | None = None
    power_watts: float | None = None
    memory_used_bytes: int | None = None


class DeviceSampler(Protocol):
    def sample(self) -> dict[str, DeviceSample]:
        """Readings by GPU or MIG UUID; devices that cannot be read are left out."""
        ...


class SampledHealthSource(HealthSource, DeviceSampler, Protocol):
    """What the app runs: health events for the monitor and readings for the metrics."""

    def not_watched(self) -> dict[str, dict[str, str]]:
        """GPU UUID -> what cannot be read on it now -> why (logged once; shown by ``inspect``)."""
        ...
