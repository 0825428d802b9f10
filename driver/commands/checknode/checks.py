"""``python -m driver check-node``: prove, one line per check, that this node can serve GPU claims.

Run it first on a new node, in the plugin pod (``docs/operations.md``, "Checking a new node").
It takes the same settings as ``run`` and checks, in order: NVML and every GPU and MIG device;
the device root and the device nodes; which MIG GPUs dynamic MIG can serve (``driver/commands/checknode/mig.py``); what
the health source cannot read on each GPU (``driver/commands/checknode/health.py``); the
NVIDIA Container Toolkit's CDI spec and ``libcuda`` in it; ``libcuda`` under the driver root;
``nvidia-smi``; each GPU's compute mode (read through NVML, as the driver does; the check changes
nothing on any GPU); and MPS end to end (``driver/commands/checknode/mps.py``). The exit status
is 1 if any check failed. A check that cannot run here is SKIPPED with the reason.

With ``--simulate`` and no host root of its own, it builds a throwaway simulated host tree
(stand-in ``nvidia-smi`` and ``nvidia-cuda-mps-control``, toolkit spec, device files) and runs
every check it can against it; the CUDA client checks need a real GPU and say so.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from driver import nodelayout
from driver.commands.checknode.health import health_watch_checks
from driver.commands.checknode.mig import dynamic_mig_checks
from driver.commands.checknode.mps import mps_checks
from driver.commands.checknode.result import (
    CheckResult,
    NodeReport,
    exit_status,
    fail,
    ok,
    render_json,
    render_table,
    skipped,
)
from driver.config import Settings
from driver.gpu.claimcdi.toolkit import load_toolkit_edits, toolkit_spec_candidates
from driver.gpu.discovery.cudarun import LIBCUDA, find_libcuda
from driver.gpu.discovery.inventory import ComputeMode, NodeInventory
from driver.gpu.host.binaries import (
    BinaryFailed,
    BinaryNotFound,
    driver_env,
    find_binary,
    library_link_dir,
    run_binary,
)
from driver.gpu.host.hostfs import (
    HostFsError,
    driver_root_host_path,
    find_device_root,
    mig_capability_nodes,
    missing_paths,
)
from driver.gpu.published.dynamicmigplan import pending_mig_mode
from driver.gpu.published.ownership import GpuOwnership, find_other_allocators, parse_owned_gpus
from driver.gpu.published.sharingplan import PlanError, load_plans, resolve_layout
from driver.gpu.runtime.computemode import ComputeModeError
from driver.reaper import no_cleanup
from driver.units import GIB

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class NodeRoots:
    """Where this run reads the node: the configured roots, or a simulated tree built for it."""

    host_root: Path
    driver_root: Path
    cdi_root: Path  # where the toolkit spec is looked for first
    toolkit_spec: Path | None  # explicit spec path, None = search the usual places
    simulated: bool
    notes: tuple[str, ...] = ()


@contextlib.contextmanager
def node_roots(settings: Settings, inventory: NodeInventory | None,
               remove_on_exit: Callable[[Path], None] = no_cleanup) -> Iterator[NodeRoots]:
    """The configured roots; with ``--simulate`` and no host root given, a simulated tree removed afterwards."""
    simulated = settings.simulate is not None
    if settings.simulate is None or settings.host_root != Path("/") or inventory is None:
        yield NodeRoots(settings.host_root, settings.driver_root, settings.cdi_root, settings.nvidia_cdi_spec,
                        simulated)
        return
    from driver.simulation.discovery import load_layout
    from driver.simulation.hostroot import build_host_root

    layout = load_layout(settings.simulate)[1].driver_layout
    tree = Path(tempfile.mkdtemp(prefix="tessera-check-host-"))
    # Removed below on the way out; if a signal or kill -9 ends the command first, by the reaper once the
    # stand-ins running from the tree are stopped.
    remove_on_exit(tree)
    host = build_host_root(tree, inventory, layout)
    links = library_link_dir(host.driver_root)  # made by the checks that run the stand-ins; goes with the tree
    remove_on_exit(links)
    # The operator's spec is found in the CDI root, as the driver finds it; the host layout's is named.
    explicit = settings.nvidia_cdi_spec or (None if layout == "gpu-operator" else host.toolkit_spec)
    yield NodeRoots(host.root, host.driver_root, host.toolkit_spec.parent, explicit, True,
                    (f"SIMULATION: layout {settings.simulate!r} ({layout} driver), simulated GPUs and a simulated "
                     f"host tree at {host.root} (stand-in nvidia-smi and nvidia-cuda-mps-control; removed when "
                     "the check ends)",))
    shutil.rmtree(tree, ignore_errors=True)
    shutil.rmtree(links, ignore_errors=True)


def _guarded(check: str, run: Callable[[], list[CheckResult]]) -> list[CheckResult]:
    """A check that raises is a FAIL line with the error, never a traceback instead of the table."""
    try:
        return run()
    except Exception as exc:  # the table must still come out; the error is its detail
        log.debug("check raised", exc_info=True)
        return [fail(check, f"unexpected error: {type(exc).__name__}: {exc}")]


def discover(settings: Settings) -> tuple[NodeInventory | None, list[CheckResult]]:
    """NVML (or the simulated node) and one line per GPU and MIG device."""
    name = "NVML" if settings.simulate is None else "NVML (SIMULATED)"
    try:
        inventory = nodelayout.discover_once(settings)
    except (RuntimeError, ValueError, ImportError, OSError) as exc:
        return None, [fail(name, str(exc))]
    where = f"simulated layout {settings.simulate!r}" if settings.simulate else "NVML"
    versions = f"driver {inventory.driver_version}, CUDA {inventory.cuda_driver_version}"
    lines = [ok(name, f"{where}: {versions}, {len(inventory.gpus)} GPU(s)") if inventory.gpus
             else fail(name, f"{where}: no GPUs (is the driver loaded, are the GPUs bound to it?)")]
    for gpu in inventory.gpus:
        memory = f"{gpu.memory_bytes / GIB:.0f} GiB" if gpu.memory_bytes else "memory unknown"
        if gpu.mig_enabled:
            sms = f"MIG enabled, {len(gpu.mig_instances)} MIG device(s)"
        elif gpu.multiprocessors is not None:
            sms = f"{gpu.multiprocessors} SMs"
        else:
            sms = f"SM count not published: {gpu.multiprocessors_missing or 'unknown'}"
        pending = pending_mig_mode(gpu)
        lines.append(ok(f"GPU {gpu.minor}", f"{gpu.uuid} {gpu.product_name}, {memory}, {sms}"
                        + (f"; {pending}" if pending else "")))
        for mig in gpu.mig_instances:
            lines.append(ok(f"MIG {gpu.minor}/gi{mig.gi_id}",
                            f"{mig.uuid} {mig.profile}, {mig.multiprocessors or '?'} SMs"))
    return inventory, lines


def device_checks(settings: Settings, roots: NodeRoots, inventory: NodeInventory | None) -> list[CheckResult]:
    explicit = PurePosixPath(settings.driver_root_on_host) if settings.driver_root_on_host else None
    on_host = driver_root_host_path(roots.host_root, roots.driver_root, explicit)
    device_root = find_device_root(roots.host_root, roots.driver_root, on_host)
    lines = [ok("device root", f"{device_root.describe()}, read here at {device_root.seen_at / 'dev'}")]
    control = ["/dev/nvidiactl", "/dev/nvidia-uvm"]
    gpus = inventory.gpus if inventory else ()
    gpu_nodes = [f"/dev/nvidia{gpu.minor}" for gpu in gpus]
    caps: list[str] = []
    problems: list[str] = []
    for gpu in gpus:
        for mig in gpu.mig_instances:
            try:
                caps += [n.path for n in mig_capability_nodes(roots.host_root, gpu.minor, mig.gi_id, mig.ci_id)]
            except HostFsError as exc:
                problems.append(f"MIG {mig.uuid}: {exc}")
    # MIG capability nodes are judged as the CDI path uses them: read from /proc and written into the spec with
    # type, major and minor, so the runtime makes them in the container. The kernel module does not create them
    # on the host (nvidia-modprobe does, on demand), so their absence there is no failure.
    missing = missing_paths(device_root.seen_at, [*control, *gpu_nodes])
    if missing:
        problems.append(f"missing under {device_root.seen_at}: {', '.join(missing)}")
    if problems:
        lines.append(fail("device nodes", "; ".join(problems)))
    else:
        caps_on_host = len(caps) - len(missing_paths(device_root.seen_at, caps))
        lines.append(ok("device nodes", f"all present: {', '.join(control)}, {len(gpu_nodes)} GPU node(s) "
                                        f"({', '.join(gpu_nodes) or 'none'}), {len(caps)} MIG capability node(s) "
                                        f"read from /proc ({caps_on_host} of them also on the host; the CDI spec gives "
                                        "type, major and minor, so none need be)"))
    return lines


def toolkit_checks(settings: Settings, roots: NodeRoots) -> list[CheckResult]:
    edits = load_toolkit_edits(roots.toolkit_spec, toolkit_spec_candidates(roots.cdi_root),
                               settings.driver_libraries_required)
    also = f" (also found, not used: {', '.join(map(str, edits.also_found))})" if edits.also_found else ""
    if edits.source is None or edits.edits is None:
        return [fail("toolkit CDI spec", edits.problem or "not found"),
                skipped("libcuda in toolkit spec", "no toolkit CDI spec to look in")]
    spec = ok("toolkit CDI spec", f"{edits.source}{also}")
    if edits.problem is not None and not edits.required:
        return [spec, ok("libcuda in toolkit spec", f"{edits.problem}; accepted: driver libraries are not required "
                                                    "on this node (driverLibraries.required=false)")]
    if edits.problem is not None:
        return [spec, fail("libcuda in toolkit spec", edits.problem)]
    return [spec, ok("libcuda in toolkit spec", f"{edits.source} mounts libcuda.so*: containers get the driver")]


def libcuda_check(roots: NodeRoots) -> list[CheckResult]:
    found = find_libcuda(roots.driver_root)
    if found is not None:
        return [ok("libcuda", f"{found} (driver root {roots.driver_root})")]
    if roots.simulated:
        return [skipped("libcuda", "SIMULATION: the simulated driver root has no real libcuda")]
    return [fail("libcuda", f"no {LIBCUDA} under driver root {roots.driver_root}; is --driver-root "
                            "(nvidiaDriverRoot) where the NVIDIA driver is installed?")]


def nvidia_smi_check(roots: NodeRoots) -> list[CheckResult]:
    try:
        binary = find_binary(roots.driver_root, "nvidia-smi")
        listed = run_binary([str(binary), "-L"], env=driver_env(roots.driver_root), timeout=15.0)
    except (BinaryNotFound, BinaryFailed) as exc:
        return [fail("nvidia-smi", str(exc))]
    count = sum(1 for line in listed.splitlines() if line.strip())
    return [ok("nvidia-smi", f"{binary}: `nvidia-smi -L` ran and listed {count} line(s)")]


def plans_check(path: Path | None, inventory: NodeInventory | None) -> list[CheckResult]:
    """The plans file loads, and every plan in it resolves on this node's GPUs (any plan may be labelled here)."""
    if path is None:
        return []
    try:
        plans = load_plans(path)
    except PlanError as exc:
        return [fail("sharing plans", "; ".join(str(exc).splitlines()))]
    problems = []
    for name, plan in sorted(plans.plans.items()):
        try:
            if inventory is not None:  # without one, the NVML line already failed
                resolve_layout(plan, inventory, name)
        except PlanError as exc:
            problems.extend(str(exc).splitlines())
    if problems:
        return [fail("sharing plans", f"{path}: {'; '.join(problems)}")]
    return [ok("sharing plans", f"{path}: valid, {len(plans.plans)} plan(s), each resolves on this node's GPUs "
                                "(`python -m driver check-plan` shows what each GPU publishes)")]


