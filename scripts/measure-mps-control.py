#!/usr/bin/env python3
"""Measure how an MPS control daemon treats a busy and a silent control socket (run as root).

    python3 scripts/measure-mps-control.py [.cache/nvidia-mps/550.*/usr/bin/nvidia-cuda-mps-control ...]

For each control binary (NVIDIA's, from scripts/fetch-nvidia-mps.sh, or the stand-in) it starts a
daemon in a scratch directory and prints, one line a fact:

* busy: while one front-end keeps its control session open (its stdin not yet closed), what another
  front-end (root, and UID 65534) gets and how fast;
* silent: while a process of UID 65534 has only ``connect()``ed to ``<pipe>/control`` (SOCK_SEQPACKET,
  NVIDIA's socket type) and sent nothing, whether a front-end is answered, what the daemon's main
  thread is blocked in (``/proc/<pid>/task/<pid>/syscall``), and what ends the hold: ``shutdown()`` of
  the daemon's end of that connection (taken with pidfd_getfd), SIGTERM, ``quit``.

docs/sharing.md ("NVIDIA's daemon, as measured") records the results; the stand-in models them.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

NOBODY = 65534
_SYS_PIDFD_GETFD = 438
HOLD_SILENT = ("import socket,sys,time\n"
               "s=socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
               "try: s.connect(sys.argv[1])\n"
               "except OSError: s=socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect(sys.argv[1])\n"
               "print('held', flush=True); sys.stdin.read()\n")


def front_end(binary: Path, env: dict[str, str], command: str, uid: int = 0,
              timeout: float = 30) -> tuple[int | str, str, float]:
    argv = [str(binary)] if uid == 0 else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                                           str(binary)]
    began = time.monotonic()
    try:
        done = subprocess.run(argv, input=command + "\n", capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", "", time.monotonic() - began
    return done.returncode, (done.stdout + done.stderr).strip(), time.monotonic() - began


def pidfd_getfd(pid: int, fd: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        got = int(libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0))
        if got < 0:
            raise OSError(ctypes.get_errno(), "pidfd_getfd")
        return got
    finally:
        os.close(pidfd)


def daemon_pid(pipe: Path) -> int:
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if b"-d" in argv[1:3] and f"CUDA_MPS_PIPE_DIRECTORY={pipe}\0".encode() in environ:
            return int(entry.name)
    raise RuntimeError("daemon not found")


def blocked_in(pid: int) -> tuple[str, int | None, str]:
    """The main thread's syscall number, its first argument as an fd, and what that fd is."""
    fields = Path(f"/proc/{pid}/task/{pid}/syscall").read_text().split()
    fd = int(fields[1], 16) if len(fields) > 1 else None
    what = os.readlink(f"/proc/{pid}/fd/{fd}") if fd is not None and os.path.exists(f"/proc/{pid}/fd/{fd}") else "-"
    return fields[0], fd, what


