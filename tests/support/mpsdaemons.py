"""The MPS control daemons tests can run against: the stand-in, and NVIDIA's own when fetched.

``scripts/fetch-nvidia-mps.sh`` (run by scripts/test.sh before pytest) unpacks Debian's non-free
``nvidia-cuda-mps`` builds into ``.cache/nvidia-mps/<version>+<suite>/``. NVIDIA's daemon starts and
answers control commands without a GPU as long as no CUDA client connects, so the same MPS tests
run against it. Without network the builds are missing and those cases skip, saying why.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.processes import install_standin

REPO = Path(__file__).resolve().parents[2]
NVIDIA_MPS_CACHE = REPO / ".cache" / "nvidia-mps"
CONTROL = "nvidia-cuda-mps-control"


@dataclass(frozen=True)
class MpsDaemonKind:
    name: str  # test id: "standin", "nvidia-550", "nvidia-535"
    binary: Path | None  # NVIDIA's binary; None for the stand-in
    writes_pid_file: bool
    knows_multi_user: bool
    guards_settings: bool = True  # settings from another UID refused (550; 535 takes them)

    @property
    def is_real(self) -> bool:
        return self.binary is not None

    def install(self, bin_dir: Path) -> None:
        """Put this daemon's control binary into a simulated driver root's ``usr/bin``."""
        target = bin_dir / CONTROL
        target.unlink(missing_ok=True)
        if self.binary is None:
            install_standin(CONTROL, bin_dir)
        else:
            shutil.copy2(self.binary, target)


def _nvidia_build(series: str) -> Path | None:
    if not NVIDIA_MPS_CACHE.is_dir():
        return None
    for build in sorted(NVIDIA_MPS_CACHE.glob(f"{series}.*")):
        binary = build / "usr" / "bin" / CONTROL
        if binary.is_file():
            return binary
    return None


STANDIN = MpsDaemonKind("standin", None, writes_pid_file=True, knows_multi_user=True)


def daemon_params() -> list[object]:
    """pytest params: the stand-in always; NVIDIA's 550.x and 535.x, or a skip naming the fetch script."""
    params: list[object] = [pytest.param(STANDIN, id="standin")]
    for series, newer in (("550", True), ("535", False)):
        binary = _nvidia_build(series)
        kind = MpsDaemonKind(f"nvidia-{series}", binary, writes_pid_file=newer, knows_multi_user=False,
                             guards_settings=newer)
        marks = [] if binary is not None else [pytest.mark.skip(
            reason=f"NVIDIA's nvidia-cuda-mps {series}.x is not in {NVIDIA_MPS_CACHE}: "
                   "run scripts/fetch-nvidia-mps.sh (needs Debian's package mirror)")]
        params.append(pytest.param(kind, id=kind.name, marks=marks))
    return params
