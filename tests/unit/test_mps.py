"""MpsManager against the simulated nvidia-cuda-mps-control: real processes and Unix sockets.

Everything lives in a short /tmp directory (socket paths must stay under ~100 bytes). The
fixture kills every process whose command line names that directory, so no daemon outlives a
test, even a failing one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pydantic import ValidationError

from driver.gpu.mps import (
    _KILL_WAIT_S,
    _TERM_GRACE_S,
    MIB,
    MpsDaemonRecord,
    MpsDaemonSpec,
    MpsError,
    MpsManager,
    MpsMount,
    _parse_mib,
)
from tests.support.processes import poll_until, processes_mentioning, standin_sandbox

GPU_A = "GPU-11111111-2222-3333-4444-555555555555"
GPU_B = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


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

    def manager(self, ready: float = 5.0, command: float = 2.0, stop: float = 2.0) -> MpsManager:
        return MpsManager(self.root, self.base, ready_timeout=ready, command_timeout=command, stop_timeout=stop)

    def running(self) -> list[int]:
        return processes_mentioning(str(self.top))

    def journal_entries(self) -> list[dict[str, object]]:
        if not self.journal.exists():
            return []
        return [json.loads(line) for line in self.journal.read_text().splitlines()]


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> Iterator[Sim]:
    monkeypatch.delenv("TESSERA_SIM_MPS_FAIL", raising=False)
    with standin_sandbox("tsm", ["nvidia-cuda-mps-control"]) as top:
        journal = top / "journal.jsonl"
        monkeypatch.setenv("TESSERA_SIM_MPS_JOURNAL", str(journal))
        yield Sim(top=top, root=top / "root", base=top / "mps", journal=journal)


def _assert_nothing_left(sim: Sim, daemon_id: str) -> None:
    assert sim.running() == []
    assert not (sim.base / daemon_id).exists()


def _commands(record: MpsDaemonRecord) -> list[str]:
    lines = (record.log_dir / "commands.jsonl").read_text().splitlines()
    return [" ".join([entry["cmd"], *entry["args"]]) for entry in map(json.loads, lines)]


LIMITED = MpsDaemonSpec(
    daemon_id="claim-1",
    gpu_uuids=[GPU_A, GPU_B],
    active_thread_percentage=40,
    # GPU_B's limit is not whole MiB: MPS gets it rounded down.
    pinned_memory_limits={GPU_A: 2048 * MIB, GPU_B: 1536 * MIB + 123},
)
PLAIN = MpsDaemonSpec(daemon_id="gpu-0", gpu_uuids=[GPU_A])


# -- start ------------------------------------------------------------------------------------


def test_start_applies_limits_in_order_then_checks_readiness(sim: Sim) -> None:
    record = sim.manager().start(LIMITED)
    assert _commands(record) == [
        "set_default_active_thread_percentage 40",
        "set_default_device_pinned_mem_limit 0 2048M",
        "get_default_device_pinned_mem_limit 0",
        "set_default_device_pinned_mem_limit 1 1536M",
        "get_default_device_pinned_mem_limit 1",
        "get_default_active_thread_percentage",
    ]
    assert record.spec == LIMITED
    assert record.pipe_dir == sim.base / "claim-1" / "pipe"
    assert record.log_dir == sim.base / "claim-1" / "log"
    assert int((record.pipe_dir / "nvidia-cuda-mps-control.pid").read_text()) == record.pid
    assert record.process_start_time == _start_time(record.pid)
    assert stat.S_IMODE(record.pipe_dir.stat().st_mode) == 0o755
    environ = dict(
        item.split("=", 1) for item in Path(f"/proc/{record.pid}/environ").read_text().split("\0") if "=" in item
    )
    assert environ["CUDA_VISIBLE_DEVICES"] == f"{GPU_A},{GPU_B}"
    assert environ["CUDA_MPS_PIPE_DIRECTORY"] == str(record.pipe_dir)
    assert environ["CUDA_MPS_LOG_DIRECTORY"] == str(record.log_dir)


def test_start_without_limits_only_checks_readiness(sim: Sim) -> None:
    record = sim.manager().start(PLAIN)
    assert _commands(record) == ["get_default_active_thread_percentage"]
    assert sim.manager().is_alive(record)


@pytest.mark.parametrize(
    ("failure", "said"),
    [
        # The last fragment of each comes from the tail of control.log.
        ("start", ["claim-1", "-d` exited with status 1", "control.log", "injected start failure"]),
        (
            "reject-limits",
            ["refused 'set_default_active_thread_percentage 40'", "Cmd:set_default_active_thread_percentage 40"],
        ),
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
    _assert_nothing_left(sim, "claim-1")


def test_hanging_daemon_fails_readiness_within_bound_and_is_killed(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_SIM_MPS_FAIL", "hang")
    with pytest.raises(MpsError, match="did not become ready within 2s"):
        sim.manager(ready=2.0, command=0.3, stop=0.3).start(PLAIN)
    started = [e for e in sim.journal_entries() if e.get("event") == "start"]
    assert len(started) == 1  # a daemon did run...
    assert _gone(int(str(started[0]["pid"])))  # ...and was killed
    _assert_nothing_left(sim, "gpu-0")


def test_hanging_daemon_fails_on_first_limit(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_SIM_MPS_FAIL", "hang")
    with pytest.raises(MpsError, match=r"'set_default_active_thread_percentage 40' got no answer within 0.3s"):
        sim.manager(ready=3.0, command=0.3, stop=0.3).start(LIMITED)
    _assert_nothing_left(sim, "claim-1")


def test_limit_that_does_not_read_back_fails_start(sim: Sim) -> None:
    # A daemon that accepts the limit but reports none: wraps the stand-in and lies on read-back.
    # The stand-in keeps its name, so the daemon it starts is still recognisably the control daemon.
    real = sim.top / "real" / "nvidia-cuda-mps-control"
    real.parent.mkdir()
    (sim.root / "usr" / "bin" / "nvidia-cuda-mps-control").rename(real)
    wrapper = sim.root / "usr" / "bin" / "nvidia-cuda-mps-control"
    wrapper.write_text(
        f"#!{sys.executable}\n"
        "import os, subprocess, sys\n"
        "data = '' if sys.argv[1:] else sys.stdin.read()\n"
        "if data.startswith('get_default_device_pinned_mem_limit'):\n"
        "    print('unlimited'); sys.exit(0)\n"
        f"sys.exit(subprocess.run([{str(real)!r}, *sys.argv[1:]], input=data, text=True).returncode)\n"
    )
    wrapper.chmod(0o755)
    with pytest.raises(MpsError, match=r"device 0 \(GPU-1111.*\) reads back as 'unlimited', expected 2048M"):
        sim.manager().start(LIMITED)
    _assert_nothing_left(sim, "claim-1")


def test_missing_binary_names_the_driver_root_setting(sim: Sim) -> None:
    (sim.root / "usr" / "bin" / "nvidia-cuda-mps-control").unlink()
    with pytest.raises(MpsError, match="nvidiaDriverRoot"):
        sim.manager().start(PLAIN)
    assert not (sim.base / "gpu-0").exists()


def test_start_refuses_second_daemon_for_same_id(sim: Sim) -> None:
    manager = sim.manager()
    record = manager.start(PLAIN)
    with pytest.raises(MpsError, match=f"pid {record.pid}.* already runs"):
        manager.start(PLAIN)
    assert manager.is_alive(record)


def test_start_replaces_leftovers_of_a_dead_daemon(sim: Sim) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    pipe = sim.base / "gpu-0" / "pipe"
    pipe.mkdir(parents=True)
    (pipe / "nvidia-cuda-mps-control.pid").write_text(f"{dead.pid}\n")
    (pipe / "control").write_text("stale")
    record = sim.manager().start(PLAIN)
    assert sim.manager().is_alive(record)


def test_start_rejects_pipe_dir_too_long_for_sockets(sim: Sim) -> None:
    deep = sim.top / ("d" * 90)
    with pytest.raises(MpsError, match="too long"):
        MpsManager(sim.root, deep).start(PLAIN)
    assert not deep.exists()


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
    assert not (sim.base / "gpu-0").exists()
    manager.stop(record)  # idempotent
    assert sim.running() == []


def test_stop_terminates_a_daemon_that_ignores_quit(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_SIM_MPS_FAIL", "hang-quit")
    record = sim.manager().start(PLAIN)
    sim.manager(command=0.5, stop=0.5).stop(record)
    mine = [e for e in sim.journal_entries() if e["pid"] == record.pid]
    assert {"pid": record.pid, "cmd": "quit", "args": []} in mine
    assert not any(e.get("event") == "exit" for e in mine)  # it never quit: it was signalled
    assert _gone(record.pid)
    _assert_nothing_left(sim, "gpu-0")


def test_stop_kills_a_daemon_that_ignores_sigterm(sim: Sim) -> None:
    record = sim.manager().start(PLAIN)
    os.kill(record.pid, signal.SIGSTOP)  # a stopped process answers nothing and defers SIGTERM
    sim.manager(command=0.3, stop=0.3).stop(record)
    assert _gone(record.pid)
    _assert_nothing_left(sim, "gpu-0")


def test_stop_by_id_ends_a_daemon_whose_record_was_lost(sim: Sim) -> None:
    manager = sim.manager()
    record = manager.start(PLAIN)
    (sim.base / "shm").mkdir()  # not a daemon directory
    assert manager.daemon_ids_on_disk() == ["gpu-0"]
    with pytest.raises(MpsError, match="already runs"):
        manager.start(PLAIN)
    manager.stop_by_id("gpu-0")
    assert _gone(record.pid)
    assert manager.daemon_ids_on_disk() == []
    manager.stop_by_id("gpu-0")  # idempotent
    assert manager.is_alive(manager.start(PLAIN))


def test_stop_by_id_rejects_unsafe_ids(sim: Sim) -> None:
    with pytest.raises(ValueError, match=r"daemon_id '\.\./root' must be"):
        sim.manager().stop_by_id("../root")


# -- is_alive / ensure_running ---------------------------------------------------------------


def test_is_alive_false_after_kill_9(sim: Sim) -> None:
    manager = sim.manager()
    record = manager.start(PLAIN)
    assert manager.is_alive(record)
    os.kill(record.pid, signal.SIGKILL)
    poll_until(lambda: _gone(record.pid), "the killed daemon to die")
    assert not manager.is_alive(record)


def test_is_alive_false_when_daemon_does_not_answer(sim: Sim) -> None:
    record = sim.manager().start(PLAIN)
    os.kill(record.pid, signal.SIGSTOP)
    assert not sim.manager(command=0.3).is_alive(record)


def test_ensure_running_adopts_a_live_daemon(sim: Sim) -> None:
    manager = sim.manager()
    record = manager.start(LIMITED)
    assert manager.ensure_running(record) == record
    assert [e for e in sim.journal_entries() if e.get("event") == "start"] == [{"pid": record.pid, "event": "start"}]
    assert _commands(record).count("set_default_active_thread_percentage 40") == 1


def test_ensure_running_restarts_a_dead_daemon_with_the_same_limits(sim: Sim) -> None:
    manager = sim.manager()
    old = manager.start(LIMITED)
    os.kill(old.pid, signal.SIGKILL)
    poll_until(lambda: _gone(old.pid), "the killed daemon to die")
    new = manager.ensure_running(old)
    assert new.pid != old.pid
    assert new.spec == old.spec
    assert manager.is_alive(new)
    assert _commands(new)[:5] == [
        "set_default_active_thread_percentage 40",
        "set_default_device_pinned_mem_limit 0 2048M",
        "get_default_device_pinned_mem_limit 0",
        "set_default_device_pinned_mem_limit 1 1536M",
        "get_default_device_pinned_mem_limit 1",
    ]
    assert sorted(sim.running()) == [new.pid]


def test_recycled_pid_is_never_taken_for_our_daemon(sim: Sim) -> None:
    manager = sim.manager()
    record = manager.start(PLAIN)
    # Same PID, different start time: must not count as our daemon even though one answers.
    assert not manager.is_alive(record.model_copy(update={"process_start_time": record.process_start_time + 1}))
    manager.stop(record)

    stranger = subprocess.Popen(["sleep", "60"])
    try:
        recycled = record.model_copy(update={"pid": stranger.pid, "process_start_time": _start_time(stranger.pid) - 1})
        assert not manager.is_alive(recycled)
        manager.stop(recycled)
        restarted = manager.ensure_running(recycled)
        assert stranger.poll() is None  # never signalled
        assert restarted.pid != stranger.pid
        assert manager.is_alive(restarted)
    finally:
        stranger.kill()
        stranger.wait()


# -- tenant-controlled pids ---------------------------------------------------------------------
# Clients get the pipe dir read-write, so they can write any PID into its pid file.


@pytest.fixture
def stranger() -> Iterator[subprocess.Popen[bytes]]:
    """A process that is not an MPS daemon, though its command line names the control binary."""
    sleep = shutil.which("sleep")
    assert sleep is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")}
    process = subprocess.Popen(["nvidia-cuda-mps-control", "60"], executable=sleep, env=env)
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def _forge_pid_file(pipe_dir: Path, pid: int) -> None:
    (pipe_dir / "nvidia-cuda-mps-control.pid").write_text(f"{pid}\n")


def test_stop_by_id_never_signals_a_process_a_tenant_named(sim: Sim, stranger: subprocess.Popen[bytes]) -> None:
    manager = sim.manager(stop=0.3)
    record = manager.start(PLAIN)
    _forge_pid_file(record.pipe_dir, stranger.pid)
    manager.stop_by_id("gpu-0")
    assert stranger.poll() is None
    assert _gone(record.pid)  # the daemon itself still got quit through its socket
    _assert_nothing_left(sim, "gpu-0")


def test_stop_never_signals_another_tenants_daemon(sim: Sim) -> None:
    manager = sim.manager(stop=0.3)
    mine = manager.start(PLAIN)
    theirs = manager.start(PLAIN.model_copy(update={"daemon_id": "gpu-1"}))
    os.kill(mine.pid, signal.SIGKILL)
    poll_until(lambda: _gone(mine.pid), "the killed daemon to die")
    _forge_pid_file(mine.pipe_dir, theirs.pid)
    manager.stop(mine)
    manager.stop_by_id("gpu-0")
    assert manager.is_alive(theirs)
    assert not (sim.base / "gpu-0").exists()
    manager.stop(theirs)


def test_a_forged_checkpoint_pid_is_neither_adopted_nor_signalled(
    sim: Sim, stranger: subprocess.Popen[bytes]
) -> None:
    manager = sim.manager(stop=0.3)
    record = manager.start(PLAIN)
    manager.stop(record)
    forged = record.model_copy(update={"pid": stranger.pid, "process_start_time": _start_time(stranger.pid)})
    assert not manager.daemon_matches(forged)
    assert not manager.is_running(forged)
    assert not manager.is_alive(forged)
    manager.stop(forged)
    restarted = manager.ensure_running(forged)
    assert stranger.poll() is None
    assert restarted.pid != stranger.pid
    assert manager.daemon_matches(restarted)


def test_start_is_not_blocked_by_a_pid_file_naming_a_stranger(sim: Sim, stranger: subprocess.Popen[bytes]) -> None:
    pipe = sim.base / "gpu-0" / "pipe"
    pipe.mkdir(parents=True)
    _forge_pid_file(pipe, stranger.pid)
    record = sim.manager().start(PLAIN)
    assert sim.manager().is_alive(record)
    assert stranger.poll() is None


@pytest.mark.timeout(30)
def test_a_fifo_for_a_pid_file_does_not_hang_stop(sim: Sim) -> None:
    manager = sim.manager(stop=0.3)
    record = manager.start(PLAIN)
    pid_file = record.pipe_dir / "nvidia-cuda-mps-control.pid"
    pid_file.unlink()
    os.mkfifo(pid_file)
    manager.stop_by_id("gpu-0")
    assert _gone(record.pid)
    _assert_nothing_left(sim, "gpu-0")


# -- bounded time -----------------------------------------------------------------------------


def test_limit_commands_share_the_start_deadline(sim: Sim, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_SIM_MPS_FAIL", "hang")
    with pytest.raises(MpsError, match=r"'set_default_active_thread_percentage 40' got no answer before the 1s start"):
        sim.manager(ready=1.0, command=30.0, stop=0.3).start(LIMITED)
    _assert_nothing_left(sim, "claim-1")


def test_quit_shares_the_stop_deadline(
    sim: Sim, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TESSERA_SIM_MPS_FAIL", "hang-quit")
    record = sim.manager().start(PLAIN)
    with caplog.at_level(logging.INFO, logger="driver.gpu.mps"):
        sim.manager(command=30.0, stop=0.5).stop(record)
    reasons = [str(getattr(r, "reason", "")) for r in caplog.records]
    assert any("'quit' got no answer before the 0.5s stop deadline" in reason for reason in reasons), reasons
    assert _gone(record.pid)
    _assert_nothing_left(sim, "gpu-0")


def test_default_bounds_fit_the_kubelet_deadline(tmp_path: Path) -> None:
    manager = MpsManager(tmp_path, tmp_path)
    # A stop is a graceful part, then SIGTERM's grace, then SIGKILL's wait.
    assert manager.stop_timeout + _TERM_GRACE_S + _KILL_WAIT_S <= 15
    # A failed start is followed by a stop; the kubelet allows 45 s for the whole prepare.
    assert manager.ready_timeout + manager.stop_timeout + _TERM_GRACE_S + _KILL_WAIT_S < 45


# -- client edits -----------------------------------------------------------------------------


def _stored_record(spec: MpsDaemonSpec, pid: int, process_start_time: int) -> MpsDaemonRecord:
    """A record as a checkpoint holds it, for a daemon under base dir /m that need not exist."""
    daemon_dir = Path("/m") / spec.daemon_id
    return MpsDaemonRecord(
        spec=spec,
        pid=pid,
        pipe_dir=daemon_dir / "pipe",
        log_dir=daemon_dir / "log",
        started_at="2025-01-01T00:00:00+00:00",
        process_start_time=process_start_time,
    )


def test_client_edits_carry_pipe_dir_limits_and_shm(sim: Sim) -> None:
    manager = sim.manager()
    record = manager.start(LIMITED)
    edits = manager.client_edits(record, shm_host_dir=Path("/run/tessera/shm/claim-1"))
    assert edits.env == [
        "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=2048M,1=1536M",
    ]
    options = ["rw", "nosuid", "nodev", "bind"]
    assert edits.mounts == [
        MpsMount(str(record.pipe_dir), "/tmp/nvidia-mps", options),
        MpsMount("/run/tessera/shm/claim-1", "/dev/shm", options),
    ]


def test_client_edits_without_limits_or_shm() -> None:
    record = _stored_record(PLAIN, pid=1, process_start_time=5)
    edits = MpsManager(Path("/"), Path("/m")).client_edits(record, container_pipe_dir="/run/mps-a")
    assert edits.env == ["CUDA_MPS_PIPE_DIRECTORY=/run/mps-a"]
    assert edits.mounts == [MpsMount("/m/gpu-0/pipe", "/run/mps-a", ["rw", "nosuid", "nodev", "bind"])]


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
    values: dict[str, object] = {"daemon_id": "claim-1", "gpu_uuids": [GPU_A], **fields}
    with pytest.raises(ValidationError, match=complaint.replace("(", r"\(").replace(".", r"\.")):
        MpsDaemonSpec.model_validate(values)


def test_spec_accepts_mig_devices_and_orders_limits_by_ordinal() -> None:
    mig = "MIG-99999999-8888-7777-6666-555555555555"
    spec = MpsDaemonSpec(
        daemon_id="c.1_x-y", gpu_uuids=[mig, GPU_A], pinned_memory_limits={GPU_A: 3 * MIB, mig: MIB + MIB // 2}
    )
    assert spec.pinned_limits_mib() == [(0, 1), (1, 3)]


def test_record_round_trips_and_ignores_fields_from_newer_drivers() -> None:
    record = _stored_record(LIMITED, pid=42, process_start_time=123)
    stored = json.loads(record.model_dump_json())
    stored["from_the_future"] = True
    stored["spec"]["also_new"] = 1
    assert MpsDaemonRecord.model_validate(stored) == record


@pytest.mark.parametrize(
    ("answer", "mib"),
    [("2048M", 2048), ("4G", 4096), ("1536 MiB", 1536), ("device 0: 2048 MB", 2048), ("2048M for device 1", 2048),
     ("512", 512), ("unlimited", None), ("", None)],
)
def test_memory_read_back_understands_likely_answer_formats(answer: str, mib: int | None) -> None:
    assert _parse_mib(answer) == mib


def test_is_running_is_the_cheap_process_check(sim: Sim) -> None:
    manager = sim.manager()
    record = manager.start(PLAIN)
    commands_before = len(_commands(record))
    assert manager.is_running(record)
    assert _commands(record)[commands_before:] == [], "no control command is sent"
    assert not manager.is_running(record.model_copy(update={"process_start_time": record.process_start_time + 1}))
    manager.stop(record)
    assert not manager.is_running(record)
