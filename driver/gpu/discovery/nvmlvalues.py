"""NVML values as the driver publishes them: enum codes to NVIDIA's own strings, versions, PCI addresses.

The mappings follow NVIDIA's own driver, so user CEL selectors keep working: an unknown brand is
``"Unknown"``; an unknown architecture or addressing mode is None (the attribute is omitted)
because there is no NVIDIA string to match against. Pure functions, no NVML calls.
"""

from __future__ import annotations

import re
from pathlib import Path

BRAND_NAMES: dict[int, str] = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}

ARCHITECTURE_NAMES: dict[int, str] = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
    13: "Rubin",
}

ADDRESSING_MODE_NAMES: dict[int, str] = {0: "None", 1: "HMM", 2: "ATS"}

def brand_name(code: int) -> str:
    return BRAND_NAMES.get(code, "Unknown")


def architecture_name(code: int) -> str | None:
    return ARCHITECTURE_NAMES.get(code)


def addressing_mode_name(code: int) -> str | None:
    return ADDRESSING_MODE_NAMES.get(code)


def cuda_version_string(version: int) -> str:
    """NVML's integer CUDA driver version → ``major.minor`` (13000 → ``13.0``, 12040 → ``12.4``)."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def as_text(value: str | bytes) -> str:
    """pynvml returns str from string functions but bytes from struct char arrays."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


_BUS_ID = re.compile(r"^([0-9a-fA-F]{1,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


def normalise_pci_bus_id(raw: str | bytes) -> str | None:
    """NVML's ``00000000:3B:00.0`` → ``0000:3b:00.0`` (the well-known attribute's form); None if unparsable."""
    match = _BUS_ID.match(as_text(raw).strip().rstrip("\x00"))
    if match is None:
        return None
    domain = int(match[1], 16)
    if domain > 0xFFFF:
        return None
    return f"{domain:04x}:{match[2].lower()}:{match[3].lower()}.{match[4]}"


_PCI_ROOT = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")


def pcie_root_from_link(link_target: str) -> str | None:
    """The root complex (``pci0000:3a``) in a ``/sys/bus/pci/devices/<bdf>`` link target, if there is one."""
    return next((part for part in Path(link_target).parts if _PCI_ROOT.match(part)), None)
