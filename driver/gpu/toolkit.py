"""The NVIDIA Container Toolkit's generated CDI spec, source of the driver's user-space edits.

``nvidia-ctk cdi generate`` knows where the host's driver libraries, binaries, firmware and
hooks are; Tessera copies that spec's spec-level ``containerEdits`` into every claim spec
instead of re-implementing the library search. Without the toolkit spec, claims still get
their device nodes, but no driver libraries: workloads then fail to load ``libcuda``. That
is logged at start, recorded in each claim spec's annotations and shown by ``inspect``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cdi

log = logging.getLogger(__name__)

DEFAULT_TOOLKIT_SPEC_PATHS = (
    Path("/etc/cdi/nvidia.yaml"),
    Path("/etc/cdi/nvidia.json"),
    Path("/var/run/cdi/nvidia.yaml"),
    Path("/var/run/cdi/nvidia.json"),
)


# Which file was read and its (inode, mtime, size): a change means the spec was regenerated.
FileStamp = tuple[Path, int, int, int] | None


@dataclass(frozen=True)
class ToolkitEdits:
    source: Path | None
    edits: dict[str, Any] | None  # spec-level containerEdits, CDI wire form
    problem: str | None  # why there are no edits, for logs, annotations and inspect
    stamp: FileStamp = None

    @property
    def status(self) -> str:
        return f"from {self.source}" if self.edits is not None else f"not injected: {self.problem}"


def _find(explicit: Path | None, candidates: tuple[Path, ...]) -> tuple[tuple[Path, ...], Path | None]:
    paths = (explicit,) if explicit is not None else candidates
    return paths, next((p for p in paths if p.is_file()), None)


def _stamp(path: Path | None) -> FileStamp:
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return (path, st.st_ino, st.st_mtime_ns, st.st_size)


def toolkit_spec_changed(current: ToolkitEdits, explicit: Path | None,
                         candidates: tuple[Path, ...] = DEFAULT_TOOLKIT_SPEC_PATHS) -> bool:
    """True when the spec that would be read now is not the one ``current`` was read from.

    After a driver upgrade the operator regenerates the toolkit spec (new library versions);
    claims prepared from then on must get the new edits without a plugin restart.
    """
    return _stamp(_find(explicit, candidates)[1]) != current.stamp


def load_toolkit_edits(explicit: Path | None,
                       candidates: tuple[Path, ...] = DEFAULT_TOOLKIT_SPEC_PATHS) -> ToolkitEdits:
    """Read the toolkit spec named by the operator, or the first one found at the usual places."""
    paths, path = _find(explicit, candidates)
    if path is None:
        where = ", ".join(str(p) for p in paths)
        problem = (f"no NVIDIA Container Toolkit CDI spec at {where}; run 'nvidia-ctk cdi generate' on the node "
                   "(or set --nvidia-cdi-spec) so containers get the driver libraries")
        log.warning("driver libraries will not be injected into containers", extra={"reason": problem})
        return ToolkitEdits(None, None, problem)
    try:
        spec = cdi.read_spec(path)
    except Exception as exc:  # any parse or validation problem makes the file unusable
        problem = f"the toolkit CDI spec {path} is invalid: {exc}"
        log.warning("driver libraries will not be injected into containers", extra={"reason": problem})
        return ToolkitEdits(path, None, problem, _stamp(path))
    edits = spec.to_wire().get("containerEdits") or {}
    log.info("using the NVIDIA Container Toolkit CDI spec for driver libraries", extra={"toolkit_spec": str(path)})
    return ToolkitEdits(path, edits, None, _stamp(path))
