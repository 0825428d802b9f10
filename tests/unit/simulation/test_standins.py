"""The simulation stand-ins for nvidia-cuda-mps-control and nvidia-smi, driver-root lookup, and run_binary.

The stand-ins run as real processes in a simulated driver root under a short /tmp directory
(Unix socket paths must stay under ~100 bytes).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from driver.gpu.host.binaries import (
    BIN_DIRS,
    LIBRARY_LINK_DIR_PREFIX,
    BinaryFailed,
    BinaryNotFound,
    BinaryTimedOut,
    DriverLibrariesUnusable,
    driver_env,
    find_binary,
    find_driver_library,
    nvidia_library_dir,
    resolve_in_root,
    run_binary,
)
from tests.support.mpsdaemons import MpsDaemonKind, daemon_params
from tests.support.processes import SIM_BIN, poll_until, processes_mentioning, standin_sandbox

STANDINS = ("nvidia-cuda-mps-control", "nvidia-smi")
GPU_A = "GPU-11111111-2222-3333-4444-555555555555"


@dataclass(frozen=True)
class SimRoot:
    top: Path
    root: Path

    def exe(self, name: str) -> Path:
        return self.root / "usr" / "bin" / name


@pytest.fixture
def sim() -> Iterator[SimRoot]:
    with standin_sandbox("tss", STANDINS) as top:
        yield SimRoot(top=top, root=top / "root")


def _mps_env(sim: SimRoot, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_SIM_", "CUDA_MPS_"))}
    env["CUDA_MPS_PIPE_DIRECTORY"] = str(sim.top / "p")
    env["CUDA_MPS_LOG_DIRECTORY"] = str(sim.top / "l")
    env.update(extra)
    return env


def _mps(
    sim: SimRoot, env: dict[str, str], *args: str, stdin: str = "", timeout: float = 10.0
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(sim.exe("nvidia-cuda-mps-control")), *args],
        input=stdin,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _commands(log_dir: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (log_dir / "commands.jsonl").read_text().splitlines()]


# -- both stand-ins ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", STANDINS)
def test_standin_is_executable_and_labelled_simulation(name: str) -> None:
    path = SIM_BIN / name
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    head = path.read_text().splitlines()
    assert head[0] == "#!/usr/bin/env python3"
    assert "SIMULATION STAND-IN" in "\n".join(head[:5])
    shown = subprocess.run([str(path), "--help"], capture_output=True, text=True, timeout=10, check=True)
    assert "SIMULATION STAND-IN" in shown.stdout


# -- nvidia-cuda-mps-control ----------------------------------------------------------------


@pytest.fixture(params=daemon_params())
def mpsd(request: pytest.FixtureRequest) -> Iterator[tuple[SimRoot, MpsDaemonKind]]:
    """A driver root holding the stand-in, then NVIDIA's own control daemons where fetched."""
    kind: MpsDaemonKind = request.param
    with standin_sandbox("tss", []) as top:
        kind.install(top / "root" / "usr" / "bin")
        yield SimRoot(top=top, root=top / "root"), kind


# What NVIDIA's 550.163 and 535.261 answer (docs/sharing.md, "NVIDIA's daemon, as measured"); the
# stand-in must answer the same. Commands answered with nothing print no line.
MEASURED_DIALOGUE = [
    ("get_default_active_thread_percentage", "100.0"),
    ("set_default_active_thread_percentage 25", "25.0"),
    ("set_default_active_thread_percentage 0", "25.0"),  # refused: the log says "Invalid percentage"
    ("get_default_active_thread_percentage", "25.0"),
    ("set_default_device_pinned_mem_limit 0 20389M", None),
    ("get_default_device_pinned_mem_limit 0", "19G"),
    ("set_default_device_pinned_mem_limit 0 3840M", None),
    ("get_default_device_pinned_mem_limit 0", "3G"),
    ("set_default_device_pinned_mem_limit 0 1025M", None),
    ("get_default_device_pinned_mem_limit 0", "1G"),
    ("set_default_device_pinned_mem_limit 0 1023M", None),
    ("get_default_device_pinned_mem_limit 0", "1023M"),
    ("set_default_device_pinned_mem_limit 0 16G", None),
    ("get_default_device_pinned_mem_limit 0", "16G"),
    ("get_default_device_pinned_mem_limit 1", None),  # no limit set: nothing
    ("set_default_device_pinned_mem_limit 1 512M", None),
    ("get_default_device_pinned_mem_limit 1", "512M"),
    (f"get_default_device_pinned_mem_limit {GPU_A}", "16G"),  # a UUID reads device 0 (atoi)...
    (f"set_default_device_pinned_mem_limit {GPU_A} 3840M", None),  # ...and a set with one clears it
    ("get_default_device_pinned_mem_limit 0", None),
    ("set_default_device_pinned_mem_limit 1 abc", None),  # invalid: accepted silently, no limit left
    ("get_default_device_pinned_mem_limit 1", None),
    ("bogus", 'Unknown command "bogus"'),
    ("get_server_list", None),
]


