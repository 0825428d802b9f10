"""``python -m driver mps-host``: the long-lived process that owns the node's MPS control daemons.

Why a separate process (docs/sharing.md, "Where MPS daemons live"): daemons started by the plugin
live in the plugin container's cgroup, so a plugin restart, rolling update or OOM kill would end
every MPS server on the node and every client's CUDA context. The host runs in its own DaemonSet,
updated ``OnDelete``, with its own memory limit; the plugin, restarted or upgraded freely, asks it
over a Unix socket to start daemons (:mod:`driver.gpu.mps.hostclient`) and adopts running ones after a
restart through its checkpoint and /proc, as before. Stopping a daemon stays the plugin's job
(``quit``, then signals by PID after /proc confirms it): with ``hostPID`` both pods see one PID space.

The host's own lifetime is the daemons' lifetime: its container's cgroup holds them, so deleting the
host pod (a deliberate operator action, as the DaemonSet is ``OnDelete``) ends them; on SIGTERM it
stops them itself, and the plugin restarts them through the next host.

The host trusts nothing in a request: it is validated strictly (schema, daemon id, device UUIDs,
every path an existing directory strictly inside the configured MPS directory, reached without
symbolic links), and only root (or the host's own user) may connect.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from pydantic import ValidationError

from driver.gpu.host.binaries import BinaryFailed, BinaryNotFound, driver_env, find_binary
from driver.gpu.mps.hostcheck import (
    HostConfig,
    HostError,
    LaunchRefused,
    check_config,
    check_launch,
    lstat_mode,
    make_mount_point_in_root,
)
from driver.gpu.mps.hostclient import (
    HOST_BUSY,
    HostReleaseRequest,
    HostReply,
    HostRequest,
    NothingSent,
    encode,
    peer_credentials,
    read_line,
)
from driver.gpu.mps.hostcmd import daemon_argv, daemon_dev_root, daemon_env, replied_shm_dir
from driver.gpu.mps.launch import CONTROL_LOG_NAME, DaemonLaunch, LaunchedDaemon, MpsLaunchError, make_capability_nodes
from driver.gpu.mps.proc import CONTROL_BINARY
from driver.gpu.mps.shmmount import ShmTmpfs, answer_release

log = logging.getLogger(__name__)

# /proc/<pid>/comm holds at most 15 characters; the daemon's is its binary name cut there.
CONTROL_COMM = CONTROL_BINARY[:15]
CONTROL_SOCKET_NAME = "control"  # what the daemon binds in its pipe directory
_POLL_S = 0.02
_LOG_TAIL_BYTES = 2000
_ACCEPT_RETRY_S = 0.5
# Connections served at once, each by its own thread. A request takes at most the read timeout plus
# one daemon start; the plugin sends one per daemon start, so more at once is a misbehaving client.
MAX_CONNECTIONS = 16
_BUSY_REPLY_TIMEOUT_S = 0.5
_BUSY_LOG_INTERVAL_S = 10.0


# -- the daemons --------------------------------------------------------------------------------


@dataclass
class _Child:
    process: subprocess.Popen[bytes]
    exited: threading.Event


class DaemonSupervisor:
    """Starts daemons as children of this process and reaps each one when it exits."""

    def __init__(self, config: HostConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._children: dict[str, _Child] = {}
        self._closed = False  # set by stop_all: a request still in flight must not start a daemon after it

    def running(self) -> dict[str, int]:
        with self._lock:
            return {i: c.process.pid for i, c in self._children.items() if not c.exited.is_set()}

    def launch(self, request: DaemonLaunch) -> LaunchedDaemon:
        mode = self.config.mode
        try:
            binary = find_binary(mode.driver_root, CONTROL_BINARY)
            host_env = {} if mode.chroot else driver_env(mode.driver_root)
        except (BinaryNotFound, BinaryFailed) as exc:
            raise MpsLaunchError(str(exc)) from exc
        if mode.chroot:
            try:
                make_mount_point_in_root(self.config)
            except HostError as exc:
                raise MpsLaunchError(str(exc)) from exc
        if mode.shm_tmpfs and request.shm_dir is not None:
            # In the host's own namespace, whose MPS directory volume propagates it to the node, where
            # the clients' CDI bind mounts resolve; the daemon's namespace, made after, inherits it.
            ShmTmpfs(mode.shm_size, "--shm-tmpfs").mount(request)
        make_capability_nodes(request, mode.host_root, daemon_dev_root(mode))  # this /dev: a copy from its start
        argv = daemon_argv(request, binary, self.config.mps_dir, mode, self.config.tools)
        env = daemon_env(request, mode, host_env)
        output_path = request.log_dir / CONTROL_LOG_NAME
        with self._lock:
            if self._closed:
                raise MpsLaunchError("the MPS host is shutting down; the plugin retries through the next one")
            current = self._children.get(request.daemon_id)
            if current is not None and not current.exited.is_set():
                raise MpsLaunchError(f"daemon {request.daemon_id} already runs here (pid {current.process.pid}); "
                                     "stop it before starting it again")
            try:
                output = os.open(output_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                                 0o640)
            except OSError as exc:
                raise MpsLaunchError(f"cannot open {output_path} for the daemon's output: {exc}") from exc
            try:
                # Own session: the daemon leads a process group holding its MPS servers, and signals
                # aimed at the host's group do not reach it.
                # umask 022: the host runs with 077 (driver/cli.py), but client UIDs must reach the
                # sockets the daemon creates in its pipe directory.
                process = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=output,
                                           stderr=subprocess.STDOUT, cwd="/", start_new_session=True, umask=0o022)
            except OSError as exc:
                raise MpsLaunchError(f"could not run {argv[0]}: {exc}") from exc
            finally:
                os.close(output)
            child = _Child(process, threading.Event())
            self._children[request.daemon_id] = child
        threading.Thread(target=self._reap, args=(request.daemon_id, child), daemon=True,
                         name=f"mps-reaper-{process.pid}").start()
        log.info("MPS control daemon launched", extra={"daemon_id": request.daemon_id, "pid": process.pid,
                                                        "argv": argv})
        self._wait_until_serving(request, child, output_path)
        return LaunchedDaemon(pid=process.pid, shm_dir=replied_shm_dir(request, mode))

    def _wait_until_serving(self, request: DaemonLaunch, child: _Child, output_path: Path) -> None:
        """Return once the process runs the daemon binary (past any unshare/mount/chroot steps) and has
        made its control socket, so a daemon that cannot start is this launch's error, with its output."""
        pid = child.process.pid
        control = request.pipe_dir / CONTROL_SOCKET_NAME
        deadline = time.monotonic() + self.config.start_timeout
        while True:
            if child.exited.wait(_POLL_S):
                raise MpsLaunchError(f"daemon {request.daemon_id} (pid {pid}) exited with status "
                                     f"{child.process.returncode} at start{_tail(output_path)}")
            running = _comm(pid) == CONTROL_COMM
            if running and stat.S_ISSOCK(lstat_mode(control)):
                return
            if time.monotonic() >= deadline:
                _signal_child(child, signal.SIGKILL)
                missing = f"created no {control}" if running else f"did not exec {CONTROL_BINARY}"
                raise MpsLaunchError(f"daemon {request.daemon_id} (pid {pid}) {missing} within "
                                     f"{self.config.start_timeout:g}s; killed{_tail(output_path)}")

    def _reap(self, daemon_id: str, child: _Child) -> None:
        status = child.process.wait()
        child.exited.set()
        with self._lock:
            if self._children.get(daemon_id) is child:
                del self._children[daemon_id]
        log.info("MPS control daemon exited", extra={"daemon_id": daemon_id, "pid": child.process.pid,
                                                      "status": status})

    def stop_all(self) -> None:
        """SIGTERM every daemon's process group, then SIGKILL what is left after the grace period."""
        with self._lock:
            self._closed = True
            children = list(self._children.values())
        for child in children:
            _signal_child(child, signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_grace
        for child in children:
            if not child.exited.wait(max(deadline - time.monotonic(), 0.0)):
                _signal_child(child, signal.SIGKILL)
                child.exited.wait(2.0)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _signal_child(child: _Child, signum: signal.Signals) -> None:
    """Signal the daemon's process group (it leads one: its own session), unless it was reaped already:
    until the reaper collects it, its PID cannot be reused."""
    if child.exited.is_set():
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.process.pid, signum)


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            handle.seek(max(os.fstat(handle.fileno()).st_size - _LOG_TAIL_BYTES, 0))
            text = handle.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""
    return f"; {path} ends with: {text}" if text else ""