def classify_compute_mode(uuid: str, mode: ComputeMode) -> tuple[bool, str]:
    """(acceptable, what it means) for a whole GPU's compute mode."""
    if mode is ComputeMode.DEFAULT:
        return True, "DEFAULT (the driver sets EXCLUSIVE_PROCESS while one of its MPS daemons serves the GPU)"
    if mode is ComputeMode.EXCLUSIVE_PROCESS:
        return True, ("EXCLUSIVE_PROCESS: one process (or one MPS server) at a time; set while an MPS daemon "
                      "serves the GPU, or left over from one")
    return False, (f"PROHIBITED: no CUDA context can be created, so no claim on this GPU can run; "
                   f"undo with `nvidia-smi -i {uuid} -c DEFAULT` (as root) if nothing on the node set it on purpose")


def compute_mode_checks(settings: Settings, roots: NodeRoots,
                        inventory: NodeInventory | None) -> tuple[dict[str, str], list[CheckResult]]:
    """Read only, through NVML as the driver reads them. MIG-enabled GPUs are skipped: MIG allows only DEFAULT."""
    modes: dict[str, str] = {}
    lines: list[CheckResult] = []
    reader = nodelayout.open_compute_modes(settings, roots.driver_root)
    try:
        for gpu in inventory.gpus if inventory else ():
            check = f"compute mode GPU {gpu.minor}"
            if gpu.mig_enabled:
                lines.append(ok(check, "MIG enabled: compute mode is DEFAULT and cannot be changed"))
                continue
            try:
                mode = reader.get(gpu.uuid)
            except ComputeModeError as exc:
                lines.append(fail(check, str(exc)))
                continue
            modes[gpu.uuid] = mode.value
            good, meaning = classify_compute_mode(gpu.uuid, mode)
            lines.append(ok(check, meaning) if good else fail(check, meaning))
    finally:
        reader.close()
    return modes, lines