def test_mps_daemon_answers_as_nvidias_daemon_does(mpsd: tuple[SimRoot, MpsDaemonKind]) -> None:
    sim, kind = mpsd
    env = _mps_env(sim, CUDA_VISIBLE_DEVICES=GPU_A)
    started = _mps(sim, env, "-d")
    assert started.returncode == 0, started.stderr
    pipe = sim.top / "p"
    expected_files = ["control", "control_lock", "control_privileged", "log"]
    if kind.writes_pid_file:
        expected_files.append("nvidia-cuda-mps-control.pid")
    assert sorted(p.name for p in pipe.iterdir()) == expected_files
    assert stat.S_IMODE((pipe / "control").lstat().st_mode) == 0o666
    assert stat.S_ISFIFO((pipe / "log").lstat().st_mode)

    answers = _mps(sim, env, stdin="".join(f"{command}\n" for command, _ in MEASURED_DIALOGUE))
    assert answers.returncode == 0, answers.stderr
    assert answers.stdout.splitlines() == [answer for _, answer in MEASURED_DIALOGUE if answer is not None]
    logged = ("Cmd:set_default_active_thread_percentage 25", "Invalid percentage, expected between (0.0, 100.0]",
              "No default pinned memory limit set for the device!", "Cmd:get_server_list")

    def log_lines() -> list[str]:  # complete lines only: the daemon may be writing the last one
        return (sim.top / "l" / "control.log").read_text().rpartition("\n")[0].splitlines()

    # The daemon may write its log line after the answer has gone out.
    poll_until(lambda: all(any(line.endswith(text) for line in log_lines()) for text in logged),
               "the daemon to log the dialogue")
    stamp = re.compile(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} Control [ \d]{4}\d+\] ")
    assert [line for line in log_lines() if not stamp.match(line)] == []

    daemons = processes_mentioning(str(sim.top))
    assert _mps(sim, env, stdin="quit\n").returncode == 0
    poll_until(lambda: processes_mentioning(str(sim.top)) == [], "the daemon to exit after quit")
    assert daemons
    assert sorted(p.name for p in pipe.iterdir()) == ["control", "control_lock", "control_privileged"]


def test_mps_foreground_daemon_logs_to_stdout_and_refuses_a_second(mpsd: tuple[SimRoot, MpsDaemonKind]) -> None:
    sim, _ = mpsd
    env = _mps_env(sim)
    (sim.top / "p").mkdir()
    (sim.top / "l").mkdir()
    out = (sim.top / "out").open("w")
    first = subprocess.Popen([str(sim.exe("nvidia-cuda-mps-control")), "-f"], env=env, stdout=out,
                             stderr=subprocess.STDOUT)
    try:
        poll_until(lambda: (sim.top / "p" / "control").exists(), "the foreground daemon to listen")
        poll_until(lambda: _mps(sim, env, stdin="get_server_list\n").returncode == 0, "the daemon to answer")
        second = _mps(sim, env, "-f")
        assert second.returncode == 1
        assert second.stdout.strip() == "An instance of this daemon is already running"
        assert not (sim.top / "l" / "control.log").exists()
        assert "Starting control daemon using socket" in (sim.top / "out").read_text()
        assert _mps(sim, env, stdin="quit\n").returncode == 0
        assert first.wait(timeout=10) == 0
    finally:
        first.kill()
        first.wait()
        out.close()


