"""Whether this node can make a consumable share's memory a hard limit in the kernel.

NVIDIA's MPS v3 memory partitioning accounts every allocation of a cgroup's processes on a GPU and
fails those past the cgroup's hard limit (``dmem.max``). It needs (nvidia-gpu reference 6.3):

* the NVIDIA driver R615 or newer (CUDA 13.4, which added ``nvmlDeviceSetMemoryLimits_v1``);
* cgroup v2 with the kernel's ``dmem`` controller (Linux 6.14+), i.e. ``dmem`` listed in the
  host's ``/sys/fs/cgroup/cgroup.controllers`` (that file exists only on the v2 hierarchy);
* a GPU without MIG (MIG GPUs are never consumable, see :func:`driver.gpu.published.consumable.build_policy`);
* something that sets the limit for the container: the NVIDIA Container Toolkit's CDI hook
  ``nvidia-cdi-hook apply-cuda-memory-limits --driver-root <root> --gpu-id <uuid>``
  (nvidia-container-toolkit PR #2075, merged 2026-09;
  cmd/nvidia-cdi-hook/apply-cuda-memory-limits/apply-cuda-memory-limits.go). It runs as a
  ``createRuntime`` hook, reads ``NVIDIA_GPU_MEMORY_REQUESTS`` and ``NVIDIA_GPU_MEMORY_LIMITS``, or
  where those are absent ``NVIDIA_GPU_MEMORY_REQUEST`` and ``NVIDIA_GPU_MEMORY_LIMIT`` (whole MiB, both
  required, request <= limit) from the container's OCI spec and calls ``SetMemoryLimits_v1`` on the
  container's cgroup for each ``--gpu-id``.

One pair of values per container, not per GPU: the plural names are the same single number (parsed with
``ParseUint``), looked up first, not a per-GPU list. So (1) the driver sets both forms, each to the claim's
memory, so that a same-named variable from elsewhere in the pod spec cannot take precedence by being the
plural one; and (2) two consumable claims in **one container** collide: the container gets one of the
claims' values (the last CDI device's, as the runtime merges them) and every hook applies it to its own GPU.
A claim never carries two such devices (claimplan refuses a consumable device held twice, and shares of two
GPUs need two MPS daemons, which one claim cannot have), but two claims can end up in one container and the
driver, which prepares claims one at a time, cannot see containers: :func:`warn_if_shared_pod` logs when two
such claims are reserved for one pod, and docs/sharing.md tells users not to put two in one container.

The toolkit is taken to have the hook when its CDI spec (the one this driver copies driver edits
from) already names ``apply-cuda-memory-limits`` in a hook: that proves the installed
``nvidia-cdi-hook`` knows the subcommand, and gives its path on the host. A node where any
ingredient is missing publishes ``mps-advisory`` and says which one is missing.
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
