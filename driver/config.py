"""Command-line flags and environment variables of ``python -m driver``, validated once at start.

The settings are a pydantic model, validated before the plugin creates any socket: a bad flag exits 2
with one line per problem and nothing registered. Importing pydantic and validating the settings is on
the registration path (~45 ms of CPU and ~7 MiB on the 2-core dev machine, docs/benchmarks.md); the parsers of the
XID list and the MPS ``/dev/shm`` size are imported only when those settings are given.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from driver.kubeletplugin.calls import DEFAULT_PREPARE_DEADLINE, KUBELET_PREPARE_TIMEOUT
from driver.units import GIB

DEFAULT_DRIVER_NAME = "gpu.tessera.dev"
DEFAULT_PLAN_LABEL = f"{DEFAULT_DRIVER_NAME}/sharing-plan"
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")

LogLevel = Literal["debug", "info", "warning", "error"]


class Settings(BaseModel):
    """Everything the driver process is configured with; the single source for ``run`` and ``inspect``.

    Built from flags and environment variables by :func:`settings_from_args` (every value parsed and
    checked, paths made absolute).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    driver_name: str = DEFAULT_DRIVER_NAME
    node_name: str = ""
    pod_uid: str | None = None
    kubeconfig: str | None = None
    registrar_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    # Where device plugins (NVIDIA's among them) put their sockets: another GPU allocator is looked for there.
    device_plugins_dir: Path = Path("/var/lib/kubelet/device-plugins")
    # The GPUs this driver owns (minors and GPU UUIDs, comma-separated) where another allocator shares the
    # node; empty: every GPU, or none while another allocator is found (driver.gpu.published.ownership).
    owned_gpus: str = ""
    plugins_dir: Path = Path("/var/lib/kubelet/plugins")
    cdi_root: Path = Path("/var/run/cdi")
    driver_root: Path = Path("/")
    host_root: Path = Path("/")
    # The root whose dev/ this process (and the MPS daemons it starts) opens devices through; None: its own /
    # (the simulated node's host tree when simulating). MIG capability nodes are made there (host/capnodes.py).
    own_dev_root: Path | None = None
    driver_root_on_host: Path | None = None  # None: derived (driver.gpu.host.hostfs.driver_root_host_path)
    driver_libraries_required: bool = True
    nvidia_cdi_spec: Path | None = None
    sharing_plans: Path | None = None
    sharing_plan_label: str = DEFAULT_PLAN_LABEL
    mps_host_socket: Path | None = None
    # Each MPS daemon's own /dev/shm tmpfs (docs/sharing.md, "The pipe directory and /dev/shm"): the size
    # where the plan or the claim names none, and whether the plugin's own launcher mounts one (the MPS host
    # has --shm-tmpfs).
    # driver.gpu.claimconfig.quantity.DEFAULT_SHM_SIZE (tests/unit/test_config.py checks they agree)
    mps_shm_size: int = GIB
    mps_shm_tmpfs: bool = False
    simulate: str | None = None
    http_port: int = Field(default=8080, ge=0, le=65535)
    rescan_interval: float = Field(default=30.0, gt=0)
    # Tenants can change a shared daemon's limits: they are read back this often (docs/sharing.md,
    # "Limits are watched"); at most 10 s, what the driver promises.
    mps_limit_check_interval: float = Field(default=5.0, gt=0, le=10)
    prepare_deadline: float = DEFAULT_PREPARE_DEADLINE
    log_level: LogLevel = "info"
    log_format: Literal["json", "text"] = "json"
    # Device health (docs/operations.md "Device health").
    ignored_xids: str = ""
    device_taints: Literal["auto", "always", "never"] = "auto"
    health_taint_effect: Literal["NoSchedule", "NoExecute"] = "NoSchedule"

    @field_validator("ignored_xids")
    @classmethod
    def _xid_list(cls, value: str) -> str:
        # Imported when the setting is given, never for the default: the XID table is not on the
        # registration path.
        from driver.gpu.health.xids import parse_ignored_xids

        parse_ignored_xids(value)  # raises ValueError naming the bad entry
        return value

    @field_validator("owned_gpus")
    @classmethod
    def _owned_gpu_list(cls, value: str) -> str:
        from driver.gpu.published.ownership import parse_owned_gpus  # as above: only when given

        parse_owned_gpus(value)  # raises ValueError naming the bad entry
        return value

    @field_validator("mps_shm_size", mode="before")
    @classmethod
    def _shm_size(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        from driver.gpu.mps.shmmount import parse_shm_size  # as above: the MPS modules, only when given

        return parse_shm_size(value)

    @field_validator("driver_name")
    @classmethod
    def _driver_name_is_dns_subdomain(cls, value: str) -> str:
        if len(value) > 63 or "." not in value or not _DNS_SUBDOMAIN.fullmatch(value):
            raise ValueError(f"{value!r} is not a DNS subdomain of at most 63 characters (e.g. gpu.tessera.dev)")
        return value

    @field_validator("prepare_deadline")
    @classmethod
    def _deadline_inside_the_kubelets(cls, value: float) -> float:
        # The kubelet cuts a prepare call off at 45 s; the driver must answer (and roll back) before that.
        if not 0 < value < KUBELET_PREPARE_TIMEOUT:
            limit = f"{KUBELET_PREPARE_TIMEOUT:g}"
            raise ValueError(f"{value:g} is not between 0 and {limit} seconds exclusive (the kubelet gives up on a "
                             f"prepare after {limit} s); default {DEFAULT_PREPARE_DEADLINE:g}")
        return value

    @field_validator("registrar_dir", "device_plugins_dir", "plugins_dir", "cdi_root", "driver_root", "host_root",
                     "own_dev_root", "nvidia_cdi_spec", "sharing_plans", "mps_host_socket", "kubeconfig")
    @classmethod
    def _absolute_here(cls, value: Path | str | None) -> Path | str | None:
        # Paths in this process's file system are made absolute against the working directory once, at
        # start: a relative socket path handed to gRPC, or a directory read after a chdir (the MPS
        # launcher runs daemons from /), would mean something else later. Symlinks are kept as given.
        if value is None:
            return None
        absolute = os.path.abspath(value)
        return absolute if isinstance(value, str) else Path(absolute)

    @field_validator("driver_root_on_host")
    @classmethod
    def _host_path_is_absolute(cls, value: Path | None) -> Path | None:
        # A path on the node, not here: no working directory could make a relative one mean anything.
        if value is not None and not value.is_absolute():
            raise ValueError(f"{str(value)!r} is not an absolute path (e.g. /run/nvidia/driver): it is the driver "
                             "root's path on the node, not in this container")
        return value

    @property
    def state_dir(self) -> Path:
        """The driver's own directory: DRA socket, checkpoint, lock, MPS daemons."""
        return self.plugins_dir / self.driver_name

    @property
    def mps_shm_dir(self) -> Path:
        # Beside, never inside, the MPS daemon directory: tenants write here.
        return self.state_dir / "mps-shm"


class StartupError(Exception):
    """Configuration or environment problem that must stop the driver with a clear message.

    Raised while the driver initialises (:mod:`driver.commands.run.app`), reported by the run that started it
    (:mod:`driver.commands.run.startup`); defined here, below both.
    """


class SettingsError(ValueError):
    """Settings that cannot be used: every (field, problem), so all of them are reported at once.

    The problems are pydantic's validation errors, each said in one line for people (:func:`_expected`):
    pydantic's own text spans lines, names fields rather than flags and ends in a documentation URL.
    """

    def __init__(self, problems: list[tuple[str, str]]):
        super().__init__("; ".join(f"{field}: {problem}" for field, problem in problems))
        self.problems = problems

    @classmethod
    def from_validation(cls, exc: ValidationError) -> SettingsError:
        return cls([(str(error["loc"][0]) if error["loc"] else "", _expected(error))
                    for error in exc.errors(include_url=False)])


def settings_from_values(given: Mapping[str, str]) -> Settings:
    """Settings from the text of each given setting (field name -> text); SettingsError lists every problem."""
    try:
        return Settings.model_validate(dict(given))
    except ValidationError as exc:
        raise SettingsError.from_validation(exc) from None


def _expected(error: Mapping[str, Any]) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "value_error":  # raised by our validators, whose messages are written for people
        return str(ctx.get("error", error["msg"]))
    if kind == "extra_forbidden":
        return "not a setting"
    bounds = {"greater_than": "greater than", "greater_than_equal": "at least", "less_than": "less than",
              "less_than_equal": "at most"}
    if kind in bounds:
        limit = next(iter(ctx.values()), "?")
        return f"expected a number {bounds[kind]} {format(limit, 'g') if isinstance(limit, float) else limit}"
    wanted = {"int_parsing": "a whole number", "int_from_float": "a whole number", "float_parsing": "a number",
              "bool_parsing": "true or false", "literal_error": f"one of {ctx.get('expected', '')}"}
    if kind in wanted:
        return f"expected {wanted[kind]}"
    return " ".join(str(error["msg"]).replace("Input should be", "expected").split())


# flag -> (settings field, environment variable, help)
_FLAGS: list[tuple[str, str, str, str]] = [
    ("--driver-name", "driver_name", "DRIVER_NAME", "DRA driver name (ResourceSlice spec.driver)"),
    ("--node-name", "node_name", "NODE_NAME", "this node's name; also the pool name"),
    ("--pod-uid", "pod_uid", "POD_UID", "plugin pod UID: pod-specific socket names for seamless rolling updates"),
    ("--kubeconfig", "kubeconfig", "KUBECONFIG", "kubeconfig file; in-cluster config when unset"),
    ("--registrar-dir", "registrar_dir", "KUBELET_REGISTRAR_DIRECTORY_PATH", "kubelet plugin registration dir"),
    ("--device-plugins-dir", "device_plugins_dir", "KUBELET_DEVICE_PLUGINS_DIRECTORY_PATH",
     "kubelet device plugin dir, read only: a GPU device plugin's socket there means another GPU allocator"),
    ("--owned-gpus", "owned_gpus", "OWNED_GPUS",
     "GPUs this driver owns beside another GPU allocator: comma-separated minors and GPU UUIDs (unset: every GPU, "
     "or none while another allocator is found; docs/migration.md)"),
    ("--plugins-dir", "plugins_dir", "KUBELET_PLUGINS_DIRECTORY_PATH",
     "kubelet plugins dir; state lives in <plugins-dir>/<driver-name>"),
    ("--cdi-root", "cdi_root", "CDI_ROOT", "where per-claim CDI specs are written"),
    ("--driver-root", "driver_root", "NVIDIA_DRIVER_ROOT", "where NVIDIA binaries (nvidia-smi, MPS) are found"),
    ("--host-root", "host_root", "HOST_ROOT", "where the host's /dev and /proc/driver/nvidia are visible"),
    ("--own-dev-root", "own_dev_root", "OWN_DEV_ROOT",
     "the root whose dev/ this container opens devices through (default /); MIG capability nodes are made there "
     "before an MPS daemon of this process or a MIG create opens an instance"),
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
                               "driver_libraries_required", "nvidia_cdi_spec", "sharing_plans", "simulate",
                               "registrar_dir", "device_plugins_dir", "owned_gpus"})


def add_settings_arguments(parser: argparse.ArgumentParser, only: frozenset[str] | None = None) -> None:
    """The settings' flags (those in ``only``, if given), each with its variable and default in the help."""
    for flag, field, env, help_text in _FLAGS:
        if only is not None and field not in only:
            continue
        default = Settings.model_fields[field].default
        shown = "unset" if default is None or default == "" else str(default).lower() if isinstance(default, bool) \
            else f"{default:g}" if isinstance(default, float) else str(default)  # 30, as the docs write it, not 30.0
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