@pytest.mark.parametrize("args", [["-x"], ["-M"], ["-d", "-x"]])
def test_mps_unknown_arguments_make_the_front_end_client(mpsd: tuple[SimRoot, MpsDaemonKind], args: list[str]) -> None:
    sim, _ = mpsd
    result = _mps(sim, _mps_env(sim), *args)
    assert result.returncode == 1
    assert "Cannot find MPS control daemon process" in result.stderr
    assert processes_mentioning(str(sim.top)) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="running a client as another UID needs root")
def test_mps_settings_and_quit_from_another_uid_are_refused(mpsd: tuple[SimRoot, MpsDaemonKind]) -> None:
    sim, kind = mpsd
    sim.top.chmod(0o755)  # the other UID must reach the binary and the pipe dir
    env = _mps_env(sim)
    assert _mps(sim, env, "-d").returncode == 0
    nobody = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(sim.exe("nvidia-cuda-mps-control"))],
        input="set_default_active_thread_percentage 50\nquit\nget_default_active_thread_percentage\n",
        env=env, capture_output=True, text=True, timeout=10, check=False)
    assert nobody.returncode == 0
    # Measured: 550 refuses another UID's settings; 535 takes them. Neither lets it quit the daemon.
    refused = ("Insufficient privileges for UID 65534. Control deamon settings can only be modified by the user "
               "started it or by the root user.")
    assert nobody.stdout.splitlines() == [
        refused if kind.guards_settings else "50.0",
        "Not enough privilege to execute quit command",
        "100.0" if kind.guards_settings else "50.0",
    ]
    assert _mps(sim, env, stdin="quit\n").returncode == 0


def test_mps_client_without_daemon_fails_with_message(sim: SimRoot) -> None:
    result = _mps(sim, _mps_env(sim), stdin="get_server_list\n")
    assert result.returncode != 0
    assert "Cannot find MPS control daemon" in result.stderr


def test_mps_daemon_refuses_second_instance_in_same_pipe_dir(sim: SimRoot) -> None:
    env = _mps_env(sim)
    assert _mps(sim, env, "-d").returncode == 0
    second = _mps(sim, env, "-d")
    assert second.returncode == 1
    assert second.stdout.strip() == "An instance of this daemon is already running"
    assert len(processes_mentioning(str(sim.top))) == 1


def test_mps_535_model_writes_no_pid_file(sim: SimRoot) -> None:
    env = _mps_env(sim, TESSERA_SIM_MPS_DRIVER="535")
    assert _mps(sim, env, "-d").returncode == 0
    assert sorted(p.name for p in (sim.top / "p").iterdir()) == ["control", "control_lock", "control_privileged", "log"]


class SimClient:
    """A SIMULATION MPS client of the stand-in: connected until closed."""

    def __init__(self, sim: SimRoot, env: dict[str, str], uid: int) -> None:
        self.process = subprocess.Popen(
            [str(sim.exe("nvidia-cuda-mps-control")), "--simulation-client", str(uid)],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def says(self) -> str:
        assert self.process.stdout is not None
        return self.process.stdout.readline().strip()

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=10)


def test_mps_one_server_per_uid_queues_other_uids_until_the_first_is_done(sim: SimRoot) -> None:
    # nvidia-cuda-mps-control(1): a client of another UID waits until the running server's clients are done.
    env = _mps_env(sim)
    assert _mps(sim, env, "-d").returncode == 0
    clients: list[SimClient] = []
    try:
        # One at a time: each is answered before the next connects.
        alice = SimClient(sim, env, 1000)
        clients.append(alice)
        first = alice.says()
        assert re.fullmatch(r"SERVER \d+ uid 1000", first)
        bob = SimClient(sim, env, 2000)
        clients.append(bob)
        assert bob.says() == "QUEUED uid 2000 behind uid 1000"
        alice2 = SimClient(sim, env, 1000)
        clients.append(alice2)
        assert alice2.says() == first  # the same UID shares the running server
        assert _mps(sim, env, stdin="get_server_list\n").stdout.split() == [first.split()[1]]
        alice.close()
        assert _mps(sim, env, stdin="get_server_list\n").stdout.split() == [first.split()[1]], "alice2 still runs"
        alice2.close()
        served = bob.says()
        assert re.fullmatch(r"SERVER \d+ uid 2000", served) and served.split()[1] != first.split()[1]
    finally:
        for client in clients:
            client.process.kill()
            client.process.wait()


