"""Whether this node can make a consumable share's memory a hard limit in the kernel.

The ingredients (R615 driver, cgroup v2 ``dmem``, a GPU without MIG, the toolkit's ``apply-cuda-memory-limits``
hook, taken to be there when the toolkit's CDI spec names it), their sources, and why two such claims must not share
a container (:func:`warn_if_shared_pod`): docs/sharing.md, "Kernel-enforced memory" and "One kernel-limited
consumable claim per container". A node where any ingredient is missing publishes ``mps-advisory``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import cdi
from driver.gpu.claimconfig.choices import DeviceKind
from driver.gpu.published.consumable import KernelMemoryLimits
from driver.gpu.published.sharelayout import GpuForm
from driver.gpu.record.checkpoint import Checkpoint, ClaimRecord

log = logging.getLogger(__name__)

MIN_DRIVER_MAJOR = 615
HOOK_SUBCOMMAND = "apply-cuda-memory-limits"
HOOK_STAGE = "createRuntime"  # the hook reads the container's cgroup from its state (PID): after create
CGROUP_CONTROLLERS = Path("sys/fs/cgroup/cgroup.controllers")  # under the host root
DMEM_CONTROLLER = "dmem"
MEMORY_REQUEST_ENV = "NVIDIA_GPU_MEMORY_REQUEST"
MEMORY_LIMIT_ENV = "NVIDIA_GPU_MEMORY_LIMIT"
# What the hook looks up first (the same single value, not a per-GPU list).
MEMORY_REQUESTS_ENV = "NVIDIA_GPU_MEMORY_REQUESTS"
MEMORY_LIMITS_ENV = "NVIDIA_GPU_MEMORY_LIMITS"


def check(driver_version: str | None, cgroup_controllers: str | None, hook_path: str | None) -> KernelMemoryLimits:
    """The verdict from what was read: the driver's version string, the root cgroup's
    ``cgroup.controllers`` text (None: no such file, so not cgroup v2) and the hook's path (None:
    the toolkit's spec has no such hook). Every missing ingredient is named in ``reason``."""
    missing: list[str] = []
    major = _major(driver_version)
    if major is None or major < MIN_DRIVER_MAJOR:
        missing.append(f"NVIDIA driver {driver_version or 'version unknown'} is older than R{MIN_DRIVER_MAJOR} "
                       "(MPS v3 memory partitioning)")
    if cgroup_controllers is None:
        missing.append(f"no /{CGROUP_CONTROLLERS} on the host: not cgroup v2")
    elif DMEM_CONTROLLER not in cgroup_controllers.split():
        missing.append(f"cgroup v2 lacks the {DMEM_CONTROLLER!r} controller (Linux 6.14+)")
    if hook_path is None:
        missing.append(f"the NVIDIA Container Toolkit's CDI spec has no {HOOK_SUBCOMMAND!r} hook "
                       "(a toolkit with nvidia-container-toolkit PR #2075)")
    if missing:
        return KernelMemoryLimits(False, "; ".join(missing))
    return KernelMemoryLimits(True, f"MPS v3 memory partitioning through {hook_path} {HOOK_SUBCOMMAND}",
                              hook_path=hook_path)


def detect(host_root: Path, driver_version: str | None, toolkit_spec: Path | None) -> KernelMemoryLimits:
    """Read the node's ingredients (at start and at every rescan) and judge them with :func:`check`."""
    try:
        controllers: str | None = (host_root / CGROUP_CONTROLLERS).read_text()
    except OSError:
        controllers = None
    return check(driver_version, controllers, memory_limit_hook(toolkit_spec))


def memory_limit_hook(toolkit_spec: Path | None) -> str | None:
    """The path of the toolkit's ``nvidia-cdi-hook`` if its spec already uses ``apply-cuda-memory-limits``."""
    if toolkit_spec is None:
        return None
    try:
        wire = cdi.read_spec(toolkit_spec).to_wire()
    except Exception:  # unreadable or invalid: the toolkit module reports it; here it only means "no hook"
        return None
    for hook in _hooks(wire):
        args = hook.get("args") or []
        if HOOK_SUBCOMMAND in args and isinstance(hook.get("path"), str):
            return str(hook["path"])
    return None


def hook_edits(hook_path: str, driver_root_on_host: str, gpu_uuid: str, memory_bytes: int) -> tuple[dict[str, Any],
                                                                                                        list[str]]:
    """(CDI hook, env) that make ``memory_bytes`` the hard limit of the container's cgroup on ``gpu_uuid``.

    Request and limit are the same: the claim was given this much and no more (the hook sets
    ``dmem.min`` from the request, ``dmem.max`` from the limit). The args start with the binary's
    name as the toolkit's own specs write them (``nvidia-cdi-hook <subcommand> ...``).
    """
    mib = str(memory_bytes >> 20)
    hook = {"hookName": HOOK_STAGE, "path": hook_path,
            "args": ["nvidia-cdi-hook", HOOK_SUBCOMMAND, "--driver-root", driver_root_on_host, "--gpu-id", gpu_uuid]}
    names = (MEMORY_REQUESTS_ENV, MEMORY_LIMITS_ENV, MEMORY_REQUEST_ENV, MEMORY_LIMIT_ENV)
    return hook, [f"{name}={mib}" for name in names]


def hooked_devices(record: ClaimRecord, layout: Mapping[str, GpuForm]) -> list[str]:
    """The claim's devices whose CDI edits carry the memory-limit hook (the rule of ``claimcdi/edits.py``)."""
    hooked: list[str] = []
    for dev in record.devices:
        shares = layout.get(dev.gpu_uuid)
        policy = shares.consumable if shares is not None else None
        if dev.kind == DeviceKind.CONSUMABLE and policy is not None and policy.memory_limit_hook \
                and dev.consumed_memory_bytes:
            hooked.append(dev.device.device_name)
    return hooked


def warn_if_shared_pod(record: ClaimRecord, cp: Checkpoint) -> list[str]:
    """Log (and return the uids of) the other prepared claims with the memory-limit hook that are reserved
    for one of ``record``'s pods: if one container uses both, the hook gives both GPUs one claim's memory."""
    pods = set(record.pod_uids)
    if not pods or not hooked_devices(record, cp.layout):
        return []
    others = sorted((c for c in cp.claims.values() if c.uid != record.uid and pods & set(c.pod_uids)
                     and hooked_devices(c, cp.layout)), key=lambda c: c.uid)
    for other in others:
        log.warning("two claims with kernel-enforced GPU memory are reserved for one pod: if one container uses "
                    "both, NVIDIA's apply-cuda-memory-limits hook applies one claim's memory to both claims' GPUs "
                    "(it reads one NVIDIA_GPU_MEMORY_LIMIT per container); give each claim its own container",
                    extra={"claim": f"{record.namespace}/{record.name}", "claim_uid": record.uid,
                           "other_claim": f"{other.namespace}/{other.name}", "other_claim_uid": other.uid,
                           "pod_uids": sorted(pods & set(other.pod_uids))})
    return [c.uid for c in others]


def _hooks(wire: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from (wire.get("containerEdits") or {}).get("hooks") or []
    for device in wire.get("devices") or []:
        yield from (device.get("containerEdits") or {}).get("hooks") or []


def _major(version: str | None) -> int | None:
    match = re.match(r"\s*(\d+)", version or "")
    return int(match.group(1)) if match else None
