"""``check-node``'s MPS checks: a throwaway control daemon with small limits, and a CUDA client under it.

The daemon lives in a private temporary directory, is started by the driver's own
:class:`~driver.gpu.mps.manager.MpsManager` (so the check exercises the code that serves claims) and is
always stopped before the command returns. Nothing on the GPU is changed: the compute mode is
only read (by ``checknode``), and MPS ``set_default_*`` limits belong to this daemon alone.

The client is ``python -m driver.gpu.discovery.cudaprobe mps-client`` in its own process group with a
timeout, given only ``CUDA_MPS_PIPE_DIRECTORY``: no client-side limit variables, so what it
sees is what the daemon enforces. It shows whether the limits hold: allocations must stop with
CUDA_ERROR_OUT_OF_MEMORY at or below the pinned limit, and ``cuCtxGetExecAffinity`` must report
about the thread percentage of the GPU's SMs.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from driver.commands.checknode.result import CheckResult, fail, ok, skipped
from driver.gpu.discovery.cudaprobe import CUDA_ERROR_NAMES, CUDA_ERROR_OUT_OF_MEMORY, ClientReport, bare_uuid
from driver.gpu.discovery.cudarun import LIBCUDA, ProbeFailed, find_libcuda, probe_env, run_probe
from driver.gpu.discovery.inventory import NodeInventory
from driver.gpu.host.binaries import BinaryFailed, BinaryNotFound, driver_env, find_binary, run_binary
from driver.gpu.mps.locallauncher import LocalLauncher
from driver.gpu.mps.manager import MpsManager
from driver.gpu.mps.model import MpsDaemonRecord, MpsDaemonSpec, MpsError
from driver.gpu.mps.proc import CONTROL_BINARY
from driver.reaper import no_cleanup
from driver.units import MIB

PINNED_LIMIT_MIB = 2048
THREAD_PERCENTAGE = 25
ALLOCATION_STEP_MIB = 128
CLIENT_TIMEOUT_S = 60.0
DAEMON_ID = "check-node"
# How MPS turns a thread percentage into an SM count is not documented (the MPS docs only say the
# client's share of "available threads" is constrained); allow a little above the exact share for
# rounding to hardware units. Seen on an H200 with driver 580: 25 % of 132 SMs gave 32 (below the exact
# 33: whole TPCs of 2 SMs), so the slack only matters for GPUs that round up.
SM_ROUNDING_SLACK = 2
_OOM = CUDA_ERROR_NAMES[CUDA_ERROR_OUT_OF_MEMORY]

CHECK_DAEMON = "MPS control daemon"
CHECK_MEMORY = "MPS pinned memory limit"
CHECK_SMS = "MPS SM limit"
CHECK_STOP = "MPS daemon stopped"


def full_sm_count(inventory: NodeInventory, uuid: str) -> int | None:
    """The SM count discovery knows for a whole GPU or MIG device."""
    for gpu in inventory.gpus:
        if gpu.uuid == uuid:
            return gpu.multiprocessors
        for mig in gpu.mig_instances:
            if mig.uuid == uuid:
                return mig.multiprocessors
    return None


def choose_target(inventory: NodeInventory, compute_modes: dict[str, str], requested: str | None) -> str:
    """The device UUID to test MPS on, or raise ValueError saying why there is none.

    A requested device is the one (``check_node`` has made sure that it exists). Otherwise the first whole GPU
    (no MIG) whose compute mode reads DEFAULT: an EXCLUSIVE_PROCESS one is probably serving claims through a
    daemon already, and our server could not get a context on it. Otherwise the first MIG device (compute mode
    does not apply).
    """
    if requested is not None:
        return requested
    for gpu in inventory.gpus:
        if not gpu.mig_enabled and compute_modes.get(gpu.uuid) == "DEFAULT":
            return gpu.uuid
    for gpu in inventory.gpus:
        if gpu.mig_instances:
            return gpu.mig_instances[0].uuid
    whole = [g.uuid for g in inventory.gpus if not g.mig_enabled]
    if whole:
        raise ValueError("no whole GPU reads compute mode DEFAULT (those in EXCLUSIVE_PROCESS are probably serving "
                         "MPS claims); pass --mps-device <uuid> to test one anyway")
    raise ValueError("this node has no GPU or MIG device")


def classify_client(report: ClientReport, target: str, full_sms: int | None) -> list[CheckResult]:
    """The memory-limit and SM-limit lines for what the client saw under the daemon."""
    if report.error is not None:
        why = f"the CUDA client could not use {target} under the MPS daemon: {report.error}"
        return [fail(CHECK_MEMORY, why), fail(CHECK_SMS, why)]
    if report.device_uuid is None or report.device_uuid != bare_uuid(target):
        why = (f"the CUDA client saw device {report.device_uuid}, not {target}: it did not run under the daemon "
               "(in compute mode DEFAULT a client whose MPS connection fails runs without MPS, outside every limit)")
        return [fail(CHECK_MEMORY, why), fail(CHECK_SMS, why)]
    return [_memory_line(report), _sm_line(report, full_sms)]


def _memory_line(report: ClientReport) -> CheckResult:
    limit = PINNED_LIMIT_MIB * MIB
    got = report.allocated_bytes // MIB
    if report.allocation_error is None or report.allocated_bytes > limit:
        return fail(CHECK_MEMORY, f"the client allocated {got} MiB without an error, more than the {PINNED_LIMIT_MIB} "
                                  "MiB pinned limit: the limit is NOT enforced")
    if report.allocation_error != _OOM:
        return fail(CHECK_MEMORY, f"allocations stopped at {got} MiB with {report.allocation_error}, "
                                  f"not {_OOM}: something other than the pinned limit refused them")
    if report.allocated_bytes == 0:
        return fail(CHECK_MEMORY, f"even the first {ALLOCATION_STEP_MIB} MiB allocation failed ({_OOM}) under a "
                                  f"{PINNED_LIMIT_MIB} MiB limit: is the GPU's memory used up by other processes?")
    return ok(CHECK_MEMORY, f"allocations in {ALLOCATION_STEP_MIB} MiB steps stopped at {got} MiB with {_OOM}: "
                            f"the {PINNED_LIMIT_MIB} MiB pinned limit is enforced")


def _sm_line(report: ClientReport, full_sms: int | None) -> CheckResult:
    full = full_sms if full_sms is not None else report.multiprocessors
    got = report.affinity_sm_count
    if got is None or full is None:
        return fail(CHECK_SMS, "cuCtxGetExecAffinity(CU_EXEC_AFFINITY_TYPE_SM_COUNT) gave no SM count")
    most = math.ceil(full * THREAD_PERCENTAGE / 100) + SM_ROUNDING_SLACK
    if 0 < got <= most and got < full:
        return ok(CHECK_SMS, f"the client's context may use {got} of {full} SMs under {THREAD_PERCENTAGE}% active "
                             "threads: the thread percentage is enforced")
    return fail(CHECK_SMS, f"the client's context may use {got} of {full} SMs, expected at most {most} under "
                           f"{THREAD_PERCENTAGE}% active threads: the thread percentage is NOT enforced")


def _manager(driver_root: Path, base_dir: Path) -> MpsManager:
    return MpsManager(driver_root, base_dir, LocalLauncher(driver_root))


def _read_back(driver_root: Path, record: MpsDaemonRecord) -> str:
    env = driver_env(driver_root)
    env.update(CUDA_MPS_PIPE_DIRECTORY=str(record.pipe_dir), CUDA_MPS_LOG_DIRECTORY=str(record.log_dir))
    binary = str(find_binary(driver_root, CONTROL_BINARY))
    pinned = run_binary([binary], env=env, timeout=5.0, stdin_text="get_default_device_pinned_mem_limit 0\n")
    threads = run_binary([binary], env=env, timeout=5.0, stdin_text="get_default_active_thread_percentage\n")
    return (f"pinned limit {PINNED_LIMIT_MIB}M reads back {pinned or '(nothing)'}, "
            f"active threads {THREAD_PERCENTAGE}% reads back {threads or '(nothing)'}")


def _client(driver_root: Path, libcuda: Path, record: MpsDaemonRecord, target: str,
            full_sms: int | None) -> list[CheckResult]:
    args = ["mps-client", "--libcuda", str(libcuda), "--step-mib", str(ALLOCATION_STEP_MIB),
            "--cap-mib", str(2 * PINNED_LIMIT_MIB)]
    try:
        env = probe_env(driver_root, {"CUDA_MPS_PIPE_DIRECTORY": str(record.pipe_dir)})
        report = ClientReport.model_validate(json.loads(run_probe(args, env, CLIENT_TIMEOUT_S)))
    except (ProbeFailed, ValueError) as exc:
        return [fail(CHECK_MEMORY, str(exc)), fail(CHECK_SMS, str(exc))]
    return classify_client(report, target, full_sms)


def client_skip_reason(driver_root: Path, simulated: bool) -> str | None:
    """Why the CUDA client cannot run here, or None if it can."""
    if simulated:
        return ("SIMULATION: no real GPU and no real libcuda on a simulated node, so no CUDA client can show "
                "whether the daemon's limits are enforced")
    if find_libcuda(driver_root) is None:
        return f"no {LIBCUDA} under driver root {driver_root}, so no CUDA client can run"
    return None


def mps_checks(driver_root: Path, inventory: NodeInventory, compute_modes: dict[str, str],
               requested: str | None, simulated: bool,
               remove_on_exit: Callable[[Path], None] = no_cleanup) -> list[CheckResult]:
    """Start a daemon, run the client (where one can run), stop the daemon: always, even on an exception."""
    try:
        target = choose_target(inventory, compute_modes, requested)
    except ValueError as exc:
        return [skipped(name, str(exc)) for name in (CHECK_DAEMON, CHECK_MEMORY, CHECK_SMS)]
    skip = client_skip_reason(driver_root, simulated)
    # Short and private: sockets inside the pipe dir must fit in 107 bytes.
    scratch = Path(tempfile.mkdtemp(prefix="tessera-check-"))
    # Not removed when an exception (a signal) leaves early: a daemon started without its record yet
    # may still be running from it; the reaper stops it first, then removes the directory.
    remove_on_exit(scratch)
    results = _with_daemon(driver_root, scratch, inventory, target, skip)
    shutil.rmtree(scratch, ignore_errors=True)
    return results


def _with_daemon(driver_root: Path, scratch: Path, inventory: NodeInventory, target: str,
                 skip: str | None) -> list[CheckResult]:
    results: list[CheckResult] = []
    manager = _manager(driver_root, scratch / "mps")
    spec = MpsDaemonSpec(daemon_id=DAEMON_ID, gpu_uuids=[target], active_thread_percentage=THREAD_PERCENTAGE,
                         pinned_memory_limits={target: PINNED_LIMIT_MIB * MIB})
    try:
        record = manager.start(spec)
    except (MpsError, BinaryNotFound, OSError) as exc:
        results.append(fail(CHECK_DAEMON, str(exc)))
        results.extend(skipped(n, "the MPS daemon did not start") for n in (CHECK_MEMORY, CHECK_SMS))
        return results
    try:
        try:
            readback = _read_back(driver_root, record)
        except (BinaryFailed, BinaryNotFound) as exc:
            readback = f"limits set, but reading them back for display failed: {exc}"
        results.append(ok(CHECK_DAEMON, f"started for {target} (pid {record.pid}); {readback}"))
        libcuda = find_libcuda(driver_root)
        if skip is not None or libcuda is None:
            results.extend(skipped(n, skip or f"no {LIBCUDA}") for n in (CHECK_MEMORY, CHECK_SMS))
        else:
            results.extend(_client(driver_root, libcuda, record, target, full_sm_count(inventory, target)))
    finally:
        try:
            manager.stop(record)
            results.append(ok(CHECK_STOP, f"quit, pid {record.pid} gone, its directories removed"))
        except MpsError as exc:
            results.append(fail(CHECK_STOP, str(exc)))
    return results
