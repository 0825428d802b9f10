"""How an MPS control daemon process comes into being: the launch request and the launcher contract.

The driver decides *what* a daemon serves (pipe and log directories, visible devices, limits);
a launcher decides *where* the process lives. Two launchers exist:

* ``LocalLauncher`` (this module): the daemon is a child of the calling process. Used by the demo,
  the tests and single-container installs; the daemons then share the plugin container's fate.
* ``MpsHostLauncher`` (``driver/gpu/mps/hostclient.py``): the request goes over a local Unix socket to
  ``python -m driver mps-host``, a long-lived process in its own pod, so restarting or upgrading the
  plugin leaves running daemons (and their clients' CUDA contexts) untouched.

Both run ``nvidia-cuda-mps-control -f`` (foreground) and supervise it, so the PID is known without
the pid file that some driver versions do not write (535.x writes none: docs/sharing.md, "NVIDIA's
daemon, as measured").
Limits are not part of the launch: the manager sets them over the control socket afterwards.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator

from driver.gpu.mps.model import check_shm_size
from driver.gpu.mps.proc import CONTROL_BINARY, tied_to
from driver.gpu.runtime.binaries import BinaryFailed, BinaryNotFound, driver_env, find_binary
from driver.gpu.runtime.capnodes import CAPABILITY, CapabilityNodeError, ensure_nodes

if TYPE_CHECKING:  # shmmount imports this module
    from driver.gpu.mps.shmmount import ShmTmpfs

# With -f the daemon writes its log to standard output, not to <log dir>/control.log as -d does
# (measured, docs/sharing.md); the launcher sends that output to the file -d would have written.
CONTROL_LOG_NAME = "control.log"
# The multi-user flag of NVIDIA's DRA driver (dra-driver-nvidia-gpu PR #1153:
# `nvidia-cuda-mps-control -d -M`, Volta or newer). 535.x and 550.x do not know it: with it they act
# as the front-end client, print "Cannot find MPS control daemon process" and exit 1.
MULTI_USER_FLAG = "-M"


class MpsLaunchError(Exception):
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
    shm_size: int | None = None
    # The MIG capabilities (paths under /proc/driver/nvidia/capabilities) of the MIG devices served: their nodes
    # are made in the daemon's /dev before it starts (runtime/capnodes.py). Never numbers: the launcher reads those.
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

    @field_validator("shm_size")
    @classmethod
    def _shm_size_range(cls, value: int | None) -> int | None:
        return None if value is None else check_shm_size(value)


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

    def release_shm(self, daemon_id: str, shm_dir: Path) -> None:
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
    """The capability nodes of the MIG devices ``request`` serves, in the daemon's /dev (``runtime/capnodes.py``)."""
    if not request.capabilities:
        return
    try:
        ensure_nodes(proc_root, dev_root, request.capabilities)
    except CapabilityNodeError as exc:
        raise MpsLaunchError(f"MIG capability nodes for the daemon: {exc}") from exc


class LocalLauncher:
    """Runs the daemon as a child of this process, in its own session, and reaps it when it exits."""

    def __init__(self, driver_root: Path, shm: ShmTmpfs | None = None,
                 capability_roots: tuple[Path, Path] | None = None) -> None:
        """``shm``: give each daemon its own tmpfs as /dev/shm (``--mps-shm-tmpfs``); None: the
        daemons share this process's /dev/shm. ``capability_roots``: (where /proc is, the root whose dev/
        this process opens devices through), to make a MIG device's capability nodes; None: never made."""
        self.driver_root = driver_root
        self.shm = shm
        self.capability_roots = capability_roots

    def describe(self) -> str:
        shm = f", each with its own /dev/shm tmpfs ({self.shm.flag})" if self.shm is not None else ""
        return (f"child processes of the plugin (pid {os.getpid()}), binaries from driver root "
                f"{self.driver_root}{shm}")

    def release_shm(self, daemon_id: str, shm_dir: Path) -> None:
        from driver.gpu.mps.shmmount import release_shm  # shmmount imports this module

        # Also without the setting: a tmpfs an earlier run mounted under it must not outlive the daemon.
        release_shm(shm_dir, self.shm.flag if self.shm is not None else "--mps-shm-tmpfs")

    def started_here(self, pid: int) -> bool:
        # A daemon orphaned by a plugin crash is re-parented but stays in the plugin container's cgroup.
        return tied_to(pid, os.getpid())

    def launch(self, request: DaemonLaunch, timeout: float | None = None) -> LaunchedDaemon:
        try:
            binary = find_binary(self.driver_root, CONTROL_BINARY)
            env = driver_env(self.driver_root)
        except (BinaryNotFound, BinaryFailed) as exc:
            raise MpsLaunchError(str(exc)) from exc
        env.update(control_env(request))
        if self.capability_roots is not None:  # the daemon's servers open the MIG devices through our /dev
            make_capability_nodes(request, *self.capability_roots)
        argv = [str(binary), *control_args(request)]
        shm_dir = None
        if self.shm is not None and request.shm_dir is not None:
            # Mounted here, in the namespace the clients' CDI bind mounts resolve in, before the
            # daemon starts; the daemon gets it as /dev/shm in a mount namespace of its own.
            shm_dir = self.shm.mount(request)
            argv = self.shm.wrap(request, binary, self.driver_root)
        output_path = request.log_dir / CONTROL_LOG_NAME
        try:
            # O_NOFOLLOW: the log dir is the driver's, but a link there must still not redirect the output.
            output = os.open(output_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
        except OSError as exc:
            raise MpsLaunchError(f"cannot open {output_path} for the daemon's output: {exc}") from exc
        try:
            # A new session keeps the daemon out of signals aimed at the plugin's process group, and
            # makes it a group leader so stopping it can signal its MPS servers too.
            child = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                cwd="/",
                start_new_session=True,
                # The driver runs with umask 077 (driver/cli.py); the daemon's sockets in the pipe
                # dir must be reachable by client containers of other UIDs.
                umask=0o022,
            )
        except OSError as exc:
            raise MpsLaunchError(f"could not run {argv[0]}: {exc}") from exc
        finally:
            os.close(output)
        # Whoever stops the daemon only signals it and watches /proc; this thread collects its exit
        # status so no zombie is left, however the daemon ends.
        threading.Thread(target=child.wait, name=f"mps-daemon-reaper-{child.pid}", daemon=True).start()
        return LaunchedDaemon(pid=child.pid, shm_dir=shm_dir)
