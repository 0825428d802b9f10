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
import time
from collections.abc import Callable
from pathlib import Path

from driver.gpu.mps.control import CONTROL_SOCKET_NAME, MpsControl
from driver.gpu.mps.dirs import (
    clear_dir,
    driver_daemon_ids,
    ensure_real_dir,
    log_tail,
    remove_daemon_dir,
)
from driver.gpu.mps.identity import DaemonIdentity
from driver.gpu.mps.launch import CONTROL_LOG_NAME, DaemonLaunch, DaemonLauncher
from driver.gpu.mps.limits import LimitDrift, apply_limits, check_and_restore_limits, check_limits
from driver.gpu.mps.model import (
    SUN_PATH_MAX_BYTES,
    MpsDaemonRecord,
    MpsDaemonSpec,
    MpsDaemonStopped,
    MpsError,
    check_daemon_id,
)
from driver.gpu.mps.proc import (
    CONTROL_BINARY,
    StopSteps,
    daemon_start_time,
    is_same_process,
    read_proc_stat,
    recorded_daemon,
)
from driver.gpu.mps.restarts import STOPPED_EXIT_WAIT_S, STOPPED_RETRY_S, RestartBackoff, stopped_by_quit
from driver.gpu.mps.shmmount import try_unmount_daemon_shm
from driver.gpu.mps.stopping import stop_processes
from driver.kubeletplugin.types import Deadline
from driver.units import now

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 20

