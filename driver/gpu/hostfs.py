"""Reading the host's NVIDIA device nodes and /proc entries, under a configurable host root.

Everything takes ``host_root`` (``/`` on a real node, the host mounted elsewhere in a container,
or a tree built by ``driver.simulation.hostroot`` for the simulated node). Paths returned are
the paths as the container sees them (``/dev/nvidiactl``), not the host-root-prefixed ones.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

CONTROL_DEVICE_PATHS = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset")
NVIDIA_CAPS_DEVICE_NAME = "nvidia-caps"
CAPABILITIES_DIR = "proc/driver/nvidia/capabilities"


class HostFsError(Exception):
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


def control_device_paths(host_root: Path = Path("/")) -> list[str]:
    """The NVIDIA control device nodes that exist on the host, in a fixed order."""
    return [path for path in CONTROL_DEVICE_PATHS if host_path(host_root, path).exists()]


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
    text = _read(
        file,
        f"the MIG access capability of {instance}",
        "is the NVIDIA driver loaded with MIG enabled, and does that MIG device still exist?",
    )
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
