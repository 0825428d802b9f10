"""Talking to the MPS host: the wire format, and the launcher the kubelet plugin uses.

The MPS host (``python -m driver mps-host``, :mod:`driver.gpu.mps.hostserver`) only starts daemons, over a local
Unix socket; the plugin does everything else itself (docs/sharing.md, "Where MPS daemons live": why, and the split).

One connection carries one exchange, each side sending one line of JSON:

* request: ``{"version": 1, "launch": <DaemonLaunch>}``
* reply: ``{"daemon": <LaunchedDaemon>}`` or ``{"error": "<why>"}``
* or, once a daemon is stopped for good: ``{"version": 1, "release": <ShmRelease>}``, answered
  ``{"released": true}`` or an error: the host unmounts the daemon's ``/dev/shm`` tmpfs (shmmount.py).

Fields left at None are not sent, so a host older than the plugin still takes every request that
uses no newer field (an old host refuses ``release`` as an invalid request: it mounted nothing).

A connection closed without a request is how the plugin learns the host's PID (``SO_PEERCRED``; the
socket is root's, 0600, so the peer is the host), which ties daemons found in /proc to it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from driver.gpu.claimconfig.quantity import DEFAULT_SHM_SIZE
from driver.gpu.mps.launch import DaemonLaunch, LaunchedDaemon, MpsLaunchError
from driver.gpu.mps.proc import is_same_process, read_proc_stat, tied_to

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
# A request or reply is a few hundred bytes; anything near this is not one.
MAX_MESSAGE_BYTES = 64 * 1024
HOST_HINT = "is the tessera-mps-host DaemonSet running on this node?"
# What a host older than shm sizes answers to a request that carries one.
OLD_HOST_REFUSAL = "shm_size: Extra inputs are not permitted"
# How the host's error for a request it cannot parse begins (hostserver.py, MpsHost.answer).
INVALID_REQUEST = "invalid request:"
# How the host's answer begins when all its connection slots are taken (it read nothing: try again).
HOST_BUSY = "the MPS host is busy"
# Between tries on a busy or broken host connection, doubling up to the cap.
_RETRY_FIRST_S = 0.05
_RETRY_MAX_S = 0.5


class _TryAgain(Exception):
    """The host was busy or the connection broke before a reply: the request may be sent again."""


class HostRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1  # PROTOCOL_VERSION
    launch: DaemonLaunch


class ShmRelease(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    daemon_id: str
    shm_dir: Path  # must be <mps dir>/<daemon_id>/shm


class HostReleaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1  # PROTOCOL_VERSION
    release: ShmRelease


class HostReply(BaseModel):
    """Exactly one of ``daemon``, ``error`` and ``released``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    daemon: LaunchedDaemon | None = None
    error: str | None = None
    released: bool | None = None  # the answer to a release: done

    @model_validator(mode="after")
    def _exactly_one(self) -> HostReply:
        if [self.daemon is not None, self.error is not None, bool(self.released)].count(True) != 1:
            raise ValueError("a reply carries exactly one of 'daemon', 'error' and 'released'")
        return self


class NothingSent(ValueError):
    """The peer closed the connection before sending a byte (a launcher learning the host's PID)."""


def peer_credentials(conn: socket.socket) -> tuple[int, int]:
    """``(pid, uid)`` of the process at the other end of a Unix socket (``SO_PEERCRED``), as this process's
    namespaces see it (pid 0 if it cannot see it)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", creds)
    return int(pid), int(uid)


def encode(message: BaseModel) -> bytes:
    # exclude_none: an older peer refuses fields it does not know, and None is every new field's default.
    return message.model_dump_json(exclude_none=True).encode() + b"\n"


def read_line(conn: socket.socket, until: float | None = None) -> bytes:
    """One newline-terminated message from ``conn`` (without the newline); bounded in size.

    ``until`` (``time.monotonic()``) bounds the whole message, not each ``recv``: a peer sending a byte
    now and then cannot hold the connection past it. Raises ``ValueError`` for an oversized or
    unterminated message, ``TimeoutError`` once ``until`` or the socket's timeout has passed.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        if until is not None:
            left = until - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no complete message in the time allowed ({size} bytes came)")
            conn.settimeout(left)
        try:
            chunk = conn.recv(4096)
        except TimeoutError as exc:
            raise TimeoutError(f"no complete message in the time allowed ({size} bytes came)") from exc
        if not chunk and not chunks:
            raise NothingSent("the connection closed before anything was sent")
        if not chunk:
            raise ValueError(f"the connection closed after {size} bytes, before a complete line")
        newline = chunk.find(b"\n")
        if newline >= 0:
            chunks.append(chunk[:newline])
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_MESSAGE_BYTES:
            raise ValueError(f"message longer than {MAX_MESSAGE_BYTES} bytes")


