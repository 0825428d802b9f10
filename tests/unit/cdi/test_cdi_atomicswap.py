"""SwappedFile: durable writes swap a companion into place; the companion is overwritten only while the
directory on disk is known to name it the companion, so a power failure never finds the target torn."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cdi import atomicswap
from cdi.atomicswap import SwappedFile


def test_durable_writes_swap_and_keep_the_previous_content_in_the_companion(tmp_path: Path) -> None:
    target = SwappedFile(tmp_path / "state.json")
    target.write(b"first")  # no target yet: created by rename, the companion stays behind
    target.write(b"second")
    target.write(b"third")
    assert (tmp_path / "state.json").read_bytes() == b"third"
    assert (tmp_path / ".state.json.swap.tmp").read_bytes() == b"second"
    inode = (tmp_path / "state.json").stat().st_ino
    target.write(b"4")
    assert (tmp_path / ".state.json.swap.tmp").stat().st_ino == inode, "swapped, not created"
    assert (tmp_path / "state.json").read_bytes() == b"4"


def test_a_write_that_need_not_be_durable_leaves_the_companion_alone(tmp_path: Path) -> None:
    # Its rename may be undone by a power failure; the companion could then be the on-disk target.
    target = SwappedFile(tmp_path / "state.json")
    target.write(b"one")
    target.write(b"two")
    companion = (tmp_path / ".state.json.swap.tmp").read_bytes()
    target.write(b"three", durable=False)
    assert (tmp_path / "state.json").read_bytes() == b"three"
    assert (tmp_path / ".state.json.swap.tmp").read_bytes() == companion


def test_after_a_failed_directory_sync_the_next_write_syncs_before_touching_the_companion(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = SwappedFile(tmp_path / "state.json")
    target.write(b"one")
    target.write(b"two")
    events: list[str] = []
    real_sync, real_open = atomicswap.fsync_directory, os.open

    def failing_sync(directory: Path) -> None:
        events.append("sync")
        raise OSError("simulated EIO")

    monkeypatch.setattr(atomicswap, "fsync_directory", failing_sync)
    with pytest.raises(OSError, match="EIO"):
        target.write(b"three")
    events.clear()

    def recording_sync(directory: Path) -> None:
        events.append("sync")
        real_sync(directory)

    def recording_open(path: object, *args: object) -> int:
        events.append(f"open {Path(str(path)).name}")
        return real_open(path, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(atomicswap, "fsync_directory", recording_sync)
    monkeypatch.setattr(atomicswap.os, "open", recording_open)
    target.write(b"four")
    assert events[0] == "sync" and "open .state.json.swap.tmp" in events[1:]
    monkeypatch.undo()
    assert (tmp_path / "state.json").read_bytes() == b"four"


def test_without_the_swap_it_renames(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(atomicswap, "_RENAMEAT2", None)  # Linux before 3.15, or a file system without it
    target = SwappedFile(tmp_path / "state.json", mode=0o644)
    target.write(b"one")
    target.write(b"two")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    assert (tmp_path / "state.json").stat().st_mode & 0o777 == 0o644


def test_a_symlink_in_the_companions_place_is_not_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(b"untouched")
    (tmp_path / ".state.json.swap.tmp").symlink_to(elsewhere)
    target = SwappedFile(tmp_path / "state.json")
    target.write(b"one")
    target.write(b"two")
    assert (tmp_path / "state.json").read_bytes() == b"two"
    assert elsewhere.read_bytes() == b"untouched"


def test_a_deferred_directory_sync_is_done_by_the_caller_or_else_by_the_next_write(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = SwappedFile(tmp_path / "state.json")
    target.write(b"one")
    syncs: list[Path] = []
    real_sync = atomicswap.fsync_directory

    def counting_sync(directory: Path) -> None:
        syncs.append(directory)
        real_sync(directory)

    monkeypatch.setattr(atomicswap, "fsync_directory", counting_sync)
    target.write(b"two", defer_directory_sync=True)
    assert syncs == [], "the caller syncs, e.g. once it released its lock"
    target.sync_directory()
    assert syncs == [tmp_path]
    target.write(b"three", defer_directory_sync=True)
    target.write(b"four")  # the caller never synced the swap of "three": this write does first, then its own
    assert syncs == [tmp_path] * 3
    assert (tmp_path / "state.json").read_bytes() == b"four"
