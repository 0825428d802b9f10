"""Settings from flags and environment: precedence, validation errors naming the field, derived paths."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from driver.config import DEFAULT_DRIVER_NAME, Settings, SettingsError, parse_settings, settings_from_values
from driver.gpu.claimconfig.quantity import DEFAULT_SHM_SIZE


def _error_fields(exc: SettingsError) -> set[str]:
    return {field for field, _problem in exc.problems}


def test_defaults_apply_when_nothing_is_given() -> None:
    s = parse_settings([], {})
    assert s.driver_name == DEFAULT_DRIVER_NAME == "gpu.tessera.dev"
    assert s.plugins_dir == Path("/var/lib/kubelet/plugins")
    assert s.cdi_root == Path("/var/run/cdi")
    assert s.http_port == 8080
    assert s.log_level == "info" and s.log_format == "json"
    assert s.nvidia_cdi_spec is None and s.simulate is None


def test_environment_beats_defaults() -> None:
    s = parse_settings([], {"DRIVER_NAME": "gpu.example.com", "NODE_NAME": "node-7", "HTTP_PORT": "9090",
                            "KUBELET_PLUGINS_DIRECTORY_PATH": "/tmp/plugins", "LOG_LEVEL": "debug",
                            "RESCAN_INTERVAL": "2.5", "NVIDIA_CDI_SPEC": "/etc/cdi/custom.yaml"})
    assert s.driver_name == "gpu.example.com"
    assert s.node_name == "node-7"
    assert s.http_port == 9090
    assert s.plugins_dir == Path("/tmp/plugins")
    assert s.log_level == "debug"
    assert s.rescan_interval == 2.5
    assert s.nvidia_cdi_spec == Path("/etc/cdi/custom.yaml")


def test_flags_beat_environment() -> None:
    env = {"DRIVER_NAME": "gpu.example.com", "NODE_NAME": "from-env", "HTTP_PORT": "9090"}
    s = parse_settings(["--driver-name", "gpu.flag.dev", "--node-name", "from-flag", "--http-port", "0"], env)
    assert s.driver_name == "gpu.flag.dev"
    assert s.node_name == "from-flag"
    assert s.http_port == 0


def test_empty_environment_value_counts_as_unset() -> None:
    s = parse_settings([], {"DRIVER_NAME": "", "HTTP_PORT": ""})
    assert s.driver_name == DEFAULT_DRIVER_NAME
    assert s.http_port == 8080


def test_environment_is_not_read_from_the_process_when_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_NAME", "process-env")
    assert parse_settings([], {}).node_name == ""
    assert parse_settings([], None).node_name == "process-env"


@pytest.mark.parametrize("name", ["GPU.Tessera.dev", "nodots", "-gpu.tessera.dev", "gpu..tessera.dev",
                                  "gpu_tessera.dev", "a" * 60 + ".dev"])
def test_invalid_driver_name_is_rejected_naming_the_field(name: str) -> None:
    with pytest.raises(SettingsError) as info:
        parse_settings([f"--driver-name={name}"], {})
    assert _error_fields(info.value) == {"driver_name"}
    assert "DNS subdomain" in str(info.value)


def test_invalid_log_level_is_rejected_naming_the_field() -> None:
    with pytest.raises(SettingsError) as info:
        parse_settings([], {"LOG_LEVEL": "verbose"})
    assert _error_fields(info.value) == {"log_level"}


def test_invalid_log_format_is_rejected_naming_the_field() -> None:
    with pytest.raises(SettingsError) as info:
        parse_settings(["--log-format", "xml"], {})
    assert _error_fields(info.value) == {"log_format"}


@pytest.mark.parametrize("port", ["-1", "65536", "http"])
def test_invalid_port_is_rejected_naming_the_field(port: str) -> None:
    with pytest.raises(SettingsError) as info:
        parse_settings(["--http-port", port], {})
    assert _error_fields(info.value) == {"http_port"}


def test_non_positive_rescan_interval_is_rejected() -> None:
    with pytest.raises(SettingsError) as info:
        parse_settings(["--rescan-interval", "0"], {})
    assert _error_fields(info.value) == {"rescan_interval"}


@pytest.mark.parametrize("interval", ["0", "10.5"])
def test_the_mps_limit_check_interval_keeps_the_10s_promise(interval: str) -> None:
    assert parse_settings([], {}).mps_limit_check_interval == 5.0
    assert parse_settings([], {"MPS_LIMIT_CHECK_INTERVAL": "10"}).mps_limit_check_interval == 10.0
    with pytest.raises(SettingsError) as info:
        parse_settings(["--mps-limit-check-interval", interval], {})
    assert _error_fields(info.value) == {"mps_limit_check_interval"}


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(SettingsError) as info:
        parse_settings(["--log-level", "loud", "--http-port", "99999"], {"DRIVER_NAME": "BAD"})
    assert _error_fields(info.value) == {"log_level", "http_port", "driver_name"}


def test_state_dir_is_under_plugins_dir_named_after_the_driver() -> None:
    s = parse_settings(["--plugins-dir", "/var/lib/kubelet/plugins", "--driver-name", "gpu.example.com"], {})
    assert s.state_dir == Path("/var/lib/kubelet/plugins/gpu.example.com")
    assert s.mps_shm_dir == Path("/var/lib/kubelet/plugins/gpu.example.com/mps-shm")


def test_settings_are_frozen_and_strict_about_fields() -> None:
    s = Settings()
    with pytest.raises(ValidationError):
        s.node_name = "changed"  # type: ignore[misc]
    with pytest.raises(SettingsError) as info:
        settings_from_values({"no_such_setting": "1"})
    assert _error_fields(info.value) == {"no_such_setting"}


def test_the_default_shm_size_is_the_mps_default() -> None:
    # Written out in driver/config.py so that reading the settings does not import the MPS modules.
    assert Settings().mps_shm_size == DEFAULT_SHM_SIZE


@pytest.mark.parametrize(("text", "value"), [("true", True), ("False", False), ("1", True), ("no", False),
                                             ("on", True), ("off", False)])
def test_booleans_are_read_as_before(text: str, value: bool) -> None:
    assert parse_settings(["--driver-libraries-required", text], {}).driver_libraries_required is value


def test_reading_the_default_settings_needs_no_gpu_modules() -> None:
    # `run` validates its settings (pydantic) before it registers with the kubelet, and imports the GPU
    # side only after (driver/commands/run/startup.py).
    code = ("import sys; from driver.config import parse_settings; parse_settings([], {}); "
            "print(sorted(m for m in sys.modules if m.startswith('driver.gpu')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_unknown_flag_is_refused() -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--no-such-flag", "x"], {})


def test_prepare_deadline_flag_and_its_bound() -> None:
    assert parse_settings([], {}).prepare_deadline == 30.0
    assert parse_settings(["--prepare-deadline", "12.5"], {}).prepare_deadline == 12.5
    assert parse_settings([], {"PREPARE_DEADLINE": "20"}).prepare_deadline == 20.0
    for bad in ("45", "60", "0", "-1", "nan"):
        with pytest.raises(SettingsError) as caught:
            parse_settings(["--prepare-deadline", bad], {})
        assert _error_fields(caught.value) == {"prepare_deadline"}
        [(_field, problem)] = caught.value.problems
        assert "the kubelet gives up on a prepare after 45 s" in problem and "\n" not in problem


@pytest.mark.parametrize("flag,field", [("--plugins-dir", "plugins_dir"), ("--registrar-dir", "registrar_dir"),
                                        ("--device-plugins-dir", "device_plugins_dir"), ("--cdi-root", "cdi_root"),
                                        ("--driver-root", "driver_root"),
                                        ("--host-root", "host_root"), ("--nvidia-cdi-spec", "nvidia_cdi_spec"),
                                        ("--sharing-plans", "sharing_plans"), ("--mps-host-socket", "mps_host_socket"),
                                        ("--kubeconfig", "kubeconfig")])
def test_relative_paths_are_made_absolute_against_the_working_directory_at_start(
        flag: str, field: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = parse_settings([flag, "sub/dir"], {})
    assert str(getattr(s, field)) == str(tmp_path / "sub" / "dir")
    monkeypatch.chdir("/")  # a later chdir (the MPS launcher runs daemons from /) changes nothing
    assert str(getattr(s, field)) == str(tmp_path / "sub" / "dir")


def test_the_driver_roots_path_on_the_host_must_be_absolute() -> None:
    with pytest.raises(SettingsError) as caught:
        parse_settings(["--driver-root-on-host", "run/nvidia/driver"], {})
    assert _error_fields(caught.value) == {"driver_root_on_host"}
