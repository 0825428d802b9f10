"""Reading the host's NVIDIA device nodes and /proc entries, under a configurable host root.

``/proc`` is always read under ``host_root`` (``/`` on a real node, the host mounted elsewhere in
a container, or a tree built by ``driver.simulation.hostroot`` for the simulated node). Device
nodes are read under a *device root* (:func:`find_device_root`): the host's ``/dev`` for a driver
installed on the host, ``<driver root>/dev`` for the GPU Operator's containerised driver. Paths
returned are the paths as the workload container sees them (``/dev/nvidiactl``); a
:class:`DeviceRoot` also knows where the same node is on the host, which CDI needs as ``hostPath``.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import BaseModel, ConfigDict

from driver.gpu.errors import DriverError

CONTROL_DEVICE_PATHS = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
NVIDIA_CAPS_DEVICE_NAME = "nvidia-caps"
CAPABILITIES_DIR = "proc/driver/nvidia/capabilities"
NODE_ROOT = PurePosixPath("/")  # the node's own root, as a host path


class HostFsError(DriverError):
    """A host file the driver needs is missing or not in the expected format."""


class CapabilityNode(BaseModel):
    """A MIG capability device node as it must appear in the container (for a CDI ``deviceNodes`` entry)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str  # "/dev/nvidia-caps/nvidia-cap30"
    major: int
    minor: int
    file_mode: int  # permission bits, e.g. 292 (0o444)


def host_path(host_root: Path, container_path: str) -> Path:
    """Where ``container_path`` (absolute, e.g. ``/dev/nvidia0``) lives under ``host_root``."""
    return host_root / container_path.lstrip("/")


@dataclass(frozen=True)
class DeviceRoot:
    """A root whose ``dev/`` holds the NVIDIA device nodes, seen from two places.

    ``seen_at`` is where this process reads it (``/host`` or ``/driver-root`` in the plugin pod);
    ``on_host`` is the same root's path on the node (``/`` or ``/run/nvidia/driver``), which is
    what the container runtime resolves a CDI ``hostPath`` against.
    """

    seen_at: Path
    on_host: PurePosixPath
    origin: str  # "host" or "driver root": for messages

    def local(self, container_path: str) -> Path:
        """Where this process finds the node that containers see at ``container_path``."""
        return host_path(self.seen_at, container_path)

    def host_path(self, container_path: str) -> str:
        return posixpath.join(str(self.on_host), container_path.lstrip("/"))

    def exists(self, container_path: str) -> bool:
        """Whether the node is there (strings, not Paths: this runs for every device of every prepare)."""
        return os.path.exists(os.path.join(self.seen_at, container_path.lstrip("/")))

    def node(self, container_path: str, **fields: Any) -> dict[str, Any]:
        """A CDI ``deviceNodes`` entry: ``hostPath`` only when the node is not at the same path on the host.

        A ``hostPath`` forces CDI 0.5.0, so a host-installed driver keeps writing the older specs.
        """
        entry: dict[str, Any] = {"path": container_path}
        on_host = self.host_path(container_path)
        if on_host != container_path:
            entry["hostPath"] = on_host
        entry.update(fields)
        return entry

    def describe(self) -> str:
        return f"{self.on_host / 'dev'} (the {self.origin}'s /dev)"


def driver_root_host_path(host_root: Path, driver_root: Path, explicit: PurePosixPath | None) -> PurePosixPath:
    """The driver root's path on the node.

    Named explicitly in the plugin pod (the chart mounts the driver root at ``/driver-root``, which
    says nothing about where it is on the host). Otherwise a driver root under the host root is
    taken at that place (``<host root>/run/nvidia/driver`` is ``/run/nvidia/driver``), and any other
    is taken as a host path, as when the driver runs on the host itself.
    """
    if explicit is not None:
        return explicit
    try:
        return NODE_ROOT / driver_root.relative_to(host_root)
    except ValueError:
        return PurePosixPath(driver_root)


def find_device_root(host_root: Path, driver_root: Path, driver_root_on_host: PurePosixPath) -> DeviceRoot:
    """Where the device nodes are: ``<driver root>/dev`` if it holds them, else the host's ``/dev``.

    NVIDIA's DRA kubelet plugin (``cmd/gpu-kubelet-plugin/root.go``, ``getDevRoot``) and the GPU
    Operator's validator (``cmd/nvidia-validator/driver.go``) use the driver root as device root
    when it has a ``dev`` directory; the GPU Operator's driver container creates the nodes there and
    the host's ``/dev`` never gets them. This asks for ``nvidiactl`` itself rather than any ``dev``
    directory, so a driver root with an empty or unrelated ``dev/`` does not hide the host's nodes.
    Evaluated per use: the operator's driver container may come up after the plugin.
    """
    if driver_root_on_host != NODE_ROOT and host_path(driver_root, "/dev/nvidiactl").exists():
        return DeviceRoot(driver_root, driver_root_on_host, "driver root")
    return DeviceRoot(host_root, NODE_ROOT, "host")


