"""``check-node`` and the demo leave nothing running, however they end: SIGTERM, Ctrl-C, a closed terminal, kill -9.

Real processes. Each run gets a private TMPDIR under /tmp, which every process it starts inherits:
the test finds them by it (and kills whatever is left in ``finally``, so a failing test leaves
nothing either), and every throwaway directory lands in it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.reaper import TOKEN_ENV
from tests.support.processes import kill_processes_mentioning, poll_until, processes_mentioning

STOPS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]


@pytest.fixture
def top() -> Iterator[Path]:
    # /tmp, not tmp_path: Unix socket paths under it must stay short.
    path = Path(tempfile.mkdtemp(prefix="tsig-", dir="/tmp"))
    try:
        yield path
    finally:
        kill_processes_mentioning(str(path), in_environment=True)
        shutil.rmtree(path, ignore_errors=True)


def _children_running(parent: int, name: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit() and name.encode() in (entry / "cmdline").read_bytes()
                    and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent):
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _watchdogs(top: Path) -> list[int]:
    return [pid for pid in processes_mentioning(str(top), in_environment=True) if b"driver.reaper" in _cmdline(pid)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # it exited since it was listed: the exits these tests wait for
        return b""


def _check_node(top: Path) -> subprocess.Popen[str]:
    # The daemon stand-in never answers (TESSERA_SIM_MPS_FAIL=hang): check-node is caught inside the
    # daemon's start, before it has a record of it, the hardest moment to clean up from.
    env = dict(os.environ, TMPDIR=str(top), TESSERA_SIM_MPS_FAIL="hang")
    return subprocess.Popen([sys.executable, "-m", "driver", "check-node", "--simulate", "demo"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _daemon_of(proc: subprocess.Popen[str]) -> int:
    daemons: list[int] = []

    def started() -> bool:
        daemons[:] = _children_running(proc.pid, "nvidia-cuda-mps-control")
        return bool(daemons)

    poll_until(started, "check-node's throwaway MPS daemon to start", limit=30)
    return daemons[0]


def _nothing_left(top: Path) -> None:
    assert processes_mentioning(str(top), in_environment=True) == []
    assert list(top.iterdir()) == []  # the simulated host tree and the daemon's directory are gone


@pytest.mark.parametrize("signum", STOPS, ids=lambda s: s.name)
def test_check_node_stopped_by_a_signal_stops_its_daemon_and_says_so_in_one_line(top: Path,
                                                                                 signum: signal.Signals) -> None:
    proc = _check_node(top)
    try:
        daemon = _daemon_of(proc)
        assert TOKEN_ENV.encode() in Path(f"/proc/{daemon}/environ").read_bytes()
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + signum, err
    assert "Traceback" not in out + err
    assert err.strip() == (f"python -m driver check-node: stopped by {signum.name}; everything it started is "
                           "stopped and its files removed")
    _nothing_left(top)


def test_check_node_killed_outright_is_cleaned_up_after_by_its_watchdog(top: Path) -> None:
    proc = _check_node(top)
    try:
        _daemon_of(proc)
        watchdogs = _watchdogs(top)
        assert len(watchdogs) == 1
        proc.kill()
        proc.wait()
        # The watchdog exits once it has stopped the daemon and removed the directories.
        poll_until(lambda: not _watchdogs(top), "the watchdog to finish", limit=30)
    finally:
        proc.kill()
        proc.wait()
    _nothing_left(top)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state == "Z"  # exited; reparented, it waits for a PID 1 that may never reap it


def test_check_node_whose_parent_dies_stops_everything_it_started(top: Path) -> None:
    # A shell (or kubectl exec session) that vanishes without signalling its child: check-node gets its
    # parent-death signal and cleans up as on SIGTERM.
    launcher = ("import subprocess, sys, time; child = subprocess.Popen(sys.argv[1:]); "
                "print(child.pid, flush=True); time.sleep(120)")
    env = dict(os.environ, TMPDIR=str(top), TESSERA_SIM_MPS_FAIL="hang")
    parent = subprocess.Popen([sys.executable, "-c", launcher, sys.executable, "-m", "driver", "check-node",
                               "--simulate", "demo"], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, start_new_session=True)
    try:
        assert parent.stdout is not None
        check_node = int(parent.stdout.readline())
        poll_until(lambda: bool(_children_running(check_node, "nvidia-cuda-mps-control")),
                   "check-node's throwaway MPS daemon to start", limit=30)
        parent.kill()
        parent.wait()
        # Well before the daemon's 10 s start timeout would have let check-node finish on its own.
        poll_until(lambda: _gone(check_node) and not _watchdogs(top), "check-node and its watchdog to end", limit=8)
    finally:
        parent.kill()
        parent.wait()
    _nothing_left(top)


def _demo(top: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "driver", "demo", "--workdir", str(top / "work")],
                            env=dict(os.environ, TMPDIR=str(top)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _until_a_daemon_stand_in_runs(proc: subprocess.Popen[str]) -> list[str]:
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "MPS control daemon" in line:  # a daemon stand-in, detached from the driver, is running now
            return seen
    pytest.fail("the demo ended before starting an MPS daemon stand-in:\n" + "".join(seen))


def test_a_closed_terminal_stops_the_demo_and_everything_it_started(top: Path) -> None:
    proc = _demo(top)
    try:
        seen = _until_a_daemon_stand_in_runs(proc)
        os.killpg(proc.pid, signal.SIGHUP)  # what closing the terminal does to its foreground group
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    output = "".join(seen) + rest
    assert proc.returncode == 128 + signal.SIGHUP, output
    assert "Traceback" not in output
    assert "demo stopped by SIGHUP" in output
    assert processes_mentioning(str(top), in_environment=True) == []


def test_the_demo_killed_outright_takes_the_driver_and_the_stand_ins_with_it(top: Path) -> None:
    proc = _demo(top)
    try:
        _until_a_daemon_stand_in_runs(proc)
        assert len(_watchdogs(top)) == 1
        proc.kill()
        proc.wait()
        poll_until(lambda: not _watchdogs(top), "the watchdog to finish", limit=60)
    finally:
        proc.kill()
        proc.wait()
    assert processes_mentioning(str(top), in_environment=True) == []
