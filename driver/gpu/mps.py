"""CUDA MPS control daemons that the driver starts and stops itself (no Deployment, no pod).

One daemon serves one set of GPUs from its own pipe directory. Its limits are set with
``set_default_*`` right after it starts and before the driver hands its pipe directory to any
client (through the CDI spec written after :meth:`MpsManager.start` returns), so every MPS server
it spawns gets them. The returned :class:`MpsDaemonRecord` goes into the driver's checkpoint, so
after a driver restart the daemon is adopted if it still runs, or restarted with the same limits.

The pipe directory is bind-mounted read-write into client containers, so anything read from it
(the pid file) is tenant-controlled. A PID, whether from there or from the checkpoint, is signalled
or adopted only once /proc shows it is this daemon: the recorded start time, a command line naming
the control binary, and ``CUDA_MPS_PIPE_DIRECTORY=<its pipe dir>`` in its environment.

Every step is bounded so a prepare fits the kubelet's deadline: :meth:`MpsManager.start` takes at
most ``ready_timeout`` (launch, limits and readiness together) plus a cleanup on failure, and
:meth:`MpsManager.stop` at most ``stop_timeout`` for a graceful quit plus a few seconds of signals.

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
from stat import S_ISREG
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
_KILL_WAIT_S = 3.0
# A pid file holds a few digits; anything longer is not one.
_PID_FILE_MAX_BYTES = 32
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


@dataclass(frozen=True)
class _Deadline:
    """A point on the monotonic clock that several steps share, and how to name it in errors."""

    at: float
    what: str  # e.g. "the 10s start deadline"

    @classmethod
    def after(cls, seconds: float, purpose: str) -> _Deadline:
        return cls(time.monotonic() + seconds, f"the {seconds:g}s {purpose} deadline")

    def remaining(self) -> float:
        return self.at - time.monotonic()


class MpsManager:
    """Starts, checks, adopts and stops daemons living in ``base_dir/<daemon_id>/{pipe,log}``."""

    def __init__(
        self,
        driver_root: Path,
        base_dir: Path,
        ready_timeout: float = 10.0,
        command_timeout: float = 5.0,
        stop_timeout: float = 8.0,
    ) -> None:
        """``ready_timeout`` bounds all of :meth:`start`; ``command_timeout`` one control command;
        ``stop_timeout`` the graceful part of a stop (quit, then waiting for the exit)."""
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
        deadline = _Deadline.after(self.ready_timeout, "start")
        started: tuple[int, int] | None = None
        try:
            self._make_dirs(pipe_dir, log_dir)
            self._launch(spec, pipe_dir, log_dir, deadline)
            started = self._wait_for_pid(pipe_dir, deadline)
            env = self._control_env(pipe_dir, log_dir)
            self._apply_limits(spec, env, deadline)
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

    def daemon_matches(self, record: MpsDaemonRecord) -> bool:
        """True if ``record.pid`` is still this record's daemon: same start time, the control binary,
        serving ``record.pipe_dir``. Only /proc is read."""
        return _daemon_start_time(record.pid, record.pipe_dir) == record.process_start_time

    def is_running(self, record: MpsDaemonRecord) -> bool:
        """True if the recorded daemon still runs (:meth:`daemon_matches`). Cheap: no control command."""
        return self.daemon_matches(record)

    def is_alive(self, record: MpsDaemonRecord) -> bool:
        """True if the recorded daemon still runs (:meth:`daemon_matches`) and answers a control command."""
        if not self.daemon_matches(record):
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

        A daemon that is already gone is fine. Signals only go to the recorded process if
        :meth:`daemon_matches` holds, so a process that reused the PID is never touched.
        """
        known: tuple[int, int] | None = (record.pid, record.process_start_time)
        if not self.daemon_matches(record):
            known = None
        self._teardown(record.pipe_dir, record.log_dir, known)
        log.info("MPS control daemon stopped", extra={"daemon_id": record.spec.daemon_id, "pid": record.pid})

    def stop_by_id(self, daemon_id: str) -> None:
        """Stop whatever daemon runs in ``base_dir/<daemon_id>`` and remove its directories.

        For a daemon that has no record: its starter crashed before checkpointing the one
        :meth:`start` returned. The pid file names the process; it is signalled only if /proc shows
        it is the control daemon serving this pipe directory.
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

    def _launch(self, spec: MpsDaemonSpec, pipe_dir: Path, log_dir: Path, deadline: _Deadline) -> None:
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
                    timeout=max(deadline.remaining(), _POLL_INTERVAL_S),
                    start_new_session=True,
                    check=False,
                )
            except subprocess.TimeoutExpired as exc:
                raise MpsError(f"`{binary} -d` did not return within {self.ready_timeout:g}s") from exc
            if done.returncode != 0:
                output.seek(0)
                said = output.read().decode("utf-8", "replace").strip()
                raise MpsError(f"`{binary} -d` exited with status {done.returncode}: {said or '(no output)'}")

    def _wait_for_pid(self, pipe_dir: Path, deadline: _Deadline) -> tuple[int, int]:
        pid_file = pipe_dir / PID_FILE_NAME
        while True:
            pid = _read_pid_file(pid_file)
            if pid is not None:
                start_time = _daemon_start_time(pid, pipe_dir)
                if start_time is None:
                    raise MpsError(
                        f"the daemon's pid {pid} (from {pid_file}) is not running, or is not "
                        f"{CONTROL_BINARY} serving {pipe_dir}"
                    )
                return pid, start_time
            if deadline.remaining() <= 0:
                raise MpsError(f"{pid_file} did not appear within {self.ready_timeout:g}s")
            time.sleep(_POLL_INTERVAL_S)

    def _apply_limits(self, spec: MpsDaemonSpec, env: dict[str, str], deadline: _Deadline) -> None:
        if spec.active_thread_percentage is not None:
            self._set(env, f"set_default_active_thread_percentage {spec.active_thread_percentage}", deadline)
        for ordinal, mib in spec.pinned_limits_mib():
            # Whether the daemon honours a UUID or an index for <dev> is UNCONFIRMED (nvidia-gpu.md 1.4,
            # 5#1). The index within the daemon's CUDA_VISIBLE_DEVICES is what clients see, so use it,
            # and read the value back so a limit the daemon did not take fails here, not silently.
            self._set(env, f"set_default_device_pinned_mem_limit {ordinal} {mib}M", deadline)
            answer = self._control(env, f"get_default_device_pinned_mem_limit {ordinal}", deadline)
            if _parse_mib(answer) != mib:
                raise MpsError(
                    f"pinned memory limit for device {ordinal} ({spec.gpu_uuids[ordinal]}) reads back as "
                    f"{answer!r}, expected {mib}M"
                )

    def _wait_until_ready(
        self, spec: MpsDaemonSpec, env: dict[str, str], started: tuple[int, int], deadline: _Deadline
    ) -> None:
        pid, start_time = started
        while True:
            if not is_same_process(pid, start_time):
                raise MpsError(f"the daemon (pid {pid}) exited before it became ready")
            try:
                answer = self._control(env, "get_default_active_thread_percentage", deadline)
                break
            except MpsError as exc:
                if deadline.remaining() <= 0:
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
        try:
            env = driver_env(self.driver_root)
        except BinaryFailed as exc:
            raise MpsError(str(exc)) from exc
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(pipe_dir)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(log_dir)
        return env

    def _control(self, env: dict[str, str], command: str, deadline: _Deadline | None = None) -> str:
        """Send one command the way the docs do (``echo '<cmd>' | nvidia-cuda-mps-control``) and return the answer.

        It gets ``command_timeout``, or what is left before ``deadline`` if that is less.
        """
        label = f"control command {command!r}"
        timeout, limit = self.command_timeout, f"within {self.command_timeout:g}s"
        if deadline is not None and deadline.remaining() < timeout:
            timeout, limit = deadline.remaining(), f"before {deadline.what}"
            if timeout <= 0:
                raise MpsError(f"{label} not sent: {deadline.what} has passed")
        binary = find_binary(self.driver_root, CONTROL_BINARY)
        try:
            return run_binary([str(binary)], env=env, timeout=timeout, stdin_text=command + "\n", label=label)
        except BinaryTimedOut as exc:
            raise MpsError(f"{label} got no answer {limit}") from exc
        except BinaryFailed as exc:
            raise MpsError(str(exc)) from exc

    def _set(self, env: dict[str, str], command: str, deadline: _Deadline) -> None:
        answer = self._control(env, command, deadline)
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
        deadline = _Deadline.after(self.stop_timeout, "stop")
        quit_delivered = False
        if pipe_dir.is_dir():
            try:
                self._control(self._control_env(pipe_dir, log_dir), "quit", deadline)
                quit_delivered = True
            except (MpsError, BinaryNotFound, OSError) as exc:
                log.info("MPS quit not delivered; will signal the daemon", extra={"pipe_dir": str(pipe_dir),
                                                                                   "reason": str(exc)})
        if target is not None:
            pid, start_time = target
            exited = quit_delivered and _wait_for_exit(pid, start_time, max(deadline.remaining(), 0.0))
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


def is_same_process(pid: int, start_time: int) -> bool:
    """The PID is alive and started at ``start_time`` (field 22 of /proc/<pid>/stat): never a recycled PID."""
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
    """The positive PID in ``path``, or None.

    Clients can write the pipe dir: the "pid file" may be a FIFO (a plain open would block), a link
    to anywhere, or huge. Only a small regular file that is no symlink is read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not S_ISREG(os.fstat(fd).st_mode):
            return None
        text = os.read(fd, _PID_FILE_MAX_BYTES).decode("ascii", "replace").strip()
    except OSError:
        return None
    finally:
        os.close(fd)
    # Not int(): "0" or "-1" would make a signal reach a whole process group.
    return int(text) if text.isdigit() and int(text) > 0 else None