class MpsHostLauncher:
    """A :class:`~driver.gpu.mps.launch.DaemonLauncher` that asks the MPS host to start the daemon."""

    def __init__(self, socket_path: Path, connect_timeout: float = 2.0, reply_timeout: float = 15.0,
                 shm_size: int = DEFAULT_SHM_SIZE) -> None:
        """``reply_timeout`` covers the host's whole launch (it waits until the daemon binary runs).
        ``shm_size``: the daemon's /dev/shm tmpfs size for a request that names none (--mps-shm-size)."""
        self.socket_path = socket_path
        self.shm_size = shm_size
        self.connect_timeout = connect_timeout
        self.reply_timeout = reply_timeout
        self._host: tuple[int, int] | None = None  # the host's (pid, start time), learned on connecting

    def describe(self) -> str:
        return f"MPS host at {self.socket_path} (daemons outlive the plugin)"

    def started_here(self, pid: int) -> bool:
        # The host runs daemons as its children; with hostPID the plugin sees the host's PID.
        host = self._host_pid()
        return host is not None and tied_to(pid, host)

    def _host_pid(self) -> int | None:
        known = self._host
        if known is not None and is_same_process(*known):
            return known[0]
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(self.connect_timeout)
            try:
                conn.connect(str(self.socket_path))
            except OSError:
                return None  # no host: nothing found in /proc is tied to it
            self._remember_host(conn)
        return self._host[0] if self._host is not None else None

    def _remember_host(self, conn: socket.socket) -> None:
        pid, _uid = peer_credentials(conn)
        stat = read_proc_stat(pid) if pid > 0 else None
        self._host = (pid, stat.start_time) if stat is not None else None

    def launch(self, request: DaemonLaunch, timeout: float | None = None) -> LaunchedDaemon:
        """Ask the host to start the daemon, within ``timeout`` seconds (else ``reply_timeout``). A busy
        host, or a connection it cut before replying, is asked again until then."""
        if request.shm_size is None:
            request = request.model_copy(update={"shm_size": self.shm_size})
        budget = self.reply_timeout if timeout is None else max(timeout, 0.0)
        until, pause, tries = time.monotonic() + budget, _RETRY_FIRST_S, 0
        while True:
            tries += 1
            try:
                return self._launch(request, until)
            except _TryAgain as exc:
                if time.monotonic() + pause >= until:
                    raise MpsLaunchError(
                        f"{HOST_BUSY} or cut the connection: daemon {request.daemon_id} was not started after "
                        f"{tries} tries in {budget:.1f}s (last: {exc}); the kubelet retries") from exc
                log.info("the MPS host was busy or cut the connection; asking again",
                         extra={"daemon_id": request.daemon_id, "reason": str(exc), "tries": tries})
                time.sleep(pause)
                pause = min(pause * 2, _RETRY_MAX_S)

    def _launch(self, request: DaemonLaunch, until: float) -> LaunchedDaemon:
        where, started = f"MPS host socket {self.socket_path}", time.monotonic()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(max(min(self.connect_timeout, until - time.monotonic()), 0.001))
            try:
                conn.connect(str(self.socket_path))
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise MpsLaunchError(f"cannot reach the {where} ({exc.strerror}); {HOST_HINT}") from exc
            except TimeoutError as exc:
                raise MpsLaunchError(f"the {where} accepted no connection within {self.connect_timeout:g}s; "
                                     f"{HOST_HINT}") from exc
            except OSError as exc:
                raise MpsLaunchError(f"cannot connect to the {where}: {exc}") from exc
            self._remember_host(conn)
            try:
                conn.settimeout(max(until - time.monotonic(), 0.001))
                # A busy host answers without reading the request: its answer, if it came, says why.
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    conn.sendall(encode(HostRequest(launch=request)))
                raw = read_line(conn, until)
            except TimeoutError as exc:
                raise MpsLaunchError(f"the {where} did not answer within {until - started:.1f}s while starting "
                                     f"daemon {request.daemon_id}") from exc
            except (OSError, ValueError) as exc:  # NothingSent included: cut before any reply
                raise _TryAgain(f"the connection broke off: {exc}") from exc
        try:
            reply = HostReply.model_validate(json.loads(raw))
        except (ValueError, ValidationError) as exc:  # JSONDecodeError is a ValueError
            raise MpsLaunchError(f"the {where} sent an unreadable reply ({exc}); "
                                 "are the plugin and the MPS host the same version?") from exc
        if reply.error is not None:
            if reply.error.startswith(HOST_BUSY):
                raise _TryAgain(reply.error)
            if OLD_HOST_REFUSAL in reply.error and request.shm_size is not None:
                # A host older than the plugin (it is updated OnDelete) mounts no tmpfs, so it needs no
                # size: ask again without one (None is not sent) rather than fail every MPS prepare.
                log.warning("the MPS host is older than the plugin: daemons get no /dev/shm tmpfs of their own "
                            "until its pod is replaced", extra={"daemon_id": request.daemon_id})
                return self._launch(request.model_copy(update={"shm_size": None}), until)
            raise MpsLaunchError(f"the MPS host refused daemon {request.daemon_id}: {reply.error}")
        assert reply.daemon is not None  # the model guarantees one of the two
        return reply.daemon

    def unmount_shm(self, daemon_id: str, shm_dir: Path) -> None:
        """Ask the host to unmount the daemon's /dev/shm tmpfs (one it mounted in its own namespace,
        which only it can unmount). A host too old to know the request mounted nothing."""
        where = f"MPS host socket {self.socket_path}"
        message = encode(HostReleaseRequest(release=ShmRelease(daemon_id=daemon_id, shm_dir=shm_dir)))
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(self.connect_timeout)
                conn.connect(str(self.socket_path))
                conn.settimeout(self.reply_timeout)
                conn.sendall(message)
                reply = HostReply.model_validate(json.loads(read_line(conn)))
        except (OSError, ValueError) as exc:  # ValidationError and JSONDecodeError are ValueErrors
            raise MpsLaunchError(f"cannot ask the {where} to unmount {shm_dir}: {exc}; {HOST_HINT}") from exc
        if reply.error is not None and not reply.error.startswith(INVALID_REQUEST):
            raise MpsLaunchError(f"the MPS host did not unmount {shm_dir} of daemon {daemon_id}: {reply.error}")