# -- the socket ---------------------------------------------------------------------------------


def open_listener(path: Path) -> socket.socket:
    """Listen on ``path`` (mode 0600, in a 0700 directory this user owns), replacing a stale socket.

    A socket that still answers belongs to a running host: refuse. Anything there that is not a
    socket is left alone: refuse. The new socket is bound under a temporary name and renamed over
    the path, so a client never finds the path missing or half set up.
    """
    directory = path.parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise HostError(f"--socket: {directory} is not a directory owned by uid {os.geteuid()}")
    if info.st_mode & stat.S_ISVTX:
        # Narrowing a shared directory such as /tmp would lock every other user of the host out.
        raise HostError(f"--socket: {directory} is a shared (sticky) directory; put the socket in a directory "
                        "of its own")
    os.chmod(directory, 0o700)
    try:
        existing = os.lstat(path).st_mode
    except FileNotFoundError:
        existing = None
    if existing is not None:
        if not stat.S_ISSOCK(existing):
            raise HostError(f"--socket: {path} exists and is not a socket; remove it if it is not needed")
        if _answers(path):
            raise HostError(f"--socket: another MPS host is serving {path}")
    staging = directory / f".{path.name}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        staging.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(staging))
        os.chmod(staging, 0o600)
        listener.listen(16)
        os.rename(staging, path)
    except OSError as exc:
        listener.close()
        raise HostError(f"--socket: cannot listen on {path}: {exc}") from exc
    return listener


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _one_line(exc: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'request'}: {e['msg']}" for e in exc.errors())


