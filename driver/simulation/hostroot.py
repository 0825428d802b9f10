"""SIMULATION: build the host tree (/dev, /proc, the toolkit's CDI spec, driver binaries) for a simulated node.

The driver reads the host through a configurable host root (``driver.gpu.host.hostfs``); on the
simulated node that root is a directory built here from the simulated inventory. Device nodes
are regular files standing in for character devices; ``/proc`` files follow the real formats.
A ``SIMULATED`` note at the root says so, and guards against building over a real tree.

Two driver layouts (``driverLayout`` of a simulated node, ``driver.simulation.layouts.yaml``):
``host``, a driver installed from the distribution's packages, with everything at the usual
places under ``/`` and the toolkit's ``/etc/cdi/nvidia.yaml``; and ``gpu-operator``, NVIDIA's
GPU Operator, whose driver container's root is ``/run/nvidia/driver`` with the device nodes
in its own ``dev/`` and whose toolkit writes ``/var/run/cdi/management.nvidia.com-gpu.yaml``.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import yaml

from driver.gpu.discovery.inventory import NodeInventory
from driver.gpu.host.hostfs import CAPABILITIES_DIR

MARKER_FILE = "SIMULATED"
SIM_GPUS_FILE = "var/lib/tessera-sim-gpus.json"  # under the driver root; read by driver/simulation/bin/nvidia-smi
SIMULATED_CAPS_MAJOR = 237
SIMULATED_FRONTEND_MAJOR = 195
SIMULATED_UVM_MAJOR = 510
CAPABILITY_FILE_MODE = 292  # 0o444, what the NVIDIA driver reports for MIG access capabilities
DRIVER_LIB_DIR = "/usr/lib/x86_64-linux-gnu"
CTK_HOOK = "/usr/bin/nvidia-cdi-hook"
CTK_MOUNT_OPTIONS = ["ro", "nosuid", "nodev", "rbind", "rprivate"]
CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")

DriverLayout = Literal["host", "gpu-operator"]
# The GPU Operator's driver container root, shared with the host; the container creates the device
# nodes in its own dev/ there, and the host's /dev never gets them (the operator's validator,
# gpu-operator cmd/nvidia-validator/driver.go, only adds /dev/char links; dra-driver-nvidia-gpu
# cmd/gpu-kubelet-plugin/root.go, getDevRoot, uses <driver root>/dev then).
OPERATOR_DRIVER_ROOT = PurePosixPath("/run/nvidia/driver")
# The operator's toolkit writes its spec here under this name, kind management.nvidia.com/gpu:
# nvidia-container-toolkit cmd/nvidia-ctk-installer/toolkit/toolkit.go (generateCDISpec).
OPERATOR_CDI_DIR = PurePosixPath("/var/run/cdi")
OPERATOR_SPEC_NAME = "management.nvidia.com-gpu.yaml"
# The operator installs the toolkit on the host under /usr/local/nvidia/toolkit, so its spec's hooks
# name this binary (the operator's MIG manager defaults to the same path: NVIDIA mig-parted,
# cmd/nvidia-mig-manager, DefaultNvidiaCDIHookPath).
OPERATOR_CTK_HOOK = "/usr/local/nvidia/toolkit/nvidia-cdi-hook"
# The host's root cgroup on a cgroup v2 node lists its controllers here; the kernel's dmem controller
# (Linux 6.14+) is what MPS v3 memory partitioning needs (nvidia-gpu reference 6.3).
CGROUP_CONTROLLERS = "sys/fs/cgroup/cgroup.controllers"
CGROUP_V2_CONTROLLERS = ("cpuset", "cpu", "io", "memory", "hugetlb", "pids", "rdma", "misc")
KERNEL_MEMORY_DRIVER_MAJOR = 615


@dataclass(frozen=True)
class SimulatedHost:
    """Where a built tree keeps what the driver is pointed at (all paths inside the tree)."""

    root: Path  # --host-root
    driver_root: Path  # --driver-root
    toolkit_spec: Path
    layout: DriverLayout

    def driver_args(self) -> list[str]:
        """``python -m driver run`` flags for this tree, except ``--cdi-root``.

        On the ``gpu-operator`` layout the toolkit spec is not named: the driver must find it in its
        CDI root, so run it with ``--cdi-root`` set to ``toolkit_spec.parent``.
        """
        args = ["--host-root", str(self.root), "--driver-root", str(self.driver_root)]
        return args if self.layout == "gpu-operator" else [*args, "--nvidia-cdi-spec", str(self.toolkit_spec)]

_MARKER_TEXT = """\
SIMULATED HOST ROOT (simulated: true)