def control_device_paths(device_root: Path = Path("/")) -> list[str]:
    """The NVIDIA control device nodes that exist under ``device_root``, in a fixed order."""
    root = os.fspath(device_root)
    return [path for path in CONTROL_DEVICE_PATHS if os.path.exists(os.path.join(root, path.lstrip("/")))]


def missing_paths(host_root: Path, paths: Iterable[str]) -> list[str]:
    """Those of ``paths`` (container form) that do not exist under ``host_root``."""
    return [path for path in paths if not host_path(host_root, path).exists()]


def _read(file: Path, what: str, hint: str) -> str:
    try:
        return file.read_text()
    except FileNotFoundError:
        raise HostFsError(f"{file} does not exist: expected {what}; {hint}") from None
    except OSError as err:
        raise HostFsError(f"cannot read {file} ({err.strerror}): expected {what}; {hint}") from err


def nvidia_caps_major(host_root: Path = Path("/")) -> int:
    """The character-device major of ``nvidia-caps`` (MIG capability nodes), from ``/proc/devices``."""
    file = host_path(host_root, "/proc/devices")
    text = _read(file, "the kernel's device list", "is the host's /proc mounted at the host root?")
    in_character_section = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.endswith("devices:"):
            in_character_section = stripped == "Character devices:"
            continue
        fields = stripped.split()
        if in_character_section and len(fields) == 2 and fields[1] == NVIDIA_CAPS_DEVICE_NAME:
            if not fields[0].isdigit():
                raise HostFsError(f"{file}: the {NVIDIA_CAPS_DEVICE_NAME} entry has major {fields[0]!r}, not a number")
            return int(fields[0])
    raise HostFsError(
        f"{file} has no '{NVIDIA_CAPS_DEVICE_NAME}' entry in its 'Character devices:' section; "
        "is the NVIDIA driver loaded with MIG support (the nvidia-caps device registered)?"
    )


def _access_fields(file: Path, gpu_minor: int, gi_id: int, ci_id: int | None) -> tuple[int, int]:
    instance = f"GPU {gpu_minor} GPU instance {gi_id}" + ("" if ci_id is None else f" compute instance {ci_id}")
    return _capability_fields(file, f"the MIG access capability of {instance}",
                              "is the NVIDIA driver loaded with MIG enabled, and does that MIG device still exist?")


def _capability_fields(file: Path, what: str, hint: str) -> tuple[int, int]:
    text = _read(file, what, hint)
    values: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            values[key.strip()] = value.strip()
    parsed: dict[str, int] = {}
    for key in ("DeviceFileMinor", "DeviceFileMode"):
        raw = values.get(key)
        if raw is None:
            raise HostFsError(f"{file} has no '{key}:' line; expected 'DeviceFileMinor: <n>' and 'DeviceFileMode: <n>'")
        if not raw.isdigit():
            raise HostFsError(f"{file}: '{key}: {raw}' is not a non-negative decimal integer")
        parsed[key] = int(raw)
    return parsed["DeviceFileMinor"], parsed["DeviceFileMode"]


def mig_capability_nodes(host_root: Path, gpu_minor: int, gi_id: int, ci_id: int) -> list[CapabilityNode]:
    """The GI and CI access capability nodes a container needs to use one MIG device, in that order."""
    gi_dir = host_path(host_root, f"/{CAPABILITIES_DIR}/gpu{gpu_minor}/mig/gi{gi_id}")
    access_files = ((gi_dir / "access", None), (gi_dir / f"ci{ci_id}" / "access", ci_id))
    read = [_access_fields(file, gpu_minor, gi_id, ci) for file, ci in access_files]
    major = nvidia_caps_major(host_root)
    return [
        CapabilityNode(path=f"/dev/nvidia-caps/nvidia-cap{minor}", major=major, minor=minor, file_mode=mode)
        for minor, mode in read
    ]


# The driver's own MIG capabilities, one for all GPUs (the kernel module's table; mig-minors "config 1",
# "monitor 2"): monitor lets a process that opens a MIG-mode GPU list and query its MIG devices (nvidia-smi).
MIG_MONITOR = "mig/monitor"


def mig_driver_capability_node(host_root: Path, name: str) -> CapabilityNode:
    """The capability node of ``name`` (``mig/monitor``, ``mig/config``), read from ``/proc`` like an instance's."""
    file = host_path(host_root, f"/{CAPABILITIES_DIR}/{name}")
    minor, mode = _capability_fields(file, f"the {name} capability",
                                     "is the NVIDIA driver loaded on a node with MIG-capable GPUs?")
    return CapabilityNode(path=f"/dev/nvidia-caps/nvidia-cap{minor}", major=nvidia_caps_major(host_root),
                          minor=minor, file_mode=mode)
