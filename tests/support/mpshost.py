"""Helpers for the MPS host tests: launch requests, and a host served on a real socket in a thread."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from driver.gpu.mps.hostcheck import HostConfig, check_config, default_tools
from driver.gpu.mps.hostclient import MpsHostLauncher
from driver.gpu.mps.hostcmd import HostMode
from driver.gpu.mps.hostserver import MpsHost, open_listener
from driver.gpu.mps.launch import DaemonLaunch

GPU = "GPU-11111111-2222-3333-4444-555555555555"


def launch_request(base: Path, daemon_id: str = "plan-0123456789ab", **changes: object) -> DaemonLaunch:
    fields: dict[str, object] = {"daemon_id": daemon_id, "pipe_dir": base / daemon_id / "pipe",
                                 "log_dir": base / daemon_id / "log", "visible_devices": [GPU]}
    fields.update(changes)
    return DaemonLaunch.model_validate(fields)


def make_dirs(request: DaemonLaunch) -> None:
    for directory in (request.pipe_dir, request.log_dir, request.shm_dir):
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)


def host_for(base: Path, driver_root: Path, start_timeout: float = 5.0, **mode: bool) -> MpsHost:
    return MpsHost(HostConfig(socket_path=base.parent / "h.sock", mps_dir=base, start_timeout=start_timeout,
                              mode=HostMode(driver_root=driver_root, **mode), tools=default_tools()))


@dataclass
class Served:
    host: MpsHost
    launcher: MpsHostLauncher
    base: Path


@contextlib.contextmanager
def serving(top: Path, start_timeout: float = 5.0, **mode: bool) -> Iterator[Served]:
    base = top / "mps"
    base.mkdir(exist_ok=True)
    host = host_for(base, top / "root", start_timeout, **mode)
    check_config(host.config)
    listener = open_listener(top / "run" / "host.sock")
    thread = threading.Thread(target=host.serve, args=(listener,), daemon=True)
    thread.start()
    try:
        yield Served(host, MpsHostLauncher(top / "run" / "host.sock"), base)
    finally:
        host.stop()
        thread.join(5)
        listener.close()
        host.supervisor.stop_all()
