"""The health check a new claim passes at prepare: no unhealthy device unless the claim tolerates it.

An unhealthy device carries the driver's taint (``health/published.py``), so the scheduler keeps
claims away from it; a claim whose allocation result tolerates every taint of the device was
sent there on purpose (a diagnostics job, a monitoring pod) and is prepared, with a log line
saying why. Claims already prepared are never checked again.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from driver.gpu.errors import PrepareError
from driver.kubeletplugin.slicemodel import DeviceTaint
from driver.kubeletplugin.tolerations import describe_taint, untolerated

if TYPE_CHECKING:
    from driver.gpu.claim.claimplan import ClaimPlan

log = logging.getLogger(__name__)

# Device name -> the taints it carries while unhealthy.
DeviceTaints = Mapping[str, Sequence[DeviceTaint]]


def check_device_health(claim_plan: ClaimPlan, problems: Mapping[str, str], taints: DeviceTaints | None = None) -> None:
    """Refuse ``claim_plan`` on an unhealthy device it does not tolerate.

    ``problems``: device name -> why it is unhealthy; ``taints``: device name -> the taints it
    carries while unhealthy. A device with a problem but no taint known is never tolerated.
    """
    refused: list[str] = []
    for index, target in enumerate(claim_plan.targets):
        problem = problems.get(target.name)
        if problem is None:
            continue
        device_taints = list((taints or {}).get(target.name, ()))
        # Results are read only here, for the rare claim on an unhealthy device.
        result = claim_plan.results[index] if device_taints else None
        if result is None or untolerated(result.tolerations, device_taints):
            refused.append(f"{target.name} ({problem})")
            continue
        log.info("claim admitted to an unhealthy device: its allocation tolerates the device's taints",
                 extra={"claim_uid": claim_plan.uid, "claim": f"{claim_plan.namespace}/{claim_plan.name}",
                        "device": target.name,
                        "reason": problem, "tolerated": [describe_taint(t) for t in device_taints]})
    if refused:
        raise PrepareError(
            f"device {', '.join(refused)} is unhealthy, so the claim is not prepared on it; the device is tainted "
            "where the cluster supports device taints: delete the pod so its claim is allocated again, wait until "
            "the device recovers (the kubelet retries), or add a toleration for the taint to the request")
