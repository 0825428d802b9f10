"""Consumable GPUs: one device that many claims share, each sized by what it consumed.

A sharing-plan entry ``consumable`` publishes a GPU once, with ``allowMultipleAllocations: true``
and the capacities ``memory`` (bytes) and ``multiprocessors`` (SMs), each with a request policy
(KEP-5075, ``DRAConsumableCapacity``). The scheduler records what each claim took in
``consumedCapacity``; at prepare this module turns that into the claim's limits (an MPS daemon of
its own with the claim's pinned memory and thread percentage, see docs/sharing.md) and re-checks
that the prepared claims of a GPU fit its capacity. Pure functions; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from driver.gpu.claimconfig.quantity import parse_whole_quantity
from driver.gpu.discovery.inventory import GpuInfo
from driver.gpu.errors import PrepareError
from driver.gpu.published.sharelayout import ConsumablePolicy, Enforcement
from driver.units import GIB

# Whole GiB: MPS takes pinned limits in whole MiB and shows them rounded down to whole G from 1 GiB on
# (nvidia-gpu reference 6.2), so a GiB grid is what the daemon both enforces and displays unchanged.
MEMORY_STEP_BYTES = GIB
CONSUMABLE_MEMORY = "memory"
CONSUMABLE_MULTIPROCESSORS = "multiprocessors"


# --- where the API server keeps the fields --------------------------------------------------------


def consumable_supported(minor_version: int, gate_enabled: bool) -> bool:
    """Whether an API server of Kubernetes 1.<minor_version> stores ``allowMultipleAllocations`` and
    request policies: beta and on from 1.36, alpha (off unless the gate is set) in 1.34 and 1.35
    (resource-api reference, feature gates). Elsewhere the server silently drops them."""
    return minor_version >= 36 or (minor_version >= 34 and gate_enabled)


# --- kernel-enforced memory --------------------------------------------------------------------


@dataclass(frozen=True)
class KernelMemoryLimits:
    """Whether this node can hard-limit a container's device memory in the kernel
    (detected by :mod:`driver.gpu.claimcdi.kernelmemory`); ``hook_path``: the toolkit's ``nvidia-cdi-hook``."""

    available: bool
    reason: str
    hook_path: str | None = None


# What a caller that detected nothing gets: never a claim of ``kernel`` that nothing backs.
UNDETECTED = KernelMemoryLimits(False, "kernel memory limits were not detected on this node")


# --- policy --------------------------------------------------------------------------------------


