"""Talking to the MPS host: the wire format, and the launcher the kubelet plugin uses.

The MPS host (``python -m driver mps-host``, :mod:`driver.gpu.mps.hostserver`) runs in its own
DaemonSet and owns the MPS control daemon processes, so restarting, upgrading or OOM-killing the
plugin leaves them and their clients' CUDA contexts alone (issue 6, point 8). The plugin asks it to
start a daemon over a local Unix socket; everything else (limits, health checks, adoption after a
restart, ``quit``) the plugin still does itself through the daemon's pipe directory and /proc.

One connection carries one exchange, each side sending one line of JSON:

* request: ``{"version": 1, "launch": <DaemonLaunch>}``
* reply: ``{"daemon": <LaunchedDaemon>}`` or ``{"error": "<why>"}``
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from driver.gpu.mps.launch import DaemonLaunch, LaunchedDaemon, MpsLaunchError

PROTOCOL_VERSION = 1
# A request or reply is a few hundred bytes; anything near this is not one.
MAX_MESSAGE_BYTES = 64 * 1024
HOST_HINT = "is the tessera-mps-host DaemonSet running on this node?"


class HostRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = 1  # PROTOCOL_VERSION
    launch: DaemonLaunch


class HostReply(BaseModel):
    """Exactly one of ``daemon`` and ``error``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    daemon: LaunchedDaemon | None = None
    error: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> HostReply:
        if (self.daemon is None) == (self.error is None):
            raise ValueError("a reply carries exactly one of 'daemon' and 'error'")
        return self


def encode(message: BaseModel) -> bytes:
    return message.model_dump_json().encode() + b"\n"


def read_line(conn: socket.socket) -> bytes:
    """One newline-terminated message from ``conn`` (without the newline); bounded in size.

    Raises ``ValueError`` for an oversized or unterminated message; socket timeouts propagate.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = conn.recv(4096)
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

    def __init__(self, socket_path: Path, connect_timeout: float = 2.0, reply_timeout: float = 15.0) -> None:
        """``reply_timeout`` covers the host's whole launch (it waits until the daemon binary runs)."""
        self.socket_path = socket_path
        self.connect_timeout = connect_timeout
        self.reply_timeout = reply_timeout

    def describe(self) -> str:
        return f"MPS host at {self.socket_path} (daemons outlive the plugin)"

    def launch(self, request: DaemonLaunch) -> LaunchedDaemon:
        where = f"MPS host socket {self.socket_path}"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(self.connect_timeout)
            try:
                conn.connect(str(self.socket_path))
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                raise MpsLaunchError(f"cannot reach the {where} ({exc.strerror}); {HOST_HINT}") from exc
            except TimeoutError as exc:
                raise MpsLaunchError(f"the {where} accepted no connection within {self.connect_timeout:g}s; "
                                     f"{HOST_HINT}") from exc
            except OSError as exc:
                raise MpsLaunchError(f"cannot connect to the {where}: {exc}") from exc
            conn.settimeout(self.reply_timeout)
            try:
                conn.sendall(encode(HostRequest(launch=request)))
                raw = read_line(conn)
            except TimeoutError as exc:
                raise MpsLaunchError(f"the {where} did not answer within {self.reply_timeout:g}s "
                                     f"while starting daemon {request.daemon_id}") from exc
            except (OSError, ValueError) as exc:
                raise MpsLaunchError(f"the {where} broke off while starting daemon {request.daemon_id}: {exc}") from exc
        try:
            reply = HostReply.model_validate(json.loads(raw))
        except (ValueError, ValidationError) as exc:  # JSONDecodeError is a ValueError
            raise MpsLaunchError(f"the {where} sent an unreadable reply ({exc}); "
                                 "are the plugin and the MPS host the same version?") from exc
        if reply.error is not None:
            raise MpsLaunchError(f"the MPS host refused daemon {request.daemon_id}: {reply.error}")
        assert reply.daemon is not None  # the model guarantees one of the two
        return reply.daemon
