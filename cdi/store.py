"""CDI spec files on disk: naming, atomic writes, removal, reading and listing.

Runtimes watch the spec directories and reload on every write or rename of a ``.json``/``.yaml``
file, so a spec is written with :func:`cdi.atomicfile.write_atomic`: a runtime sees the old file or
the new one, never half of one. Only specs that pass the loader's checks reach the disk.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from cdi.atomicfile import write_atomic
from cdi.names import split_kind
from cdi.spec import Spec

# The only extensions the runtimes read (not '.yml').
SPEC_EXTENSIONS: tuple[str, ...] = (".json", ".yaml")
_SPEC_FILE_MODE = 0o644
_SPEC_DIR_MODE = 0o755


def transient_spec_name(vendor: str, cls: str, transient_id: str, ext: str = ".json") -> str:
    """``<vendor>-<class>_<id><ext>``, the reference library's name for a spec tied to one owner (a claim)."""
    split_kind(f"{vendor}/{cls}")
    if not transient_id:
        raise ValueError("transient spec id is empty")
    if ext not in SPEC_EXTENSIONS:
        raise ValueError(f"spec file extension {ext!r} is not read by runtimes (expected one of {SPEC_EXTENSIONS})")
    return f"{vendor}-{cls}_{transient_id.replace('/', '_')}{ext}"


def write_spec(directory: Path, filename: str, spec: Spec, *, durable: bool = True) -> Path:
    """Atomically create or replace ``directory/filename`` with ``spec`` as JSON; returns the path.

    Raises SpecError, before touching the disk, if the spec would not load (a model built with
    ``model_construct`` or mutated in place). On any failure while writing, the previous file, if
    any, is left as it was and no temporary file remains. ``durable=False`` skips the directory
    fsync: the file is whole whenever it is there, but a power failure may undo the rename (for
    a caller that recreates missing specs from its own durable record).
    """
    _check_filename(filename)
    text = spec.to_json()
    # Validate exactly the text about to be written, not the in-memory model.
    Spec.from_text(text, source=filename)
    return write_spec_text(directory, filename, text, durable=durable)


def write_spec_text(directory: Path, filename: str, text: str, *, durable: bool = True,
                    sync_data: bool = True) -> Path:
    """:func:`write_spec` for JSON text the caller has already checked loads (see ``Spec.from_text``).

    ``sync_data``: see :func:`cdi.atomicfile.write_atomic` (False only for a caller that checks its
    specs after a restart, e.g. with :func:`spec_file_intact`, and writes them again)."""
    _check_filename(filename)
    target = directory / filename
    data = text.encode("utf-8")
    try:
        # Runtimes may read specs as another user, and nvcdi writes 0644.
        write_atomic(target, data, mode=_SPEC_FILE_MODE, durable=durable, sync_data=sync_data)
    except FileNotFoundError:  # no CDI directory yet: made on the first write, not checked at every one
        _make_spec_dir(directory)
        write_atomic(target, data, mode=_SPEC_FILE_MODE, durable=durable, sync_data=sync_data)
    return target


def _make_spec_dir(directory: Path) -> None:
    try:
        directory.mkdir(mode=_SPEC_DIR_MODE, parents=True)
    except FileExistsError:
        return  # an existing CDI directory is the node's, and keeps its mode
    # Runtimes may read specs as another user; mkdir's mode is cut by the driver's umask (0o077).
    directory.chmod(_SPEC_DIR_MODE)


def remove_spec(directory: Path, filename: str) -> bool:
    """Delete ``directory/filename``; returns whether it existed. Safe to repeat."""
    _check_filename(filename)
    try:
        (directory / filename).unlink()
    except FileNotFoundError:
        return False
    return True


def spec_file_intact(path: Path) -> bool:
    """Whether ``path`` holds a whole JSON object: what a write that a power failure tore never does.

    A cheap check (no model validation) for specs this process wrote from checked text. Only a regular file
    at ``path`` itself counts: a symlink put there is not what this process wrote (its target must not be
    trusted), and reading a FIFO would block the caller for good; either is then written over."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    with open(fd, "rb") as file:
        try:
            return stat.S_ISREG(os.fstat(fd).st_mode) and isinstance(json.loads(file.read()), dict)
        except (OSError, ValueError):
            return False


def read_spec(path: Path) -> Spec:
    """Parse and validate a spec file; raises SpecError naming the file and every problem."""
    return Spec.from_file(path)


def list_specs(directory: Path, prefix: str) -> list[Path]:
    """Regular spec files in ``directory`` (no recursion) whose names start with ``prefix``, sorted.

    Temporary files of interrupted writes are not listed: they end in ``.tmp``.
    """
    try:
        with os.scandir(directory) as entries:
            return sorted(
                Path(entry.path)
                for entry in entries
                if entry.name.startswith(prefix)
                and entry.name.endswith(SPEC_EXTENSIONS)
                and entry.is_file(follow_symlinks=False)
            )
    except FileNotFoundError:
        return []


def _check_filename(filename: str) -> None:
    if not filename or filename in (".", "..") or "/" in filename or "\0" in filename:
        raise ValueError(f"spec file name {filename!r} must be a plain file name")
    if not filename.endswith(SPEC_EXTENSIONS):
        raise ValueError(f"spec file name {filename!r} must end in .json or .yaml, the only files runtimes read")

