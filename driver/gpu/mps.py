"""CUDA MPS control daemons that the driver starts and stops itself (no Deployment, no pod).

One daemon serves one set of GPUs from its own pipe directory. Its limits are set with
``set_default_*`` right after it starts and before the driver hands its pipe directory to any
client (through the CDI spec written after :meth:`MpsManager.start` returns), so every MPS server
it spawns gets them. The returned :class:`MpsDaemonRecord` goes into the driver's checkpoint, so
after a driver restart the daemon is adopted if it still runs, or restarted with the same limits.

Facts used here (commands, environment, formats) are in ``reference/nvidia-gpu.md`` section 1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from driver.gpu.binaries import BinaryFailed, BinaryNotFound, BinaryTimedOut, driver_env, find_binary, run_binary

log = logging.getLogger(__name__)

CONTROL_BINARY = "nvidia-cuda-mps-control"
PID_FILE_NAME = "nvidia-cuda-mps-control.pid"
MIB = 1024 * 1024
LOG_TAIL_LINES = 20
# sun_path is 108 bytes including the NUL; the daemon binds its sockets inside the pipe dir.
MAX_SOCKET_PATH_BYTES = 107
CONTROL_SOCKET_NAME = "control"

_POLL_INTERVAL_S = 0.05
_TERM_GRACE_S = 2.0
_KILL_WAIT_S = 5.0
_DAEMON_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
# GPU-<uuid>, MIG-<uuid>, and the older MIG-GPU-<uuid>/<gi>/<ci>; commas would split CUDA_VISIBLE_DEVICES.
_DEVICE_UUID = re.compile(r"^(GPU|MIG)-[A-Za-z0-9/-]+$")
# The real tool's wording for a refused command is not documented; these cover the usual forms.
_REFUSAL = re.compile(r"error|invalid|unrecogni[sz]ed|fail|not supported|usage", re.IGNORECASE)
_MEMORY_ANSWER = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?(?![A-Za-z])", re.IGNORECASE)
_MIB_PER_UNIT = {"": 1.0, "K": 1 / 1024, "M": 1.0, "G": 1024.0, "T": 1024.0 * 1024}


class MpsError(Exception):
    """An MPS daemon could not be started, checked or stopped; the message says what and why."""


def check_daemon_id(value: str) -> str:
    """``value`` if it is safe as a directory name, else ValueError."""
    if not _DAEMON_ID.fullmatch(value):
        raise ValueError(
            f"daemon_id {value!r} must be 1-63 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


class MpsDaemonSpec(BaseModel):
    """What one daemon serves and the limits its servers get."""

    # extra="ignore": specs are stored inside checkpointed records, which must survive a downgrade.
    model_config = ConfigDict(extra="ignore", frozen=True)

    daemon_id: str  # names the daemon's directory, so it must be a safe file name
    gpu_uuids: list[str] = Field(min_length=1)  # becomes the daemon's CUDA_VISIBLE_DEVICES, in this order
    active_thread_percentage: int | None = Field(default=None, ge=1, le=100)
    pinned_memory_limits: dict[str, int] = Field(default_factory=dict)  # GPU UUID -> bytes

    @field_validator("daemon_id")
    @classmethod
    def _safe_daemon_id(cls, value: str) -> str:
        return check_daemon_id(value)

    @field_validator("gpu_uuids")
    @classmethod
    def _device_uuids(cls, value: list[str]) -> list[str]:
        for uuid in value:
            if not _DEVICE_UUID.fullmatch(uuid):
                raise ValueError(f"gpu_uuids entry {uuid!r} is not a GPU-... or MIG-... UUID")
        if len(set(value)) != len(value):
            raise ValueError(f"gpu_uuids {value} lists a device more than once")
        return value

    @model_validator(mode="after")
    def _limits_name_served_gpus(self) -> MpsDaemonSpec:
        for uuid, limit in self.pinned_memory_limits.items():
            if uuid not in self.gpu_uuids:
                raise ValueError(f"pinned_memory_limits names {uuid}, which is not in gpu_uuids {self.gpu_uuids}")
            if limit < MIB:
                raise ValueError(
                    f"pinned_memory_limits[{uuid}] is {limit} bytes; MPS takes whole MiB, so it must be at least "
                    f"{MIB} bytes (1 MiB)"
                )
        return self

    def pinned_limits_mib(self) -> list[tuple[int, int]]:
        """``(ordinal, MiB)`` per limited GPU, ordinal = index in ``gpu_uuids`` as the daemon numbers them."""
        return [
            (ordinal, self.pinned_memory_limits[uuid] // MIB)
            for ordinal, uuid in enumerate(self.gpu_uuids)
            if uuid in self.pinned_memory_limits
        ]


class MpsDaemonRecord(BaseModel):
    """A started daemon, as the checkpoint stores it."""

    # extra="ignore": a checkpoint written by a newer driver must still load after a rollback.
    model_config = ConfigDict(extra="ignore", frozen=True)

    version: int = 1
    spec: MpsDaemonSpec
    pid: int = Field(gt=0)
    pipe_dir: Path
    log_dir: Path
    started_at: str  # ISO 8601, UTC
    # /proc/<pid>/stat field 22 (clock ticks after boot): tells our daemon from a process that got its PID later.
    process_start_time: int = Field(ge=0)


class MpsMount(NamedTuple):
    host_path: str
    container_path: str
    options: list[str]


@dataclass(frozen=True)
class MpsClientEdits:
    """What a client container needs to reach a daemon; the caller turns it into CDI edits."""

    env: list[str]
    mounts: list[MpsMount]


@dataclass(frozen=True)
class _ProcStat:
    state: str
    pgrp: int
    start_time: int


class MpsManager:
    """Starts, checks, adopts and stops daemons living in ``base_dir/<daemon_id>/{pipe,log}``."""

    def __init__(
        self,
        driver_root: Path,
        base_dir: Path,
        ready_timeout: float = 10.0,
        command_timeout: float = 5.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self.driver_root = driver_root
        self.base_dir = base_dir
        self.ready_timeout = ready_timeout
        self.command_timeout = command_timeout
        self.stop_timeout = stop_timeout

    def daemon_dir(self, daemon_id: str) -> Path:
        return self.base_dir / daemon_id

    def start(self, spec: MpsDaemonSpec) -> MpsDaemonRecord:
        """Start a daemon for ``spec``, apply its limits and wait until it answers.

        On failure nothing is left running and the directories are gone; the :class:`MpsError`
        carries the tail of ``control.log``.
        """
        pipe_dir = self.daemon_dir(spec.daemon_id) / "pipe"
        log_dir = self.daemon_dir(spec.daemon_id) / "log"
        socket_path_bytes = len(os.fsencode(pipe_dir / CONTROL_SOCKET_NAME))
        if socket_path_bytes > MAX_SOCKET_PATH_BYTES:
            raise MpsError(
                f"MPS pipe directory {pipe_dir} is too long: sockets inside it would need {socket_path_bytes} bytes, "
                f"Unix sockets allow {MAX_SOCKET_PATH_BYTES}; use a shorter MPS base directory or daemon_id"
            )
        running = _daemon_in(pipe_dir)
        if running is not None:
            raise MpsError(
                f"an MPS control daemon (pid {running[0]}) already runs in {pipe_dir}; "
                "adopt it with ensure_running() or stop it before starting another"
            )
        _remove_daemon_dirs(pipe_dir, log_dir)  # leftovers of a daemon that is gone
        deadline = time.monotonic() + self.ready_timeout
        started: tuple[int, int] | None = None
        try:
            self._make_dirs(pipe_dir, log_dir)
            self._launch(spec, pipe_dir, log_dir, deadline)
            started = self._wait_for_pid(pipe_dir, deadline)
            env = self._control_env(pipe_dir, log_dir)
            self._apply_limits(spec, env)
            self._wait_until_ready(spec, env, started, deadline)
        except (MpsError, BinaryNotFound, OSError, subprocess.SubprocessError) as exc:
            tail = _log_tail(log_dir)
            cleanup_problem = self._cleanup_after_failure(pipe_dir, log_dir, started)
            raise MpsError(
                f"starting MPS control daemon {spec.daemon_id} for {','.join(spec.gpu_uuids)} failed: {exc}"
                f"{cleanup_problem}{tail}"
            ) from exc
        except BaseException:
            self._cleanup_after_failure(pipe_dir, log_dir, started)
            raise
        pid, process_start_time = started
        record = MpsDaemonRecord(
            spec=spec,
            pid=pid,
            pipe_dir=pipe_dir,
            log_dir=log_dir,
            started_at=datetime.now(UTC).isoformat(timespec="seconds"),
            process_start_time=process_start_time,
        )
        log.info("MPS control daemon started", extra={"daemon_id": spec.daemon_id, "pid": pid,
                                                      "gpu_uuids": spec.gpu_uuids})
        return record

    def is_running(self, record: MpsDaemonRecord) -> bool:
        """True if the recorded process still runs (same start time). Cheap: no control command."""
        return _is_same_process(record.pid, record.process_start_time)

    def is_alive(self, record: MpsDaemonRecord) -> bool:
        """True if the recorded process still runs (same start time) and answers a control command."""
        if not _is_same_process(record.pid, record.process_start_time):
            return False
        try:
            self._control(self._control_env(record.pipe_dir, record.log_dir), "get_default_active_thread_percentage")
        except (MpsError, BinaryNotFound, OSError):
            return False
        return True

    def ensure_running(self, record: MpsDaemonRecord) -> MpsDaemonRecord:
        """Adopt the recorded daemon if it is alive; otherwise clean up and start it again, same limits."""
        if self.is_alive(record):
            return record
        log.warning("MPS control daemon is gone or not answering; restarting it",
                    extra={"daemon_id": record.spec.daemon_id, "pid": record.pid})
        self.stop(record)
        return self.start(record.spec)

    def stop(self, record: MpsDaemonRecord) -> None:
        """Quit the daemon, fall back to SIGTERM then SIGKILL, and remove its directories.

        A daemon that is already gone is fine. Signals only go to the recorded process if it still
        has the recorded start time, so a process that reused the PID is never touched.
        """
        known: tuple[int, int] | None = (record.pid, record.process_start_time)
        if not _is_same_process(record.pid, record.process_start_time):
            known = None
        self._teardown(record.pipe_dir, record.log_dir, known)
        log.info("MPS control daemon stopped", extra={"daemon_id": record.spec.daemon_id, "pid": record.pid})

    def stop_by_id(self, daemon_id: str) -> None:
        """Stop whatever daemon runs in ``base_dir/<daemon_id>`` and remove its directories.

        For a daemon that has no record: its starter crashed before checkpointing the one
        :meth:`start` returned. The pid file names the process; it is signalled only if its command
        line is the control daemon's.
        """
        daemon_dir = self.daemon_dir(check_daemon_id(daemon_id))
        self._teardown(daemon_dir / "pipe", daemon_dir / "log", None)

    def daemon_ids_on_disk(self) -> list[str]:
        """Ids of daemon directories under ``base_dir``, to find ones the checkpoint does not know."""
        try:
            entries = sorted(self.base_dir.iterdir())
        except FileNotFoundError:
            return []
        return [entry.name for entry in entries if (entry / "pipe").is_dir() or (entry / "log").is_dir()]

    def client_edits(
        self,
        record: MpsDaemonRecord,
        container_pipe_dir: str = "/tmp/nvidia-mps",
        shm_host_dir: Path | None = None,
    ) -> MpsClientEdits:
        """Environment and mounts that connect a container to this daemon.

        The limit variables repeat the daemon's defaults on the client side. MPS applies them per
        client process, so they only restrict further (nvidia-gpu.md 1.5).
        """
        spec = record.spec
        env = [f"CUDA_MPS_PIPE_DIRECTORY={container_pipe_dir}"]
        if spec.active_thread_percentage is not None:
            env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={spec.active_thread_percentage}")
        limits = spec.pinned_limits_mib()
        if limits:
            env.append("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=" + ",".join(f"{o}={mib}M" for o, mib in limits))
        bind_options = ["rw", "nosuid", "nodev", "bind"]
        mounts = [MpsMount(str(record.pipe_dir), container_pipe_dir, list(bind_options))]
        if shm_host_dir is not None:
            mounts.append(MpsMount(str(shm_host_dir), "/dev/shm", list(bind_options)))
        return MpsClientEdits(env=env, mounts=mounts)

    # -- starting -------------------------------------------------------------------------------

    def _make_dirs(self, pipe_dir: Path, log_dir: Path) -> None:
        for directory in (pipe_dir, log_dir):
            directory.mkdir(parents=True)
            # Client containers often run as non-root UIDs and must traverse the pipe dir to reach
            # the daemon's sockets; mkdir's mode is cut by the umask, so set it explicitly.
            directory.chmod(0o755)
        pipe_dir.parent.chmod(0o755)

    def _launch(self, spec: MpsDaemonSpec, pipe_dir: Path, log_dir: Path, deadline: float) -> None:
        binary = find_binary(self.driver_root, CONTROL_BINARY)
        env = self._control_env(pipe_dir, log_dir)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.gpu_uuids)
        # A file, not a pipe, for the output: if the daemon kept the inherited descriptor open,
        # reading a pipe to EOF would wait for the daemon to exit.
        with tempfile.TemporaryFile() as output:
            try:
                # run() waits for the -d parent, so it is reaped; the daemon itself is detached.
                # A new session keeps the daemon out of signals aimed at the plugin's process group.
                done = subprocess.run(
                    [str(binary), "-d"],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=output,
                    stderr=subprocess.STDOUT,
                    timeout=max(deadline - time.monotonic(), _POLL_INTERVAL_S),
                    start_new_session=True,
                    check=False,
                )
            except subprocess.TimeoutExpired as exc:
                raise MpsError(f"`{binary} -d` did not return within {self.ready_timeout:g}s") from exc
            if done.returncode != 0:
                output.seek(0)
                said = output.read().decode("utf-8", "replace").strip()
                raise MpsError(f"`{binary} -d` exited with status {done.returncode}: {said or '(no output)'}")

    def _wait_for_pid(self, pipe_dir: Path, deadline: float) -> tuple[int, int]:
        pid_file = pipe_dir / PID_FILE_NAME
        while True:
            pid = _read_pid_file(pid_file)
            if pid is not None:
                stat = _read_proc_stat(pid)
                if stat is None or stat.state in ("Z", "X"):
                    raise MpsError(f"the daemon's pid {pid} (from {pid_file}) is not running")
                return pid, stat.start_time
            if time.monotonic() >= deadline:
                raise MpsError(f"{pid_file} did not appear within {self.ready_timeout:g}s")
            time.sleep(_POLL_INTERVAL_S)

    def _apply_limits(self, spec: MpsDaemonSpec, env: dict[str, str]) -> None:
        if spec.active_thread_percentage is not None:
            self._set(env, f"set_default_active_thread_percentage {spec.active_thread_percentage}")
        for ordinal, mib in spec.pinned_limits_mib():
            # Whether the daemon honours a UUID or an index for <dev> is UNCONFIRMED (nvidia-gpu.md 1.4,
            # 5#1). The index within the daemon's CUDA_VISIBLE_DEVICES is what clients see, so use it,
            # and read the value back so a limit the daemon did not take fails here, not silently.
            self._set(env, f"set_default_device_pinned_mem_limit {ordinal} {mib}M")
            answer = self._control(env, f"get_default_device_pinned_mem_limit {ordinal}")
            if _parse_mib(answer) != mib:
                raise MpsError(
                    f"pinned memory limit for device {ordinal} ({spec.gpu_uuids[ordinal]}) reads back as "
                    f"{answer!r}, expected {mib}M"
                )

    def _wait_until_ready(
        self, spec: MpsDaemonSpec, env: dict[str, str], started: tuple[int, int], deadline: float
    ) -> None:
        pid, start_time = started
        while True:
            if not _is_same_process(pid, start_time):
                raise MpsError(f"the daemon (pid {pid}) exited before it became ready")
            try:
                answer = self._control(env, "get_default_active_thread_percentage")
                break
            except MpsError as exc:
                if time.monotonic() >= deadline:
                    raise MpsError(f"the daemon did not become ready within {self.ready_timeout:g}s: {exc}") from exc
            time.sleep(_POLL_INTERVAL_S)
        try:
            percentage = float(answer)
        except ValueError as exc:
            raise MpsError(f"get_default_active_thread_percentage answered {answer!r}, expected a number") from exc
        expected = spec.active_thread_percentage
        if expected is not None and abs(percentage - expected) > 0.01:
            raise MpsError(f"default active thread percentage reads back as {answer}, expected {expected}")

    # -- control commands -------------------------------------------------------------------------

    def _control_env(self, pipe_dir: Path, log_dir: Path) -> dict[str, str]:
        env = driver_env(self.driver_root)
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(pipe_dir)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(log_dir)
        return env

    def _control(self, env: dict[str, str], command: str) -> str:
        """Send one command the way the docs do (``echo '<cmd>' | nvidia-cuda-mps-control``) and return the answer."""
        binary = find_binary(self.driver_root, CONTROL_BINARY)
        label = f"control command {command!r}"
        try:
            return run_binary([str(binary)], env=env, timeout=self.command_timeout, stdin_text=command + "\n",
                              label=label)
        except BinaryTimedOut as exc:
            raise MpsError(f"{label} got no answer within {self.command_timeout:g}s") from exc
        except BinaryFailed as exc:
            raise MpsError(str(exc)) from exc

    def _set(self, env: dict[str, str], command: str) -> None:
        answer = self._control(env, command)
        if _REFUSAL.search(answer):
            raise MpsError(f"the daemon refused {command!r}: {answer}")

    # -- stopping -------------------------------------------------------------------------------

    def _cleanup_after_failure(self, pipe_dir: Path, log_dir: Path, started: tuple[int, int] | None) -> str:
        """Tear down a half-started daemon; returns a note for the error message if that failed too."""
        try:
            self._teardown(pipe_dir, log_dir, started)
        except MpsError as exc:
            return f"; cleanup also failed: {exc}"
        return ""

    def _teardown(self, pipe_dir: Path, log_dir: Path, known: tuple[int, int] | None) -> None:
        # A daemon may run in the directory without being the recorded one (started by a driver that
        # crashed before checkpointing it): the pid file names it.
        target = known or _daemon_in(pipe_dir)
        quit_delivered = False
        if pipe_dir.is_dir():
            try:
                self._control(self._control_env(pipe_dir, log_dir), "quit")
                quit_delivered = True
            except (MpsError, BinaryNotFound, OSError) as exc:
                log.info("MPS quit not delivered; will signal the daemon", extra={"pipe_dir": str(pipe_dir),
                                                                                   "reason": str(exc)})
        if target is not None:
            pid, start_time = target
            exited = quit_delivered and _wait_for_exit(pid, start_time, self.stop_timeout)
            if not exited:
                _signal_daemon(pid, start_time, signal.SIGTERM)
                exited = _wait_for_exit(pid, start_time, min(self.stop_timeout, _TERM_GRACE_S))
            if not exited:
                _signal_daemon(pid, start_time, signal.SIGKILL)
                if not _wait_for_exit(pid, start_time, _KILL_WAIT_S):
                    raise MpsError(f"MPS control daemon pid {pid} is still running after SIGKILL")
        _remove_daemon_dirs(pipe_dir, log_dir)


# -- process helpers ----------------------------------------------------------------------------


def _read_proc_stat(pid: int) -> _ProcStat | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # Field 2 (comm) is parenthesised and may contain spaces or ')'; the fields after it are plain.
    rest = text.rpartition(")")[2].split()
    try:
        return _ProcStat(state=rest[0], pgrp=int(rest[2]), start_time=int(rest[19]))
    except (IndexError, ValueError):
        return None


def _is_same_process(pid: int, start_time: int) -> bool:
    stat = _read_proc_stat(pid)
    return stat is not None and stat.start_time == start_time and stat.state not in ("Z", "X")


def _wait_for_exit(pid: int, start_time: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        stat = _read_proc_stat(pid)
        if stat is None or stat.start_time != start_time:
            return True
        if stat.state in ("Z", "X"):
            # When the plugin runs as PID 1 of its container, orphaned daemons become our children.
            _reap(pid)
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_INTERVAL_S)


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):  # not our child: its own parent reaps it
        os.waitpid(pid, os.WNOHANG)


def _signal_daemon(pid: int, start_time: int, signum: signal.Signals) -> None:
    stat = _read_proc_stat(pid)
    if stat is None or stat.start_time != start_time:
        return
    try:
        # If the daemon leads its own process group, signalling the group also ends the MPS servers
        # it spawned, which would otherwise outlive it holding the GPU.
        if stat.pgrp == pid:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except ProcessLookupError:
        pass


def _read_pid_file(path: Path) -> int | None:
    try:
        return int(path.read_text(encoding="ascii").strip())
    except (OSError, ValueError):
        return None


def _daemon_in(pipe_dir: Path) -> tuple[int, int] | None:
    """``(pid, start time)`` of a live control daemon named by the pipe dir's pid file, if any."""
    pid = _read_pid_file(pipe_dir / PID_FILE_NAME)
    if pid is None:
        return None
    stat = _read_proc_stat(pid)
    if stat is None or stat.state in ("Z", "X"):
        return None
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    # A stale pid file may name an unrelated process that got the PID later.
    if not any(os.path.basename(arg) == os.fsencode(CONTROL_BINARY) for arg in argv):
        return None
    return pid, stat.start_time