This directory is not a real host. Tessera's simulation built it to stand in for a node's
/dev, /proc, NVIDIA Container Toolkit CDI spec and driver binaries. The files under dev/ are
regular files, not device nodes; nothing here touches a GPU.
"""


def capability_minors(gpu_minor: int, gi_id: int, ci_id: int) -> tuple[int, int]:
    """(GI access minor, CI access minor) by the pattern observed on real drivers.

    Only the simulation computes these; the driver always reads them from /proc.
    """
    gi_access = 3 + 135 * gpu_minor + 9 * gi_id
    return gi_access, gi_access + 1 + ci_id


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _access_text(minor: int) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {CAPABILITY_FILE_MODE}\nDeviceFileModify: 1\n"


def write_mig_capability_proc(root: Path, gpu_minor: int, gi_id: int, ci_id: int) -> None:
    """The /proc access files of one MIG device (GI and CI)."""
    gi_minor, ci_minor = capability_minors(gpu_minor, gi_id, ci_id)
    gi_dir = root / CAPABILITIES_DIR / f"gpu{gpu_minor}" / "mig" / f"gi{gi_id}"
    _write(gi_dir / "access", _access_text(gi_minor))
    _write(gi_dir / f"ci{ci_id}" / "access", _access_text(ci_minor))


def _mig_dir(root: Path, gpu_minor: int) -> Path:
    return root / CAPABILITIES_DIR / f"gpu{gpu_minor}" / "mig"


def listed_mig_devices(root: Path, gpu_minor: int) -> set[tuple[int, int | None]]:
    """What the /proc tree shows of one GPU's instances: (GI id, CI id) per compute instance, (GI id, None) for
    a GPU instance without one."""
    found: set[tuple[int, int | None]] = set()
    for gi_dir in _mig_dir(root, gpu_minor).glob("gi*"):
        if not gi_dir.name[2:].isdigit():
            continue
        cis = [int(ci.name[2:]) for ci in gi_dir.glob("ci*") if ci.name[2:].isdigit()]
        found.update((int(gi_dir.name[2:]), ci) for ci in cis)
        if not cis:
            found.add((int(gi_dir.name[2:]), None))
    return found


def sync_mig_devices(root: Path, gpus: Mapping[int, Sequence[tuple[int, int | None]]]) -> None:
    """Make the /proc access files of the GPUs in ``gpus`` (minor -> each GPU instance as (GI id, CI id, None
    for a GI without one)) match them, as the NVIDIA driver does: the files of an instance appear when it is
    created and go when it is destroyed; no other instance's file is touched, so a process reading another
    instance's files (a prepare on another GPU) never finds them missing. Nothing is made under /dev: the
    kernel module creates no capability node (nvidia-modprobe does, on demand; reference/nvidia-gpu.md)."""
    for minor, instances in gpus.items():
        wanted = set(instances)
        have = listed_mig_devices(root, minor)
        for gi_id, ci_id in sorted(have - wanted, key=str):
            gi_dir = _mig_dir(root, minor) / f"gi{gi_id}"
            if ci_id is not None:
                shutil.rmtree(gi_dir / f"ci{ci_id}", ignore_errors=True)
            if not any(g == gi_id for g, _ in wanted):
                shutil.rmtree(gi_dir, ignore_errors=True)
        for gi_id, ci_id in sorted(wanted - have, key=str):
            gi_minor, ci_minor = capability_minors(minor, gi_id, ci_id or 0)
            gi_dir = _mig_dir(root, minor) / f"gi{gi_id}"
            if not (gi_dir / "access").exists():
                _write_new(gi_dir / "access", _access_text(gi_minor))
            if ci_id is not None:
                _write_new(gi_dir / f"ci{ci_id}" / "access", _access_text(ci_minor))


def _write_new(path: Path, text: str) -> None:
    """A file that appears whole (renamed into place), as the kernel's proc entries do."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _proc_devices() -> str:
    return (
        "Character devices:\n"
        "  1 mem\n"
        "  5 /dev/tty\n"
        f"{SIMULATED_FRONTEND_MAJOR} nvidia-frontend\n"
        f"{SIMULATED_CAPS_MAJOR} nvidia-caps\n"
        f"{SIMULATED_UVM_MAJOR} nvidia-uvm\n"
        "\n"
        "Block devices:\n"
        "  7 loop\n"
        "259 blkext\n"
    )


