"""Command-line flags and environment variables of ``python -m driver``, validated once at start."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from driver import settingvalues as values
from driver.kubeletplugin.calls import DEFAULT_PREPARE_DEADLINE
from driver.settingvalues import SettingValueError
from driver.units import GIB

DEFAULT_DRIVER_NAME = "gpu.tessera.dev"
DEFAULT_PLAN_LABEL = f"{DEFAULT_DRIVER_NAME}/sharing-plan"

LogLevel = Literal["debug", "info", "warning", "error"]


@dataclass(frozen=True)
class Settings:
    """Everything the driver process is configured with; the single source for ``run`` and ``inspect``.

    Built from flags and environment variables by :func:`settings_from_args` (every value parsed and
    checked, paths made absolute); constructing one directly takes the values as they are (tests).
    """

    driver_name: str = DEFAULT_DRIVER_NAME
    node_name: str = ""
    pod_uid: str | None = None
    kubeconfig: str | None = None
    registrar_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    plugins_dir: Path = Path("/var/lib/kubelet/plugins")
    cdi_root: Path = Path("/var/run/cdi")
    driver_root: Path = Path("/")
    host_root: Path = Path("/")
    driver_root_on_host: Path | None = None  # None: derived (driver.gpu.claimcdi.hostfs.driver_root_host_path)
    driver_libraries_required: bool = True
    nvidia_cdi_spec: Path | None = None
    sharing_plans: Path | None = None
    sharing_plan_label: str = DEFAULT_PLAN_LABEL
    mps_host_socket: Path | None = None
    # Each MPS daemon's own /dev/shm tmpfs (docs/sharing.md, "/dev/shm"): the size where the plan or
    # the claim names none, and whether the plugin's own launcher mounts one (the MPS host has --shm-tmpfs).
    mps_shm_size: int = GIB  # driver.gpu.mps.model.DEFAULT_SHM_SIZE (tests/unit/test_config.py checks they agree)
    mps_shm_tmpfs: bool = False
    simulate: str | None = None
    http_port: int = 8080
    rescan_interval: float = 30.0
    # Tenants can change a shared daemon's limits: they are read back this often (docs/sharing.md,
    # "Limits are watched"); at most 10 s, what the driver promises.
    mps_limit_check_interval: float = 5.0
    prepare_deadline: float = DEFAULT_PREPARE_DEADLINE
    log_level: LogLevel = "info"
    log_format: Literal["json", "text"] = "json"
    # Device health (docs/operations.md "Device health").
    ignored_xids: str = ""
    device_taints: Literal["auto", "always", "never"] = "auto"
    health_taint_effect: Literal["NoSchedule", "NoExecute"] = "NoSchedule"

    @property
    def state_dir(self) -> Path:
        """The driver's own directory: DRA socket, checkpoint, lock, MPS daemons."""
        return self.plugins_dir / self.driver_name

    @property
    def mps_shm_dir(self) -> Path:
        # Beside, never inside, the MPS daemon directory: tenants write here (issue 6, point 11).
        return self.state_dir / "mps-shm"


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Settings)}

# How each setting's text becomes its value (driver/settingvalues.py).
_PARSERS: dict[str, values.Parse] = {
    "driver_name": values.dns_subdomain, "node_name": values.text, "pod_uid": values.text,
    "kubeconfig": values.local_path_text, "registrar_dir": values.local_path, "plugins_dir": values.local_path,
    "cdi_root": values.local_path, "driver_root": values.local_path, "host_root": values.local_path,
    "driver_root_on_host": values.host_path, "driver_libraries_required": values.boolean,
    "nvidia_cdi_spec": values.local_path, "sharing_plans": values.local_path, "sharing_plan_label": values.text,
    "mps_host_socket": values.local_path, "mps_shm_size": values.shm_size, "mps_shm_tmpfs": values.boolean,
    "simulate": values.text, "http_port": values.whole_number(0, 65535), "rescan_interval": values.number(gt=0),
    "mps_limit_check_interval": values.number(gt=0, le=10), "prepare_deadline": values.prepare_deadline,
    "log_level": values.one_of("debug", "info", "warning", "error"), "log_format": values.one_of("json", "text"),
    "ignored_xids": values.ignored_xids, "device_taints": values.one_of("auto", "always", "never"),
    "health_taint_effect": values.one_of("NoSchedule", "NoExecute"),
}


