"""``LocalLauncher``: each MPS control daemon a child of the calling process.

Used by the demo, the tests and single-container installs; the daemons then share the plugin
container's fate. The other launcher, ``MpsHostLauncher`` (``hostclient.py``), hands the same
request (``launch.py``) to the MPS host.
"""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

from driver.gpu.host.binaries import BinaryFailed, BinaryNotFound, driver_env, find_binary
from driver.gpu.mps.launch import (
    CONTROL_LOG_NAME,
    DaemonLaunch,
    LaunchedDaemon,
    MpsLaunchError,
    control_args,
    control_env,
    make_capability_nodes,
)
from driver.gpu.mps.proc import CONTROL_BINARY, tied_to
from driver.gpu.mps.shmmount import ShmTmpfs, unmount_shm_here


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

    def unmount_shm(self, daemon_id: str, shm_dir: Path) -> None:
        # Also without the setting: a tmpfs an earlier run mounted under it must not outlive the daemon.
        unmount_shm_here(shm_dir, self.shm.flag if self.shm is not None else "--mps-shm-tmpfs")

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