def allocators_check(settings: Settings, inventory: NodeInventory | None) -> list[CheckResult]:
    """Another GPU allocator on the node (driver/gpu/published/ownership.py): a failure while it keeps every GPU
    back."""
    ownership = GpuOwnership(parse_owned_gpus(settings.owned_gpus), find_other_allocators(
        settings.device_plugins_dir, settings.registrar_dir, settings.driver_name))
    line = ownership.summary(inventory or NodeInventory())
    return [fail("other GPU allocators", line) if ownership.refusal() else ok("other GPU allocators", line)]


class UnknownMpsDevice(ValueError):
    """``--mps-device`` names no GPU or MIG device of this node: a usage error, not a failed check."""


def check_node(settings: Settings, mps_device: str | None = None,
               remove_on_exit: Callable[[Path], None] = no_cleanup) -> NodeReport:
    """``remove_on_exit``: the command's :meth:`Reaper.remove_on_exit`, for the scratch directories."""
    inventory, results = discover(settings)
    if mps_device is not None and inventory is not None:
        known = [g.uuid for g in inventory.gpus] + [m.uuid for g in inventory.gpus for m in g.mig_instances]
        if mps_device not in known:
            raise UnknownMpsDevice(f"--mps-device {mps_device!r}: not a GPU or MIG device of this node "
                                   f"(known: {', '.join(known) or 'none'})")
    with node_roots(settings, inventory, remove_on_exit) as roots:
        results += _guarded("device nodes", lambda: device_checks(settings, roots, inventory))
        results += _guarded("dynamic MIG", lambda: dynamic_mig_checks(settings, inventory))
        results += _guarded("health watch", lambda: health_watch_checks(settings, inventory))
        results += _guarded("toolkit CDI spec", lambda: toolkit_checks(settings, roots))
        results += _guarded("libcuda", lambda: libcuda_check(roots))
        results += _guarded("nvidia-smi", lambda: nvidia_smi_check(roots))
        modes, lines = compute_mode_checks(settings, roots, inventory)
        results += lines
        if settings.sharing_plans is not None:
            results += _guarded("sharing plans", lambda: plans_check(settings.sharing_plans, inventory))
        results += _guarded("other GPU allocators", lambda: allocators_check(settings, inventory))
        if inventory is None:
            results.append(skipped("MPS", "no GPU inventory (see the NVML line)"))
        else:
            results += _guarded("MPS", lambda: mps_checks(roots.driver_root, inventory, modes, mps_device,
                                                          roots.simulated, remove_on_exit))
    return NodeReport(simulated=roots.simulated, notes=list(roots.notes), checks=results)


def run_check_node(settings: Settings, as_json: bool, mps_device: str | None,
                   remove_on_exit: Callable[[Path], None] = no_cleanup) -> tuple[int, str]:
    """(exit status, output) for the CLI, which runs it under a :class:`~driver.reaper.Reaper`."""
    report = check_node(settings, mps_device, remove_on_exit)
    return exit_status(report), render_json(report) if as_json else render_table(report)