class MpsHost:
    def __init__(self, config: HostConfig, max_connections: int = MAX_CONNECTIONS) -> None:
        self.config = config
        self.supervisor = DaemonSupervisor(config)
        self._stop = threading.Event()
        self.max_connections = max_connections
        self._slots = threading.BoundedSemaphore(max_connections)
        self._busy_refused = 0
        self._busy_logged_at = -_BUSY_LOG_INTERVAL_S

    def answer(self, raw: bytes) -> HostReply:
        """The reply to one request line; never raises for a bad request."""
        try:
            data = json.loads(raw)
            if isinstance(data, dict) and "release" in data:
                return answer_release(HostReleaseRequest.model_validate(data).release, self.config.mps_dir)
            request = HostRequest.model_validate(data)
        except (ValueError, RecursionError) as exc:  # ValidationError and JSONDecodeError are ValueErrors;
            # RecursionError: JSON nested deeper than the parser's stack, still just a bad request.
            why = _one_line(exc) if isinstance(exc, ValidationError) else f"not JSON: {exc}"
            return HostReply(error=f"invalid request: {why}")
        try:
            check_launch(request.launch, self.config.mps_dir)
            return HostReply(daemon=self.supervisor.launch(request.launch))
        except (LaunchRefused, MpsLaunchError) as exc:
            log.warning("MPS daemon launch refused or failed", extra={"daemon_id": request.launch.daemon_id,
                                                                       "reason": str(exc)})
            return HostReply(error=str(exc))

    def _serve_connection(self, conn: socket.socket) -> None:
        with conn:
            try:
                _pid, uid = peer_credentials(conn)
                if uid not in (0, os.geteuid()):
                    reply = HostReply(error=f"uid {uid} may not start MPS daemons")
                else:
                    # The whole request, not each recv: a byte every few seconds must not hold a slot for good.
                    reply = self.answer(read_line(conn, time.monotonic() + self.config.read_timeout))
                conn.settimeout(self.config.read_timeout)
                conn.sendall(encode(reply))
            except NothingSent:
                log.debug("MPS host connection closed without a request (a plugin learning the host's PID)")
            except (OSError, ValueError) as exc:
                log.warning("MPS host connection dropped", extra={"reason": str(exc)})
            except Exception:
                log.exception("MPS host failed to answer a request")

    def serve(self, listener: socket.socket) -> None:
        listener.settimeout(0.5)
        while not self._stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                # EMFILE, ENFILE, ENOBUFS...: transient. Leaving the loop would end the host and with
                # it every daemon and its clients' CUDA contexts.
                log.warning("MPS host could not accept a connection; retrying", extra={"reason": str(exc)})
                # Not _stop.wait: the signal handler sets _stop on this thread, and Event.wait holds the Event's
                # (non-reentrant) lock for a moment; a signal then would wait for the thread it interrupted.
                time.sleep(_ACCEPT_RETRY_S)
                continue
            if not self._slots.acquire(blocking=False):
                self._refuse_busy(conn)
                continue
            try:
                threading.Thread(target=self._serve_slot, args=(conn,), daemon=True, name="mps-host-conn").start()
            except RuntimeError as exc:  # no thread to be had: the client retries
                self._slots.release()
                conn.close()
                log.warning("MPS host could not start a thread for a connection", extra={"reason": str(exc)})

    def _serve_slot(self, conn: socket.socket) -> None:
        try:
            self._serve_connection(conn)
        finally:
            self._slots.release()

    def _refuse_busy(self, conn: socket.socket) -> None:
        """Answer at once, from the accepting thread, without reading the request: one line, bounded."""
        with conn:
            conn.settimeout(_BUSY_REPLY_TIMEOUT_S)
            with contextlib.suppress(OSError):
                conn.sendall(encode(HostReply(error=f"{HOST_BUSY}: it already serves {self.max_connections} "
                                                    "connections; retry")))
        self._busy_refused += 1
        now = time.monotonic()
        if now - self._busy_logged_at >= _BUSY_LOG_INTERVAL_S:
            log.warning("MPS host refused connections: too many at once", extra={
                "refused": self._busy_refused, "max_connections": self.max_connections})
            self._busy_logged_at, self._busy_refused = now, 0

    def stop(self) -> None:
        self._stop.set()


def run_host(config: HostConfig) -> int:
    check_config(config)
    listener = open_listener(config.socket_path)
    ours = os.stat(config.socket_path).st_ino
    host = MpsHost(config)

    def _on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal received; stopping the MPS host and its daemons",
                 extra={"signal": signal.Signals(signum).name})
        host.stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    log.info("MPS host serving", extra={"socket": str(config.socket_path), "mps_dir": str(config.mps_dir),
                                        "driver_root": str(config.mode.driver_root), "chroot": config.mode.chroot,
                                        "private_shm": config.mode.private_shm})
    try:
        host.serve(listener)
    finally:
        listener.close()
        with contextlib.suppress(OSError):
            if os.stat(config.socket_path).st_ino == ours:  # a newer host may have replaced it
                config.socket_path.unlink()
        host.supervisor.stop_all()
    log.info("MPS host stopped")
    return 0
