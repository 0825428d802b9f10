"""A client that holds an MPS control daemon silent: found through /proc and let go, nobody else touched.

NVIDIA's control daemon serves its sockets from one thread. After accepting a connection it waits in
``recvmsg()`` for the client's credentials, with no timeout, so a process of any UID that
``connect()``s to the 0666 ``control`` socket and sends nothing holds the daemon there as long as it
likes: every control command waits behind it, and so would CUDA clients (measured with 550.163 and
535.261, scripts/measure-mps-control.py: still held after 12 s; ``quit`` waits too).

The daemon's main thread then shows that ``recvmsg()`` on the held connection in
``/proc/<pid>/syscall``. Seen on the same socket before and after a command that got no answer, the
hold is no client's handshake in progress (those take milliseconds). The driver takes the daemon's
end of that connection with ``pidfd_getfd(2)`` and shuts it down: the daemon logs "User did not
send valid credentials" and goes on with the next client (measured: the waiting command was
answered 2-9 ms later, the daemon kept running). No signal, no restart, and the holder's process is
left alone. What cannot be ended this way (an open control session: the daemon waits in ``poll()``)
is reported as unconfirmed limits instead (``watch/daemonwatch.py``).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import socket
from dataclasses import dataclass

log = logging.getLogger(__name__)

# Syscalls in which a thread waits for data on a descriptor (its first argument), by architecture:
# read, recvfrom, recvmsg (NVIDIA's daemon uses recvmsg; the Python stand-in recvfrom).
_RECEIVING = {"x86_64": {0, 45, 47}, "aarch64": {63, 207, 212}}
_PIDFD_GETFD = {"x86_64": 438, "aarch64": 438}


@dataclass(frozen=True)
class HeldConnection:
    """The connection a daemon's main thread waits on: its descriptor there and the socket's inode."""

    pid: int
    fd: int
    inode: int


def held_connection(pid: int) -> HeldConnection | None:
    """The socket ``pid``'s main thread is blocked receiving on, or None (running, or waiting elsewhere).
    Needs the rights to read another process's syscall (root, or the daemon's owner)."""
    receiving = _RECEIVING.get(platform.machine())
    if receiving is None:
        return None
    try:
        with open(f"/proc/{pid}/syscall", encoding="ascii") as f:
            fields = f.read().split()
        number, fd = int(fields[0]), int(fields[1], 16)
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
    except (OSError, ValueError, IndexError):
        return None  # gone, running ("running" has no number), or not ours to read
    if number not in receiving or not target.startswith("socket:["):
        return None
    return HeldConnection(pid=pid, fd=fd, inode=int(target[len("socket:["):-1]))


def release(held: HeldConnection) -> bool:
    """Shut down the daemon's end of ``held`` if that descriptor is still the same socket; True if done."""
    number = _PIDFD_GETFD.get(platform.machine())
    if number is None:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        pidfd = os.pidfd_open(held.pid)
    except OSError:
        return False
    try:
        fd = int(libc.syscall(number, pidfd, held.fd, 0))
        if fd < 0:
            code = ctypes.get_errno()
            log.info("could not take the daemon's end of a held control connection",
                     extra={"pid": held.pid, "fd": held.fd, "reason": os.strerror(code or errno.EBADF)})
            return False
        try:
            if os.fstat(fd).st_ino != held.inode:
                return False  # the daemon moved on and reused the number meanwhile
            # The copy and the daemon's descriptor are one socket: shutting it down ends the daemon's wait.
            with socket.socket(fileno=fd) as sock:
                fd = -1  # closed with the socket object
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
        finally:
            if fd >= 0:
                os.close(fd)
    finally:
        os.close(pidfd)
    log.warning("ended a silent hold of an MPS daemon's control socket (a client connected and sent nothing)",
                extra={"pid": held.pid, "fd": held.fd})
    return True
