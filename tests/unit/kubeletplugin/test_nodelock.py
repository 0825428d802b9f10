"""NodeLock: exclusion between threads of one process and between processes (flock), with a timeout."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from driver.kubeletplugin.filemodes import ensure_private_dir
from driver.kubeletplugin.nodelock import LockFileError, LockTimeout, NodeLock

_HOLD_FLOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()  # hold until the test closes our stdin
"""

_TRY_FLOCK = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    print("busy")
else:
    print("free")
"""


@contextmanager
def _other_process_holding(path: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD_FLOCK, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=30)


def _probe_from_another_process(path: Path) -> str:
    done = subprocess.run([sys.executable, "-c", _TRY_FLOCK, str(path)], capture_output=True, text=True, timeout=30)
    return done.stdout.strip()


def test_lock_creates_its_directory_and_can_be_taken_again(tmp_path: Path) -> None:
    lock = NodeLock(tmp_path / "state" / "state.lock", timeout=1)
    with lock.held():
        assert (tmp_path / "state" / "state.lock").exists()
    with lock.held():
        pass


def test_lock_is_released_when_the_body_raises(tmp_path: Path) -> None:
    lock = NodeLock(tmp_path / "state.lock", timeout=0.2)
    with pytest.raises(RuntimeError), lock.held():
        raise RuntimeError("boom")
    with lock.held():
        pass
    assert _probe_from_another_process(tmp_path / "state.lock") == "free"


def test_threads_of_one_process_take_turns(tmp_path: Path) -> None:
    lock = NodeLock(tmp_path / "state.lock", timeout=30)
    counter = 0
    inside = 0
    most_inside = 0
    guard = threading.Lock()

    def work() -> None:
        nonlocal counter, inside, most_inside
        for _ in range(25):
            with lock.held():
                with guard:
                    inside += 1
                    most_inside = max(most_inside, inside)
                value = counter
                time.sleep(0)  # hand the GIL over mid-update: without the lock, updates get lost
                counter = value + 1
                with guard:
                    inside -= 1

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most_inside == 1
    assert counter == 6 * 25


def test_thread_waiting_too_long_gets_lock_timeout(tmp_path: Path) -> None:
    lock = NodeLock(tmp_path / "state.lock", timeout=0.1)
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock.held():
            entered.set()
            release.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert entered.wait(30)
        with pytest.raises(LockTimeout, match="another operation in this driver"), lock.held():
            pytest.fail("entered a lock another thread holds")
    finally:
        release.set()
        holder.join()
    with lock.held():
        pass


def test_held_lock_excludes_another_process(tmp_path: Path) -> None:
    path = tmp_path / "state.lock"
    lock = NodeLock(path, timeout=5)
    with lock.held():
        assert _probe_from_another_process(path) == "busy"
    assert _probe_from_another_process(path) == "free"


def test_lock_held_by_another_process_times_out_with_a_message(tmp_path: Path) -> None:
    path = tmp_path / "state.lock"
    lock = NodeLock(path, timeout=0.1)
    with _other_process_holding(path), pytest.raises(LockTimeout) as info, lock.held():
        pytest.fail("entered a lock another process holds")
    message = str(info.value)
    assert str(path) in message
    assert "another plugin process" in message
    # The other process is gone: the lock is free again, and the failed attempt left it usable.
    with lock.held():
        pass


def test_lock_taken_once_the_other_process_lets_go(tmp_path: Path) -> None:
    path = tmp_path / "state.lock"
    lock = NodeLock(path, timeout=30)
    acquired = threading.Event()

    def take() -> None:
        with lock.held():
            acquired.set()

    with _other_process_holding(path) as holder:
        waiter = threading.Thread(target=take)
        waiter.start()
        assert not acquired.is_set()
        assert holder.stdin is not None
        holder.stdin.close()  # the other process exits and its flock goes with it
        holder.wait(timeout=30)
    waiter.join(timeout=30)
    assert acquired.is_set()


def test_two_lock_objects_on_one_path_exclude_each_other(tmp_path: Path) -> None:
    # Two plugin instances in one process (as in tests) share only the file, not the mutex.
    path = tmp_path / "state.lock"
    first, second = NodeLock(path, timeout=5), NodeLock(path, timeout=0.1)
    with first.held(), pytest.raises(LockTimeout), second.held():
        pytest.fail("flock did not exclude a second descriptor")


def test_lock_file_and_its_directory_are_private(tmp_path: Path) -> None:
    lock = NodeLock(tmp_path / "state" / "state.lock", timeout=1)
    with lock.held():
        pass
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700
    assert stat.S_IMODE(lock.path.stat().st_mode) == 0o600


def test_a_lock_file_left_with_a_wider_mode_is_narrowed(tmp_path: Path) -> None:
    path = tmp_path / "state.lock"
    path.touch()
    path.chmod(0o666)
    with NodeLock(path, timeout=1).held():
        pass
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_symlink_in_place_of_the_lock_file_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep")
    target.chmod(0o644)
    (tmp_path / "state.lock").symlink_to(target)
    with pytest.raises(LockFileError, match=r"state\.lock is a symlink"), NodeLock(tmp_path / "state.lock").held():
        raise AssertionError("the lock must not be taken")
    assert target.read_text() == "keep"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    # A dangling link must not make the driver create the file it points to either.
    (tmp_path / "dangling.lock").symlink_to(tmp_path / "created-by-us")
    with pytest.raises(LockFileError), NodeLock(tmp_path / "dangling.lock").held():
        pass
    assert not (tmp_path / "created-by-us").exists()


def test_a_fifo_in_place_of_the_lock_file_is_refused_without_blocking(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "state.lock")
    with pytest.raises(LockFileError, match="not a regular file"), NodeLock(tmp_path / "state.lock").held():
        pass


def test_a_lock_in_a_shared_sticky_directory_is_refused_and_the_directory_keeps_its_mode(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(PermissionError, match="shared"):
        ensure_private_dir(shared)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
