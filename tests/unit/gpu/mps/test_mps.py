"""MpsManager with the LocalLauncher: real processes and Unix sockets.

Tests marked with the ``daemon`` parameter run against the stand-in and, when
scripts/fetch-nvidia-mps.sh could fetch them, NVIDIA's own 550.x and 535.x control daemons (they
run without a GPU as long as no CUDA client connects). The others use the stand-in's injected
failures and its command journal.

Everything lives in a short /tmp directory (socket paths must stay under ~100 bytes). The fixture
kills every process whose command line names that directory, so no daemon outlives a test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import ValidationError

from cdi import Mount
from driver.gpu.discovery.inventory import multi_user_capable
from driver.gpu.mps.holders import held_connection
from driver.gpu.mps.launch import DaemonLaunch, LaunchedDaemon
from driver.gpu.mps.locallauncher import LocalLauncher
from driver.gpu.mps.manager import _KILL_WAIT_S, _TERM_GRACE_S, MpsManager
from driver.gpu.mps.model import (
    MpsBusy,
    MpsDaemonRecord,
    MpsDaemonSpec,
    MpsDaemonStopped,
    MpsError,
    client_edits,
    pinned_limit_taken,
)
from driver.gpu.runtime.multiuser import supports_multi_user
from driver.kubeletplugin.types import Deadline
from driver.units import MIB
from tests.support.mpsdaemons import STANDIN, MpsDaemonKind, daemon_params
from tests.support.processes import poll_until, processes_mentioning, standin_sandbox

GPU_A = "GPU-11111111-2222-3333-4444-555555555555"
GPU_B = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
PLAN_ID = "plan-0123456789ab"
CLAIM_ID = "claim-0123456789ab-0"
OTHER_ID = "claim-ba9876543210-0"


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def _start_time(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])


@dataclass(frozen=True)
class Sim:
    top: Path
    root: Path
    base: Path
    journal: Path
    kind: MpsDaemonKind

    def manager(
        self, ready: float = 20.0, command: float = 5.0, stop: float = 5.0, backoff: float = 60.0
    ) -> MpsManager:
        return MpsManager(self.root, self.base, LocalLauncher(self.root), shm_dir=self.top / "shm",
                          ready_timeout=ready, command_timeout=command, stop_timeout=stop, restart_backoff=backoff)

    def running(self) -> list[int]:
        return processes_mentioning(str(self.top))

    def journal_entries(self) -> list[dict[str, object]]:
        if not self.journal.exists():
            return []
        # Each entry also names its daemon's pipe dir; these tests tell daemons apart by pid.
        entries = [json.loads(line) for line in self.journal.read_text().splitlines()]
        return [{k: v for k, v in e.items() if k != "pipe_dir"} for e in entries]


def _sandbox(monkeypatch: pytest.MonkeyPatch, kind: MpsDaemonKind) -> Iterator[Sim]:
    for name in ("TESSERA_SIM_MPS_FAIL", "TESSERA_SIM_MPS_DRIVER"):
        monkeypatch.delenv(name, raising=False)
    with standin_sandbox("tsm", []) as top:
        kind.install(top / "root" / "usr" / "bin")
        journal = top / "journal.jsonl"
        monkeypatch.setenv("TESSERA_SIM_MPS_JOURNAL", str(journal))
        yield Sim(top=top, root=top / "root", base=top / "mps", journal=journal, kind=kind)


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> Iterator[Sim]:
    """The stand-in only."""
    yield from _sandbox(monkeypatch, STANDIN)


@pytest.fixture(params=daemon_params())
def anyd(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Sim]:
    """The stand-in, then NVIDIA's daemons where fetched."""
    yield from _sandbox(monkeypatch, request.param)


def _answers_control(manager: MpsManager, record: MpsDaemonRecord) -> bool:
    """True if the recorded daemon runs and answers a control command within ``command_timeout``."""
    if not manager.process_running(record):
        return False
    try:
        manager.control.send(record.pipe_dir, record.log_dir, "get_default_active_thread_percentage")
    except MpsError:
        return False
    return True


def _assert_nothing_left(sim: Sim, daemon_id: str) -> None:
    assert sim.running() == []
    assert not (sim.base / daemon_id).exists()


def _commands(record: MpsDaemonRecord) -> list[str]:
    lines = (record.log_dir / "commands.jsonl").read_text().splitlines()
    return [" ".join([entry["cmd"], *entry["args"]]) for entry in map(json.loads, lines)]


