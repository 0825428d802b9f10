"""Who may be a client of an MPS daemon: the prepare-time check behind ``clients: nonRoot``.

A process that is root on the host can change an MPS daemon's limits or stop it through the pipe
directory every client mounts (a read-only mount still allows ``connect()``; measured with
NVIDIA's 550 and 535 daemons, docs/sharing.md "Tenants"). Where a daemon's clients are
``nonRoot`` (the default for plan MPS shares, whose daemon serves every claim on the GPU), a
claim is prepared only if every consumer it is reserved for is a pod that meets Pod Security
"baseline" and cannot run as root or group root; the pods are read from the API server
(``ResourceClaim.reserved_pods``) and judged by the generic ``ReservedPods.findings()``, which
fails closed (no pod, a consumer that is not a pod, a pod under another UID). The check runs on
every prepare call, before anything starts, so a refused claim leaves nothing behind; claims whose
daemons admit ``any`` client never read a pod.

:func:`claim_enforcement` says how the limits then hold, for the checkpoint and the usage metrics.
"""

from __future__ import annotations

import logging

from driver.gpu.claim.claimplan import ClaimPlan, PlannedDaemon
from driver.gpu.claimconfig.choices import MpsClients
from driver.gpu.errors import PrepareError
from driver.gpu.published.devicenames import gpu_device_name, mig_device_name
from driver.gpu.published.sharelayout import Enforcement, mps_enforcement
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.types import Deadline, PodsUnreadable

log = logging.getLogger(__name__)


def client_rules(claim_plan: ClaimPlan) -> tuple[tuple[str, MpsClients], ...]:
    """(daemon id, clients) of every daemon of the plan that restricts its clients; empty: nothing to check."""
    return tuple((d.daemon_id, d.clients) for d in claim_plan.daemons if d.clients == "nonRoot")


def check_clients(claim: ResourceClaim, claim_plan: ClaimPlan, deadline: Deadline) -> None:
    """Refuse the claim (:class:`PrepareError`, one line) if a daemon it uses admits only non-root
    clients and a consumer of the claim is not such a pod, or if its pods cannot be read."""
    restricted = [d for d in claim_plan.daemons if d.clients == "nonRoot"]
    if not restricted:
        return
    daemon = restricted[0]  # a claim reaches one daemon (claimplan refuses more)
    where = _where(claim_plan, daemon)
    deadline.check("reading the claim's pods")
    try:
        pods = claim.reserved_pods(deadline.remaining())
    except PodsUnreadable as exc:
        raise PrepareError(f"{_what(daemon)} on {where} admits only non-root clients, so the pods the claim is "
                           f"reserved for must be checked first, but {exc}") from exc
    findings = pods.findings()
    if findings:
        first = findings[0]
        more = {1: "", 2: " (1 more finding)"}.get(len(findings), f" ({len(findings) - 1} more findings)")
        raise PrepareError(f"{first.describe()}{more}; {_what(daemon)} on {where} admits only pods that meet "
                           f"Pod Security \"baseline\" and cannot run as root or group root (clients: nonRoot); "
                           f"{first.fix}, or {_alternative(daemon)}")


def claim_enforcement(
        claim_plan: ClaimPlan, driver_version: str | None) -> tuple[MpsClients | None, Enforcement | None]:
    """The clients the claim's MPS daemon admits and how its limits hold for them; (None, None) without one."""
    if not claim_plan.daemons:
        return None, None
    daemon = claim_plan.daemons[0]
    return daemon.clients, mps_enforcement(daemon.clients, driver_version, exclusive=bool(daemon.exclusive_gpus))


def _what(daemon: PlannedDaemon) -> str:
    return "the MPS daemon shared with other claims" if daemon.shared else "the claim's own MPS daemon"


def _alternative(daemon: PlannedDaemon) -> str:
    if daemon.shared:
        return "use a share whose plan sets clients: any"
    return "set clients: any in the claim's mpsConfig"


def _where(claim_plan: ClaimPlan, daemon: PlannedDaemon) -> str:
    served = [t for t in claim_plan.targets if t.name in daemon.device_names]
    if daemon.shared:  # the GPU, or the MIG instance, whose shares all go through the daemon
        return ", ".join(sorted({gpu_device_name(t.gpu.minor) if t.mig is None
                                 else mig_device_name(t.gpu.minor, t.mig.profile, t.mig.placement_start)
                                 for t in served}))
    return ", ".join(t.name for t in served)
