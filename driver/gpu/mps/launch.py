"""How an MPS control daemon process comes into being: the launch request and the launcher contract.

The driver decides *what* a daemon serves (pipe and log directories, visible devices, limits);
a launcher decides *where* the process lives. Two launchers exist:

* ``LocalLauncher`` (``driver/gpu/mps/locallauncher.py``): the daemon is a child of the calling
  process. Used by the demo, the tests and single-container installs; the daemons then share the
  plugin container's fate.
* ``MpsHostLauncher`` (``driver/gpu/mps/hostclient.py``): the request goes over a local Unix socket to
  ``python -m driver mps-host``, a long-lived process in its own pod, so restarting or upgrading the
  plugin leaves running daemons (and their clients' CUDA contexts) untouched.

Both run ``nvidia-cuda-mps-control -f`` (foreground) and supervise it, so the PID is known without
the pid file that some driver versions do not write (535.x writes none: docs/sharing.md, "NVIDIA's
daemon, as measured").
Limits are not part of the launch: the manager sets them over the control socket afterwards.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Protocol

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from driver.gpu.claimconfig.quantity import check_shm_size
from driver.gpu.host.capnodes import CAPABILITY, CapabilityNodeError, ensure_nodes
from driver.gpu.mps.model import MpsError

# With -f the daemon writes its log to standard output, not to <log dir>/control.log as -d does
# (measured, docs/sharing.md); the launcher sends that output to the file -d would have written.
CONTROL_LOG_NAME = "control.log"
# The multi-user flag of NVIDIA's DRA driver (dra-driver-nvidia-gpu PR #1153:
# `nvidia-cuda-mps-control -d -M`, Volta or newer). 535.x and 550.x do not know it: with it they act
# as the front-end client, print "Cannot find MPS control daemon process" and exit 1.
MULTI_USER_FLAG = "-M"


class MpsLaunchError(MpsError):
    """The daemon process could not be started; the message says why."""


class DaemonLaunch(BaseModel):
    """What one control daemon needs to start; sent as JSON to the MPS host, so plain data only."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    daemon_id: str
    pipe_dir: Path  # CUDA_MPS_PIPE_DIRECTORY
    log_dir: Path  # CUDA_MPS_LOG_DIRECTORY
    visible_devices: list[str] = Field(min_length=1)  # CUDA_VISIBLE_DEVICES, GPU-/MIG- UUIDs in order
    multi_user: bool = False
    shm_dir: Path | None = None  # a per-daemon /dev/shm the launcher may give the daemon
    # Bytes of that /dev/shm where the launcher mounts a tmpfs there; None: the launcher's default.
    shm_size: Annotated[int, AfterValidator(check_shm_size)] | None = None
    # The MIG capabilities (paths under /proc/driver/nvidia/capabilities) of the MIG devices served: their nodes
    # are made in the daemon's /dev before it starts (host/capnodes.py). Never numbers: the launcher reads those.
    # None (not []) when there are none: an MPS host older than this field refuses any field it does not know.
    capabilities: list[str] | None = Field(default=None, min_length=1, max_length=64)

    @field_validator("capabilities")
    @classmethod
    def _capability_paths(cls, value: list[str] | None) -> list[str] | None:
        for name in value or []:
            if not CAPABILITY.fullmatch(name):
                raise ValueError(f"capabilities entry {name!r} is not gpu<N>/mig/gi<G>[/ci<C>]/access, "
                                 f"mig/config or mig/monitor")
        return value


class LaunchedDaemon(BaseModel):
    """What the launcher started."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pid: int = Field(gt=0)
    # The host directory the daemon sees as /dev/shm, which clients must mount too; None means the
    # launcher's own /dev/shm (the configured shared MPS shm directory).
    shm_dir: Path | None = None


class DaemonLauncher(Protocol):
    def launch(self, request: DaemonLaunch, timeout: float | None = None) -> LaunchedDaemon:
        """Start ``nvidia-cuda-mps-control -f`` for ``request`` and return its PID; raise MpsLaunchError.
        ``timeout``: what is left of the caller's deadline, for a launcher that waits on another process."""
        ...

    def describe(self) -> str:
        """One line for logs and ``inspect``: where daemons run."""
        ...

    def unmount_shm(self, daemon_id: str, shm_dir: Path) -> None:
        """Unmount the tmpfs the launcher mounted on ``shm_dir`` (none: nothing to do), once the daemon
        is stopped for good and its directory is about to go; raise MpsLaunchError."""
        ...

    def started_here(self, pid: int) -> bool:
        """Whether this launcher started the live process ``pid`` (its parent is the launching process, or it
        sits in that process's cgroup). For daemons found in /proc without a record: only these are
        the driver's; whatever else looks like a daemon is foreign (``identity.py``)."""
        ...


def control_args(request: DaemonLaunch) -> list[str]:
    """The arguments after the binary: foreground, so the launcher knows the PID without a pid file."""
    return ["-f", MULTI_USER_FLAG] if request.multi_user else ["-f"]


def control_env(request: DaemonLaunch) -> dict[str, str]:
    """The daemon's own variables (NVIDIA MPS docs, environment variables); PATH and the library path
    come from the launcher."""
    return {
        "CUDA_MPS_PIPE_DIRECTORY": str(request.pipe_dir),
        "CUDA_MPS_LOG_DIRECTORY": str(request.log_dir),
        "CUDA_VISIBLE_DEVICES": ",".join(request.visible_devices),
    }


def make_capability_nodes(request: DaemonLaunch, proc_root: Path, dev_root: Path) -> None:
    """The capability nodes of the MIG devices ``request`` serves, in the daemon's /dev (``host/capnodes.py``)."""
    if not request.capabilities:
        return
    try:
        ensure_nodes(proc_root, dev_root, request.capabilities)
    except CapabilityNodeError as exc:
        raise MpsLaunchError(f"MIG capability nodes for the daemon: {exc}") from exc