def exited(pid: int) -> bool:
    """Gone, or a zombie (a daemon started with -d is nobody's child here to reap)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def wait_for_log(logs: Path, text: str, count: int) -> None:
    ends = time.monotonic() + 10
    while (logs / "control.log").read_text().count(text) < count:
        if time.monotonic() > ends:
            raise RuntimeError(f"no {count}th {text!r} in control.log")
        time.sleep(0.01)


def measure(binary: Path) -> None:
    print(f"== {binary}")
    scratch = Path(tempfile.mkdtemp(prefix="mps-measure-"))
    scratch.chmod(0o755)
    pipe, logs = scratch / "pipe", scratch / "log"
    pipe.mkdir(mode=0o755)
    logs.mkdir(mode=0o755)
    env = {"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    subprocess.run([str(binary), "-d"], env=env, check=True, timeout=10)
    pid = daemon_pid(pipe)
    get = "get_default_active_thread_percentage"
    try:
        print("idle: root get", front_end(binary, env, get))
        # -- busy: one open control session
        for holder_uid in (0, NOBODY):
            argv = [str(binary)] if holder_uid == 0 else ["setpriv", f"--reuid={holder_uid}",
                                                           f"--regid={holder_uid}", "--clear-groups", str(binary)]
            sessions = (logs / "control.log").read_text().count("NEW UI")
            holder = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
            assert holder.stdin is not None and holder.stdout is not None
            holder.stdin.write(get + "\n")
            holder.stdin.flush()
            wait_for_log(logs, "NEW UI", sessions + 1)
            print(f"busy (session of uid {holder_uid} open)")
            commands_before = (logs / "control.log").read_text().count("Cmd:")
            print(f"  main thread blocked in {blocked_in(pid)}")
            for uid, command in ((0, get), (NOBODY, get), (0, "set_default_active_thread_percentage 50")):
                tally: Counter[tuple[int | str, str]] = Counter()
                slowest = 0.0
                for _ in range(10):
                    rc, out, took = front_end(binary, env, command, uid)
                    tally[(rc, out)] += 1
                    slowest = max(slowest, took)
                print(f"  uid {uid} {command.split()[0]} x10: {dict(tally)}, slowest {slowest:.3f}s")
            print("  commands the daemon carried out meanwhile:",
                  (logs / "control.log").read_text().count("Cmd:") - commands_before)
            holder.stdin.close()
            holder.wait(10)
            print("  after the session closed, root get:", front_end(binary, env, get))
        # -- silent: connect() and nothing else
        silent = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                                   sys.executable, "-c", HOLD_SILENT, str(pipe / "control")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert silent.stdout is not None and silent.stdin is not None
        print("silent (uid 65534 connected, sends nothing):", silent.stdout.readline().strip())
        time.sleep(0.3)
        print("  main thread blocked in", blocked_in(pid), "(47 = recvmsg)")
        print("  root get with 3s timeout:", front_end(binary, env, get, timeout=3))
        print("  uid 65534 get with 3s timeout:", front_end(binary, env, get, NOBODY, timeout=3))
        call = subprocess.Popen([str(binary)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
        assert call.stdin is not None and call.stdout is not None
        call.stdin.write(get + "\n")
        call.stdin.close()
        time.sleep(12)
        print("  after 12 s still held (no daemon timeout):", call.poll() is None,
              "main thread", blocked_in(pid))
        _, fd, what = blocked_in(pid)
        assert fd is not None
        began = time.monotonic()
        dup = pidfd_getfd(pid, fd)
        with socket.socket(fileno=dup) as daemons_end:
            daemons_end.shutdown(socket.SHUT_RDWR)
        answer = call.stdout.read().strip()
        call.wait(10)
        print(f"  shutdown() of the daemon's fd {fd} ({what}): the waiting get answered {answer!r} "
              f"{time.monotonic() - began:.3f}s later; daemon alive: {os.path.exists(f'/proc/{pid}')}")
        silent.stdin.close()
        silent.wait(10)
        print("  root get afterwards:", front_end(binary, env, get))
        # -- quit and SIGTERM during a silent hold
        silent = subprocess.Popen([sys.executable, "-c", HOLD_SILENT, str(pipe / "control")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert silent.stdout is not None and silent.stdin is not None
        silent.stdout.readline()
        print("silent again: root quit with 3s timeout:", front_end(binary, env, "quit", timeout=3))
        began = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        while not exited(pid) and time.monotonic() - began < 10:
            time.sleep(0.01)
        print(f"  SIGTERM: daemon exited after {time.monotonic() - began:.3f}s: {exited(pid)}")
        silent.stdin.close()
        silent.wait(10)
    finally:
        if os.path.exists(f"/proc/{pid}"):
            os.kill(pid, signal.SIGKILL)
        print("  control.log tail:")
        for line in (logs / "control.log").read_text().splitlines()[-6:]:
            print("   ", line)


def main(argv: list[str]) -> int:
    binaries = [Path(a) for a in argv] or sorted(Path(".cache/nvidia-mps").glob("*/usr/bin/nvidia-cuda-mps-control"))
    for binary in binaries:
        measure(binary.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
