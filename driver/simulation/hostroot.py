"""SIMULATION: build the host tree (/dev, /proc, the toolkit's CDI spec, driver binaries) for a simulated node.

The driver reads the host through a configurable host root (``driver.gpu.hostfs``); on the
simulated node that root is a directory built here from the simulated inventory. Device nodes
are regular files standing in for character devices; ``/proc`` files follow the real formats.
A ``SIMULATED`` note at the root says so, and guards against building over a real tree.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from importlib import resources
from importlib.abc import Traversable
from pathlib import Path
from typing import Any

import yaml

from driver.gpu.hostfs import CAPABILITIES_DIR
from driver.gpu.inventory import NodeInventory

MARKER_FILE = "SIMULATED"
SIMULATED_CAPS_MAJOR = 237
SIMULATED_FRONTEND_MAJOR = 195
SIMULATED_UVM_MAJOR = 510
CAPABILITY_FILE_MODE = 292  # 0o444, what the NVIDIA driver reports for MIG access capabilities
DRIVER_LIB_DIR = "/usr/lib/x86_64-linux-gnu"
CTK_HOOK = "/usr/bin/nvidia-cdi-hook"
CTK_MOUNT_OPTIONS = ["ro", "nosuid", "nodev", "rbind", "rprivate"]
CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")

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


def write_mig_capability(root: Path, gpu_minor: int, gi_id: int, ci_id: int) -> None:
    """The /proc access files and /dev/nvidia-caps nodes of one MIG device (GI and CI)."""
    gi_minor, ci_minor = capability_minors(gpu_minor, gi_id, ci_id)
    gi_dir = root / CAPABILITIES_DIR / f"gpu{gpu_minor}" / "mig" / f"gi{gi_id}"
    _write(gi_dir / "access", _access_text(gi_minor))
    _write(gi_dir / f"ci{ci_id}" / "access", _access_text(ci_minor))
    for minor in (gi_minor, ci_minor):
        _write(root / "dev" / "nvidia-caps" / f"nvidia-cap{minor}", "simulated device node\n")


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


def toolkit_spec(inventory: NodeInventory, binaries: Sequence[str] = ("nvidia-smi",)) -> dict[str, Any]:
    """A minimal NVIDIA Container Toolkit CDI spec (kind ``nvidia.com/gpu``) for the simulated node.

    ``binaries`` are the names under ``/usr/bin`` it mounts, as the toolkit mounts those present.
    """
    driver_version = inventory.driver_version or "0.0.0"

    def mount(path: str) -> dict[str, Any]:
        return {"hostPath": path, "containerPath": path, "options": list(CTK_MOUNT_OPTIONS)}

    def hook(*args: str) -> dict[str, Any]:
        return {
            "hookName": "createContainer",
            "path": CTK_HOOK,
            "args": ["nvidia-cdi-hook", *args],
            "env": ["NVIDIA_CTK_DEBUG=false"],
        }

    gpus = sorted(inventory.gpus, key=lambda g: g.index)

    def gpu_node(minor: int) -> dict[str, Any]:
        # A fresh dict each time: shared ones would be written as YAML anchors and aliases.
        return {"path": f"/dev/nvidia{minor}"}

    return {
        # Device names are GPU indexes and start with a digit, which needs 0.5.0; nothing needs more.
        "cdiVersion": "0.5.0",
        "kind": "nvidia.com/gpu",
        "devices": [
            {"name": "all", "containerEdits": {"deviceNodes": [gpu_node(gpu.minor) for gpu in gpus]}},
            *({"name": str(gpu.index), "containerEdits": {"deviceNodes": [gpu_node(gpu.minor)]}} for gpu in gpus),
        ],
        "containerEdits": {
            "env": ["NVIDIA_VISIBLE_DEVICES=void", f"NVIDIA_CTK_LIBCUDA_DIR={DRIVER_LIB_DIR}"],
            "deviceNodes": [{"path": f"/dev/{name}"} for name in CONTROL_DEVICES],
            "mounts": [
                mount(path) for path in [*_driver_files(driver_version), *(f"/usr/bin/{name}" for name in binaries)]
            ],
            "hooks": [
                hook("create-symlinks", "--link", f"libcuda.so.1::{DRIVER_LIB_DIR}/libcuda.so"),
                hook("update-ldcache", "--folder", DRIVER_LIB_DIR),
            ],
        },
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


def build_host_root(root: Path, inventory: NodeInventory) -> None:
    """Create (or rebuild) the simulated host tree at ``root`` for ``inventory``.

    Rebuilding replaces the GPU device files and MIG capabilities, so a tree always matches the
    inventory it was last built from; other content under ``root`` is left alone.
    """
    _guard(root)
    root.mkdir(parents=True, exist_ok=True)
    _write(root / MARKER_FILE, _MARKER_TEXT)

    dev = root / "dev"
    dev.mkdir(exist_ok=True)
    for stale in dev.glob("nvidia[0-9]*"):
        stale.unlink()
    for stale_dir in (dev / "nvidia-caps", root / CAPABILITIES_DIR):
        shutil.rmtree(stale_dir, ignore_errors=True)
    for name in CONTROL_DEVICES:
        _write(dev / name, "simulated device node\n")
    for gpu in inventory.gpus:
        _write(dev / f"nvidia{gpu.minor}", "simulated device node\n")
        for mig in gpu.mig_instances:
            write_mig_capability(root, gpu.minor, mig.gi_id, mig.ci_id)

    # Placeholders for the libraries the toolkit spec mounts, so its host paths exist in the tree.
    for library in _driver_files(inventory.driver_version or "0.0.0"):
        _write(root / library.lstrip("/"), "simulated driver library (not a real shared object)\n")

    _write(root / "proc" / "devices", _proc_devices())

    bin_dir = root / "usr" / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    binaries = _simulation_binaries()
    for binary in binaries:
        target = bin_dir / binary.name
        # The stand-ins run with the driver's own interpreter: '#!/usr/bin/env python3' may find
        # another Python, or a version-manager shim that adds ~100 ms to every simulated call.
        _shebang, _, body = binary.read_text().partition("\n")
        target.write_text(f"#!{sys.executable}\n{body}")
        target.chmod(0o755)

    spec = toolkit_spec(inventory, [b.name for b in binaries])
    header = "# SIMULATED NVIDIA Container Toolkit spec (simulated: true), written by Tessera's simulation\n"
    _write(root / "etc" / "cdi" / "nvidia.yaml", header + yaml.safe_dump(spec, sort_keys=False))