def _environ(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_text().split("\0")
    return dict(item.split("=", 1) for item in items if "=" in item)


LIMITED = MpsDaemonSpec(
    daemon_id=CLAIM_ID,
    gpu_uuids=[GPU_A, GPU_B],
    active_thread_percentage=40,
    # GPU_B's limit is not whole MiB: MPS gets it rounded down.
    pinned_memory_limits={GPU_A: 2048 * MIB, GPU_B: 512 * MIB + 123},
)
PLAIN = MpsDaemonSpec(daemon_id=PLAN_ID, gpu_uuids=[GPU_A])


# -- start ------------------------------------------------------------------------------------


def test_start_supervises_the_foreground_daemon_and_reads_limits_back(anyd: Sim) -> None:
    record = anyd.manager().start(LIMITED)
    assert record.spec == LIMITED
    assert record.pipe_dir == anyd.base / CLAIM_ID / "pipe"
    assert record.log_dir == anyd.base / CLAIM_ID / "log"
    assert record.process_start_time == _start_time(record.pid)
    assert record.shm_dir == anyd.top / "shm"  # the LocalLauncher gives no daemon its own /dev/shm
    assert Path(f"/proc/{record.pid}/cmdline").read_bytes().split(b"\0")[-2:] == [b"-f", b""]
    environ = _environ(record.pid)
    assert environ["CUDA_VISIBLE_DEVICES"] == f"{GPU_A},{GPU_B}"
    assert environ["CUDA_MPS_PIPE_DIRECTORY"] == str(record.pipe_dir)
    assert environ["CUDA_MPS_LOG_DIRECTORY"] == str(record.log_dir)
    assert stat.S_IMODE(record.pipe_dir.stat().st_mode) == 0o755
    # 535.x writes no pid file; the PID comes from the launcher either way.
    assert (record.pipe_dir / "nvidia-cuda-mps-control.pid").exists() == anyd.kind.writes_pid_file
    # With -f the daemon logs to its standard output, which the launcher keeps as control.log.
    assert "Starting control daemon using socket" in (record.log_dir / "control.log").read_text()
    assert _answers_control(anyd.manager(), record)
    anyd.manager().stop(record)
    _assert_nothing_left(anyd, CLAIM_ID)


def test_standin_start_waits_for_readiness_then_sets_and_reads_back_each_limit(sim: Sim) -> None:
    record = sim.manager().start(LIMITED)
    sentinel = "get_default_active_thread_percentage"  # ends each session: its answer shows it was served
    assert _commands(record) == [
        "get_default_active_thread_percentage", sentinel,
        # The sets through one client, then the reads: a tenant's `quit` has less time to fall in between.
        "set_default_active_thread_percentage 40",
        "set_default_device_pinned_mem_limit 0 2048M",
        "set_default_device_pinned_mem_limit 1 512M", sentinel,
        "get_default_active_thread_percentage",
        "get_default_device_pinned_mem_limit 0",
        "get_default_device_pinned_mem_limit 1", sentinel,
    ]


def test_h100_plan_default_limits_prepare_though_displayed_in_whole_g(anyd: Sim) -> None:
    # 81559 MiB split 2, 3, 4 and 7 ways: the daemon shows 39G, 26G, 19G and 11G.
    uuids = [f"GPU-00000000-0000-0000-0000-00000000000{i}" for i in range(4)]
    limits = {uuid: 81559 // shares * MIB for uuid, shares in zip(uuids, (2, 3, 4, 7), strict=True)}
    spec = MpsDaemonSpec(daemon_id=PLAN_ID, gpu_uuids=uuids, active_thread_percentage=25, pinned_memory_limits=limits)
    manager = anyd.manager()
    record = manager.start(spec)
    assert manager.process_running(record)
    manager.stop(record)


@pytest.mark.parametrize(
    ("answer", "mib", "taken"),
    [
        ("19G", 20389, True), ("3G", 3840, True), ("1G", 1025, True), ("16G", 16384, True),
        ("3840M", 3840, True), ("1023M", 1023, True), ("512M", 512, True), (" 19G\n", 20389, True),
        ("20G", 20389, False), ("18G", 20389, False), ("1G", 1023, False), ("0G", 512, False),
        ("", 3840, False), ("abc", 3840, False), ("3840", 3840, False), ("3.75G", 3840, False),
        ("3840MiB", 3840, False), ("2048M", 3840, False),
    ],
)
def test_pinned_limit_read_back_forgives_only_the_daemons_rounding(answer: str, mib: int, taken: bool) -> None:
    assert pinned_limit_taken(answer, mib) is taken


def _lying_daemon(sim: Sim, answer: str) -> None:
    """Wrap the control binary: the daemon is the real thing (exec'd), the client lies on one read-back."""
    real = sim.top / "real" / "nvidia-cuda-mps-control"
    real.parent.mkdir()
    (sim.root / "usr" / "bin" / "nvidia-cuda-mps-control").rename(real)
    wrapper = sim.root / "usr" / "bin" / "nvidia-cuda-mps-control"
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import os, subprocess, sys\n"
        f"if sys.argv[1:]: os.execv({str(real)!r}, [{str(real)!r}, *sys.argv[1:]])\n"
        "data = sys.stdin.read()\n"
        "lines = data.splitlines()\n"
        "if 'get_default_device_pinned_mem_limit 0' in lines and all(l.startswith('get_') for l in lines):\n"
        "    ask = lambda l: subprocess.run([" + repr(str(real)) + "], input=l + '\\n', capture_output=True,\n"
        "                                   text=True).stdout.strip()\n"
        f"    out = [{answer!r} if l == 'get_default_device_pinned_mem_limit 0' else ask(l) for l in lines]\n"
        "    print('\\n'.join(o for o in out if o)); sys.exit(0)\n"
        f"sys.exit(subprocess.run([{str(real)!r}], input=data, text=True).returncode)\n"
    )
    wrapper.chmod(0o755)


@pytest.mark.parametrize("answer", ["", "abc", "1G", "2049M"])
def test_limit_that_does_not_read_back_fails_start(anyd: Sim, answer: str) -> None:
    _lying_daemon(anyd, answer)
    with pytest.raises(MpsError, match=rf"device 0 \(GPU-1111.*\) reads back as '{answer}', expected 2048M "
                                       r"\(which the daemon shows as '2G'\)"):
        anyd.manager().start(LIMITED)
    _assert_nothing_left(anyd, CLAIM_ID)


@pytest.mark.parametrize(
    ("failure", "said"),
    [
        ("start", ["exited before it became ready", "control.log", "injected start failure"]),
        ("reject-limits", ["refused 'set_default_active_thread_percentage 40'",
                           "Cmd:set_default_active_thread_percentage 40"]),
    ],
    ids=["daemon does not start", "daemon refuses a limit"],
)
def test_failed_start_says_why_with_log_tail_and_leaves_nothing(
    sim: Sim, monkeypatch: pytest.MonkeyPatch, failure: str, said: list[str]
) -> None:
    monkeypatch.setenv("TESSERA_SIM_MPS_FAIL", failure)
    with pytest.raises(MpsError) as caught:
        sim.manager().start(LIMITED)
    for fragment in said:
        assert fragment in str(caught.value)
    _assert_nothing_left(sim, CLAIM_ID)


def test_hanging_daemon_fails_readiness_within_bound_and_is_killed(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_SIM_MPS_FAIL", "hang")
    with pytest.raises(MpsError, match="did not become ready before the 1s start deadline"):
        sim.manager(ready=1.0, command=0.3, stop=0.3).start(PLAIN)
    started = [e for e in sim.journal_entries() if e.get("event") == "start"]
    assert len(started) == 1  # a daemon did run...
    assert _gone(int(str(started[0]["pid"])))  # ...and was killed
    _assert_nothing_left(sim, PLAN_ID)


def test_start_takes_the_callers_shorter_deadline(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_SIM_MPS_FAIL", "hang")
    with pytest.raises(MpsError, match=r"did not become ready before the 0\.\d+s start deadline"):
        sim.manager(ready=20.0, command=0.3, stop=0.3).start(PLAIN, Deadline.after(0.5))
    _assert_nothing_left(sim, PLAN_ID)


def test_missing_binary_names_the_driver_root_setting(sim: Sim) -> None:
    (sim.root / "usr" / "bin" / "nvidia-cuda-mps-control").unlink()
    with pytest.raises(MpsError, match="nvidiaDriverRoot"):
        sim.manager().start(PLAIN)
    assert not (sim.base / PLAN_ID).exists()


def test_start_refuses_second_daemon_for_same_id(anyd: Sim) -> None:
    manager = anyd.manager()
    record = manager.start(PLAIN)
    with pytest.raises(MpsError, match=f"pid {record.pid}.* already runs"):
        manager.start(PLAIN)
    assert _answers_control(manager, record)
    manager.stop(record)


def test_start_keeps_a_leftover_pipe_dir_and_empties_it_without_following_links(sim: Sim) -> None:
    outside = sim.top / "precious"
    outside.mkdir()
    (outside / "file").write_text("keep me")
    pipe = sim.base / PLAN_ID / "pipe"
    pipe.mkdir(parents=True)
    (pipe / "control").write_text("stale")
    (pipe / "link-to-dir").symlink_to(outside)
    (pipe / "sub").mkdir()
    (pipe / "sub" / "link").symlink_to(outside / "file")
    inode = pipe.stat().st_ino
    record = sim.manager().start(PLAIN)
    assert record.pipe_dir.stat().st_ino == inode
    assert sorted(p.name for p in pipe.iterdir()) == [
        "control", "control_lock", "control_privileged", "log", "nvidia-cuda-mps-control.pid"]
    assert stat.S_ISSOCK((pipe / "control").lstat().st_mode)
    assert (outside / "file").read_text() == "keep me"


def test_start_rejects_pipe_dir_too_long_for_sockets(sim: Sim) -> None:
    deep = sim.top / ("d" * 90)
    with pytest.raises(MpsError, match="too long"):
        MpsManager(sim.root, deep, LocalLauncher(sim.root)).start(PLAIN)
    assert not deep.exists()


def test_shm_dir_inside_the_daemon_base_dir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must not be inside the MPS daemon directory"):
        MpsManager(tmp_path, tmp_path / "mps", LocalLauncher(tmp_path), shm_dir=tmp_path / "mps" / "shm")


def test_launcher_reaps_the_daemon_so_no_zombie_is_left(sim: Sim) -> None:
    manager = sim.manager()
    record = manager.start(PLAIN)
    os.kill(record.pid, signal.SIGKILL)
    poll_until(lambda: not Path(f"/proc/{record.pid}").exists(), "the killed daemon to be reaped")


# -- multi-user -------------------------------------------------------------------------------


def test_multi_user_daemon_starts_where_the_driver_knows_the_flag(anyd: Sim) -> None:
    manager = anyd.manager()
    assert supports_multi_user(manager, GPU_A) is anyd.kind.knows_multi_user
    assert anyd.running() == []
    spec = PLAIN.model_copy(update={"multi_user": True})
    if anyd.kind.knows_multi_user:
        record = manager.start(spec)
        assert Path(f"/proc/{record.pid}/cmdline").read_bytes().split(b"\0")[-3:] == [b"-f", b"-M", b""]
        manager.stop(record)
    else:
        # 535/550 take "-f -M" for the front-end client: it finds no daemon and exits 1.
        with pytest.raises(MpsError, match=r"exited before it became ready(.|\n)*Cannot find MPS control daemon"):
            manager.start(spec)
    _assert_nothing_left(anyd, PLAN_ID)


def test_standin_modelling_550_has_no_multi_user_mode(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_SIM_MPS_DRIVER", "550")
    assert not supports_multi_user(sim.manager(), GPU_A)


@pytest.mark.parametrize(("capability", "capable"), [("9.0", True), ("7.0", True), ("6.1", False), (None, False),
                                                    ("x", False)])
def test_multi_user_needs_volta(capability: str | None, capable: bool) -> None:
    assert multi_user_capable(capability) is capable


# -- stop -------------------------------------------------------------------------------------


def test_stop_sends_quit_and_the_daemon_exits(sim: Sim) -> None:
    manager = sim.manager()
    record = manager.start(PLAIN)
    manager.stop(record)
    mine = [e for e in sim.journal_entries() if e["pid"] == record.pid]
    assert mine[-2:] == [
        {"pid": record.pid, "cmd": "quit", "args": []},
        {"pid": record.pid, "event": "exit", "reason": "quit"},
    ]
    assert _gone(record.pid)
    assert not (sim.base / PLAN_ID).exists()
    manager.stop(record)  # idempotent
    assert sim.running() == []


def test_stop_terminates_a_daemon_that_ignores_quit(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_SIM_MPS_FAIL", "hang-quit")
    record = sim.manager().start(PLAIN)
    sim.manager(command=0.5, stop=0.5).stop(record)
    mine = [e for e in sim.journal_entries() if e["pid"] == record.pid]
    assert not any(e.get("event") == "exit" for e in mine)  # it never quit: it was signalled
    _assert_nothing_left(sim, PLAN_ID)


def test_stop_kills_a_daemon_that_ignores_sigterm(anyd: Sim) -> None:
    record = anyd.manager().start(PLAIN)
    os.kill(record.pid, signal.SIGSTOP)  # a stopped process answers nothing and defers SIGTERM
    anyd.manager(command=0.3, stop=0.3).stop(record)
    assert _gone(record.pid)
    _assert_nothing_left(anyd, PLAN_ID)


def test_stop_by_id_finds_an_unrecorded_daemon_in_proc(anyd: Sim) -> None:
    # A daemon whose record was lost (its starter crashed): found without any pid file (535 has none).
    manager = anyd.manager()
    record = manager.start(PLAIN)
    (record.pipe_dir / "nvidia-cuda-mps-control.pid").unlink(missing_ok=True)
    assert manager.daemon_ids_on_disk() == [PLAN_ID]
    manager.stop_by_id(PLAN_ID)
    assert _gone(record.pid)
    assert manager.daemon_ids_on_disk() == []
    manager.stop_by_id(PLAN_ID)  # idempotent
    again = manager.start(PLAIN)
    assert _answers_control(manager, again)
    manager.stop(again)


def test_stop_by_id_rejects_unsafe_ids(sim: Sim) -> None:
    with pytest.raises(ValueError, match=r"daemon_id '\.\./root' must be"):
        sim.manager().stop_by_id("../root")


# -- process_running / answering control / ensure_running -----------------------------------------------


def test_process_running_reads_proc_only(sim: Sim) -> None:
    manager = sim.manager()
    record = manager.start(PLAIN)
    commands_before = len(_commands(record))
    assert manager.process_running(record)
    assert manager.ensure_running(record) == record
    assert _commands(record)[commands_before:] == [], "no control command is sent"
    assert not manager.process_running(record.model_copy(update={"process_start_time": record.process_start_time + 1}))
    manager.stop(record)
    assert not manager.process_running(record)


def test_answers_control_false_when_daemon_does_not_answer(sim: Sim) -> None:
    record = sim.manager().start(PLAIN)
    os.kill(record.pid, signal.SIGSTOP)
    assert not _answers_control(sim.manager(command=0.3), record)


def test_restart_keeps_the_pipe_dir_inode_and_the_limits(anyd: Sim) -> None:
    manager = anyd.manager()
    old = manager.start(LIMITED)
    inode = old.pipe_dir.stat().st_ino
    os.kill(old.pid, signal.SIGKILL)
    poll_until(lambda: _gone(old.pid), "the killed daemon to die")
    new = manager.ensure_running(old)
    assert new.pid != old.pid
    assert new.spec == old.spec
    assert new.pipe_dir == old.pipe_dir and new.pipe_dir.stat().st_ino == inode
    assert _answers_control(manager, new)
    assert sorted(anyd.running()) == [new.pid]
    manager.stop(new)


def test_a_daemon_stopped_after_a_clean_start_is_restarted_at_once_every_time(anyd: Sim) -> None:
    # A tenant root in its container can `quit` the shared daemon as often as it likes: each time it is
    # restarted at once, with its limits; no backoff builds up (it deferred other tenants' prepares).
    manager = anyd.manager(backoff=60.0)
    record = manager.start(LIMITED)
    for _ in range(4):
        _tenant(anyd, record, "quit")
        poll_until(lambda r=record: _gone(r.pid), "the daemon to quit")  # type: ignore[misc]
        record = manager.ensure_running(record)
        assert manager.process_running(record)
        assert _tenant(anyd, record, "get_default_active_thread_percentage") == "40.0"
    assert not (anyd.base / CLAIM_ID / "restarts.json").exists()
    manager.stop(record)


def test_only_failed_starts_back_off_and_a_caller_waits_at_most_two_seconds(
    sim: Sim, monkeypatch: pytest.MonkeyPatch
) -> None:
    manager = sim.manager(backoff=60.0)
    record = manager.start(PLAIN)
    os.kill(record.pid, signal.SIGKILL)
    poll_until(lambda: _gone(record.pid), "the killed daemon to die")
    monkeypatch.setenv("TESSERA_SIM_MPS_FAIL", "start")
    with pytest.raises(MpsError, match="starting MPS control daemon"):
        manager.ensure_running(record)  # the first attempt is immediate, and fails
    assert json.loads((sim.base / PLAN_ID / "restarts.json").read_text())["count"] == 1
    monkeypatch.delenv("TESSERA_SIM_MPS_FAIL")
    # 60 s to go is more than a caller waits: refused at once, saying why. Recorded on disk, so a
    # restarted plugin backs off too.
    with pytest.raises(MpsError, match=rf"{PLAN_ID} is not running; it failed to start 1 time\(s\) in a row, "
                                       r"so the next start is deferred for \d+s"):
        sim.manager(backoff=60.0).ensure_running(record)
    # A backoff that ends within 2 s is waited out; a clean start forgets the failures.
    restarted = sim.manager(backoff=1.0).ensure_running(record)
    assert _answers_control(manager, restarted)
    assert json.loads((sim.base / PLAN_ID / "restarts.json").read_text())["count"] == 0
    manager.stop(restarted)


class StopOnceListening(LocalLauncher):
    """Launches the daemon, and the first ``times`` times stops it as soon as it listens: with a client's
    `quit` (a tenant between the daemon's launch and its limits), or with SIGKILL (it just exits)."""

    def __init__(self, sim: Sim, how: str, times: int = 1) -> None:
        super().__init__(sim.root)
        self.sim, self.how, self.times = sim, how, times
        self.stopped: list[int] = []

    def launch(self, request: DaemonLaunch, timeout: float | None = None) -> LaunchedDaemon:
        launched = super().launch(request)
        if len(self.stopped) < self.times:
            self.stopped.append(launched.pid)
            poll_until(lambda: (request.pipe_dir / "control").is_socket(), "the daemon to listen")
            if self.how == "quit":
                _tenant_at(self.sim, request.pipe_dir, "quit")
            else:
                os.kill(launched.pid, signal.SIGKILL)
            poll_until(lambda: _gone(launched.pid), "the daemon to exit")
        return launched


def _stopping_manager(sim: Sim, how: str, times: int = 1) -> tuple[MpsManager, StopOnceListening]:
    launcher = StopOnceListening(sim, how, times)
    return MpsManager(sim.root, sim.base, launcher, shm_dir=sim.top / "shm", restart_backoff=60.0), launcher


def test_a_daemon_quit_while_it_starts_is_started_again_within_the_deadline(anyd: Sim) -> None:
    manager, launcher = _stopping_manager(anyd, "quit")
    record = manager.start(LIMITED, Deadline.after(20.0))
    assert launcher.stopped and record.pid not in launcher.stopped
    assert _tenant(anyd, record, "get_default_active_thread_percentage") == "40.0"
    manager.stop(record)


def test_a_restart_a_client_keeps_quitting_is_reported_stopped_not_failed(sim: Sim) -> None:
    manager, launcher = _stopping_manager(sim, "quit", times=0)
    record = manager.start(PLAIN)
    _tenant(sim, record, "quit")
    poll_until(lambda: _gone(record.pid), "the daemon to quit")
    launcher.times = 100
    with pytest.raises(MpsDaemonStopped, match="exited before it became ready"):
        manager.ensure_running(record, Deadline.after(20.0), retry_stopped=True)
    assert len(launcher.stopped) >= 2, "started again after the first quit"
    assert not (sim.base / PLAN_ID / "restarts.json").exists(), "a client's quit is no failed start"
    launcher.times = 0
    restarted = manager.ensure_running(record)
    assert manager.process_running(restarted)
    manager.stop(restarted)


def test_a_daemon_that_exits_by_itself_while_it_starts_failed_to_start(sim: Sim) -> None:
    manager, launcher = _stopping_manager(sim, "kill", times=0)
    record = manager.start(PLAIN)
    os.kill(record.pid, signal.SIGKILL)
    poll_until(lambda: _gone(record.pid), "the daemon to die")
    launcher.times = 1
    with pytest.raises(MpsError) as caught:
        manager.ensure_running(record, Deadline.after(20.0), retry_stopped=True)
    assert not isinstance(caught.value, MpsDaemonStopped)
    assert len(launcher.stopped) == 1, "no second attempt"
    assert json.loads((sim.base / PLAN_ID / "restarts.json").read_text())["count"] == 1


def test_limits_a_client_changed_are_found_restored_and_read_back(anyd: Sim) -> None:
    manager = anyd.manager()
    record = manager.start(LIMITED)
    assert manager.check_and_restore_limits(record) == []
    _tenant(anyd, record, "set_default_active_thread_percentage 100")
    _tenant(anyd, record, "set_default_device_pinned_mem_limit 0 79G")
    drift = manager.check_and_restore_limits(record)
    assert [(d.limit, d.found, d.expected) for d in drift] == [
        ("active_thread_percentage", "100.0", "40"), ("pinned_mem_limit/0", "79G", "2048M")]
    assert _tenant(anyd, record, "get_default_active_thread_percentage") == "40.0"
    assert _tenant(anyd, record, "get_default_device_pinned_mem_limit 0") == "2G"
    assert manager.check_and_restore_limits(record) == []
    manager.stop(record)


def test_a_daemon_quit_while_its_limits_are_read_is_reported_stopped(sim: Sim) -> None:
    manager = sim.manager()
    record = manager.start(LIMITED)
    _tenant(sim, record, "quit")
    with pytest.raises(MpsDaemonStopped, match=f"{CLAIM_ID} .* stopped while its limits were checked"):
        manager.check_and_restore_limits(record)


def test_a_client_holding_the_control_socket_silent_is_let_go_and_the_limits_read_back(anyd: Sim) -> None:
    # The daemon waits for a connected client's first message without a timeout (measured with NVIDIA's 535
    # and 550): a silent one, from any UID (the socket is 0666), holds every command up until let go.
    manager = anyd.manager(command=3.0)
    record = manager.start(LIMITED)
    kind = socket.SOCK_SEQPACKET if anyd.kind.is_real else socket.SOCK_STREAM
    with socket.socket(socket.AF_UNIX, kind) as held:
        held.connect(str(record.pipe_dir / "control"))
        assert held.recv(64), "the daemon's greeting: it accepted the connection"
        poll_until(lambda: held_connection(record.pid) is not None, "the daemon to wait on the silent connection")
        held.settimeout(30)
        assert manager.check_and_restore_limits(record, Deadline.after(10.0)) == []
        assert held.recv(64) == b"", "the daemon's end of the silent connection was shut down"
    assert manager.process_running(record), "nobody was signalled"
    manager.stop(record)


def test_a_client_holding_the_control_session_makes_a_read_back_say_the_socket_is_busy(anyd: Sim) -> None:
    # One control session at a time (measured with NVIDIA's 535 and 550): while a front-end keeps its session
    # open, another exits at once, said busy or not, and none of its commands is carried out.
    manager = anyd.manager(command=1.0)
    record = manager.start(LIMITED)
    sessions = _control_log(record).count("NEW UI")
    binary = str(anyd.root / "usr" / "bin" / "nvidia-cuda-mps-control")
    holder = subprocess.Popen([binary], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(record.pipe_dir)})
    try:
        assert holder.stdin is not None and holder.stdout is not None
        holder.stdin.write("get_default_active_thread_percentage\n")
        holder.stdin.flush()
        poll_until(lambda: _control_log(record).count("NEW UI") > sessions, "the holder's session to open", limit=30)
        with pytest.raises(MpsBusy, match=f"another client held the daemon's control socket {record.pipe_dir}/control"):
            manager.check_and_restore_limits(record, Deadline.after(1.0))
    finally:
        holder.communicate(timeout=30)
    assert manager.check_and_restore_limits(record) == []
    manager.stop(record)


def _control_log(record: MpsDaemonRecord) -> str:
    return (record.log_dir / "control.log").read_text() if (record.log_dir / "control.log").exists() else ""


def _tenant(sim: Sim, record: MpsDaemonRecord, command: str) -> str:
    return _tenant_at(sim, record.pipe_dir, command)


def _tenant_at(sim: Sim, pipe_dir: Path, command: str) -> str:
    """What a root tenant does through its mount of the pipe dir: the control client, one command."""
    done = subprocess.run([str(sim.root / "usr" / "bin" / "nvidia-cuda-mps-control")], input=command + "\n",
                          capture_output=True, text=True, timeout=30,
                          env={"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_recycled_pid_is_never_taken_for_our_daemon(sim: Sim) -> None:
    manager = sim.manager()
    record = manager.start(PLAIN)
    recycled_pid = record.model_copy(update={"process_start_time": record.process_start_time + 1})
    assert not _answers_control(manager, recycled_pid)
    manager.stop(record)
    stranger = subprocess.Popen(["sleep", "60"])
    try:
        recycled = record.model_copy(update={"pid": stranger.pid, "process_start_time": _start_time(stranger.pid) - 1})
        assert not _answers_control(manager, recycled)
        manager.stop(recycled)
        restarted = manager.ensure_running(recycled)
        assert stranger.poll() is None  # never signalled
        assert restarted.pid != stranger.pid
        assert _answers_control(manager, restarted)
    finally:
        stranger.kill()
        stranger.wait()


# -- hostile tenants ----------------------------------------------------------------------------
# A tenant who is root in its container controls what it can write: the shared /dev/shm, and the
# pipe dir where an older driver mounted it read-write.


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """A process that is not an MPS daemon, though its command line names the control binary and -f."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "nvidia-cuda-mps-control", "-f"],
                               env=env)
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def test_a_pid_file_naming_a_stranger_is_ignored(sim: Sim, stranger: subprocess.Popen[bytes]) -> None:
    manager = sim.manager(stop=0.3)
    record = manager.start(PLAIN)
    (record.pipe_dir / "nvidia-cuda-mps-control.pid").write_text(f"{stranger.pid}\n")
    manager.stop_by_id(PLAN_ID)
    assert stranger.poll() is None
    _assert_nothing_left(sim, PLAN_ID)


def test_a_forged_checkpoint_pid_is_neither_adopted_nor_signalled(
    sim: Sim, stranger: subprocess.Popen[bytes]
) -> None:
    manager = sim.manager(stop=0.3)
    record = manager.start(PLAIN)
    manager.stop(record)
    forged = record.model_copy(update={"pid": stranger.pid, "process_start_time": _start_time(stranger.pid)})
    assert not manager.process_running(forged)
    assert not _answers_control(manager, forged)
    manager.stop(forged)
    restarted = manager.ensure_running(forged)
    assert stranger.poll() is None
    assert manager.process_running(restarted)


class SilentControl:
    """A tenant's fake ``control``: a Unix socket that accepts connections and never answers."""

    def __init__(self) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.held: list[socket.socket] = []

    def plant(self, pipe_dir: Path, name: str) -> None:
        (pipe_dir / name).unlink()
        self.server.bind(str(pipe_dir / name))
        self.server.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.held.append(self.server.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.server.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def silent_control() -> Iterator[list[SilentControl]]:
    fakes = [SilentControl(), SilentControl()]
    yield fakes
    for fake in fakes:
        fake.close()


@pytest.mark.timeout(60)
def test_a_silent_fake_control_socket_never_hangs_the_driver(anyd: Sim, silent_control: list[SilentControl]) -> None:
    manager = anyd.manager(command=0.5, stop=0.5)
    record = manager.start(PLAIN)
    # NVIDIA's client run as root talks to control_privileged; others to control: replace both.
    for fake, name in zip(silent_control, ("control", "control_privileged"), strict=True):
        fake.plant(record.pipe_dir, name)
    assert manager.process_running(record)  # /proc only: no round trip to the fake socket
    assert not _answers_control(manager, record)  # the round trip is bounded
    manager.stop(record)  # quit gets no answer; the daemon is signalled
    assert _gone(record.pid)
    _assert_nothing_left(anyd, PLAN_ID)


def test_a_control_symlink_to_another_daemon_does_not_stop_it(anyd: Sim) -> None:
    manager = anyd.manager(command=0.5, stop=0.5)
    mine = manager.start(PLAIN)
    theirs = manager.start(PLAIN.model_copy(update={"daemon_id": OTHER_ID}))
    for name in ("control", "control_privileged"):
        (mine.pipe_dir / name).unlink()
        (mine.pipe_dir / name).symlink_to(theirs.pipe_dir / name)
    manager.stop(mine)
    assert _gone(mine.pid)
    assert _answers_control(anyd.manager(), theirs)
    anyd.manager().stop(theirs)


def test_planted_names_under_the_base_dir_are_not_daemons(sim: Sim) -> None:
    manager = sim.manager()
    victim = manager.start(PLAIN.model_copy(update={"daemon_id": OTHER_ID}))
    sim.base.joinpath("shm").mkdir()  # the old place of the shared /dev/shm
    sim.base.joinpath("not-a-daemon").mkdir()
    sim.base.joinpath(CLAIM_ID).symlink_to(victim.pipe_dir.parent)  # a tenant's link to another daemon
    assert manager.daemon_ids_on_disk() == [OTHER_ID]
    assert _answers_control(manager, victim)
    manager.stop(victim)


def test_a_symlink_in_the_shm_dir_never_reaches_outside(sim: Sim) -> None:
    outside = sim.top / "precious"
    outside.write_text("keep me")
    manager = sim.manager()
    record = manager.start(PLAIN)
    shm = record.pipe_dir.parent / "shm"  # a per-daemon shm, as a namespacing launcher would use
    shm.mkdir()
    (shm / "evil").symlink_to(outside)
    (shm / "dir").mkdir()
    (shm / "dir" / "evil").symlink_to(sim.top)
    manager.stop(record)
    assert outside.read_text() == "keep me"
    assert sim.top.is_dir()
    _assert_nothing_left(sim, PLAN_ID)


# -- bounded time -----------------------------------------------------------------------------


def test_quit_shares_the_stop_deadline(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_SIM_MPS_FAIL", "hang-quit")
    record = sim.manager().start(PLAIN)
    sim.manager(command=30.0, stop=0.5).stop(record)
    assert _gone(record.pid)
    _assert_nothing_left(sim, PLAN_ID)


def test_default_bounds_fit_the_kubelet_deadline(tmp_path: Path) -> None:
    manager = MpsManager(tmp_path, tmp_path, LocalLauncher(tmp_path))
    assert manager.stop_timeout + _TERM_GRACE_S + _KILL_WAIT_S <= 15
    assert manager.ready_timeout + manager.stop_timeout + _TERM_GRACE_S + _KILL_WAIT_S < 45


# -- client edits -----------------------------------------------------------------------------


def _stored_record(spec: MpsDaemonSpec, shm_dir: Path | None = None) -> MpsDaemonRecord:
    daemon_dir = Path("/m") / spec.daemon_id
    return MpsDaemonRecord(spec=spec, pid=1, pipe_dir=daemon_dir / "pipe", log_dir=daemon_dir / "log",
                           started_at="2025-01-01T00:00:00+00:00", process_start_time=5, shm_dir=shm_dir)


def test_client_edits_mount_the_pipe_dir_read_only_and_the_daemons_shm(sim: Sim) -> None:
    manager = sim.manager()
    record = manager.start(LIMITED)
    edits = client_edits(record, shm_host_dir=Path("/elsewhere"))
    assert edits.env == [
        "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M,1=512M",
    ]
    assert edits.mounts == [
        Mount(host_path=str(record.pipe_dir), container_path="/tmp/nvidia-mps",
              options=["ro", "nosuid", "nodev", "bind"]),
        Mount(host_path=str(sim.top / "shm"), container_path="/dev/shm", options=["rw", "nosuid", "nodev", "bind"]),
    ]


def test_client_edits_of_an_old_record_fall_back_to_the_given_shm() -> None:
    edits = client_edits(_stored_record(PLAIN), container_pipe_dir="/run/mps-a", shm_host_dir=Path("/s"))
    assert edits.env == ["CUDA_MPS_PIPE_DIRECTORY=/run/mps-a"]
    assert edits.mounts == [
        Mount(host_path=f"/m/{PLAN_ID}/pipe", container_path="/run/mps-a", options=["ro", "nosuid", "nodev", "bind"]),
        Mount(host_path="/s", container_path="/dev/shm", options=["rw", "nosuid", "nodev", "bind"])]
    per_daemon = client_edits(_stored_record(PLAIN, shm_dir=Path("/d/shm")), shm_host_dir=Path("/s"))
    assert per_daemon.mounts[1].host_path == "/d/shm"


# -- models -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"daemon_id": "../escape"}, "daemon_id"),
        ({"daemon_id": "a/b"}, "daemon_id"),
        ({"daemon_id": ""}, "daemon_id"),
        ({"gpu_uuids": []}, "gpu_uuids"),
        ({"gpu_uuids": ["0"]}, "not a GPU-... or MIG-... UUID"),
        ({"gpu_uuids": [f"{GPU_A},{GPU_B}"]}, "not a GPU-... or MIG-... UUID"),
        ({"gpu_uuids": [GPU_A, GPU_A]}, "more than once"),
        ({"active_thread_percentage": 0}, "active_thread_percentage"),
        ({"active_thread_percentage": 101}, "active_thread_percentage"),
        ({"pinned_memory_limits": {GPU_A: MIB - 1}}, "at least 1048576 bytes"),
        ({"pinned_memory_limits": {GPU_B: MIB}}, f"names {GPU_B}, which is not in gpu_uuids"),
    ],
)
def test_spec_rejects_bad_input_with_specific_errors(fields: dict[str, object], complaint: str) -> None:
    values: dict[str, object] = {"daemon_id": CLAIM_ID, "gpu_uuids": [GPU_A], **fields}
    with pytest.raises(ValidationError, match=complaint.replace("(", r"\(").replace(".", r"\.")):
        MpsDaemonSpec.model_validate(values)


def test_spec_accepts_mig_devices_and_orders_limits_by_ordinal() -> None:
    mig = "MIG-99999999-8888-7777-6666-555555555555"
    spec = MpsDaemonSpec(
        daemon_id="c.1_x-y", gpu_uuids=[mig, GPU_A], pinned_memory_limits={GPU_A: 3 * MIB, mig: MIB + MIB // 2}
    )
    assert spec.pinned_limits_mib() == [(0, 1), (1, 3)]


def test_record_round_trips_and_ignores_fields_from_newer_drivers() -> None:
    record = _stored_record(LIMITED.model_copy(update={"multi_user": True}), shm_dir=Path("/d/shm"))
    stored = json.loads(record.model_dump_json())
    stored["from_the_future"] = True
    stored["spec"]["also_new"] = 1
    assert MpsDaemonRecord.model_validate(stored) == record


def test_record_written_before_shm_and_multi_user_were_recorded_loads() -> None:
    stored = json.loads(_stored_record(PLAIN).model_dump_json())
    del stored["shm_dir"], stored["spec"]["multi_user"]
    loaded = MpsDaemonRecord.model_validate(stored)
    assert loaded.shm_dir is None and loaded.spec.multi_user is False


def test_a_launcher_answering_with_another_shm_dir_is_refused_and_its_daemon_stopped(sim: Sim) -> None:
    # Clients get the answered directory read-write at /dev/shm: a launcher (the MPS host, over a
    # socket) must not be able to point them anywhere but the directory the manager asked for.
    class Elsewhere(LocalLauncher):
        def launch(self, request: DaemonLaunch, timeout: float | None = None) -> LaunchedDaemon:
            launched = super().launch(request)
            return LaunchedDaemon(pid=launched.pid, shm_dir=sim.top / "elsewhere")

    manager = MpsManager(sim.root, sim.base, Elsewhere(sim.root), shm_dir=sim.top / "shm", ready_timeout=20.0)
    with pytest.raises(MpsError, match="requested"):
        manager.start(LIMITED)
    _assert_nothing_left(sim, CLAIM_ID)


def test_a_running_daemon_without_a_record_is_adopted_only_with_its_limits(anyd: Sim) -> None:
    started = anyd.manager().start(LIMITED)
    # A new manager, as after a checkpoint rebuilt from CDI specs: no record, only the directory.
    adopted = anyd.manager().adopt(LIMITED)
    assert adopted is not None
    assert (adopted.pid, adopted.process_start_time, adopted.pipe_dir) == (
        started.pid, started.process_start_time, started.pipe_dir)
    other_limits = LIMITED.model_copy(update={"active_thread_percentage": 41})
    assert anyd.manager().adopt(other_limits) is None, "a daemon with other limits is not the one wanted"
    anyd.manager().stop(started)
    assert anyd.manager().adopt(LIMITED) is None


class _SessionTakenAtLaunch(LocalLauncher):
    """Launches as the plugin does, then lets a client open the daemon's one control session before the
    driver can send anything: a tenant polling the (predictable, kept) pipe dir could do the same."""

    def __init__(self, driver_root: Path) -> None:
        super().__init__(driver_root)
        self.holders: list[subprocess.Popen[str]] = []

    def launch(self, request: DaemonLaunch, timeout: float | None = None) -> LaunchedDaemon:
        launched = super().launch(request, timeout)
        poll_until(lambda: (request.pipe_dir / "control").is_socket(), "the daemon to listen")
        log = request.log_dir / "control.log"
        binary = str(self.driver_root / "usr" / "bin" / "nvidia-cuda-mps-control")
        holder = subprocess.Popen([binary], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                  env={"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(request.pipe_dir)})
        self.holders.append(holder)
        assert holder.stdin is not None
        holder.stdin.write("get_default_active_thread_percentage\n")
        holder.stdin.flush()
        poll_until(lambda: log.exists() and "NEW UI" in log.read_text(), "the client's session", limit=30)
        return launched


def test_a_start_whose_control_session_another_client_holds_fails_naming_the_busy_socket(anyd: Sim) -> None:
    launcher = _SessionTakenAtLaunch(anyd.root)
    manager = MpsManager(anyd.root, anyd.base, launcher, shm_dir=anyd.top / "shm", ready_timeout=3.0,
                         command_timeout=1.0)
    try:
        with pytest.raises(MpsError, match=r"another client held the daemon's control socket .*/pipe/control"):
            manager.start(LIMITED)
    finally:
        for holder in launcher.holders:
            holder.communicate(timeout=30)
    _assert_nothing_left(anyd, CLAIM_ID)