def test_mps_multi_user_daemon_serves_every_uid_at_once(sim: SimRoot) -> None:
    env = _mps_env(sim)
    assert _mps(sim, env, "-d", "-M").returncode == 0
    alice, bob = SimClient(sim, env, 1000), SimClient(sim, env, 2000)
    try:
        served = alice.says()
        assert re.fullmatch(r"SERVER \d+ uid 1000", served)
        assert bob.says() == f"SERVER {served.split()[1]} uid 2000"
    finally:
        for client in (alice, bob):
            client.process.kill()
            client.process.wait()


def test_mps_injected_start_failure_leaves_nothing_running(sim: SimRoot) -> None:
    result = _mps(sim, _mps_env(sim, TESSERA_SIM_MPS_FAIL="start"), "-d")
    assert result.returncode != 0
    assert "failed to start" in result.stderr
    assert "injected start failure" in (sim.top / "l" / "control.log").read_text()
    assert not (sim.top / "p" / "nvidia-cuda-mps-control.pid").exists()
    assert processes_mentioning(str(sim.top)) == []


def test_mps_reject_limits_answers_set_commands_with_error(sim: SimRoot) -> None:
    env = _mps_env(sim, TESSERA_SIM_MPS_FAIL="reject-limits")
    assert _mps(sim, env, "-d").returncode == 0
    result = _mps(sim, env, stdin="set_default_active_thread_percentage 50\nget_default_active_thread_percentage\n")
    assert result.returncode == 0
    first, second = result.stdout.splitlines()
    assert first.startswith("Error:")
    assert second == "100.0"


def test_mps_hang_mode_never_answers(sim: SimRoot) -> None:
    env = _mps_env(sim, TESSERA_SIM_MPS_FAIL="hang")
    assert _mps(sim, env, "-d").returncode == 0
    with pytest.raises(subprocess.TimeoutExpired):
        _mps(sim, env, stdin="get_default_active_thread_percentage\n", timeout=0.5)


def test_mps_daemon_dies_on_sigterm(sim: SimRoot) -> None:
    env = _mps_env(sim)
    assert _mps(sim, env, "-d").returncode == 0
    pid = int((sim.top / "p" / "nvidia-cuda-mps-control.pid").read_text())
    os.kill(pid, signal.SIGTERM)
    poll_until(lambda: pid not in processes_mentioning(str(sim.top)), "the daemon to die on SIGTERM")


# -- nvidia-smi -------------------------------------------------------------------------------