def _driver_files(driver_version: str) -> list[str]:
    return [f"{DRIVER_LIB_DIR}/libcuda.so.{driver_version}", f"{DRIVER_LIB_DIR}/libnvidia-ml.so.{driver_version}"]


def _ctk_mount(path: str, driver_root_on_host: PurePosixPath) -> dict[str, Any]:
    # The toolkit rewrites host paths to the driver root's real place on the host (nvidia-container-toolkit
    # "transformroot").
    return {"hostPath": str(driver_root_on_host / path.lstrip("/")), "containerPath": path,
            "options": list(CTK_MOUNT_OPTIONS)}


def _ctk_hook(hook_path: str, *args: str) -> dict[str, Any]:
    return {"hookName": "createContainer", "path": hook_path, "args": ["nvidia-cdi-hook", *args],
            "env": ["NVIDIA_CTK_DEBUG=false"]}


def _common_edits(inventory: NodeInventory, binaries: Sequence[str], driver_root_on_host: PurePosixPath,
                  hook_path: str) -> dict[str, Any]:
    driver_version = inventory.driver_version or "0.0.0"
    files = [*_driver_files(driver_version), *(f"/usr/bin/{name}" for name in binaries)]
    return {
        "env": ["NVIDIA_VISIBLE_DEVICES=void", f"NVIDIA_CTK_LIBCUDA_DIR={DRIVER_LIB_DIR}"],
        "mounts": [_ctk_mount(path, driver_root_on_host) for path in files],
        "hooks": [
            _ctk_hook(hook_path, "create-symlinks", "--link", f"libcuda.so.1::{DRIVER_LIB_DIR}/libcuda.so"),
            _ctk_hook(hook_path, "update-ldcache", "--folder", DRIVER_LIB_DIR),
        ],
    }


def kernel_memory_node(inventory: NodeInventory) -> bool:
    """Whether the simulated host has what MPS v3 memory partitioning needs: modelled as every R615+
    node (the simulated layout's ``kernelMemoryLimits`` picks that driver), so one option sets all."""
    head = (inventory.driver_version or "0").split(".", 1)[0]
    return head.isdigit() and int(head) >= KERNEL_MEMORY_DRIVER_MAJOR


def _memory_limits_hook(gpu_uuid: str) -> dict[str, Any]:
    # A toolkit with PR #2075 adds this hook per GPU (pkg/nvcdi, the cudaMemoryLimits
    # discoverer: hookCreator.Create("apply-cuda-memory-limits", driver root, uuid)); runtimes run it at
    # createRuntime, as the toolkit's own tests show it in a container's config.json.
    return {"hookName": "createRuntime", "path": CTK_HOOK,
            "args": ["nvidia-cdi-hook", "apply-cuda-memory-limits", "--driver-root", "/", "--gpu-id", gpu_uuid],
            "env": ["NVIDIA_CTK_DEBUG=false"]}


