"""MPS daemon directories (driver/gpu/mps/dirs.py): the restart backoff arithmetic and removing what tenants left."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from driver.gpu.mps.dirs import (
    RestartState,
    clear_dir,
    log_tail,
    next_restart_state,
    read_restart_state,
    remove_daemon_dir,
    restart_delay,
    trim_log,
    write_restart_state,
)

BASE, CAP = 2.0, 300.0


def test_the_delay_doubles_per_restart_up_to_the_cap() -> None:
    now = 1_000_000.0
    delays = [restart_delay(RestartState(count, now), BASE, CAP, now) for count in (0, 1, 2, 3, 9, 10)]
    assert delays == [0.0, 2.0, 4.0, 8.0, 300.0, 300.0]


def test_a_daemon_that_crashed_for_days_still_gets_a_delay_not_an_overflow() -> None:
    # Each restart waits at most CAP, less than the 2 x CAP that counts as stable, so the count keeps growing.
    state, now = RestartState(0, 0.0), 1_000_000.0
    for _ in range(1100):
        now += CAP
        state = next_restart_state(state, CAP, now)
    assert state.count == 1100
    assert restart_delay(state, BASE, CAP, now + 1) == CAP - 1


def test_a_wall_clock_set_back_defers_a_restart_by_at_most_the_cap() -> None:
    now = 1_000_000.0
    recorded_a_day_ahead = RestartState(count=1, last_at=now + 86_400)
    assert restart_delay(recorded_a_day_ahead, BASE, CAP, now) <= BASE
    assert restart_delay(RestartState(count=20, last_at=now + 86_400), BASE, CAP, now) <= CAP


def test_a_tree_nested_past_the_recursion_limit_is_removed_without_following_links(tmp_path: Path) -> None:
    outside = tmp_path / "precious"
    outside.write_text("keep me")
    daemon_dir = tmp_path / "plan-0123456789ab"
    shm = daemon_dir / "shm"
    shm.mkdir(parents=True)
    fd = os.open(shm, os.O_RDONLY)
    try:  # a tenant's tree in its /dev/shm, deeper than Python's recursion limit (1000)
        for depth in range(1500):
            os.mkdir("d", dir_fd=fd)
            if depth == 700:
                os.symlink(outside, "link", dir_fd=fd)
                os.symlink(tmp_path, "dirlink", dir_fd=fd)
            child = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
    try:
        remove_daemon_dir(daemon_dir)
        left_behind = daemon_dir.exists()
    finally:
        # If the removal broke, pytest's own tmp_path cleanup (recursive) would fail on what is left.
        subprocess.run(["rm", "-rf", str(daemon_dir)], check=False)
    assert not left_behind
    assert outside.read_text() == "keep me"


def test_a_tenants_directories_named_like_the_removals_own_are_emptied_too_and_the_mount_point_kept(
        tmp_path: Path) -> None:
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "file").write_text("keep me")
    shm = tmp_path / "plan-0123456789ab" / "shm"
    for planted in (".tessera-rm-1/.tessera-rm-2/d", ".tessera-rm-2/d/e", "plain/.tessera-rm-1/f"):
        (shm / planted).mkdir(parents=True)
        (shm / planted / "file").write_text("tenant")
        (shm / planted / "link").symlink_to(outside)
        (shm / planted / "filelink").symlink_to(outside / "file")
    (shm / ".tessera-rm-3").symlink_to(outside)
    clear_dir(shm)
    assert shm.is_dir() and list(shm.iterdir()) == []
    assert [p.name for p in outside.iterdir()] == ["file"] and (outside / "file").read_text() == "keep me"


def test_a_daemon_log_past_its_bound_is_emptied_and_the_daemon_keeps_appending(tmp_path: Path) -> None:
    log = tmp_path / "control.log"
    daemon = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)  # as the launchers open it for the daemon
    try:
        os.write(daemon, b"x" * 100)
        assert not trim_log(log, 100)
        os.write(daemon, b"y")
        assert trim_log(log, 100)
        os.write(daemon, b"next line\n")
    finally:
        os.close(daemon)
    assert log.read_text() == "[log emptied by the driver: it passed 100 bytes]\nnext line\n"
    (tmp_path / "link").symlink_to(log)
    assert not trim_log(tmp_path / "link", 0), "never through a symlink"


def test_a_link_in_place_of_a_daemon_directory_never_takes_its_restart_record_or_log_elsewhere(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (outside / "log").mkdir(parents=True)
    (outside / "log" / "control.log").write_text("x" * 1000)
    (outside / "restarts.json").write_text('{"count": 5, "last_at": 1.0}')
    base = tmp_path / "mps"
    base.mkdir()
    daemon_dir = base / "plan-0123456789ab"
    daemon_dir.symlink_to(outside)
    assert read_restart_state(daemon_dir) == RestartState(0, 0.0), "not read through the link"
    with pytest.raises(OSError):
        write_restart_state(daemon_dir, RestartState(1, 2.0))
    assert not trim_log(daemon_dir / "log" / "control.log", 10)
    assert "no " in log_tail(daemon_dir / "log" / "control.log", 5)
    remove_daemon_dir(daemon_dir)
    assert not daemon_dir.exists() and not daemon_dir.is_symlink()
    assert (outside / "log" / "control.log").read_text() == "x" * 1000
    assert (outside / "restarts.json").read_text() == '{"count": 5, "last_at": 1.0}'
