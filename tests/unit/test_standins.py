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

from driver.gpu.binaries import (
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


def test_mps_daemon_answers_commands_logs_them_and_quits(sim: SimRoot) -> None:
    env = _mps_env(sim)
    started = _mps(sim, env, "-d")
    assert started.returncode == 0, started.stderr
    pid = int((sim.top / "p" / "nvidia-cuda-mps-control.pid").read_text())
    assert pid in processes_mentioning(str(sim.top))

    answers = _mps(
        sim,
        env,
        stdin="get_default_active_thread_percentage\n"
        "set_default_active_thread_percentage 25\n"
        "get_default_active_thread_percentage\n"
        "set_default_device_pinned_mem_limit 0 4G\n"
        "get_default_device_pinned_mem_limit 0\n"
        "get_server_list\n",
    )
    assert answers.returncode == 0, answers.stderr
    assert answers.stdout.split() == ["100.0", "25.0", "4096M"]
    assert _commands(sim.top / "l") == [
        {"cmd": "get_default_active_thread_percentage", "args": []},
        {"cmd": "set_default_active_thread_percentage", "args": ["25"]},
        {"cmd": "get_default_active_thread_percentage", "args": []},
        {"cmd": "set_default_device_pinned_mem_limit", "args": ["0", "4G"]},
        {"cmd": "get_default_device_pinned_mem_limit", "args": ["0"]},
        {"cmd": "get_server_list", "args": []},
    ]
    log_lines = (sim.top / "l" / "control.log").read_text().splitlines()
    assert all(re.match(r"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} Control \d+\] ", line) for line in log_lines)
    assert any(line.endswith("Cmd:set_default_active_thread_percentage 25") for line in log_lines)

    assert _mps(sim, env, stdin="quit\n").returncode == 0
    poll_until(lambda: pid not in processes_mentioning(str(sim.top)), "the daemon to exit after quit")
    assert sorted(p.name for p in (sim.top / "p").iterdir()) == []


def test_mps_client_without_daemon_fails_with_message(sim: SimRoot) -> None:
    result = _mps(sim, _mps_env(sim), stdin="get_server_list\n")
    assert result.returncode != 0
    assert "Cannot find MPS control daemon" in result.stderr


def test_mps_daemon_refuses_second_instance_in_same_pipe_dir(sim: SimRoot) -> None:
    env = _mps_env(sim)
    assert _mps(sim, env, "-d").returncode == 0
    second = _mps(sim, env, "-d")
    assert second.returncode != 0
    assert "already running" in (sim.top / "l" / "control.log").read_text()
    assert len(processes_mentioning(str(sim.top))) == 1


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