def _daemon_start_time(pid: int, pipe_dir: Path) -> int | None:
    """The start time of ``pid`` if it is a live control daemon serving ``pipe_dir``, else None.

    The PID may come from a tenant-writable pid file, or be recycled since it was recorded.
    """
    stat = _read_proc_stat(pid)
    if stat is None or stat.state in ("Z", "X"):
        return None
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone, or not ours to read: either way not our daemon
        return None
    if b"CUDA_MPS_PIPE_DIRECTORY=" + os.fsencode(pipe_dir) not in environ or not _runs_control_binary(pid):
        return None
    # The files above were read after the stat: a PID recycled in between would show a new start time.
    again = _read_proc_stat(pid)
    if again is None or again.start_time != stat.start_time:
        return None
    return stat.start_time


def _runs_control_binary(pid: int) -> bool:
    """Whether the command line (the simulation's, run by an interpreter) or the executable is the control binary.

    Both are looked at in case the real daemon rewrites its argv.
    """
    name = os.fsencode(CONTROL_BINARY)
    with contextlib.suppress(OSError):
        if any(os.path.basename(arg) == name for arg in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")):
            return True
    with contextlib.suppress(OSError):
        return os.path.basename(os.readlink(f"/proc/{pid}/exe")) == CONTROL_BINARY
    return False


def _daemon_in(pipe_dir: Path) -> tuple[int, int] | None:
    """``(pid, start time)`` of the live control daemon serving ``pipe_dir``, as its pid file names it, if any."""
    pid = _read_pid_file(pipe_dir / PID_FILE_NAME)
    if pid is None:
        return None
    start_time = _daemon_start_time(pid, pipe_dir)
    return None if start_time is None else (pid, start_time)


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