def toolkit_spec(inventory: NodeInventory, binaries: Sequence[str] = ("nvidia-smi",)) -> dict[str, Any]:
    """A minimal NVIDIA Container Toolkit CDI spec (kind ``nvidia.com/gpu``) for the simulated node.

    ``binaries`` are the names under ``/usr/bin`` it mounts, as the toolkit mounts those present.
    On a kernel-memory node (:func:`kernel_memory_node`) each GPU's device carries the toolkit's
    ``apply-cuda-memory-limits`` hook.
    """
    gpus = sorted(inventory.gpus, key=lambda g: g.index)
    kernel = kernel_memory_node(inventory)

    def gpu_edits(gpu_minor: int, gpu_uuid: str) -> dict[str, Any]:
        edits: dict[str, Any] = {"deviceNodes": [gpu_node(gpu_minor)]}
        if kernel:
            edits["hooks"] = [_memory_limits_hook(gpu_uuid)]
        return edits

    def gpu_node(minor: int) -> dict[str, Any]:
        # A fresh dict each time: shared ones would be written as YAML anchors and aliases.
        return {"path": f"/dev/nvidia{minor}"}

    common = _common_edits(inventory, binaries, PurePosixPath("/"), CTK_HOOK)
    return {
        # Device names are GPU indexes and start with a digit, which needs 0.5.0; nothing needs more.
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "devices": [
            {"name": "all", "containerEdits": {"deviceNodes": [gpu_node(gpu.minor) for gpu in gpus]}},
            *({"name": str(gpu.index), "containerEdits": gpu_edits(gpu.minor, gpu.uuid)} for gpu in gpus),
        ],
        "containerEdits": {
            "env": common["env"],
            "deviceNodes": [{"path": f"/dev/{name}"} for name in CONTROL_DEVICES],
            "mounts": common["mounts"],
            "hooks": common["hooks"],
        },
    }


def operator_toolkit_spec(inventory: NodeInventory, binaries: Sequence[str] = ("nvidia-smi",),
                          driver_root_on_host: PurePosixPath = OPERATOR_DRIVER_ROOT) -> dict[str, Any]:
    """The GPU Operator toolkit's management spec (kind ``management.nvidia.com/gpu``) for the simulated node.

    As nvidia-container-toolkit ``pkg/nvcdi/management.go`` builds it: one device, ``all``, holding
    every NVIDIA device node found under the device root (``GetAllDeviceSpecs``), and spec-level
    edits holding the driver's libraries, binaries and hooks (``GetCommonEdits``). Every host path
    lies under the driver root; device nodes carry ``hostPath`` because it differs from ``path``
    (nvcdi writes it only then).
    """
    gpus = sorted(inventory.gpus, key=lambda g: g.minor)
    caps = sorted({minor for gpu in gpus for mig in gpu.mig_instances
                   for minor in capability_minors(gpu.minor, mig.gi_id, mig.ci_id)})
    names = [*(f"nvidia{gpu.minor}" for gpu in gpus), *(f"nvidia-caps/nvidia-cap{m}" for m in caps),
             *CONTROL_DEVICES]
    nodes = [{"path": f"/dev/{name}", "hostPath": str(driver_root_on_host / "dev" / name)} for name in names]
    return {
        "cdiVersion": "0.5.0",  # hostPath on device nodes needs 0.5.0 (cdi/version.py)
        "kind": "management.nvidia.com/gpu",
        "devices": [{"name": "all", "containerEdits": {"deviceNodes": nodes}}],
        "containerEdits": _common_edits(inventory, binaries, driver_root_on_host, OPERATOR_CTK_HOOK),
    }


def _simulation_binaries() -> list[Traversable]:
    directory = resources.files("driver.simulation").joinpath("bin")
    if not directory.is_dir():
        return []
    # Dotfiles (e.g. a .gitkeep) are repository furniture, not binaries.
    return sorted((f for f in directory.iterdir() if f.is_file() and not f.name.startswith(".")), key=lambda f: f.name)


def _guard(root: Path) -> None:
    if root.exists() and any(root.iterdir()) and not (root / MARKER_FILE).is_file():
        raise ValueError(
            f"{root} is not empty and has no {MARKER_FILE} note: refusing to build a simulated host "
            "tree over what may be a real one; pass an empty or previously simulated directory"
        )


def _write_device_nodes(dev_root: Path, inventory: NodeInventory) -> None:
    """Stand-ins for the driver's device nodes under ``dev_root`` (a root whose dev/ holds them)."""
    dev = dev_root / "dev"
    dev.mkdir(parents=True, exist_ok=True)
    for name in CONTROL_DEVICES:
        _write(dev / name, "simulated device node\n")
    for gpu in inventory.gpus:
        _write(dev / f"nvidia{gpu.minor}", "simulated device node\n")
        for mig in gpu.mig_instances:
            for minor in capability_minors(gpu.minor, mig.gi_id, mig.ci_id):
                _write(dev / "nvidia-caps" / f"nvidia-cap{minor}", "simulated device node\n")


