"""MIG capability device nodes made where a process is about to open a MIG instance, as nvidia-modprobe would.

Why: a process (libcuda in an MPS server, NVML creating an instance) opens a MIG device through
``/dev/nvidia-caps/nvidia-cap<N>`` in *its own* ``/dev``, and the kernel module creates no such node: nvidia-modprobe
does, on demand, from the numbers the kernel publishes (reference/nvidia-gpu.md; NVIDIA MIG User Guide, "Device
Nodes and Capabilities"). A long-lived privileged container's ``/dev`` (the MPS host's, the plugin's own) is a copy
taken when it started, so the node of an instance created later is in nobody's ``/dev`` there, and nvidia-modprobe
is not in the image. Workload containers need nothing of this: their CDI spec gives type, major and minor, and the
runtime makes the node.

So before an MPS daemon starts on a MIG device (``mps/launch.py``, ``mps/hostserver.py``) and before the plugin's
own NVML create (``runtime/migruntime.py``, ``mig/config``), the nodes are made in the ``/dev`` that process uses:
major from the ``nvidia-caps`` line of ``/proc/devices``, minor and mode from the capability's ``access`` file
(``DeviceFileMinor``, ``DeviceFileMode``) under ``/proc/driver/nvidia/capabilities``; owner root, as nvidia-modprobe
leaves them. Only the kernel's numbers are used: a request names capabilities by their ``/proc`` path, never by
number. A node already there with those numbers is kept; anything else at that path is left alone and reported
(never replaced: it is not ours to remove), as is a node that cannot be made (no ``CAP_MKNOD``): the process that
opens the instance then fails with the missing node named in the log.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

from driver.gpu.errors import DriverError
from driver.gpu.host.hostfs import HostFsError, mig_driver_capability_node

log = logging.getLogger(__name__)

# A capability as a file under /proc/driver/nvidia/capabilities: a MIG instance's GI or CI access file, or the
# driver's own mig/config and mig/monitor (files themselves: nvidia-modprobe -f .../capabilities/mig/config).
CAPABILITY = re.compile(r"^(gpu\d{1,4}/mig/gi\d{1,3}(/ci\d{1,3})?/access|mig/config|mig/monitor)$")
MIG_CONFIG = "mig/config"
CAPS_DIR = "dev/nvidia-caps"


class CapabilityNodeError(DriverError):
    """A capability could not be read from /proc; the message names the file."""


def instance_capabilities(gpu_minor: int, gi_id: int, ci_id: int) -> list[str]:
    """The GI and CI access capabilities a process needs to open one MIG device."""
    return [f"gpu{gpu_minor}/mig/gi{gi_id}/access", f"gpu{gpu_minor}/mig/gi{gi_id}/ci{ci_id}/access"]


def ensure_nodes(proc_root: Path, dev_root: Path, capabilities: Iterable[str]) -> list[str]:
    """Make ``<dev_root>/dev/nvidia-caps/nvidia-cap<N>`` for each capability that lacks it; the paths made.
    ``proc_root``: where /proc is (the host root). CapabilityNodeError if the kernel's files cannot be read."""
    wanted = list(dict.fromkeys(capabilities))
    if not wanted:
        return []
    for name in wanted:
        if not CAPABILITY.fullmatch(name):
            raise CapabilityNodeError(f"{name!r} is not a MIG capability path (gpu<N>/mig/gi<G>[/ci<C>]/access, "
                                      f"mig/config or mig/monitor)")
    try:
        nodes = [mig_driver_capability_node(proc_root, name) for name in wanted]
    except HostFsError as exc:
        raise CapabilityNodeError(str(exc)) from exc
    caps = dev_root / CAPS_DIR
    made: list[str] = []
    for node in nodes:
        major, minor, mode = node.major, node.minor, node.file_mode
        path = caps / f"nvidia-cap{minor}"
        if _present(path, major, minor):
            continue
        try:
            caps.mkdir(mode=0o755, parents=True, exist_ok=True)
            os.mknod(path, stat.S_IFCHR | (mode & 0o777), os.makedev(major, minor))
            os.chmod(path, mode & 0o777)  # the kernel's mode, whatever this process's umask (the MPS host's: 077)
        except FileExistsError:
            _present(path, major, minor)  # made meanwhile, or something else: reported there
            continue
        except OSError as exc:
            hint = "; making device nodes needs CAP_MKNOD" if exc.errno in (errno.EPERM, errno.EACCES) else ""
            log.warning("could not make a MIG capability node; a process opening the MIG device there will fail",
                        extra={"path": str(path), "major": major, "minor": minor, "reason": f"{exc}{hint}"})
            continue
        made.append(str(path))
    if made:
        log.info("MIG capability nodes made", extra={"dev_root": str(dev_root), "nodes": made})
    return made


def ensure_nodes_best_effort(proc_root: Path, dev_root: Path, capabilities: Iterable[str]) -> None:
    """:func:`ensure_nodes`, a failure logged: for a process that can do its work without them (NVML's create
    as root needs no ``mig/config`` node, NVIDIA's docs say: root or CAP_SYS_ADMIN, or that capability)."""
    try:
        ensure_nodes(proc_root, dev_root, capabilities)
    except CapabilityNodeError as exc:
        log.warning("MIG capability nodes could not be made", extra={"dev_root": str(dev_root), "reason": str(exc)})


def _present(path: Path, major: int, minor: int) -> bool:
    """Whether ``path`` exists (so nothing is to be made there); warns when it is not the expected node."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if not (stat.S_ISCHR(info.st_mode) and os.major(info.st_rdev) == major and os.minor(info.st_rdev) == minor):
        log.warning("something other than the MIG capability node is at its path; left alone", extra={
            "path": str(path), "expected": f"character device {major}:{minor}"})
    return True
