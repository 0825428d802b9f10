"""What the sharing runtime and the device state need from the hardware-facing managers.

The production classes (``mps.manager.MpsManager``, ``runtime.timeslice.TimeSlicer``,
``runtime.computemode.NvmlComputeModes``) satisfy these structurally; tests pass small fakes that do
too, so neither side needs a cast.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from driver.gpu.claimconfig.choices import TimeSliceInterval
from driver.gpu.discovery.inventory import ComputeMode
from driver.gpu.mps.limits import LimitDrift
from driver.gpu.mps.model import MpsDaemonRecord, MpsDaemonSpec
from driver.kubeletplugin.types import Deadline


class MpsDaemons(Protocol):
    """Starts, checks and stops MPS control daemons; raises ``MpsError`` with the daemon's story."""

    def start(self, spec: MpsDaemonSpec, deadline: Deadline | None = None) -> MpsDaemonRecord:
        """A running daemon for ``spec`` with its limits applied, before ``deadline`` if given."""
        ...

    def process_running(self, record: MpsDaemonRecord) -> bool:
        """Whether the recorded daemon's process still runs (/proc only, never the control socket)."""
        ...

    def ensure_running(self, record: MpsDaemonRecord, deadline: Deadline | None = None,
                       retry_stopped: bool = False) -> MpsDaemonRecord:
        """The recorded daemon if it runs, else a restarted one with the same limits (with ``retry_stopped``,
        started again before ``deadline`` if a client stops it while it starts)."""
        ...

    def check_and_restore_limits(self, record: MpsDaemonRecord, deadline: Deadline | None = None) -> list[LimitDrift]:
        """Read the running daemon's limits back and set again those a client changed; the drift found.
        ``MpsDaemonStopped`` if the daemon exited meanwhile."""
        ...

    def adopt(self, spec: MpsDaemonSpec, deadline: Deadline | None = None,
              restore: bool = False) -> MpsDaemonRecord | None:
        """A record for a live daemon of ``spec`` that has none (lost with the checkpoint), if its limits
        read back as ``spec``'s."""
        ...

    def stop(self, record: MpsDaemonRecord, deadline: Deadline | None = None) -> None:
        """Stop the daemon and remove its directories, before ``deadline`` if given; a daemon
        already gone is fine."""
        ...

    def stop_by_id(self, daemon_id: str, deadline: Deadline | None = None) -> None:
        """Stop the driver's daemon serving ``daemon_id``'s directory (one started but never recorded),
        before ``deadline`` if given; processes that only look like one are left alone."""
        ...

    def daemon_ids_on_disk(self) -> list[str]:
        """Daemon directories of the driver's naming, to find ones no record knows."""
        ...


class ServedClaim(Protocol):
    """A claim a daemon serves, as reports name it (``checkpoint.ClaimRecord`` is one)."""

    @property
    def uid(self) -> str: ...

    @property
    def namespace(self) -> str: ...

    @property
    def name(self) -> str: ...


class DaemonReports(Protocol):
    """Where the runtime tells what tenants did to a shared daemon: the log, metrics and Events."""

    def limits_reverted(self, daemon_id: str, drift: Sequence[LimitDrift], claims: Sequence[ServedClaim]) -> None:
        """A client changed the daemon's limits; they were set back (already done when this is called)."""
        ...

    def daemon_restarted(self, daemon_id: str, claims: Sequence[ServedClaim]) -> None:
        """The daemon was gone (exited or stopped by a client) and was started again."""
        ...

    def limits_unconfirmed(self, daemon_id: str, reason: str, claims: Sequence[ServedClaim], first: bool) -> None:
        """The daemon's limits could not be read back for longer than the watch interval: ``first`` when that
        episode begins; ``claims`` are those not told yet (a claim that joins meanwhile is told then)."""
        ...

    def limits_confirmed(self, daemon_id: str, claims: Sequence[ServedClaim]) -> None:
        """The limits of a daemon reported unconfirmed read back as promised again."""
        ...


class TimeSlices(Protocol):
    """Sets and resets GPU time slices (``nvidia-smi compute-policy``), all GPUs of a call or none."""

    def apply(self, gpu_uuids: Sequence[str], interval: TimeSliceInterval, deadline: Deadline | None = None) -> None:
        ...

    def reset(self, gpu_uuids: Sequence[str]) -> None:
        ...


class ComputeModeControl(Protocol):
    """Reads and sets a whole GPU's compute mode (NVML ``nvmlDevice{Get,Set}ComputeMode``)."""

    def get(self, uuid: str, deadline: Deadline | None = None) -> ComputeMode:
        ...

    def set(self, uuid: str, mode: ComputeMode, deadline: Deadline | None = None) -> None:
        ...