def _smi(sim: SimRoot, *args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_SIM_")}
    env["TESSERA_SIM_NVIDIA_SMI_LOG"] = str(sim.top / "smi.jsonl")
    env["TESSERA_SIM_NVIDIA_SMI_STATE"] = str(sim.top / "smi-state.json")
    env.update(extra)
    return subprocess.run(
        [str(sim.exe("nvidia-smi")), *args], env=env, capture_output=True, text=True, timeout=10, check=False
    )


def _smi_calls(sim: SimRoot) -> list[list[str]]:
    return [json.loads(line) for line in (sim.top / "smi.jsonl").read_text().splitlines()]


def test_nvidia_smi_records_calls_and_keeps_settings(sim: SimRoot) -> None:
    assert _smi(sim, "-i", GPU_A, "-c", "EXCLUSIVE_PROCESS").returncode == 0
    assert _smi(sim, "compute-policy", "-i", GPU_A, "--set-timeslice", "3").returncode == 0
    listed = _smi(sim, "compute-policy", "-l")
    assert f"{GPU_A}: timeslice Long (3)" in listed.stdout
    gpus = _smi(sim, "-L", TESSERA_SIM_GPU_UUIDS="GPU-seeded-0")
    assert gpus.stdout.splitlines() == [
        "GPU 0: Simulated GPU (SIMULATION STAND-IN) (UUID: GPU-seeded-0)",
        f"GPU 1: Simulated GPU (SIMULATION STAND-IN) (UUID: {GPU_A})",
    ]
    state = json.loads((sim.top / "smi-state.json").read_text())
    assert state[GPU_A] == {"compute_mode": "EXCLUSIVE_PROCESS", "timeslice": 3}
    assert _smi_calls(sim) == [
        ["-i", GPU_A, "-c", "EXCLUSIVE_PROCESS"],
        ["compute-policy", "-i", GPU_A, "--set-timeslice", "3"],
        ["compute-policy", "-l"],
        ["-L"],
    ]


def test_nvidia_smi_injected_failure_matches_only_its_call(sim: SimRoot) -> None:
    fail = {"TESSERA_SIM_NVIDIA_SMI_FAIL": "--set-timeslice"}
    assert _smi(sim, "-i", GPU_A, "-c", "DEFAULT", **fail).returncode == 0
    failed = _smi(sim, "compute-policy", "-i", GPU_A, "--set-timeslice", "1", **fail)
    assert failed.returncode == 3
    assert "injected failure" in failed.stderr
    assert _smi_calls(sim)[-1] == ["compute-policy", "-i", GPU_A, "--set-timeslice", "1"]
    state = json.loads((sim.top / "smi-state.json").read_text())
    assert state[GPU_A]["timeslice"] == 0


@pytest.mark.parametrize(
    "args",
    [
        ["compute-policy", "-i", GPU_A, "--set-timeslice", "7"],
        ["-i", GPU_A, "-c", "EXCLUSIVE_THREAD"],
        ["compute-policy", "-i", "MIG-abc", "--set-timeslice", "1"],
        ["--no-such-flag"],
    ],
)
def test_nvidia_smi_rejects_bad_arguments(sim: SimRoot, args: list[str]) -> None:
    result = _smi(sim, *args)
    assert result.returncode == 2
    assert "SIMULATION STAND-IN" in result.stderr


def test_nvidia_smi_default_log_is_under_the_driver_root(sim: SimRoot) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_SIM_")}
    subprocess.run(
        [str(sim.exe("nvidia-smi")), "-i", GPU_A, "-c", "DEFAULT"], env=env, check=True, capture_output=True, timeout=10
    )
    calls = (sim.root / "var" / "log" / "nvidia-smi-calls.jsonl").read_text().splitlines()
    assert [json.loads(c) for c in calls] == [["-i", GPU_A, "-c", "DEFAULT"]]


# -- find_binary / driver_env -----------------------------------------------------------------


def _make_exe(path: Path, mode: int = 0o755) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(mode)
    return path


def test_find_binary_takes_first_executable_in_search_order(tmp_path: Path) -> None:
    _make_exe(tmp_path / "usr/sbin/tool")
    expected = _make_exe(tmp_path / "bin/tool")
    _make_exe(tmp_path / "usr/local/nvidia/bin/tool", mode=0o644)  # not executable: skipped
    assert find_binary(tmp_path, "tool") == expected
    first = _make_exe(tmp_path / "usr/bin/tool")
    assert find_binary(tmp_path, "tool") == first


def test_find_binary_error_lists_where_it_looked_and_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(BinaryNotFound) as caught:
        find_binary(tmp_path, "nvidia-smi")
    message = str(caught.value)
    assert "nvidia-smi" in message
    for bin_dir in BIN_DIRS:
        assert str(tmp_path / bin_dir) in message
    assert "nvidiaDriverRoot" in message
    assert "--driver-root" in message


@pytest.mark.parametrize("name", ["", "usr/bin/nvidia-smi", "../nvidia-smi"])
def test_find_binary_wants_a_bare_name(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="bare file name"):
        find_binary(tmp_path, name)


def _fake_driver_root(root: Path) -> Path:
    """A driver root laid out like Ubuntu's, with the host's libc next to NVIDIA's libraries."""
    lib = root / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    for name in ("libc.so.6", "libm.so.6", "libnvidia-ml.so.580.95.05", "libcuda.so.580.95.05",
                 "libnvidia-ptxjitcompiler.so.580.95.05", "libcudart.so.12"):
        (lib / name).write_text(name)
    (lib / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.580.95.05")
    # Some installers write absolute links; on the host they point inside the driver root.
    (lib / "libcuda.so.1").symlink_to("/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05")
    (lib / "libnvidia-gone.so.1").symlink_to("libnvidia-gone.so.580")  # dangling: skipped
    (root / "usr/bin").mkdir(parents=True)
    return lib


def _links(directory: Path) -> dict[str, str]:
    return {entry.name: os.readlink(entry) for entry in directory.iterdir()}


def test_driver_env_exposes_only_nvidia_libraries(tmp_path: Path) -> None:
    root = tmp_path / "driver-root"
    lib = _fake_driver_root(root)
    env = driver_env(root, {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": "/opt/lib", "OTHER": "x"}, tmp_path)
    assert env["PATH"] == f"{root}/usr/bin:/usr/bin:/bin"
    link_dir, rest = env["LD_LIBRARY_PATH"].split(":", 1)
    assert rest == "/opt/lib"
    assert Path(link_dir).parent == tmp_path
    assert Path(link_dir).name.startswith(LIBRARY_LINK_DIR_PREFIX)
    assert _links(Path(link_dir)) == {
        "libcuda.so.1": str(lib / "libcuda.so.580.95.05"),
        "libcuda.so.580.95.05": str(lib / "libcuda.so.580.95.05"),
        "libnvidia-ml.so.1": str(lib / "libnvidia-ml.so.580.95.05"),
        "libnvidia-ml.so.580.95.05": str(lib / "libnvidia-ml.so.580.95.05"),
        "libnvidia-ptxjitcompiler.so.580.95.05": str(lib / "libnvidia-ptxjitcompiler.so.580.95.05"),
    }
    assert env["OTHER"] == "x"
    assert str(lib) not in env["LD_LIBRARY_PATH"]


def test_library_dir_is_rebuilt_in_place_after_a_driver_upgrade(tmp_path: Path) -> None:
    root = tmp_path / "driver-root"
    lib = _fake_driver_root(root)
    first = nvidia_library_dir(root, tmp_path)
    assert first is not None
    assert nvidia_library_dir(root, tmp_path) == first  # idempotent
    (lib / "libnvidia-ml.so.1").unlink()
    (lib / "libnvidia-ml.so.580.95.05").unlink()
    (lib / "libnvidia-ml.so.590.1").write_text("new")
    (lib / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.590.1")
    assert nvidia_library_dir(root, tmp_path) == first
    links = _links(first)
    assert links["libnvidia-ml.so.1"] == str(lib / "libnvidia-ml.so.590.1")
    assert "libnvidia-ml.so.580.95.05" not in links
    assert (first / "libnvidia-ml.so.1").read_text() == "new"


def test_library_dir_differs_per_driver_root(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    _fake_driver_root(one)
    _fake_driver_root(two)
    assert nvidia_library_dir(one, tmp_path) != nvidia_library_dir(two, tmp_path)


def test_library_dir_someone_else_planted_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "driver-root"
    _fake_driver_root(root)
    planted = nvidia_library_dir(root, tmp_path)
    assert planted is not None
    shutil.rmtree(planted)
    planted.symlink_to(tmp_path)  # not a directory of ours
    with pytest.raises(DriverLibrariesUnusable, match=f"cannot build {planted}.*writable {tmp_path}"):
        driver_env(root, {}, tmp_path)


def test_driver_env_without_nvidia_libraries_leaves_library_path_alone(tmp_path: Path) -> None:
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "usr/lib64").mkdir(parents=True)
    (tmp_path / "usr/lib64/libc.so.6").write_text("libc")
    env = driver_env(tmp_path, {"PATH": "/usr/bin"}, tmp_path / "links")
    assert env["PATH"] == f"{tmp_path}/usr/bin:/usr/bin"
    assert "LD_LIBRARY_PATH" not in env
    assert not (tmp_path / "links").exists()


def test_driver_env_at_root_changes_nothing(tmp_path: Path) -> None:
    base = {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/lib"}
    assert driver_env(Path("/"), base, tmp_path) == base
    assert list(tmp_path.iterdir()) == []


def test_driver_env_defaults_to_our_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_TEST_MARKER", "present")
    assert driver_env(tmp_path)["TESSERA_TEST_MARKER"] == "present"


def test_find_driver_library_searches_lib_dirs_in_order(tmp_path: Path) -> None:
    (tmp_path / "usr/lib").mkdir(parents=True)
    (tmp_path / "usr/lib/libnvidia-ml.so.1").write_text("late")
    assert find_driver_library(tmp_path, "libnvidia-ml.so.1") == tmp_path / "usr/lib/libnvidia-ml.so.1"
    (tmp_path / "usr/lib64").mkdir(parents=True)
    (tmp_path / "usr/lib64/libnvidia-ml.so.580").write_text("early")
    (tmp_path / "usr/lib64/libnvidia-ml.so.1").symlink_to("/usr/lib64/libnvidia-ml.so.580")
    assert find_driver_library(tmp_path, "libnvidia-ml.so.1") == tmp_path / "usr/lib64/libnvidia-ml.so.580"
    assert find_driver_library(tmp_path, "libcuda.so.1") is None


def test_resolve_in_root_gives_up_on_link_loops(tmp_path: Path) -> None:
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("/a")
    assert resolve_in_root(tmp_path, tmp_path / "a") is None


# -- run_binary -------------------------------------------------------------------------------


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_run_binary_feeds_stdin_and_returns_stripped_stdout() -> None:
    echo = _python("import sys; print(sys.stdin.read().upper())")
    assert run_binary(echo, env={}, timeout=10, stdin_text="quit\n") == "QUIT"


def test_run_binary_without_input_gives_an_empty_stdin() -> None:
    assert run_binary(_python("import sys; print(repr(sys.stdin.read()))"), env={}, timeout=10) == "''"


def test_run_binary_passes_only_the_given_environment() -> None:
    shown = run_binary(_python("import os; print(os.environ.get('MARKER'))"), env={"MARKER": "set"}, timeout=10)
    assert shown == "set"


@pytest.mark.parametrize(
    ("code", "exit_code", "said"),
    [
        ("import sys; print('on stdout'); sys.exit('on stderr')", 1, "on stderr"),  # stderr wins
        ("import sys; print('only stdout'); sys.exit(3)", 3, "only stdout"),  # nvidia-smi reports errors there
        ("import sys; sys.exit(4)", 4, "(no output)"),
    ],
)
def test_run_binary_failure_names_command_exit_code_and_output(code: str, exit_code: int, said: str) -> None:
    command = _python(code)
    with pytest.raises(BinaryFailed) as caught:
        run_binary(command, env={}, timeout=10)
    assert str(caught.value) == f"`{shlex.join(command)}` failed with exit code {exit_code}: {said}"
    assert not isinstance(caught.value, BinaryTimedOut)


def test_run_binary_label_replaces_the_command_line_in_errors() -> None:
    with pytest.raises(BinaryFailed, match=r"^control command 'x' failed with exit code 2: \(no output\)$"):
        run_binary(_python("raise SystemExit(2)"), env={}, timeout=10, label="control command 'x'")


def test_run_binary_timeout_is_its_own_error() -> None:
    with pytest.raises(BinaryTimedOut, match=r"time\.sleep\(30\)'` did not finish within 0\.2s$"):
        run_binary(_python("import time; time.sleep(30)"), env={}, timeout=0.2)


def test_run_binary_that_cannot_start_says_so(tmp_path: Path) -> None:
    not_executable = _make_exe(tmp_path / "tool", mode=0o644)
    with pytest.raises(BinaryFailed, match=f"`{not_executable}` could not run: .*Permission denied"):
        run_binary([str(not_executable)], env={}, timeout=10)


# -- compute mode: MIG refusal and what a client that cannot reach MPS does ----------------------


def _gpus_file(sim: SimRoot, mig_enabled: bool) -> str:
    path = sim.top / "gpus.json"
    path.write_text(json.dumps({"gpus": [{"uuid": GPU_A, "minor": 1, "pci_bus_id": "0000:31:00.0",
                                          "mig_enabled": mig_enabled}]}))
    return str(path)


def test_nvidia_smi_refuses_a_compute_mode_on_a_mig_enabled_gpu(sim: SimRoot) -> None:
    gpus = _gpus_file(sim, mig_enabled=True)
    refused = _smi(sim, "-i", GPU_A, "-c", "EXCLUSIVE_PROCESS", TESSERA_SIM_GPUS_FILE=gpus)
    assert refused.returncode == 3
    assert refused.stdout.splitlines() == [
        "Setting compute mode to EXCLUSIVE_PROCESS is not supported on a MIG-enabled device.",
        "Unable to set the compute mode for GPU 00000000:31:00.0: Not Supported",
        "Treating as warning and moving on.", "All done."]
    query = ["--query-gpu=compute_mode", "--format=csv,noheader", "-i", GPU_A]
    assert _smi(sim, *query, TESSERA_SIM_GPUS_FILE=gpus).stdout.strip() == "Default", "left as it was"
    assert _smi(sim, "-i", GPU_A, "-c", "DEFAULT", TESSERA_SIM_GPUS_FILE=gpus).returncode == 0
    no_mig = _gpus_file(sim, mig_enabled=False)
    assert _smi(sim, "-i", GPU_A, "-c", "3", TESSERA_SIM_GPUS_FILE=no_mig).returncode == 0
    assert _smi(sim, *query, TESSERA_SIM_GPUS_FILE=no_mig).stdout.strip() == "Exclusive_Process"


def test_the_simulated_host_tree_tells_nvidia_smi_which_gpus_have_mig(tmp_path: Path) -> None:
    from driver.simulation.discovery import SimulatedDiscovery
    from driver.simulation.hostroot import SIM_GPUS_FILE, build_host_root

    inventory = SimulatedDiscovery("demo", "node-a").discover()
    host = build_host_root(tmp_path / "host", inventory)
    listed = json.loads((host.driver_root / SIM_GPUS_FILE).read_text())["gpus"]
    assert [(g["uuid"], g["mig_enabled"]) for g in listed] == [(g.uuid, g.mig_enabled) for g in inventory.gpus]
    assert [g["mig_enabled"] for g in listed] == [False, True, False]


def _lone_client(sim: SimRoot, mode: str | None, **extra: str) -> subprocess.Popen[str]:
    state = sim.top / "smi-state.json"
    state.write_text(json.dumps({GPU_A: {"compute_mode": mode, "timeslice": 0}} if mode else {}))
    # A client whose pipe dir has no daemon: its connection fails, as a tenant's would after a bad mount.
    env = _mps_env(sim, CUDA_MPS_PIPE_DIRECTORY=str(sim.top / "nowhere"), CUDA_VISIBLE_DEVICES=GPU_A,
                   TESSERA_SIM_NVIDIA_SMI_STATE=str(state), **extra)
    (sim.top / "nowhere").mkdir(exist_ok=True)
    return subprocess.Popen([str(sim.exe("nvidia-cuda-mps-control")), "--simulation-client", "1000"], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_client_that_cannot_reach_mps_runs_outside_every_limit_in_default_mode(sim: SimRoot) -> None:
    for mode in (None, "DEFAULT"):
        client = _lone_client(sim, mode)
        out, _ = client.communicate("", timeout=10)
        assert client.returncode == 0
        assert out.strip() == f"NO-MPS {GPU_A}: running without MPS, outside every MPS limit"


def test_in_exclusive_process_mode_a_client_cannot_run_beside_the_mps_daemon(sim: SimRoot) -> None:
    alone = _lone_client(sim, "EXCLUSIVE_PROCESS")
    out, _ = alone.communicate("", timeout=10)
    assert alone.returncode == 0 and out.startswith("NO-MPS"), "no daemon on the GPU: it runs as the only process"

    env = _mps_env(sim, CUDA_VISIBLE_DEVICES=GPU_A)
    assert _mps(sim, env, "-d").returncode == 0
    try:
        beside = _lone_client(sim, "EXCLUSIVE_PROCESS")
        out, _ = beside.communicate("", timeout=10)
        assert beside.returncode == 1
        assert out.strip() == f"ERROR all CUDA-capable devices are busy or unavailable ({GPU_A} is EXCLUSIVE_PROCESS)"
        prohibited = _lone_client(sim, "PROHIBITED")
        assert prohibited.communicate("", timeout=10)[0].startswith("ERROR") and prohibited.returncode == 1
    finally:
        _mps(sim, env, stdin="quit\n")
        poll_until(lambda: processes_mentioning(str(sim.top)) == [], "the daemon to quit")
