"""Daemons are known by how they were started, never by how a process looks.

A tenant of any UID can keep processes whose command line is ``nvidia-cuda-mps-control ... -f`` and
whose environment names a daemon's pipe directory (``tests/support/lookalikes.py``). The driver must
neither adopt, signal nor wait for them, and they must not stand in the way of a start. Also here:
every stop bounded by its caller's time, the daemon directory names the orphan sweep knows, and the
MPS host's connection cap and directory checks.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.commands.inspect import inspect_status
from driver.config import Settings
from driver.gpu.claim.claimplan import share_daemon_id, shared_daemon_id
from driver.gpu.mps import proc
from driver.gpu.mps.dirs import DRIVER_DAEMON_DIR_NAME, driver_daemon_ids
from driver.gpu.mps.hostcheck import HostConfig, LaunchRefused, check_launch, default_tools
from driver.gpu.mps.hostclient import MpsHostLauncher, read_line
from driver.gpu.mps.hostcmd import HostMode
from driver.gpu.mps.hostserver import MpsHost, open_listener
from driver.gpu.mps.manager import MpsManager
from driver.kubeletplugin.types import Deadline
from tests.support.lookalikes import NOBODY, look_alikes
from tests.support.mpsdaemons import STANDIN, MpsDaemonKind, daemon_params
from tests.support.mpshost import launch_request, make_dirs, serving
from tests.support.processes import poll_until, standin_sandbox
from tests.unit.gpu.mps.test_mps import LIMITED, PLAIN, PLAN_ID, Sim, _gone, _sandbox

GPU = "GPU-11111111-2222-3333-4444-555555555555"


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> Iterator[Sim]:
    yield from _sandbox(monkeypatch, STANDIN)


@pytest.fixture(params=daemon_params())
def anyd(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sim]:
    kind: MpsDaemonKind = request.param
    yield from _sandbox(monkeypatch, kind)


def _pipe(sim: Sim, daemon_id: str = PLAN_ID) -> Path:
    return sim.base / daemon_id / "pipe"


# -- who is a daemon ----------------------------------------------------------------------------


def test_look_alikes_of_another_uid_are_never_signalled_waited_for_or_in_the_way(
        sim: Sim, caplog: pytest.LogCaptureFixture) -> None:
    manager = sim.manager(stop=0.5)
    with look_alikes(_pipe(sim), count=5) as fakes:
        before = fakes.current()
        began = time.monotonic()
        manager.stop_by_id(PLAN_ID)  # the orphan sweep, and the stop before a first start
        # Each look-alike used to cost 2 s of ignored SIGTERM before its SIGKILL: 10 s here.
        assert time.monotonic() - began < 2.0
        record = manager.start(PLAIN)  # a look-alike "running" there used to refuse the start
        assert manager.process_running(record)
        # A restarted driver's manager (one per driver process) adopts the daemon, not a look-alike.
        assert sim.manager().adopt(PLAIN) is not None, "the daemon, not a look-alike, is the one found"
        manager.stop(record)
        assert manager.adopt(PLAIN) is None
        manager.stop_by_id(PLAN_ID)
        assert fakes.current() == before, "a look-alike was signalled"
    warned = [r for r in caplog.records if "not started by this driver" in r.getMessage()]
    # Each look-alike is logged once per driver process (each manager here stands for one).
    assert sorted({r.__dict__["pid"] for r in warned}) == sorted(pid for pid, _ in before)
    assert len(warned) == 2 * len(before), "logged once by each of the two managers, not at every scan"
    assert {r.__dict__["uid"] for r in warned} == {NOBODY}


def test_a_forged_record_naming_a_look_alike_is_not_running_and_not_signalled(sim: Sim) -> None:
    manager = sim.manager(stop=0.5)
    record = manager.start(PLAIN)
    manager.stop(record)
    with look_alikes(_pipe(sim), count=1) as fakes:
        [(pid, start_time)] = before = fakes.current()
        forged = record.model_copy(update={"pid": pid, "process_start_time": start_time})
        assert not manager.process_running(forged), "its PID, start time, command line and environment fit"
        manager.stop(forged)
        assert fakes.current() == before


def test_a_root_look_alike_counts_only_when_tied_to_the_launcher(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> None:
    manager = sim.manager(stop=0.5)
    # Root, but children of the keeper (not of this process, the LocalLauncher's), in this cgroup:
    # as a daemon orphaned by a crashed plugin, which the plugin's container cgroup still holds.
    with look_alikes(_pipe(sim), count=2, uid=None) as fakes:
        before = fakes.current()
        assert set(manager.identity.unrecorded(_pipe(sim))) == before
        # In another container's cgroup, with another parent: a tenant's, however it looks.
        pids = {pid for pid, _ in before}
        real = proc.read_cgroup
        monkeypatch.setattr(proc, "read_cgroup", lambda pid: b"0::/kubepods/tenant\n" if pid in pids else real(pid))
        assert manager.identity.unrecorded(_pipe(sim)) == []
        manager.stop_by_id(PLAN_ID)
        record = manager.start(PLAIN)
        manager.stop(record)
        assert fakes.current() == before


def test_the_real_daemon_is_still_adopted_and_stopped_beside_look_alikes(anyd: Sim) -> None:
    started = anyd.manager().start(LIMITED)
    with look_alikes(started.pipe_dir, count=3) as fakes:
        before = fakes.current()
        adopted = anyd.manager().adopt(LIMITED)  # a new manager: as after a lost checkpoint
        assert adopted is not None and (adopted.pid, adopted.process_start_time) == (
            started.pid, started.process_start_time)
        anyd.manager(stop=0.5).stop_by_id(started.spec.daemon_id)
        assert _gone(started.pid)
        assert fakes.current() == before


# -- bounded stops ------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", [0.0, 0.6])
def test_a_stop_is_bounded_by_the_callers_time_and_still_ends_the_daemon(sim: Sim, timeout: float) -> None:
    record = sim.manager().start(PLAIN)
    os.kill(record.pid, signal.SIGSTOP)  # answers no quit and defers SIGTERM: only SIGKILL ends it
    began = time.monotonic()
    sim.manager(command=5.0, stop=8.0).stop(record, Deadline.after(timeout))
    # At most the time given plus the wait for SIGKILL (1 s), not the 8 s + 2 s + 3 s of a full stop.
    assert time.monotonic() - began < timeout + 2.5
    assert _gone(record.pid)
    assert not (sim.base / PLAN_ID).exists()


# -- daemon directory names -----------------------------------------------------------------------


def test_the_orphan_sweep_knows_every_daemon_directory_form(tmp_path: Path) -> None:
    uid = "6f0c2d1e-8a4b-4c3d-9e2f-1a0b3c4d5e6f"
    names = [shared_daemon_id(GPU), "claim-0123456789ab-0", share_daemon_id(uid), "probe-multi-user"]
    for name in [*names, "share-0123", "share-0123456789ABCDEF", "tenant", "probe-x"]:
        (tmp_path / name).mkdir()
    assert driver_daemon_ids(tmp_path) == sorted(names)
    assert DRIVER_DAEMON_DIR_NAME.fullmatch(share_daemon_id(uid))


# -- the MPS host -------------------------------------------------------------------------------


@pytest.fixture
def base() -> Iterator[Path]:
    # /tmp, not tmp_path: socket paths inside must stay under 108 bytes.
    top = Path(tempfile.mkdtemp(prefix="tsb", dir="/tmp"))
    (top / "mps").mkdir()
    yield top / "mps"
    shutil.rmtree(top, ignore_errors=True)


@pytest.mark.parametrize(("field", "elsewhere"), [
    ("pipe_dir", "claim-ba9876543210-0/pipe"), ("log_dir", "claim-ba9876543210-0/log"),
    ("shm_dir", "claim-ba9876543210-0/shm"), ("pipe_dir", "plan-0123456789ab/log"),
    ("shm_dir", "plan-0123456789ab/pipe"),
])
def test_a_launch_names_only_its_own_daemons_directories(base: Path, field: str, elsewhere: str) -> None:
    own = launch_request(base, shm_dir=base / PLAN_ID / "shm")
    make_dirs(own)
    make_dirs(launch_request(base, "claim-ba9876543210-0", shm_dir=base / "claim-ba9876543210-0" / "shm"))
    check_launch(own, base)
    wanted = {"pipe_dir": "pipe", "log_dir": "log", "shm_dir": "shm"}[field]
    with pytest.raises(LaunchRefused) as refused:
        check_launch(own.model_copy(update={field: base / elsewhere}), base)
    assert str(refused.value) == (f"{field} {base / elsewhere} is not {base / PLAN_ID / wanted}, the {wanted} "
                                  f"directory of daemon {PLAN_ID}")


def _connect(path: Path) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(5.0)
    conn.connect(str(path))
    return conn


def test_the_host_serves_a_bounded_number_of_connections_and_answers_the_rest_at_once(base: Path) -> None:
    config = HostConfig(socket_path=base.parent / "run" / "h.sock", mps_dir=base, read_timeout=30.0,
                        mode=HostMode(driver_root=base), tools=default_tools())
    host = MpsHost(config, max_connections=2)
    listener = open_listener(config.socket_path)
    serving_thread = threading.Thread(target=host.serve, args=(listener,), daemon=True)
    serving_thread.start()
    held: list[socket.socket] = []
    try:
        held = [_connect(config.socket_path) for _ in range(2)]  # each holds a handler, waiting for a request
        poll_until(lambda: _handlers() == 2, "both held connections to get a handler")
        began = time.monotonic()
        for _ in range(20):
            with _connect(config.socket_path) as extra:
                assert b'"error":"the MPS host is busy: it already serves 2 connections; retry"' in read_line(extra)
        assert time.monotonic() - began < 5.0, "refused at once, not after the read timeout"
        assert _handlers() == 2, "no thread per refused connection"
        held.pop().close()
        poll_until(lambda: _handlers() == 1, "the closed connection's handler to end")
        with _connect(config.socket_path) as served:
            served.sendall(b"{}\n")
            assert b"invalid request" in read_line(served)
    finally:
        for conn in held:
            conn.close()
        host.stop()
        serving_thread.join(5)
        listener.close()


def _handlers() -> int:
    return sum(t.name == "mps-host-conn" for t in threading.enumerate())


@pytest.fixture
def top() -> Iterator[Path]:
    with standin_sandbox("tsi", ["nvidia-cuda-mps-control"]) as directory:
        yield directory


def test_the_host_launcher_ties_daemons_to_the_host_it_reaches(top: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="driver.gpu.mps.hostserver")
    with serving(top) as served:
        request = launch_request(served.base)
        make_dirs(request)
        launched = served.launcher.launch(request)
        # A fresh launcher (a restarted plugin) learns the host's PID from the socket's peer credentials.
        fresh = MpsHostLauncher(served.launcher.socket_path)
        assert fresh.started_here(launched.pid)
        with look_alikes(request.pipe_dir, count=1, uid=None) as fakes:
            [(pid, _)] = fakes.current()
            assert fresh.started_here(pid), "in the host's cgroup (here: the test's own)"
            real = proc.read_cgroup
            monkeypatch.setattr(proc, "read_cgroup", lambda p: b"0::/tenant\n" if p == pid else real(p))
            assert not fresh.started_here(pid)
            manager = MpsManager(top / "root", served.base, fresh, stop_timeout=0.5)
            assert [pid for pid, _ in manager.identity.unrecorded(request.pipe_dir)] == [launched.pid]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "dropped" in r.getMessage()], \
        "learning the host's PID is no dropped connection"
    assert not MpsHostLauncher(top / "run" / "gone.sock").started_here(launched.pid), "no host, nothing tied to it"


# -- inspect --------------------------------------------------------------------------------------


def test_inspect_lists_look_alikes_as_foreign_processes(tmp_path: Path) -> None:
    settings = Settings(node_name="node-a", plugins_dir=tmp_path / "plugins", cdi_root=tmp_path / "cdi")
    pipe = settings.state_dir / "mps" / PLAN_ID / "pipe"
    with look_alikes(pipe, count=2) as fakes:
        pids = sorted(pid for pid, _ in fakes.current())
        status, text = inspect_status(settings, as_json=False)
        assert status == 1
        assert "2 foreign process(es) naming a Tessera pipe directory" in text
        for pid in pids:
            assert f"- pid={pid} uid={NOBODY} euid={NOBODY} daemon dir {PLAN_ID} (pipe {pipe})" in text
        assert f"PROBLEM: 2 foreign process(es) name a Tessera MPS pipe directory (pid {pids[0]}, {pids[1]})" in text
