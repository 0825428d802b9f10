"""Real processes in tests: installing the simulation stand-ins, finding what they started, cleaning up.

Stand-in daemons (the simulated ``nvidia-cuda-mps-control -d``) detach into a session of their
own, so neither the test's process group nor ``Popen`` handles reach them. Each test gives them
a path nobody else uses (its temporary directory), which shows in their command line or
environment; /proc is searched for that path to find, and finally kill, whatever is left.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

SIM_BIN = Path(__file__).resolve().parents[2] / "driver" / "simulation" / "bin"


def install_standin(name: str, bin_dir: Path) -> None:
    """Copy a stand-in, run by this interpreter: ``/usr/bin/env python3`` may be a slow shim."""
    source = (SIM_BIN / name).read_text().split("\n", 1)[1]
    target = bin_dir / name
    target.write_text(f"#!{sys.executable}\n{source}")
    target.chmod(0o755)


@contextlib.contextmanager
def standin_sandbox(prefix: str, standins: Iterable[str]) -> Iterator[Path]:
    """A fresh /tmp directory with a driver root ``root/`` whose ``usr/bin`` holds ``standins``.

    /tmp, not pytest's tmp_path: Unix socket paths inside it must stay under ~100 bytes. On exit
    every process whose command line names the directory is killed, then the directory removed,
    so no daemon outlives the test, even a failing one.
    """
    top = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        bin_dir = top / "root" / "usr" / "bin"
        bin_dir.mkdir(parents=True)
        for name in standins:
            install_standin(name, bin_dir)
        yield top
    finally:
        kill_processes_mentioning(str(top))
        shutil.rmtree(top, ignore_errors=True)


def processes_mentioning(text: str, *, in_environment: bool = False) -> list[int]:
    """PIDs whose command line (or, with ``in_environment``, environment too) contains ``text``."""
    wanted = text.encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        sources = ("cmdline", "environ") if in_environment else ("cmdline",)
        try:
            # Processes exit while we look, and other users' environments are unreadable: skip both.
            if any(wanted in (entry / source).read_bytes() for source in sources):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def kill_processes_mentioning(text: str, *, in_environment: bool = False) -> None:
    """SIGKILL every process :func:`processes_mentioning` finds; one that exits first is fine."""
    for pid in processes_mentioning(text, in_environment=in_environment):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def poll_until(predicate: Callable[[], bool], what: str, limit: float = 10.0) -> None:
    """Fail the test unless ``predicate`` holds within ``limit`` seconds; ``what`` names it in the failure."""
    deadline = time.monotonic() + limit
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.02)