def _remove_daemon_dirs(pipe_dir: Path, log_dir: Path) -> None:
    for directory in (pipe_dir, log_dir):
        try:
            shutil.rmtree(directory)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise MpsError(f"could not remove {directory}: {exc}") from exc
    # Only if empty: the caller may keep other things (a shm mount) next to pipe/ and log/.
    for parent in {pipe_dir.parent, log_dir.parent}:
        with contextlib.suppress(OSError):
            parent.rmdir()


def _log_tail(log_dir: Path) -> str:
    control_log = log_dir / "control.log"
    try:
        lines = control_log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return f"\n(no {control_log})"
    tail = "\n".join(lines[-LOG_TAIL_LINES:])
    return f"\nlast {min(len(lines), LOG_TAIL_LINES)} lines of {control_log}:\n{tail}"


def _parse_mib(answer: str) -> int | None:
    """MiB from a memory answer such as ``10240M`` or ``10 GB``; a bare number is taken as MiB.

    The real tool's output format for ``get_default_device_pinned_mem_limit`` is not documented.
    """
    matches = _MEMORY_ANSWER.findall(answer)
    if not matches:
        return None
    # A number with a unit is the value; a bare one may be the device ordinal echoed back.
    with_unit = [m for m in matches if m[1]]
    number, unit = (with_unit or matches)[-1]
    return round(float(number) * _MIB_PER_UNIT[unit.upper()])
