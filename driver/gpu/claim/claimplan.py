"""What preparing one claim will do, worked out once and before any side effect.

:func:`plan_claim` resolves every allocation result to the device this node publishes under
that name, picks the winning opaque config per device, and derives the MPS daemons (with their
full specs), the time slice and the GPUs whose compute mode changes. Every refusal a user can
fix (a stale allocation, an invalid config, a combination MPS cannot serve) is raised here, as
a :class:`PrepareError` naming the claim's devices, so a refused claim never starts anything.
A result with admin access (``adminAccess: true``, a device other claims hold, for monitoring)
resolves to its device and nothing else: no config, daemon, time slice or consumed capacity.
Pure functions over the node view; no I/O.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from driver.gpu.claimcdi.edits import MPS_CONTAINER_PIPE_DIR
from driver.gpu.claimconfig.api import ConfigError, DeviceConfig, Sharing, resolve_mps_limits
from driver.gpu.claimconfig.choices import DeviceKind, MpsClients, TimeSliceInterval
from driver.gpu.claimconfig.precedence import group_by_config, resolve_configs
from driver.gpu.discovery.inventory import multi_user_capable
from driver.gpu.errors import PrepareError
from driver.gpu.mps.model import MpsDaemonSpec
from driver.gpu.published.consumable import ConsumedShare, consumed_share
from driver.gpu.published.targets import DeviceTarget, NodeView
from driver.kubeletplugin.claimmodel import DeviceRequestAllocationResult, ResourceClaim


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def shared_daemon_id(cuda_uuid: str) -> str:
    """The shared daemon of a GPU's (or a MIG instance's, by its MIG UUID) MPS shares."""
    # Short ids keep MPS socket paths under the 108-byte Unix socket limit.
    return f"plan-{_short_hash(cuda_uuid)}"


def claim_daemon_id(claim_uid: str, group: int) -> str:
    return f"claim-{_short_hash(claim_uid)}-{group}"


def share_daemon_id(claim_uid: str) -> str:
    """The daemon of a claim's consumable share: its own, so its limits are the claim's."""
    return f"share-{_short_hash(claim_uid)}"


def is_shared_daemon(daemon_id: str) -> bool:
    return daemon_id.startswith("plan-")


def exclusive_gpus(cuda_uuids: Iterable[str]) -> list[str]:
    """The GPUs whose compute mode an MPS daemon serving ``cuda_uuids`` makes EXCLUSIVE_PROCESS.

    Whole GPUs only: a MIG device's parent stays in DEFAULT, the only mode MIG allows.
    """
    return sorted({u for u in cuda_uuids if u.startswith("GPU-")})


@dataclass(frozen=True)
class PlannedDaemon:
    spec: MpsDaemonSpec
    shared: bool  # a shared daemon (one per GPU, shared by its share claims) rather than the claim's own
    device_names: tuple[str, ...]  # the claim's devices it serves
    # False for a consumable share's daemon: several claims' MPS servers share its GPU, and
    # EXCLUSIVE_PROCESS would let only the first server create a context.
    exclusive: bool = True
    # Who may be its client (driver/gpu/claim/tenancy.py checks nonRoot at every prepare). A consumable share's
    # daemon admits any: the GPU stays in DEFAULT, so its limits are advisory whoever the client is.
    clients: MpsClients = "any"

    @property
    def daemon_id(self) -> str:
        return self.spec.daemon_id

    @property
    def exclusive_gpus(self) -> list[str]:
        """GPUs set to EXCLUSIVE_PROCESS while this daemon runs (whole GPUs only)."""
        return exclusive_gpus(self.spec.gpu_uuids) if self.exclusive else []


@dataclass(frozen=True)
class PlannedTimeSlice:
    gpu_uuids: tuple[str, ...]
    interval: TimeSliceInterval


@dataclass(frozen=True)
class ClaimPlan:
    uid: str
    namespace: str
    name: str
    results: tuple[DeviceRequestAllocationResult, ...]
    targets: tuple[DeviceTarget, ...]  # one per result, same order
    daemons: tuple[PlannedDaemon, ...]
    timeslice: PlannedTimeSlice | None
    # Device name -> what the claim consumed of it, for each consumable device it holds.
    consumed: tuple[tuple[str, ConsumedShare], ...] = ()
    # The pods the claim is reserved for: whose GPU processes are metered as this claim's.
    pod_uids: tuple[str, ...] = ()

    @property
    def gpu_uuids(self) -> list[str]:
        """Every physical GPU the claim touches, sorted: the per-GPU locks its side effects take."""
        return sorted({t.gpu.uuid for t in self.targets})

    @property
    def held_targets(self) -> list[DeviceTarget]:
        """The devices the claim holds: all but those of admin-access results, which other claims hold too."""
        return [t for r, t in zip(self.results, self.targets, strict=True) if not r.admin_access]


def plan_claim(claim: ResourceClaim, *, driver_name: str, pool_name: str, view: NodeView,
               multi_user: bool = False) -> ClaimPlan | None:
    """The plan for ``claim`` on this node, None if none of its devices is this driver's.

    ``multi_user``: shared daemons (whose shares go to pods of any namespace, so any UID) run in
    MPS multi-user mode on GPUs that support it; the caller knows whether the node's MPS does.
    """
    results = claim.results_for(driver_name)
    if not results:
        return None
    targets = [_target_for(r, view, pool_name) for r in results]
    # Admin-access results look at devices other claims hold: no config, daemon, time slice or capacity of theirs.
    held = [(r, t) for r, t in zip(results, targets, strict=True) if not r.admin_access]
    held_results, held_targets = [r for r, _ in held], [t for _, t in held]
    kind_by_device = {t.name: t.kind for t in targets}
    try:
        groups = group_by_config(resolve_configs(claim.configs_for(driver_name), held_results,
                                                 lambda r: kind_by_device[r.device], whole_gpu_class=driver_name))
    except ConfigError as exc:
        raise PrepareError(f"invalid opaque configuration: {exc}") from exc
    _check_share_multiplicity(held_targets, whole_gpu_class=driver_name)
    uid = claim.metadata.uid
    consumed = _consumed(held_results, held_targets, driver_name)
    daemons = (_shared_daemons(held_targets, multi_user) + _claim_daemons(uid, held_targets, groups)
               + _share_daemons(uid, held_targets, consumed))
    by_name = {t.name: t for t in targets}
    _check_one_cuda_process_can_see([by_name[n] for d in daemons for n in d.device_names])
    _check_one_mps_daemon(daemons)
    return ClaimPlan(uid=uid, namespace=claim.metadata.namespace, name=claim.metadata.name, results=tuple(results),
                     targets=tuple(targets), daemons=tuple(daemons), timeslice=_timeslice(held_targets, groups),
                     consumed=tuple(consumed.items()), pod_uids=tuple(claim.pod_uids))


def _consumed(results: Sequence[DeviceRequestAllocationResult], targets: Sequence[DeviceTarget],
              driver_name: str) -> dict[str, ConsumedShare]:
    consumed: dict[str, ConsumedShare] = {}
    for result, target in zip(results, targets, strict=True):
        policy = target.form.consumable if target.form is not None else None
        if policy is None:
            continue
        if target.name in consumed:
            raise PrepareError(f"the claim holds {target.name!r} twice (two requests); ask for one request with "
                               "the memory and multiprocessors of both")
        consumed[target.name] = consumed_share(target.name, result.consumed_capacity, policy, driver_name)
    return consumed


def _share_daemons(uid: str, targets: Sequence[DeviceTarget],
                   consumed: dict[str, ConsumedShare]) -> list[PlannedDaemon]:
    """One daemon of the claim's own per consumable share, with the claim's limits as the daemon's
    defaults: MPS lets a client only lower them (docs/sharing.md), so the tenant cannot exceed its claim."""
    daemons: list[PlannedDaemon] = []
    for t in targets:
        share = consumed.get(t.name)
        if share is None:
            continue
        spec = MpsDaemonSpec(daemon_id=share_daemon_id(uid), gpu_uuids=[t.gpu.uuid],
                             active_thread_percentage=share.active_thread_percentage,
                             pinned_memory_limits={t.gpu.uuid: share.memory_bytes},
                             shm_size=t.form.shm_size_bytes if t.form is not None else None)
        daemons.append(PlannedDaemon(spec, shared=False, device_names=(t.name,), exclusive=False))
    return daemons


def _target_for(result: DeviceRequestAllocationResult, view: NodeView, pool_name: str) -> DeviceTarget:
    if result.pool != pool_name:
        raise PrepareError(f"device {result.device!r} was allocated from pool {result.pool!r}, but this node's "
                           f"pool is {pool_name!r}; the claim belongs to another node")
    target = view.targets.get(result.device)
    if target is None:
        known = ", ".join(sorted(view.targets)) or "none"
        raise PrepareError(
            f"device {result.device!r} is not published by this node (published: {known}). The allocation is "
            "stale (the GPU or the sharing plan changed); delete the pod so its claim is allocated again")
    return target


def _check_share_multiplicity(targets: Sequence[DeviceTarget], *, whole_gpu_class: str) -> None:
    by_unit: dict[str, list[DeviceTarget]] = {}
    for t in targets:
        # A consumable device held twice is refused by _consumed, with its own advice. Dynamic MIG placements are
        # no shares: each is an instance of its own, and several in one claim add capacity, as static MIG devices do.
        if t.form is not None and t.form.consumable is None and not t.form.allow_multiple_shares_per_claim \
                and not t.creates_mig_instance:
            by_unit.setdefault(t.cuda_uuid, []).append(t)  # the GPU, or the MIG instance the shares split
    for group in by_unit.values():
        if len(group) > 1:
            names = ", ".join(t.name for t in group)
            one = "MIG instance" if group[0].mig is not None else "GPU"
            raise PrepareError(
                f"the claim holds {len(group)} shares of one {one} ({names}); shares of the same {one} in one claim "
                "add no capacity (every process still gets one share's limits). Ask for one share, or for a whole "
                f"GPU (DeviceClass {whole_gpu_class}) with GpuConfig.sharing to choose your own limits; the node "
                "operator can allow this with allowMultipleSharesPerClaim in the sharing plan")


ConfigGroups = Sequence[tuple[DeviceConfig, Sequence[DeviceRequestAllocationResult]]]


def _shared_daemons(targets: Sequence[DeviceTarget], multi_user: bool) -> list[PlannedDaemon]:
    """One shared daemon per GPU (or MIG instance: its MIG UUID is the daemon's CUDA_VISIBLE_DEVICES, so the limits
    are the instance's) whose plan MPS shares the claim holds."""
    by_unit: dict[str, list[DeviceTarget]] = {}
    for t in targets:
        if t.kind == DeviceKind.MPS and t.form is not None:
            by_unit.setdefault(t.cuda_uuid, []).append(t)
    daemons: list[PlannedDaemon] = []
    for cuda_uuid, shares in sorted(by_unit.items()):
        s, gpu = shares[0].form, shares[0].gpu
        assert s is not None
        spec = MpsDaemonSpec(daemon_id=shared_daemon_id(cuda_uuid), gpu_uuids=[cuda_uuid],
                             active_thread_percentage=s.active_thread_percentage,
                             pinned_memory_limits={cuda_uuid: s.memory_bytes_per_share},
                             multi_user=multi_user and multi_user_capable(gpu.cuda_compute_capability),
                             shm_size=s.shm_size_bytes)
        daemons.append(PlannedDaemon(spec, shared=True, device_names=tuple(t.name for t in shares),
                                     clients=s.mps_clients))
    return daemons


def _claim_daemons(uid: str, targets: Sequence[DeviceTarget], groups: ConfigGroups) -> list[PlannedDaemon]:
    """One daemon per config group with ``sharing.strategy: MPS`` over whole GPUs or MIG devices."""
    by_name = {t.name: t for t in targets}
    daemons: list[PlannedDaemon] = []
    for index, (config, results) in enumerate(groups):
        sharing = config.sharing
        group = [by_name[r.device] for r in results if by_name[r.device].kind in (DeviceKind.GPU, DeviceKind.MIG)]
        if sharing is None or sharing.strategy != "MPS" or not group:
            continue
        uuids = sorted({t.cuda_uuid for t in group})  # two dynamic MIG devices share their GPU's until created
        memory = {t.cuda_uuid: t.memory_bytes or 0 for t in group}
        try:
            limits = resolve_mps_limits(sharing.mpsConfig, uuids, memory) if sharing.mpsConfig else None
        except ConfigError as exc:
            raise PrepareError(f"invalid opaque configuration: {exc}") from exc
        spec = MpsDaemonSpec(daemon_id=claim_daemon_id(uid, index), gpu_uuids=uuids,
                             active_thread_percentage=limits.active_thread_percentage if limits else None,
                             pinned_memory_limits=dict(limits.pinned_memory_bytes) if limits else {},
                             shm_size=sharing.mpsConfig.shmSize if sharing.mpsConfig else None)
        # A dynamic MIG device's daemon names its parent GPU until the instance exists (the runtime then moves
        # it onto the instance: migclaims.plan_on_instances); its GPU is in MIG mode, which allows only DEFAULT.
        daemons.append(PlannedDaemon(spec, shared=False, device_names=tuple(t.name for t in group),
                                     exclusive=not any(t.creates_mig_instance for t in group),
                                     clients=sharing.mpsConfig.clients if sharing.mpsConfig else "any"))
    return daemons


def _check_one_cuda_process_can_see(served: Sequence[DeviceTarget]) -> None:
    """``served``: every device of the claim an MPS daemon would serve. A container reaches one daemon,
    an MPS server is one CUDA process, and "a single CUDA process can only enumerate a single MIG
    device", never a MIG device next to a whole GPU (NVIDIA MIG user guide, "CUDA Device Enumeration")."""
    # A dynamic MIG device is a MIG device once created, the whole device of a dynamic GPU (its full profile) too;
    # a share of a MIG instance runs on its instance.
    migs = sorted(t.name for t in served if t.mig is not None or t.creates_mig_instance)
    others = sorted(t.name for t in served if not (t.mig is not None or t.creates_mig_instance))
    if len(migs) > 1 or (migs and others):
        raise PrepareError(
            f"MPS would have to serve {', '.join(migs + others)} together, but an MPS server is a single CUDA "
            "process, and a CUDA process sees only one MIG device and no MIG device next to a whole GPU or GPU share "
            "(NVIDIA MIG user guide). Give each MIG device with sharing.strategy MPS its own claim, or leave MPS out "
            "of this claim's config")


def _check_one_mps_daemon(daemons: Sequence[PlannedDaemon]) -> None:
    if len(daemons) > 1:
        raise PrepareError(
            f"the claim's devices would be served by {len(daemons)} MPS daemons, but a container reaches only "
            f"one (its {MPS_CONTAINER_PIPE_DIR}). Ask for MPS shares of one GPU only, or put all whole GPUs of "
            "the claim under one GpuConfig with sharing.strategy MPS (one daemon serves them all)")


def _timeslice(targets: Sequence[DeviceTarget], groups: ConfigGroups) -> PlannedTimeSlice | None:
    """The claim's time slice on its whole GPUs (TimeSlicing on a MIG device, or on the whole device of a dynamic
    MIG GPU, which is a MIG instance once prepared, is accepted and does nothing)."""
    by_name = {t.name: t for t in targets}
    gpus: set[str] = set()
    intervals: set[TimeSliceInterval] = set()
    for config, results in groups:
        sharing = config.sharing
        if not isinstance(sharing, Sharing) or sharing.strategy != "TimeSlicing":
            continue
        group = [t for t in (by_name[r.device] for r in results)
                 if t.kind == DeviceKind.GPU and not t.creates_mig_instance]
        if not group:
            continue
        intervals.add(sharing.timeSlicingConfig.interval if sharing.timeSlicingConfig else "Default")
        gpus.update(t.gpu.uuid for t in group)
    if not gpus:
        return None
    if len(intervals) > 1:
        raise PrepareError(f"the claim asks for different time-slice intervals ({', '.join(sorted(intervals))}) "
                           "on its GPUs; one claim can use one interval")
    return PlannedTimeSlice(tuple(sorted(gpus)), intervals.pop())