# NVIDIA's daemon answers 7-12 ms after launch (measured, docs/benchmarks.md): a fixed 50 ms poll
# spent most of a cold prepare waiting. Checks before the control socket exists cost one lstat.
_POLL_FIRST_S = 0.002
_POLL_MAX_S = 0.05
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
        graceful part of a stop. After a failed start the next waits ``restart_backoff`` seconds, doubling
        per failed start in a row up to ``restart_backoff_cap`` (``restarts.py``)."""
        if shm_dir is not None and shm_dir.resolve().is_relative_to(base_dir.resolve()):
            raise ValueError(f"the MPS shm directory {shm_dir} must not be inside the MPS daemon directory {base_dir}")
        self.driver_root = driver_root
        self.base_dir = base_dir
        self.launcher = launcher
        self.identity = DaemonIdentity(launcher)
        self.shm_dir = shm_dir
        # Device UUIDs -> the MIG capabilities their daemon's /dev needs (host/capnodes.py); the app's reads
        # the checkpoint. None: asked for none.
        self.capabilities: Callable[[list[str]], list[str]] | None = None
        self.ready_timeout = ready_timeout
        self.command_timeout = command_timeout
        self.control = MpsControl(driver_root, command_timeout)
        self.stop_timeout = stop_timeout
        self.restart_backoff = restart_backoff
        self.restart_backoff_cap = restart_backoff_cap

    def daemon_dir(self, daemon_id: str) -> Path:
        return self.base_dir / check_daemon_id(daemon_id)

    def start(self, spec: MpsDaemonSpec, deadline: Deadline | None = None) -> MpsDaemonRecord:
        """Start a daemon for ``spec``, wait until it answers and apply its limits, within ``ready_timeout``
        or before the caller's ``deadline`` if that comes first.

        An existing pipe directory is kept (emptied), so mounts of it stay valid. On failure nothing
        is left running, the directories are gone, and the :class:`MpsError` carries the daemon's log.
        """
        return self._start_again_if_stopped(spec, False, deadline)

    def process_running(self, record: MpsDaemonRecord) -> bool:
        """True if ``record.pid`` is still this record's daemon (PID and process start time) serving its spec's
        devices: a dynamic MIG instance made again moves the record onto its new MIG UUID (``runtime/migruntime.py``),
        and a daemon left on the old one serves nothing. Only /proc is read: a tenant cannot make this hang."""
        found = recorded_daemon(record.pid, record.pipe_dir)
        return (found is not None and found.start_time == record.process_start_time
                and found.visible_devices in (None, tuple(record.spec.gpu_uuids)))

    def _alive(self, record: MpsDaemonRecord) -> tuple[int, int] | None:
        """``(pid, start time)`` if ``record.pid`` is still the process the record started, whatever it serves."""
        alive = daemon_start_time(record.pid, record.pipe_dir) == record.process_start_time
        return (record.pid, record.process_start_time) if alive else None

    def ensure_running(self, record: MpsDaemonRecord, deadline: Deadline | None = None,
                       retry_stopped: bool = False) -> MpsDaemonRecord:
        """Adopt the recorded daemon if /proc shows it running; otherwise restart it in the same directories
        with the same limits, before ``deadline`` (or within ``ready_timeout``): at once, unless it failed to start
        before (``restarts.py``). Stopped by a client while it starts: :class:`MpsDaemonStopped`, or with
        ``retry_stopped`` (a prepare) started again in time; a background check leaves it to its next round."""
        if self.process_running(record):
            return record
        daemon_id = record.spec.daemon_id
        daemon_dir = self.daemon_dir(daemon_id)
        restart = Deadline.after(self.ready_timeout if deadline is None else deadline.remaining(), purpose="restart")
        backoff = RestartBackoff(self.restart_backoff, self.restart_backoff_cap)
        state = backoff.wait_turn(daemon_id, daemon_dir, restart)
        try:
            self.base_dir.mkdir(parents=True, exist_ok=True)
            ensure_real_dir(daemon_dir, 0o755)
        except OSError as exc:
            raise MpsError(f"cannot prepare {daemon_dir} to restart MPS daemon {daemon_id}: {exc}") from exc
        log.warning("MPS control daemon is gone (or serves devices its record no longer names); restarting it in "
                    "the same pipe directory", extra={"daemon_id": daemon_id, "pid": record.pid,
                                                      "failed_starts": state.count, "gpu_uuids": record.spec.gpu_uuids})
        self._stop_process(record.pipe_dir, record.log_dir, self._alive(record), restart)
        try:
            left = None if deadline is None else restart
            restarted = (self._start_again_if_stopped(record.spec, True, left) if retry_stopped
                         else self._start(record.spec, keep_dirs_on_failure=True, deadline=left))
        except MpsDaemonStopped:
            raise  # a client's doing, not a failure to start: no backoff
        except MpsError:
            backoff.done(daemon_dir, state, started=False)
            raise
        backoff.done(daemon_dir, state, started=True)
        return restarted

    def check_and_restore_limits(self, record: MpsDaemonRecord, deadline: Deadline | None = None) -> list[LimitDrift]:
        """Read the running daemon's limits back and set again any that a client changed; returns what was
        found changed (empty: all as the spec says). :class:`MpsDaemonStopped` if the daemon exited
        meanwhile (restart it), MpsError if it does not answer or does not take a limit back."""
        return check_and_restore_limits(self.control, record, self._within_ready(deadline, "limit check"))

    def adopt(self, spec: MpsDaemonSpec, deadline: Deadline | None = None,
              restore: bool = False) -> MpsDaemonRecord | None:
        """A record for the one live daemon in ``spec``'s directory if its limits read back as ``spec``'s,
        else None. For daemons whose record was lost with the checkpoint: their clients keep their daemon
        instead of losing it to a restart. With ``restore`` (``spec`` is the one the daemon was started
        with, from its claims' CDI specs), limits a client changed are set back and it is adopted anyway."""
        daemon_dir = self.daemon_dir(spec.daemon_id)
        running = self.identity.unrecorded(daemon_dir / "pipe")
        if len(running) != 1:
            return None
        shm = daemon_dir / "shm"  # present only when the launcher gave the daemon a /dev/shm of its own
        record = MpsDaemonRecord(spec=spec, pid=running[0][0], pipe_dir=daemon_dir / "pipe", log_dir=daemon_dir / "log",
                                 started_at=now(),
                                 process_start_time=running[0][1],
                                 shm_dir=shm if shm.is_dir() and not shm.is_symlink() else self.shm_dir)
        adoption, drift = self._within_ready(deadline, "adoption"), []
        try:
            if restore:
                drift = check_and_restore_limits(self.control, record, adoption)
            else:
                check_limits(self.control, spec, record.pipe_dir, record.log_dir, adoption)
        except MpsError as exc:
            log.info("found a daemon without a record but not with the expected limits; not adopting it",
                     extra={"daemon_id": spec.daemon_id, "reason": str(exc)})
            return None
        log.info("adopted an MPS control daemon that had no record", extra={
            "daemon_id": spec.daemon_id, "pid": record.pid, "limits_restored": [d.describe() for d in drift]})
        return record

    def stop(self, record: MpsDaemonRecord, deadline: Deadline | None = None) -> None:
        """Quit the daemon, fall back to SIGTERM then SIGKILL, and remove its directories, before
        ``deadline`` if given (a prepare's; SIGKILL is still sent once it has passed).

        A daemon that is already gone is fine. Signals only go to a process /proc shows to be this
        daemon, so a process that reused the PID is never touched.
        """
        # The recorded process, also one serving devices its record no longer names: it is still ours to stop.
        self._stop_process(record.pipe_dir, record.log_dir, self._alive(record), deadline)
        self._remove(record.pipe_dir.parent)
        log.info("MPS control daemon stopped", extra={"daemon_id": record.spec.daemon_id, "pid": record.pid})

    def stop_by_id(self, daemon_id: str, deadline: Deadline | None = None) -> None:
        """Stop the driver's daemon serving ``base_dir/<daemon_id>/pipe`` (found in /proc) and remove the
        directory, before ``deadline`` if given.

        For a daemon that has no record: its starter crashed before checkpointing the one
        :meth:`start` returned. Only a daemon the launcher started counts (``identity.py``).
        """
        daemon_dir = self.daemon_dir(daemon_id)
        self._stop_process(daemon_dir / "pipe", daemon_dir / "log", None, deadline)
        self._remove(daemon_dir)

    def daemon_ids_on_disk(self) -> list[str]:
        """Daemon directories of the driver's own naming under ``base_dir`` (no symlinks), to find ones
        the checkpoint does not know."""
        return driver_daemon_ids(self.base_dir)

    def _within_ready(self, deadline: Deadline | None, purpose: str) -> Deadline:
        """``ready_timeout`` from now, or what is left of a caller's deadline if that is less."""
        seconds = self.ready_timeout if deadline is None else deadline.bound(self.ready_timeout)
        return Deadline.after(seconds, purpose=purpose)

    # -- starting -------------------------------------------------------------------------------

    def _start_again_if_stopped(self, spec: MpsDaemonSpec, keep_dirs: bool,
                                deadline: Deadline | None) -> MpsDaemonRecord:
        # A client of the pipe dir can `quit` the daemon between its launch and its limits: that is
        # not a failure to start, and another start right away is expected to work.
        starts = Deadline.after(self.ready_timeout if deadline is None else deadline.remaining(), purpose="start")
        retry_until: float | None = None
        while True:
            try:
                return self._start(spec, keep_dirs_on_failure=keep_dirs, deadline=deadline)
            except MpsDaemonStopped as exc:
                retry_until = retry_until or time.monotonic() + STOPPED_RETRY_S
                deadline = starts
                if starts.remaining() <= STOPPED_EXIT_WAIT_S or time.monotonic() >= retry_until:
                    raise
                log.warning("MPS control daemon was stopped while it started (a client sent quit?); starting it "
                            "again", extra={"daemon_id": spec.daemon_id, "reason": str(exc).splitlines()[0]})

    def _start(self, spec: MpsDaemonSpec, keep_dirs_on_failure: bool, deadline: Deadline | None) -> MpsDaemonRecord:
        daemon_dir = self.daemon_dir(spec.daemon_id)
        pipe_dir, log_dir = daemon_dir / "pipe", daemon_dir / "log"
        socket_path_bytes = len(os.fsencode(pipe_dir / CONTROL_SOCKET_NAME))
        if socket_path_bytes > SUN_PATH_MAX_BYTES:
            raise MpsError(
                f"MPS pipe directory {pipe_dir} is too long: sockets inside it would need {socket_path_bytes} bytes, "
                f"Unix sockets allow {SUN_PATH_MAX_BYTES}; use a shorter MPS base directory or daemon_id"
            )
        running = self.identity.unrecorded(pipe_dir)
        if running:
            raise MpsError(
                f"an MPS control daemon (pid {running[0][0]}) already runs in {pipe_dir}; "
                "it must stop before another can start there"
            )
        start = self._within_ready(deadline, "start")
        started: tuple[int, int] | None = None
        launched_pid: int | None = None
        try:
            self._prepare_dirs(daemon_dir, pipe_dir, log_dir)
            request = DaemonLaunch(daemon_id=spec.daemon_id, pipe_dir=pipe_dir, log_dir=log_dir,
                                   visible_devices=spec.gpu_uuids, multi_user=spec.multi_user,
                                   shm_dir=daemon_dir / "shm", shm_size=spec.shm_size,
                                   capabilities=(self.capabilities(spec.gpu_uuids) if self.capabilities else [])
                                   or None)
            launched = self.launcher.launch(request, start.remaining())
            launched_pid = launched.pid
            if launched.shm_dir not in (None, request.shm_dir):
                # Clients get this directory read-write at /dev/shm: only the one asked for will do.
                raise MpsError(f"the launcher answered with /dev/shm {launched.shm_dir}, not the requested "
                               f"{request.shm_dir} or none")
            started = self._identify(launched.pid, pipe_dir, start)
            self._wait_until_ready(pipe_dir, log_dir, started, start)
            apply_limits(self.control, spec, pipe_dir, log_dir, start)
        except (MpsError, OSError) as exc:
            stopped = stopped_by_quit(log_dir, launched_pid, started)
            tail = log_tail(log_dir / CONTROL_LOG_NAME, LOG_TAIL_LINES)
            problem = self._cleanup_after_failure(daemon_dir, started, keep_dirs_on_failure, start)
            served = ",".join(spec.gpu_uuids)
            raise (MpsDaemonStopped if stopped else MpsError)(
                f"starting MPS control daemon {spec.daemon_id} for {served} failed: {exc}{problem}{tail}"
            ) from exc
        except BaseException:
            self._cleanup_after_failure(daemon_dir, started, keep_dirs_on_failure, start)
            raise
        if launched.shm_dir is None:
            _remove_unused_dir(daemon_dir / "shm")
        pid, process_start_time = started
        log.info("MPS control daemon started", extra={
            "daemon_id": spec.daemon_id, "pid": pid, "gpu_uuids": spec.gpu_uuids, "launcher": self.launcher.describe()})
        return MpsDaemonRecord(spec=spec, pid=pid, pipe_dir=pipe_dir, log_dir=log_dir,
                               started_at=now(),
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
        pause = _POLL_FIRST_S
        while True:
            start_time = daemon_start_time(pid, pipe_dir)
            if start_time is not None:
                return pid, start_time
            proc = read_proc_stat(pid)
            if proc is None or proc.state in ("Z", "X"):
                raise MpsError(f"the daemon (pid {pid}) exited before it became ready")
            if deadline.remaining() <= 0:
                raise MpsError(f"the launched process {pid} is not {CONTROL_BINARY} serving {pipe_dir}")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def _wait_until_ready(self, pipe_dir: Path, log_dir: Path, started: tuple[int, int], deadline: Deadline) -> None:
        pid, start_time = started
        pause = _POLL_FIRST_S
        while True:
            if not is_same_process(pid, start_time):
                raise MpsError(f"the daemon (pid {pid}) exited before it became ready")
            try:
                self.control.send(pipe_dir, log_dir, "get_default_active_thread_percentage", deadline)
                return
            except MpsError as exc:
                if deadline.remaining() <= 0:
                    raise MpsError(f"the daemon did not become ready before {deadline.what}: {exc}") from exc
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    # -- stopping -------------------------------------------------------------------------------

    def _cleanup_after_failure(self, daemon_dir: Path, started: tuple[int, int] | None, keep_dirs: bool,
                               deadline: Deadline) -> str:
        """Stop a half-started daemon within what is left of the start's deadline (at 0 it is killed at
        once: it serves nobody yet); returns a note for the error message if that failed too."""
        try:
            self._stop_process(daemon_dir / "pipe", daemon_dir / "log", started, deadline)
            if not keep_dirs:
                self._remove(daemon_dir)
        except MpsError as exc:
            return f"; cleanup also failed: {exc}"
        return ""

    def _stop_process(self, pipe_dir: Path, log_dir: Path, known: tuple[int, int] | None,
                      deadline: Deadline | None = None) -> None:
        # Besides the recorded one, any daemon of this driver's launcher that /proc shows serving this
        # pipe dir (one started by a driver that crashed before checkpointing it); never a look-alike,
        # never a PID read from the pipe dir.
        targets = sorted({*([known] if known else []), *self.identity.unrecorded(pipe_dir)})
        full = StopSteps(quit_s=self.stop_timeout, term_s=min(self.stop_timeout, _TERM_GRACE_S), kill_s=_KILL_WAIT_S)
        steps = full if deadline is None else full.within(deadline.remaining())
        stop_processes(self.control, pipe_dir, log_dir, targets, steps)

    def _remove(self, daemon_dir: Path) -> None:
        try_unmount_daemon_shm(self.launcher, daemon_dir)  # the launcher's tmpfs on shm/, if any
        remove_daemon_dir(daemon_dir)  # DaemonDirError is an MpsError


def _remove_unused_dir(path: Path) -> None:
    # Not empty: a tenant of an earlier daemon left files; they go with the daemon's directory.
    with contextlib.suppress(OSError):
        path.rmdir()
