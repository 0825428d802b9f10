"""CUDA MPS control daemons that the driver starts and stops itself (no Deployment, no pod).

One daemon serves one set of GPUs from its own pipe directory. A :class:`DaemonLauncher` runs
``nvidia-cuda-mps-control -f`` and reports its PID (no pid file: 535.x writes none). Its limits are
set with ``set_default_*`` once it answers and before the driver hands its pipe directory to any
client (through the CDI spec written after :meth:`MpsManager.start` returns), so every MPS server it
spawns gets them. The returned :class:`MpsDaemonRecord` goes into the driver's checkpoint, so after
a driver restart the daemon is adopted if it still runs, or restarted with the same limits.

A PID is signalled or adopted only once /proc shows it is this daemon (``proc.py``). Health checks
of a recorded daemon read /proc only: a tenant who plants a silent ``control`` socket cannot make a
check hang. Every control command is bounded by ``command_timeout``.

Facts used here (commands, formats, what the real daemon prints): NVIDIA's MPS documentation,
nvidia-cuda-mps-control(1) and docs/sharing.md, "NVIDIA's daemon, as measured".
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from datetime import UTC, datetime
from pathlib import Path

from driver.gpu.mps.control import CONTROL_SOCKET_NAME, Deadline, MpsControl
from driver.gpu.mps.dirs import (
    DaemonDirError,
    clear_dir,
    driver_daemon_ids,
    ensure_real_dir,
    next_restart_state,
    read_restart_state,
    remove_daemon_dir,
    restart_delay,
    write_restart_state,
)
from driver.gpu.mps.launch import CONTROL_LOG_NAME, DaemonLaunch, DaemonLauncher, MpsLaunchError
from driver.gpu.mps.model import (
    MpsDaemonRecord,
    MpsDaemonSpec,
    MpsError,
    check_daemon_id,
    pinned_limit_taken,
)
from driver.gpu.mps.proc import (
    CONTROL_BINARY,
    daemon_start_time,
    find_daemons,
    is_same_process,
    read_proc_stat,
    signal_daemon,
    wait_for_exit,
)

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 20
# sun_path is 108 bytes including the NUL; the daemon binds its sockets inside the pipe dir.
MAX_SOCKET_PATH_BYTES = 107

_POLL_INTERVAL_S = 0.05
_TERM_GRACE_S = 2.0
_KILL_WAIT_S = 3.0


class MpsManager:
    """Starts, checks, adopts and stops daemons living in ``base_dir/<daemon_id>/{pipe,log}``."""

    def __init__(
        self,
        driver_root: Path,
        base_dir: Path,
        launcher: DaemonLauncher,
        shm_dir: Path | None = None,
        ready_timeout: float = 10.0,
        command_timeout: float = 5.0,
        stop_timeout: float = 8.0,
        restart_backoff: float = 2.0,
        restart_backoff_cap: float = 300.0,
    ) -> None:
        """``shm_dir``: the shared MPS /dev/shm host directory, outside ``base_dir``. ``ready_timeout``
        bounds all of :meth:`start`; ``command_timeout`` one control command; ``stop_timeout`` the
        graceful part of a stop. Restarts of one daemon wait ``restart_backoff`` seconds, doubling
        per consecutive restart up to ``restart_backoff_cap``."""
        if shm_dir is not None and shm_dir.resolve().is_relative_to(base_dir.resolve()):
            raise ValueError(f"the MPS shm directory {shm_dir} must not be inside the MPS daemon directory {base_dir}")
        self.driver_root = driver_root
        self.base_dir = base_dir
        self.launcher = launcher
        self.shm_dir = shm_dir
        self.ready_timeout = ready_timeout
        self.command_timeout = command_timeout
        self.control = MpsControl(driver_root, command_timeout)
        self.stop_timeout = stop_timeout
        self.restart_backoff = restart_backoff
        self.restart_backoff_cap = restart_backoff_cap

    def daemon_dir(self, daemon_id: str) -> Path:
        return self.base_dir / check_daemon_id(daemon_id)

    def start(self, spec: MpsDaemonSpec, timeout: float | None = None) -> MpsDaemonRecord:
        """Start a daemon for ``spec``, wait until it answers and apply its limits, within ``ready_timeout``
        or ``timeout`` if that is less (what is left of the caller's deadline).

        An existing pipe directory is kept (emptied), so mounts of it stay valid. On failure nothing
        is left running, the directories are gone, and the :class:`MpsError` carries the daemon's log.
        """
        return self._start(spec, keep_dirs_on_failure=False, timeout=timeout)

    def process_running(self, record: MpsDaemonRecord) -> bool:
        """True if ``record.pid`` is still this record's daemon (PID and process start time). Only /proc
        is read, never the control socket: a tenant cannot make this hang."""
        return daemon_start_time(record.pid, record.pipe_dir) == record.process_start_time

    def answers_control(self, record: MpsDaemonRecord) -> bool:
        """True if the recorded daemon runs and answers a control command within ``command_timeout``."""
        if not self.process_running(record):
            return False
        try:
            self.control.send(record.pipe_dir, record.log_dir, "get_default_active_thread_percentage")
        except MpsError:
            return False
        return True

    def ensure_running(self, record: MpsDaemonRecord, timeout: float | None = None) -> MpsDaemonRecord:
        """Adopt the recorded daemon if /proc shows it running; otherwise restart it in the same
        directories with the same limits, unless it was restarted too recently (MpsError then)."""
        if self.process_running(record):
            return record
        daemon_dir = self.daemon_dir(record.spec.daemon_id)
        state = read_restart_state(daemon_dir)
        now = time.time()
        delay = restart_delay(state, self.restart_backoff, self.restart_backoff_cap, now)
        if delay > 0:
            raise MpsError(
                f"MPS control daemon {record.spec.daemon_id} is not running; it was restarted {state.count} time(s) "
                f"in a row, so the next restart is deferred for {delay:.0f}s"
            )
        try:
            self.base_dir.mkdir(parents=True, exist_ok=True)
            ensure_real_dir(daemon_dir, 0o755)
        except OSError as exc:
            raise MpsError(f"cannot prepare {daemon_dir} to restart MPS daemon {record.spec.daemon_id}: {exc}") from exc
        log.warning("MPS control daemon is gone; restarting it in the same pipe directory",
                    extra={"daemon_id": record.spec.daemon_id, "pid": record.pid, "restarts": state.count})
        # Counted before the attempt, so a daemon that fails to start backs off as one that crashes.
        try:
            write_restart_state(daemon_dir, next_restart_state(state, self.restart_backoff_cap, now))
        except OSError as exc:
            raise MpsError(f"cannot record the restart of MPS daemon {record.spec.daemon_id}: {exc}") from exc
        self._stop_process(record.pipe_dir, record.log_dir, None)
        return self._start(record.spec, keep_dirs_on_failure=True, timeout=timeout)

    def adopt(self, spec: MpsDaemonSpec) -> MpsDaemonRecord | None:
        """A record for the one live daemon in ``spec``'s directory if its limits read back as ``spec``'s,
        else None. For daemons whose record was lost with a corrupt checkpoint: their clients keep
        their daemon instead of losing it to a restart."""
        daemon_dir = self.daemon_dir(spec.daemon_id)
        pipe_dir, log_dir = daemon_dir / "pipe", daemon_dir / "log"
        running = find_daemons(pipe_dir)
        if len(running) != 1:
            return None
        try:
            self._check_limits(spec, pipe_dir, log_dir, Deadline.after(self.ready_timeout, "adoption"))
        except MpsError as exc:
            log.info("found a daemon without a record but not with the expected limits; not adopting it",
                     extra={"daemon_id": spec.daemon_id, "reason": str(exc)})
            return None
        pid, process_start_time = running[0]
        shm = daemon_dir / "shm"  # present only when the launcher gave the daemon a /dev/shm of its own
        log.info("adopted an MPS control daemon that had no record", extra={"daemon_id": spec.daemon_id, "pid": pid})
        return MpsDaemonRecord(spec=spec, pid=pid, pipe_dir=pipe_dir, log_dir=log_dir,
                               started_at=datetime.now(UTC).isoformat(timespec="seconds"),
                               process_start_time=process_start_time,
                               shm_dir=shm if shm.is_dir() and not shm.is_symlink() else self.shm_dir)

    def stop(self, record: MpsDaemonRecord) -> None:
        """Quit the daemon, fall back to SIGTERM then SIGKILL, and remove its directories.

        A daemon that is already gone is fine. Signals only go to a process /proc shows to be this
        daemon, so a process that reused the PID is never touched.
        """
        known = (record.pid, record.process_start_time) if self.process_running(record) else None
        self._stop_process(record.pipe_dir, record.log_dir, known)
        self._remove(record.pipe_dir.parent)
        log.info("MPS control daemon stopped", extra={"daemon_id": record.spec.daemon_id, "pid": record.pid})

    def stop_by_id(self, daemon_id: str) -> None:
        """Stop whatever control daemon serves ``base_dir/<daemon_id>/pipe`` (found in /proc) and remove the directory.

        For a daemon that has no record: its starter crashed before checkpointing the one
        :meth:`start` returned.
        """
        daemon_dir = self.daemon_dir(daemon_id)
        self._stop_process(daemon_dir / "pipe", daemon_dir / "log", None)
        self._remove(daemon_dir)

    def daemon_ids_on_disk(self) -> list[str]:
        """Daemon directories of the driver's own naming under ``base_dir`` (no symlinks), to find ones
        the checkpoint does not know."""
        return driver_daemon_ids(self.base_dir)

    def supports_multi_user(self, gpu_uuid: str) -> bool:
        """Whether this driver's control daemon runs in multi-user mode: starts a throwaway one with it.

        535.x and 550.x do not know the flag and exit at once; that, or any other start failure, is False.
        """
        probe = MpsDaemonSpec(daemon_id="probe-multi-user", gpu_uuids=[gpu_uuid], multi_user=True)
        try:
            self.stop_by_id(probe.daemon_id)
            record = self.start(probe)
        except MpsError as exc:
            log.info("MPS multi-user mode is not available", extra={"reason": str(exc).splitlines()[0]})
            return False
        self.stop(record)
        return True

    # -- starting -------------------------------------------------------------------------------

    def _start(self, spec: MpsDaemonSpec, keep_dirs_on_failure: bool, timeout: float | None) -> MpsDaemonRecord:
        daemon_dir = self.daemon_dir(spec.daemon_id)
        pipe_dir, log_dir = daemon_dir / "pipe", daemon_dir / "log"
        socket_path_bytes = len(os.fsencode(pipe_dir / CONTROL_SOCKET_NAME))
        if socket_path_bytes > MAX_SOCKET_PATH_BYTES:
            raise MpsError(
                f"MPS pipe directory {pipe_dir} is too long: sockets inside it would need {socket_path_bytes} bytes, "
                f"Unix sockets allow {MAX_SOCKET_PATH_BYTES}; use a shorter MPS base directory or daemon_id"
            )
        running = find_daemons(pipe_dir)
        if running:
            raise MpsError(
                f"an MPS control daemon (pid {running[0][0]}) already runs in {pipe_dir}; "
                "adopt it with ensure_running() or stop it before starting another"
            )
        limit = self.ready_timeout if timeout is None else max(min(self.ready_timeout, timeout), 0.0)
        deadline = Deadline.after(limit, "start")
        started: tuple[int, int] | None = None
        try:
            self._prepare_dirs(daemon_dir, pipe_dir, log_dir)
            request = DaemonLaunch(daemon_id=spec.daemon_id, pipe_dir=pipe_dir, log_dir=log_dir,
                                   visible_devices=spec.gpu_uuids, multi_user=spec.multi_user,
                                   shm_dir=daemon_dir / "shm")
            launched = self.launcher.launch(request)
            if launched.shm_dir not in (None, request.shm_dir):
                # Clients get this directory read-write at /dev/shm: only the one asked for will do.
                raise MpsError(f"the launcher answered with /dev/shm {launched.shm_dir}, not the requested "
                               f"{request.shm_dir} or none")
            started = self._identify(launched.pid, pipe_dir, deadline)
            self._wait_until_ready(pipe_dir, log_dir, started, deadline)
            self._apply_limits(spec, pipe_dir, log_dir, deadline)
        except (MpsError, MpsLaunchError, DaemonDirError, OSError) as exc:
            tail = _log_tail(log_dir)
            problem = self._cleanup_after_failure(daemon_dir, started, keep_dirs_on_failure)
            served = ",".join(spec.gpu_uuids)
            raise MpsError(
                f"starting MPS control daemon {spec.daemon_id} for {served} failed: {exc}{problem}{tail}"
            ) from exc
        except BaseException:
            self._cleanup_after_failure(daemon_dir, started, keep_dirs_on_failure)
            raise
        if launched.shm_dir is None:
            _remove_unused_dir(daemon_dir / "shm")
        pid, process_start_time = started
        log.info("MPS control daemon started", extra={
            "daemon_id": spec.daemon_id, "pid": pid, "gpu_uuids": spec.gpu_uuids, "launcher": self.launcher.describe()})
        return MpsDaemonRecord(spec=spec, pid=pid, pipe_dir=pipe_dir, log_dir=log_dir,
                               started_at=datetime.now(UTC).isoformat(timespec="seconds"),
                               process_start_time=process_start_time, shm_dir=launched.shm_dir or self.shm_dir)

    def _prepare_dirs(self, daemon_dir: Path, pipe_dir: Path, log_dir: Path) -> None:
        self.base_dir.mkdir(parents=True, exist_ok=True)
        # MPS servers run as their clients' UIDs and reach the pipe dir by its host path: 0755 all the way.
        for directory in (daemon_dir, pipe_dir, log_dir):
            ensure_real_dir(directory, 0o755)
        # Sockets and files of the previous daemon go; the directory (and its inode) stays.
        clear_dir(pipe_dir)
        ensure_real_dir(daemon_dir / "shm", 0o1777)  # /dev/shm's own mode, for a launcher that mounts it

    def _identify(self, pid: int, pipe_dir: Path, deadline: Deadline) -> tuple[int, int]:
        # Right after the launch /proc may still show an empty command line and environment: the
        # kernel is finishing the exec (seen under load). Look again until the start deadline.
        while True:
            start_time = daemon_start_time(pid, pipe_dir)
            if start_time is not None:
                return pid, start_time
            proc = read_proc_stat(pid)
            if proc is None or proc.state in ("Z", "X"):
                raise MpsError(f"the daemon (pid {pid}) exited before it became ready")
            if deadline.remaining() <= 0:
                raise MpsError(f"the launched process {pid} is not {CONTROL_BINARY} serving {pipe_dir}")
            time.sleep(_POLL_INTERVAL_S)

    def _wait_until_ready(self, pipe_dir: Path, log_dir: Path, started: tuple[int, int], deadline: Deadline) -> None:
        pid, start_time = started
        while True:
            if not is_same_process(pid, start_time):
                raise MpsError(f"the daemon (pid {pid}) exited before it became ready")
            try:
                self.control.send(pipe_dir, log_dir, "get_default_active_thread_percentage", deadline)
                return
            except MpsError as exc:
                if deadline.remaining() <= 0:
                    raise MpsError(f"the daemon did not become ready before {deadline.what}: {exc}") from exc
            time.sleep(_POLL_INTERVAL_S)

    def _apply_limits(self, spec: MpsDaemonSpec, pipe_dir: Path, log_dir: Path, deadline: Deadline) -> None:
        """Set each limit and read it back: the daemon accepts invalid values silently (it prints
        nothing, or the old value), so only the read-back shows whether it took one."""
        self._check_limits(spec, pipe_dir, log_dir, deadline, set_first=True)

    def _check_limits(self, spec: MpsDaemonSpec, pipe_dir: Path, log_dir: Path, deadline: Deadline,
                      set_first: bool = False) -> None:
        """Read every limit of ``spec`` back from the daemon (each set just before, with ``set_first``);
        MpsError names the first that differs."""
        if spec.active_thread_percentage is not None:
            if set_first:
                self.control.set(pipe_dir, log_dir,
                                 f"set_default_active_thread_percentage {spec.active_thread_percentage}", deadline)
            answer = self.control.send(pipe_dir, log_dir, "get_default_active_thread_percentage", deadline)
            try:
                taken = abs(float(answer) - spec.active_thread_percentage) < 0.01
            except ValueError:
                taken = False
            if not taken:
                raise MpsError(f"default active thread percentage reads back as {answer!r}, "
                               f"expected {spec.active_thread_percentage}")
        for ordinal, mib in spec.pinned_limits_mib():
            if set_first:
                # The ordinal within the daemon's CUDA_VISIBLE_DEVICES: measured, a UUID here is not
                # taken (get prints nothing; the log says "No default pinned memory limit set").
                self.control.set(pipe_dir, log_dir, f"set_default_device_pinned_mem_limit {ordinal} {mib}M", deadline)
            answer = self.control.send(pipe_dir, log_dir, f"get_default_device_pinned_mem_limit {ordinal}", deadline)
            if not pinned_limit_taken(answer, mib):
                shown = f"{mib // 1024}G" if mib >= 1024 else f"{mib}M"
                raise MpsError(
                    f"pinned memory limit for device {ordinal} ({spec.gpu_uuids[ordinal]}) reads back as "
                    f"{answer!r}, expected {mib}M (which the daemon shows as {shown!r})"
                )

    # -- stopping -------------------------------------------------------------------------------

    def _cleanup_after_failure(self, daemon_dir: Path, started: tuple[int, int] | None, keep_dirs: bool) -> str:
        """Stop a half-started daemon; returns a note for the error message if that failed too."""
        try:
            self._stop_process(daemon_dir / "pipe", daemon_dir / "log", started)
            if not keep_dirs:
                self._remove(daemon_dir)
        except MpsError as exc:
            return f"; cleanup also failed: {exc}"
        return ""

    def _stop_process(self, pipe_dir: Path, log_dir: Path, known: tuple[int, int] | None) -> None:
        # Besides the recorded one, any daemon /proc shows serving this pipe dir (one started by a
        # driver that crashed before checkpointing it). Never a PID read from the pipe dir.
        targets = sorted({*([known] if known else []), *find_daemons(pipe_dir)})
        if not targets:
            return
        deadline = Deadline.after(self.stop_timeout, "stop")
        quit_delivered = False
        try:
            self.control.send(pipe_dir, log_dir, "quit", deadline)
            quit_delivered = True
        except MpsError as exc:
            log.info("MPS quit not delivered; will signal the daemon", extra={"pipe_dir": str(pipe_dir),
                                                                               "reason": str(exc)})
        for pid, start_time in targets:
            exited = quit_delivered and wait_for_exit(pid, start_time, max(deadline.remaining(), 0.0))
            if not exited:
                signal_daemon(pid, start_time, signal.SIGTERM)
                exited = wait_for_exit(pid, start_time, min(self.stop_timeout, _TERM_GRACE_S))
            if not exited:
                signal_daemon(pid, start_time, signal.SIGKILL)
                if not wait_for_exit(pid, start_time, _KILL_WAIT_S):
                    raise MpsError(f"MPS control daemon pid {pid} is still running after SIGKILL")

    def _remove(self, daemon_dir: Path) -> None:
        try:
            remove_daemon_dir(daemon_dir)
        except DaemonDirError as exc:
            raise MpsError(str(exc)) from exc


def _remove_unused_dir(path: Path) -> None:
    # Not empty: a tenant of an earlier daemon left files; they go with the daemon's directory.
    with contextlib.suppress(OSError):
        path.rmdir()


def _log_tail(log_dir: Path) -> str:
    control_log = log_dir / CONTROL_LOG_NAME
    try:
        fd = os.open(control_log, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return f"\n(no {control_log})"
    tail = "\n".join(lines[-LOG_TAIL_LINES:])
    return f"\nlast {min(len(lines), LOG_TAIL_LINES)} lines of {control_log}:\n{tail}"