class SettingsError(ValueError):
    """Settings that cannot be used: every (field, problem), so all of them are reported at once."""

    def __init__(self, problems: list[tuple[str, str]]):
        super().__init__("; ".join(f"{field}: {problem}" for field, problem in problems))
        self.problems = problems


def settings_from_values(given: Mapping[str, str]) -> Settings:
    """Settings from the text of each given setting (field name -> text); SettingsError lists every problem."""
    parsed: dict[str, object] = {}
    problems: list[tuple[str, str]] = []
    for field, raw in given.items():
        parse = _PARSERS.get(field)
        if parse is None:
            problems.append((field, "not a setting"))
            continue
        try:
            parsed[field] = parse(raw)
        except SettingValueError as exc:
            problems.append((field, str(exc)))
    if problems:
        raise SettingsError(problems)
    return Settings(**parsed)  # type: ignore[arg-type]  # each value is of its field's type by its parser


# flag -> (settings field, environment variable, help)
_FLAGS: list[tuple[str, str, str, str]] = [
    ("--driver-name", "driver_name", "DRIVER_NAME", "DRA driver name (ResourceSlice spec.driver)"),
    ("--node-name", "node_name", "NODE_NAME", "this node's name; also the pool name"),
    ("--pod-uid", "pod_uid", "POD_UID", "plugin pod UID: pod-specific socket names for seamless rolling updates"),
    ("--kubeconfig", "kubeconfig", "KUBECONFIG", "kubeconfig file; in-cluster config when unset"),
    ("--registrar-dir", "registrar_dir", "KUBELET_REGISTRAR_DIRECTORY_PATH", "kubelet plugin registration dir"),
    ("--plugins-dir", "plugins_dir", "KUBELET_PLUGINS_DIRECTORY_PATH",
     "kubelet plugins dir; state lives in <plugins-dir>/<driver-name>"),
    ("--cdi-root", "cdi_root", "CDI_ROOT", "where per-claim CDI specs are written"),
    ("--driver-root", "driver_root", "NVIDIA_DRIVER_ROOT", "where NVIDIA binaries (nvidia-smi, MPS) are found"),
    ("--host-root", "host_root", "HOST_ROOT", "where the host's /dev and /proc/driver/nvidia are visible"),
    ("--driver-root-on-host", "driver_root_on_host", "NVIDIA_DRIVER_ROOT_ON_HOST",
     "the driver root's path on the node, for CDI hostPath of device nodes under it (derived when unset)"),
    ("--driver-libraries-required", "driver_libraries_required", "DRIVER_LIBRARIES_REQUIRED",
     "true: a node without a usable toolkit CDI spec (libcuda) is not ready and fails prepares; false: allowed"),
    ("--nvidia-cdi-spec", "nvidia_cdi_spec", "NVIDIA_CDI_SPEC", "NVIDIA Container Toolkit CDI spec (auto-detected)"),
    ("--sharing-plans", "sharing_plans", "SHARING_PLANS_FILE", "node sharing plans (YAML)"),
    ("--sharing-plan-label", "sharing_plan_label", "SHARING_PLAN_LABEL", "node label naming this node's plan"),
    ("--mps-host-socket", "mps_host_socket", "MPS_HOST_SOCKET",
     "socket of the MPS host (python -m driver mps-host) that runs MPS daemons outside this process; "
     "unset: daemons are this process's children"),
    ("--mps-shm-size", "mps_shm_size", "MPS_SHM_SIZE",
     "size of each MPS daemon's own /dev/shm tmpfs where the sharing plan or the claim names none "
     "(64Mi to 1Ti; default 1Gi)"),
    ("--mps-shm-tmpfs", "mps_shm_tmpfs", "MPS_SHM_TMPFS",
     "true: without the MPS host, mount a tmpfs of its own as each MPS daemon's /dev/shm (needs CAP_SYS_ADMIN; "
     "with the MPS host, its --shm-tmpfs does this)"),
    ("--simulate", "simulate", "TESSERA_SIMULATE", "SIMULATION: use a simulated GPU node layout (name or file)"),
    ("--http-port", "http_port", "HTTP_PORT", "port for /metrics, /healthz and /readyz (0 = any)"),
    ("--rescan-interval", "rescan_interval", "RESCAN_INTERVAL", "seconds between GPU and sharing-plan rescans"),
    ("--mps-limit-check-interval", "mps_limit_check_interval", "MPS_LIMIT_CHECK_INTERVAL",
     "seconds between read-backs of every MPS daemon's limits (changes are reverted; at most 10)"),
    ("--prepare-deadline", "prepare_deadline", "PREPARE_DEADLINE",
     "seconds one prepare call may take before its work is rolled back and the claim fails "
     "(< 45, the kubelet's limit)"),
    ("--ignored-xids", "ignored_xids", "IGNORED_XIDS",
     "comma-separated XIDs that never make a device unhealthy (e.g. 74 on nodes with flaky NVLink)"),
    ("--device-taints", "device_taints", "DEVICE_TAINTS",
     "taint unhealthy devices in ResourceSlices: auto (Kubernetes 1.36+), always (1.34/1.35 with DRADeviceTaints on) "
     "or never"),
    ("--health-taint-effect", "health_taint_effect", "HEALTH_TAINT_EFFECT",
     "effect of the unhealthy-device taint: NoSchedule, or NoExecute to also evict pods using the device"),
    ("--log-level", "log_level", "LOG_LEVEL", "debug, info, warning or error"),
    ("--log-format", "log_format", "LOG_FORMAT", "json or text"),
]


