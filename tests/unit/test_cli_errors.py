"""``python -m driver``'s command line: a bad flag is one line naming it; ``inspect``'s exit status."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from driver.cli import main
from driver.gpu.mps.model import MpsDaemonRecord, MpsDaemonSpec
from driver.gpu.record.checkpoint import Checkpoint, CheckpointStore, ClaimPhase, ClaimRecord, PreparedDeviceRecord
from driver.kubeletplugin.types import PreparedDevice
from driver.simulation.discovery import SimulatedDiscovery
from driver.simulation.hostroot import build_host_root

SETTINGS_ENV = ("HTTP_PORT", "LOG_LEVEL", "DRIVER_NAME", "RESCAN_INTERVAL", "NODE_NAME", "TESSERA_SIMULATE")
GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
UID = "0b1c2d3e-4f50-4612-8734-a5b6c7d8e9f0"


def run_cli(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        status = main(list(argv))
    except SystemExit as exc:  # argparse's own exits (usage errors, --help)
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in SETTINGS_ENV:
        monkeypatch.delenv(var, raising=False)
    # main() sets the process umask for the driver; a test must not leave it on the pytest worker.
    monkeypatch.setattr("driver.cli.os.umask", lambda mask: 0o022)


def assert_one_plain_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "pydantic" not in err and "://" not in err, "no raw validation text, no documentation URL"
    assert "usage:" not in err and "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("command", ["run", "inspect", "check-node"])
def test_a_bad_value_is_one_line_naming_the_flag_and_what_it_takes(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli([command, "--driver-libraries-required", "maybe"], capsys)
    assert status == 2 and out == ""
    line = assert_one_plain_line(err)
    assert line == f"python -m driver {command}: --driver-libraries-required 'maybe': expected true or false"


@pytest.mark.parametrize(("flag", "value", "expected"), [
    ("--http-port", "70000", "expected a number at most 65535"),
    ("--rescan-interval", "0", "expected a number greater than 0"),
    ("--log-level", "loud", "expected one of 'debug', 'info', 'warning' or 'error'"),
    ("--driver-libraries-required", "maybe", "expected true or false"),
    ("--driver-name", "Foo", "'Foo' is not a DNS subdomain of at most 63 characters (e.g. gpu.tessera.dev)"),
    ("--driver-root-on-host", "relative", "'relative' is not an absolute path (e.g. /run/nvidia/driver): it is the "
                                          "driver root's path on the node, not in this container"),
])
def test_each_kind_of_bad_value_says_what_would_be_accepted(
        flag: str, value: str, expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(["run", flag, value], capsys)
    assert status == 2
    assert assert_one_plain_line(err) == f"python -m driver run: {flag} {value!r}: {expected}"


def test_a_bad_environment_value_names_the_variable_and_its_flag(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HTTP_PORT", "eighty")
    status, _, err = run_cli(["inspect"], capsys)
    assert status == 2
    assert assert_one_plain_line(err) == ("python -m driver inspect: HTTP_PORT='eighty' (environment variable for "
                                          "--http-port): expected a whole number")


def test_every_bad_flag_gets_its_own_line(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(["run", "--log-level", "loud", "--http-port", "-1", "--driver-name", "BAD"], capsys)
    assert status == 2
    lines = err.strip().splitlines()
    assert sorted(line.split(": ")[1].split()[0] for line in lines) == ["--driver-name", "--http-port", "--log-level"]
    assert all(line.startswith("python -m driver run: ") for line in lines)


@pytest.mark.parametrize(("argv", "names"), [
    (["run", "--no-such-flag", "x"], "--no-such-flag"),
    (["inspect", "--json=yes"], "--json"),
    (["check-node", "--mps-device"], "--mps-device"),
    (["mps-host", "--socket", "/tmp/x.sock"], "--mps-dir"),
    (["mps-host", "--socket", "/tmp/x.sock", "--mps-dir", "/tmp", "--log-level", "loud"], "--log-level"),
    (["no-such-command"], "no-such-command"),
])
def test_usage_errors_are_one_line_naming_the_flag(
        argv: list[str], names: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(argv, capsys)
    assert status == 2
    line = assert_one_plain_line(err)
    assert line.startswith("python -m driver") and names in line and line.endswith("--help lists the flags)")


def test_demo_flag_errors_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(["demo", "--layout", "nope"], capsys)
    assert status == 2
    line = assert_one_plain_line(err)
    assert line.startswith("python -m driver demo: unknown --layout 'nope': choose one of ")
    status, _, err = run_cli(["demo", "--no-such-flag"], capsys)
    assert status == 2
    line = assert_one_plain_line(err)
    assert line.startswith("python -m driver demo: unrecognized arguments: --no-such-flag")


# --- inspect's exit status ------------------------------------------------------------------------


@pytest.fixture
def node_args(tmp_path: Path) -> list[str]:
    """Flags for inspect on a simulated node whose host tree is complete (so the node itself has no problem)."""
    host = tmp_path / "host"
    build_host_root(host, SimulatedDiscovery("demo", "node-a").discover())
    return ["--simulate", "demo", "--node-name", "node-a", "--host-root", str(host), "--driver-root", str(host),
            "--nvidia-cdi-spec", str(host / "etc" / "cdi" / "nvidia.yaml"),
            "--plugins-dir", str(tmp_path / "plugins"), "--cdi-root", str(tmp_path / "cdi")]


def _claim_using_a_stopped_daemon(tmp_path: Path) -> Checkpoint:
    prepared = PreparedDevice(request_names=["gpu"], pool_name="node-a", device_name="gpu-0",
                              cdi_device_ids=[f"k8s.gpu.tessera.dev/claim={UID}-gpu-0"])
    record = ClaimRecord(uid=UID, namespace="team-a", name="shared", phase=ClaimPhase.PREPARE_COMPLETED,
                         devices=[PreparedDeviceRecord(device=prepared, kind="gpu", gpu_uuid=GPU0, gpu_minor=0,
                                                       mps_daemon_id="claim-0b1c2d3e4f50-0")],
                         owned_mps_daemons=["claim-0b1c2d3e4f50-0"],
                         cdi_spec_file=f"k8s.gpu.tessera.dev-claim_{UID}.json",
                         updated_at="2025-01-01T00:00:00+00:00")
    # A PID that is not running: the highest free one below the kernel's limit.
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    daemon = MpsDaemonRecord(spec=MpsDaemonSpec(daemon_id="claim-0b1c2d3e4f50-0", gpu_uuids=[GPU0]), pid=pid,
                             process_start_time=1, pipe_dir=tmp_path / "pipe", log_dir=tmp_path / "log",
                             started_at="2025-01-01T00:00:00+00:00")
    return Checkpoint(claims={UID: record}, mps_daemons={"claim-0b1c2d3e4f50-0": daemon})


def test_inspect_exits_zero_on_a_healthy_node_with_nothing_prepared(
        node_args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(["inspect", *node_args], capsys)
    assert "PROBLEM" not in out and "note: no checkpoint" in out
    assert status == 0


def test_inspect_exits_one_when_it_reports_a_problem(
        node_args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state_dir = tmp_path / "plugins" / "gpu.tessera.dev"
    CheckpointStore(state_dir / "checkpoint.json").save(_claim_using_a_stopped_daemon(tmp_path))
    status, out, _ = run_cli(["inspect", *node_args], capsys)
    problems = [line for line in out.splitlines() if line.startswith("PROBLEM: ")]
    assert any("MPS daemon claim-0b1c2d3e4f50-0" in p and "not running" in p for p in problems)
    assert any(f"claim {UID}: CDI spec" in p for p in problems)
    assert status == 1
    status, out, _ = run_cli(["inspect", "--json", *node_args], capsys)
    assert status == 1 and '"problems": [' in out


def test_inspect_exits_one_when_the_node_cannot_serve(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty-host"
    empty.mkdir()
    status, out, _ = run_cli(["inspect", "--simulate", "demo", "--host-root", str(empty), "--driver-root", str(empty),
                              "--plugins-dir", str(tmp_path / "plugins"), "--cdi-root", str(tmp_path / "cdi")], capsys)
    assert "PROBLEM: no /dev/nvidiactl" in out
    assert status == 1
    assert os.path.isdir(empty) and not any(empty.iterdir()), "inspect is read-only"


def test_an_mps_device_not_on_the_node_is_a_usage_error_naming_the_flag(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(["check-node", "--simulate", "demo", "--cdi-root", str(tmp_path / "cdi"),
                                "--mps-device", "GPU-not-here"], capsys)
    assert status == 2 and out == ""
    line = assert_one_plain_line(err)
    assert line.startswith("python -m driver check-node: --mps-device 'GPU-not-here': not a GPU or MIG device of "
                           "this node (known: GPU-")
    assert line.endswith("--help lists the flags)")


@pytest.mark.parametrize(("command", "flag"), [("check-node", "--http-port"), ("inspect", "--prepare-deadline"),
                                               ("run", "--no-such-flag")])
def test_an_unknown_subcommand_flag_points_at_that_subcommands_help(
        command: str, flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli([command, flag, "1"], capsys)
    assert status == 2
    line = assert_one_plain_line(err)
    assert line == (f"python -m driver {command}: unrecognized arguments: {flag} 1 "
                    f"(python -m driver {command} --help lists the flags)")


def test_run_without_a_node_name_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(["run", "--simulate", "demo"], capsys)
    assert status == 2 and out == ""
    assert assert_one_plain_line(err) == ("python -m driver run: the node name is required: set --node-name or "
                                          "NODE_NAME (downward API spec.nodeName)")


@pytest.mark.parametrize(("command", "listed", "not_listed"), [
    ("inspect", ["--plugins-dir", "--sharing-plans", "--json"], ["--http-port", "--prepare-deadline", "--pod-uid"]),
    ("check-node", ["--driver-root", "--mps-device", "--verbose"], ["--http-port", "--plugins-dir", "--kubeconfig"]),
])
def test_inspect_and_check_node_help_describes_them_with_defaults_and_only_their_flags(
        command: str, listed: list[str], not_listed: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli([command, "--help"], capsys)
    assert status == 0
    text = " ".join(out.split())
    assert "Read-only" in text if command == "inspect" else "Exit status 1 on any failure" in text
    assert "default /var/run/cdi" in text or command == "check-node"
    assert "[env NVIDIA_DRIVER_ROOT; default /]" in text
    assert all(flag in text for flag in listed)
    assert not [flag for flag in not_listed if flag in text]


def test_demo_refuses_a_workdir_that_is_a_file_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    status, _, err = run_cli(["demo", "--workdir", str(afile)], capsys)
    assert status == 2
    assert assert_one_plain_line(err) == f"python -m driver demo: --workdir {afile}: exists and is not a directory"


def test_a_flag_before_the_command_is_named_in_the_error(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(["--bogus"], capsys)
    assert status == 2 and out == ""
    line = assert_one_plain_line(err)
    assert "'--bogus'" in line and "give a command first (run, inspect," in line
    assert "required" not in line


@pytest.mark.parametrize("command", ["run", "inspect", "check-node"])
def test_an_unknown_simulated_layout_is_a_usage_error_before_anything_is_checked(
        command: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli([command, "--simulate", "nope", "--node-name", "n1"], capsys)
    assert status == 2 and out == "", "the real host is never checked in place of the layout"
    line = assert_one_plain_line(err)
    assert line.startswith(f"python -m driver {command}: --simulate 'nope': unknown simulated layout 'nope': ")
    assert "dynamic-mig" in line, "the line lists the layouts there are"


def test_an_unknown_simulated_layout_from_the_environment_names_the_variable(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TESSERA_SIMULATE", "nope")
    status, _, err = run_cli(["inspect"], capsys)
    assert status == 2
    assert assert_one_plain_line(err).startswith(
        "python -m driver inspect: TESSERA_SIMULATE='nope' (environment variable for --simulate): unknown simulated")


def test_help_writes_whole_second_defaults_as_the_docs_do(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(["run", "--help"], capsys)
    text = " ".join(out.split())
    assert status == 0
    assert "[env RESCAN_INTERVAL; default 30]" in text and "[env PREPARE_DEADLINE; default 30]" in text
    assert ".0]" not in text


def test_the_configuration_docs_name_every_simulated_layout() -> None:
    from driver.simulation.discovery import available_layouts

    docs = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    row = next(line for line in docs.splitlines() if line.startswith("| `--simulate` |"))
    assert [name for name in available_layouts() if f"`{name}`" not in row] == []