def _remove_device_nodes(dev_root: Path) -> None:
    dev = dev_root / "dev"
    for pattern in ("nvidia[0-9]*", *CONTROL_DEVICES):
        for stale in dev.glob(pattern):
            stale.unlink()
    shutil.rmtree(dev / "nvidia-caps", ignore_errors=True)


def _install_binaries(driver_root: Path) -> list[str]:
    bin_dir = driver_root / "usr" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    binaries = _simulation_binaries()
    for binary in binaries:
        target = bin_dir / binary.name
        # The stand-ins run with the driver's own interpreter: '#!/usr/bin/env python3' may find
        # another Python, or a version-manager shim that adds ~100 ms to every simulated call.
        _shebang, _, body = binary.read_text().partition("\n")
        target.write_text(f"#!{sys.executable}\n{body}")
        target.chmod(0o755)
    return [b.name for b in binaries]


def build_host_root(root: Path, inventory: NodeInventory, layout: DriverLayout = "host") -> SimulatedHost:
    """Create (or rebuild) the simulated host tree at ``root`` for ``inventory``, the driver laid out as ``layout``.

    Rebuilding replaces the GPU device files and MIG capabilities, so a tree always matches the
    inventory it was last built from; other content under ``root`` is left alone.
    """
    _guard(root)
    root.mkdir(parents=True, exist_ok=True)
    _write(root / MARKER_FILE, _MARKER_TEXT)
    operator = layout == "gpu-operator"
    driver_root = root / OPERATOR_DRIVER_ROOT.relative_to("/") if operator else root

    for dev_root in {root, driver_root}:
        _remove_device_nodes(dev_root)
    shutil.rmtree(root / CAPABILITIES_DIR, ignore_errors=True)
    (root / "dev").mkdir(exist_ok=True)  # the host's /dev, without NVIDIA nodes on a GPU Operator node
    _write_device_nodes(driver_root, inventory)
    # /proc is the kernel's: the same for a containerised driver.
    for gpu in inventory.gpus:
        for mig in gpu.mig_instances:
            write_mig_capability_proc(root, gpu.minor, mig.gi_id, mig.ci_id)
    if any(gpu.mig_capable for gpu in inventory.gpus):
        # The driver's own MIG capabilities (NVIDIA's MIG user guide: nvidia-cap1 cr--------, nvidia-cap2 cr--r--r--).
        _write(root / CAPABILITIES_DIR / "mig" / "config",
               "DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 1\n")
        _write(root / CAPABILITIES_DIR / "mig" / "monitor", _access_text(2))
    _write(root / "proc" / "devices", _proc_devices())
    # A cgroup v2 host; the dmem controller only where the node models kernel memory limits.
    dmem = ("dmem",) if kernel_memory_node(inventory) else ()
    _write(root / CGROUP_CONTROLLERS, " ".join((*CGROUP_V2_CONTROLLERS, *dmem)) + "\n")

    # Placeholders for the libraries the toolkit spec mounts, so its host paths exist in the tree.
    for library in _driver_files(inventory.driver_version or "0.0.0"):
        _write(driver_root / library.lstrip("/"), "simulated driver library (not a real shared object)\n")
    binaries = _install_binaries(driver_root)
    # What the stand-ins cannot ask a GPU: which simulated GPUs have MIG enabled (nvidia-smi refuses
    # a compute mode there) and which compute modes apply to an MPS client's GPU.
    _write(driver_root / SIM_GPUS_FILE, json.dumps({"gpus": [
        {"uuid": g.uuid, "minor": g.minor, "pci_bus_id": g.pci_bus_id, "mig_enabled": g.mig_enabled}
        for g in inventory.gpus]}, indent=1) + "\n")

    if operator:
        spec = operator_toolkit_spec(inventory, binaries)
        spec_path = root / OPERATOR_CDI_DIR.relative_to("/") / OPERATOR_SPEC_NAME
        header = "# SIMULATED GPU Operator toolkit spec (simulated: true), written by Tessera's simulation\n"
    else:
        spec = toolkit_spec(inventory, binaries)
        spec_path = root / "etc" / "cdi" / "nvidia.yaml"
        header = "# SIMULATED NVIDIA Container Toolkit spec (simulated: true), written by Tessera's simulation\n"
    _write(spec_path, header + yaml.safe_dump(spec, sort_keys=False))
    return SimulatedHost(root, driver_root, spec_path, layout)