# The settings ``inspect`` and ``check-node`` read; their --help lists only these. The others still
# come from the environment (the plugin pod's, under kubectl exec) and are validated the same way.
INSPECT_FIELDS = frozenset({"driver_name", "node_name", "plugins_dir", "cdi_root", "driver_root", "host_root",
                            "driver_root_on_host", "driver_libraries_required", "nvidia_cdi_spec", "sharing_plans",
                            "mps_host_socket", "simulate"})
CHECK_NODE_FIELDS = frozenset({"node_name", "cdi_root", "driver_root", "host_root", "driver_root_on_host",
                               "driver_libraries_required", "nvidia_cdi_spec", "sharing_plans", "simulate"})


def add_settings_arguments(parser: argparse.ArgumentParser, only: frozenset[str] | None = None) -> None:
    """The settings' flags (those in ``only``, if given), each with its variable and default in the help."""
    for flag, field, env, help_text in _FLAGS:
        if only is not None and field not in only:
            continue
        default = _DEFAULTS[field]
        shown = "unset" if default is None or default == "" else str(default).lower() if isinstance(default, bool) \
            else str(default)
        suffix = "" if "default" in help_text else f"; default {shown}"  # some say it better themselves
        parser.add_argument(flag, dest=field, default=None, help=f"{help_text} [env {env}{suffix}]")


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Settings:
    """Flags win over environment variables, which win over defaults. Raises SettingsError."""
    env = os.environ if environ is None else environ
    given: dict[str, str] = {}
    for _flag, field, var, _help in _FLAGS:
        value = getattr(args, field, None)
        if value is None:
            value = env.get(var) or None
        if value is not None:
            given[field] = value
    return settings_from_values(given)


def parse_settings(argv: Sequence[str], environ: dict[str, str] | None = None) -> Settings:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return settings_from_args(parser.parse_args(list(argv)), environ)


def settings_problems(exc: SettingsError, args: argparse.Namespace,
                      environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per invalid setting, naming the flag (or the environment variable it came from) and what it takes."""
    env = os.environ if environ is None else environ
    sources = {field: (flag, var) for flag, field, var, _help in _FLAGS}
    lines = []
    for field, problem in exc.problems:
        flag, var = sources.get(field, (f"--{field.replace('_', '-')}", ""))
        given = getattr(args, field, None)
        if given is not None or not var:
            where = f"{flag} {str(given)!r}" if given is not None else flag
        else:
            where = f"{var}={env.get(var, '')!r} (environment variable for {flag})"
        lines.append(f"{where}: {problem}")
    return lines

