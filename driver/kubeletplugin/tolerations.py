"""Device taints and tolerations as Kubernetes matches them (``DeviceToleration.ToleratesTaint``).

A node plugin sees the tolerations the scheduler copied into each allocation result. A claim
whose result tolerates every taint of its device was admitted to it on purpose (a diagnostics
job on a failing GPU), so a driver that refuses unhealthy devices at prepare lets it through.
Pure; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from driver.kubeletplugin.claimmodel import DeviceToleration
from driver.kubeletplugin.slicemodel import DeviceTaint


def tolerates(toleration: DeviceToleration, taint: DeviceTaint) -> bool:
    """Kubernetes' rule: an empty effect matches every effect, an empty key every key (the API
    allows that only with ``Exists``); ``Exists`` ignores the value, ``Equal`` compares it."""
    if toleration.effect and toleration.effect != taint.effect:
        return False
    if toleration.key and toleration.key != taint.key:
        return False
    if toleration.operator == "Exists":
        return True
    if toleration.operator == "Equal":
        return toleration.value == (taint.value or "")
    return False


def untolerated(tolerations: Iterable[DeviceToleration], taints: Sequence[DeviceTaint]) -> list[DeviceTaint]:
    """The taints of ``taints`` that none of ``tolerations`` tolerates."""
    held = list(tolerations)
    return [t for t in taints if not any(tolerates(tol, t) for tol in held)]


def describe_taint(taint: DeviceTaint) -> str:
    """``key=value:Effect``, as kubectl writes a taint."""
    return f"{taint.key}={taint.value or ''}:{taint.effect}"