def build_policy(gpu: GpuInfo, *, memory_min: int | None, memory_default: int | None,
                 multiprocessors_step: int | None, multiprocessors_min: int | None,
                 multiprocessors_default: int | None, kernel: KernelMemoryLimits) -> ConsumablePolicy:
    """The request policies for ``gpu``; ValueError naming the plan field when they cannot hold."""
    if gpu.mig_enabled:
        raise ValueError("a MIG-enabled GPU cannot be consumable; publish it whole (its MIG devices are "
                         "published instead), narrow the match, or disable MIG on this GPU")
    if gpu.memory_bytes is None:
        raise ValueError("the GPU's memory size is unknown, so it cannot publish a memory capacity")
    if gpu.multiprocessors is None:
        why = gpu.multiprocessors_missing or "unknown reason"
        raise ValueError(f"the GPU's SM count is unknown ({why}), so it cannot publish a multiprocessors "
                         "capacity; consumable GPUs need libcuda on the node to count SMs")
    total_mem, total_sms = gpu.memory_bytes, gpu.multiprocessors
    mem_min = GIB if memory_min is None else memory_min
    if mem_min % MEMORY_STEP_BYTES or mem_min < MEMORY_STEP_BYTES:
        raise ValueError(f"consumable.memoryMin must be a whole number of GiB, at least 1Gi, got {mem_min} bytes")
    if mem_min + MEMORY_STEP_BYTES > total_mem:
        raise ValueError(f"consumable.memoryMin {mem_min // GIB} GiB plus one 1 GiB step is more than the "
                         f"GPU's {total_mem} bytes")
    mem_max = mem_min + (total_mem - mem_min) // MEMORY_STEP_BYTES * MEMORY_STEP_BYTES
    mem_default = mem_min if memory_default is None else memory_default
    _on_grid("consumable.memoryDefault", mem_default, mem_min, MEMORY_STEP_BYTES, mem_max, "bytes")
    step = 1 if multiprocessors_step is None else multiprocessors_step
    if step < 1:
        raise ValueError(f"consumable.multiprocessorsStep must be at least 1, got {step}")
    # A claim's thread percentage is floor(100 x SMs / total); below total/100 SMs it would be 0.
    floor_sms = -(-total_sms // 100)
    sm_min = step * -(-floor_sms // step) if multiprocessors_min is None else multiprocessors_min
    if sm_min < floor_sms:
        raise ValueError(f"consumable.multiprocessorsMin {sm_min} is less than {floor_sms}, the fewest of the "
                         f"GPU's {total_sms} SMs that MPS can give (1 percent of its threads)")
    if sm_min + step > total_sms:
        raise ValueError(f"consumable.multiprocessorsMin {sm_min} plus one step of {step} is more than the "
                         f"GPU's {total_sms} SMs")
    sm_max = sm_min + (total_sms - sm_min) // step * step
    sm_default = sm_min if multiprocessors_default is None else multiprocessors_default
    _on_grid("consumable.multiprocessorsDefault", sm_default, sm_min, step, sm_max, "SMs")
    return ConsumablePolicy(
        memory_bytes=total_mem, memory_min_bytes=mem_min, memory_step_bytes=MEMORY_STEP_BYTES,
        memory_max_bytes=mem_max, memory_default_bytes=mem_default,
        multiprocessors=total_sms, multiprocessors_min=sm_min, multiprocessors_step=step,
        multiprocessors_max=sm_max, multiprocessors_default=sm_default,
        memory_enforcement=Enforcement.KERNEL if kernel.available else Enforcement.MPS_ADVISORY,
        memory_limit_hook=kernel.hook_path if kernel.available else None)


def _on_grid(field: str, value: int, low: int, step: int, high: int, unit: str) -> None:
    if not low <= value <= high or (value - low) % step:
        raise ValueError(f"{field} {value} {unit} is not one of {low}, {low + step}, ... {high} {unit}")


# --- consumed capacity at prepare ------------------------------------------------------------------


@dataclass(frozen=True)
class ConsumedShare:
    """What one claim consumed of a consumable GPU, and the limits that follow from it."""

    memory_bytes: int
    multiprocessors: int
    active_thread_percentage: int


def thread_percentage(multiprocessors: int, total: int) -> int:
    """floor(100 x SMs / total): never more than the claim's part, so a GPU's claims add up to <= 100."""
    return max(1, 100 * multiprocessors // total)


def consumed_share(device: str, consumed: Mapping[str, str] | None, policy: ConsumablePolicy,
                   driver_name: str) -> ConsumedShare:
    """The claim's share of ``device``; PrepareError naming the amounts when it is missing or out of policy."""
    if not consumed:
        raise PrepareError(
            f"device {device!r} is consumable, but the allocation records no consumedCapacity: the API server "
            "or scheduler does not support consumable capacity (Kubernetes 1.36, or DRAConsumableCapacity on "
            "1.34/1.35); delete the pod so its claim is allocated again")
    amounts: dict[str, str] = {}
    for key, value in consumed.items():
        domain, _, name = key.rpartition("/")
        if domain and domain != driver_name:
            continue
        if name in amounts:
            # "memory" and "<driver>/memory" are one capacity: which of two amounts the scheduler counted is
            # unknowable, so taking either (the last, by map order) could set limits it never counted.
            raise PrepareError(f"device {device!r}: consumedCapacity names {name!r} twice (with and without "
                               f"{driver_name}/); delete the pod so its claim is allocated again")
        amounts[name] = value
    memory = _amount(device, amounts, CONSUMABLE_MEMORY, "bytes")
    sms = _amount(device, amounts, CONSUMABLE_MULTIPROCESSORS, "SMs")
    problems = []
    if not policy.memory_min_bytes <= memory <= policy.memory_max_bytes or \
            (memory - policy.memory_min_bytes) % policy.memory_step_bytes:
        problems.append(f"memory {amounts[CONSUMABLE_MEMORY]} ({memory} bytes) is not a whole number of GiB "
                        f"from {policy.memory_min_bytes // GIB}Gi to {policy.memory_max_bytes // GIB}Gi")
    if not policy.multiprocessors_min <= sms <= policy.multiprocessors_max or \
            (sms - policy.multiprocessors_min) % policy.multiprocessors_step:
        problems.append(f"multiprocessors {sms} is not {policy.multiprocessors_min} to "
                        f"{policy.multiprocessors_max} in steps of {policy.multiprocessors_step}")
    if problems:
        raise PrepareError(f"device {device!r}: consumedCapacity out of the published policy: "
                           f"{'; '.join(problems)}; delete the pod so its claim is allocated again")
    return ConsumedShare(memory, sms, thread_percentage(sms, policy.multiprocessors))


def _amount(device: str, amounts: Mapping[str, str], name: str, unit: str) -> int:
    if name not in amounts:
        raise PrepareError(f"device {device!r}: consumedCapacity has no {name!r} (it has "
                           f"{', '.join(sorted(amounts)) or 'nothing'}); a consumable share needs both memory and "
                           "multiprocessors")
    try:
        # Whole numbers only: the policies' grids are integers, so a fraction is off-policy, and rounding
        # it would make the limits and the prepared total differ from what the scheduler counted.
        return parse_whole_quantity(amounts[name], f"consumedCapacity.{name}")
    except ValueError as exc:
        raise PrepareError(f"device {device!r}: {exc} ({unit}); delete the pod so its claim is allocated "
                           "again") from None


@dataclass(frozen=True)
class HeldShare:
    """A share of the GPU another prepared claim holds (``share`` None: it holds the GPU in another form)."""

    claim: str
    share: ConsumedShare | None


def check_fits(device: str, wanted: ConsumedShare, held: Iterable[HeldShare], policy: ConsumablePolicy) -> None:
    """PrepareError unless ``wanted`` fits next to the GPU's other prepared claims.

    The scheduler is the first line; this catches double allocation (fixed in 1.36), a stale
    allocation after a restart, or prepared claims the scheduler no longer knows about.
    """
    others = list(held)
    whole = [h.claim for h in others if h.share is None]
    if whole:
        raise PrepareError(f"device {device!r}: the GPU is prepared in another form for claim(s) "
                           f"{', '.join(sorted(whole))}; delete the pod so its claim is allocated again")
    memory = sum(h.share.memory_bytes for h in others if h.share is not None)
    sms = sum(h.share.multiprocessors for h in others if h.share is not None)
    over = []
    if memory + wanted.memory_bytes > policy.memory_bytes:
        over.append(f"memory: {wanted.memory_bytes // GIB}Gi asked, {memory // GIB}Gi held by {len(others)} "
                    f"other claim(s), capacity {policy.memory_bytes} bytes")
    if sms + wanted.multiprocessors > policy.multiprocessors:
        over.append(f"multiprocessors: {wanted.multiprocessors} asked, {sms} held by {len(others)} other claim(s), "
                    f"capacity {policy.multiprocessors}")
    if over:
        raise PrepareError(f"device {device!r} would be overcommitted ({'; '.join(over)}); nothing was prepared. "
                           "Delete the pod so its claim is allocated again")
