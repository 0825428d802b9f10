"""An MPS daemon's default limits: set, read back, and compared with what its spec promises.

The daemon accepts invalid values silently (it prints nothing, or the old value), so only a
read-back shows whether it took one. Any client that can reach the daemon's ``control`` socket as
root (a tenant's read-only pipe-dir mount still allows ``connect()``; with R535 any UID, measured)
can change the defaults, so they are read back after start, before a prepare reuses a running
daemon, and by the limit watcher, and a drift is set again (docs/sharing.md, "Limits are watched").

Facts (commands, answer formats): nvidia-cuda-mps-control(1), reference/nvidia-gpu.md 1.4 and
docs/sharing.md, "NVIDIA's daemon, as measured".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from driver.gpu.mps.control import MpsControl
from driver.gpu.mps.dirs import trim_log
from driver.gpu.mps.holders import held_connection, release
from driver.gpu.mps.launch import CONTROL_LOG_NAME
from driver.gpu.mps.model import (
    MpsBusy,
    MpsDaemonRecord,
    MpsDaemonSpec,
    MpsDaemonStopped,
    MpsError,
    MpsNoAnswer,
    pinned_limit_taken,
)
from driver.gpu.mps.proc import wait_for_exit
from driver.gpu.mps.restarts import STOPPED_EXIT_WAIT_S
from driver.kubeletplugin.types import Deadline

log = logging.getLogger(__name__)

THREAD_PERCENTAGE = "active_thread_percentage"
# The first read-back while the daemon already waits on a connection: enough for one front-end (ms).
_FIRST_TRY_S = 0.5
# A read-back logs about 0.5 KB; every 5 s that is 8 MB a day per daemon without a bound.
MAX_LOG_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class LimitDrift:
    """One default limit that reads back other than the spec's."""

    limit: str  # "active_thread_percentage" or "pinned_mem_limit/<ordinal>": a metric label, no GPU UUID
    found: str  # what the daemon printed ("" when it printed nothing)
    expected: str  # the spec's value, as the daemon is told it

    def describe(self) -> str:
        return f"{self.limit} was {self.found or 'unset'!r}, restored to {self.expected}"


class DriftNotRestored(MpsError):
    """Limits were found changed, and setting them back was not confirmed (``__cause__`` says why)."""

    def __init__(self, message: str, drift: list[LimitDrift]) -> None:
        super().__init__(message)
        self.drift = drift


@dataclass(frozen=True)
class _Limit:
    name: str
    set_command: str
    get_command: str
    expected: str
    taken: Callable[[str], bool]
    mismatch: Callable[[str], str]  # the error message for a read-back answer that is not ``expected``
    # The daemon's answer cannot show every change: a pinned limit of 1 GiB or more reads back in whole G,
    # so 10240M raised to 11263M still reads "10G".
    hides_changes: bool = False


def _thread_percentage_taken(wanted: int) -> Callable[[str], bool]:
    def taken(answer: str) -> bool:
        try:
            return abs(float(answer) - wanted) < 0.01
        except ValueError:
            return False
    return taken


def _limits(spec: MpsDaemonSpec) -> list[_Limit]:
    limits: list[_Limit] = []
    pct = spec.active_thread_percentage
    if pct is not None:
        limits.append(_Limit(
            name=THREAD_PERCENTAGE, set_command=f"set_default_active_thread_percentage {pct}",
            get_command="get_default_active_thread_percentage", expected=str(pct),
            taken=_thread_percentage_taken(pct),
            mismatch=lambda answer: f"default active thread percentage reads back as {answer!r}, expected {pct}"))
    limits += [_pinned_limit(ordinal, spec.gpu_uuids[ordinal], mib) for ordinal, mib in spec.pinned_limits_mib()]
    return limits


def _pinned_limit(ordinal: int, uuid: str, mib: int) -> _Limit:
    shown = f"{mib // 1024}G" if mib >= 1024 else f"{mib}M"
    return _Limit(
        # The ordinal within the daemon's CUDA_VISIBLE_DEVICES: measured, a UUID here is not taken
        # (get prints nothing; the log says "No default pinned memory limit set").
        name=f"pinned_mem_limit/{ordinal}", set_command=f"set_default_device_pinned_mem_limit {ordinal} {mib}M",
        get_command=f"get_default_device_pinned_mem_limit {ordinal}", expected=f"{mib}M",
        taken=lambda answer: pinned_limit_taken(answer, mib),
        mismatch=lambda answer: (f"pinned memory limit for device {ordinal} ({uuid}) reads back as {answer!r}, "
                                 f"expected {mib}M (which the daemon shows as {shown!r})"),
        hides_changes=mib >= 1024)


def apply_limits(control: MpsControl, spec: MpsDaemonSpec, pipe_dir: Path, log_dir: Path, deadline: Deadline) -> None:
    """Set each limit and read it back; MpsError names the first the daemon did not take."""
    check_limits(control, spec, pipe_dir, log_dir, deadline, set_first=True)


def check_limits(control: MpsControl, spec: MpsDaemonSpec, pipe_dir: Path, log_dir: Path, deadline: Deadline,
                 set_first: bool = False) -> None:
    """Read every limit of ``spec`` back from the daemon (each set just before, with ``set_first``);
    MpsError names the first that differs."""
    limits = _limits(spec)
    if limits:
        _check(control, limits, pipe_dir, log_dir, deadline, set_first)


def find_drift(control: MpsControl, spec: MpsDaemonSpec, pipe_dir: Path, log_dir: Path,
               deadline: Deadline) -> list[LimitDrift]:
    """Every limit of ``spec`` that reads back otherwise (all are read, so a report names each)."""
    limits = _limits(spec)
    answers = _read_back(control, limits, pipe_dir, log_dir, deadline) if limits else []
    return [LimitDrift(limit=limit.name, found=answer, expected=limit.expected)
            for limit, answer in zip(limits, answers, strict=True) if not limit.taken(answer)]


def restore_limits(control: MpsControl, spec: MpsDaemonSpec, drift: list[LimitDrift], pipe_dir: Path,
                   log_dir: Path, deadline: Deadline) -> None:
    """Set the drifted limits again and read each back; MpsError if the daemon does not take one."""
    names = {d.limit for d in drift}
    _check(control, [limit for limit in _limits(spec) if limit.name in names], pipe_dir, log_dir, deadline,
           set_first=True)


def _check(control: MpsControl, limits: list[_Limit], pipe_dir: Path, log_dir: Path, deadline: Deadline,
           set_first: bool) -> None:
    """Read ``limits`` back (each set just before, with ``set_first``); MpsError names the first that differs."""
    if set_first:
        control.set_all(pipe_dir, log_dir, [limit.set_command for limit in limits], deadline)
    for limit, answer in zip(limits, _read_back(control, limits, pipe_dir, log_dir, deadline), strict=True):
        if not limit.taken(answer):
            raise MpsError(limit.mismatch(answer))


def _read_back(control: MpsControl, limits: list[_Limit], pipe_dir: Path, log_dir: Path,
               deadline: Deadline) -> list[str]:
    """Each limit's ``get`` answer, all through one client where each prints its line."""
    lines = control.send(pipe_dir, log_dir, "\n".join(limit.get_command for limit in limits), deadline).splitlines()
    if len(lines) == len(limits):
        return [line.strip() for line in lines]
    # A get that prints nothing (a limit not set) leaves fewer lines than commands: ask one at a time.
    return [control.send(pipe_dir, log_dir, limit.get_command, deadline) for limit in limits]


def check_and_restore_limits(control: MpsControl, record: MpsDaemonRecord, deadline: Deadline) -> list[LimitDrift]:
    """Read the running daemon's limits back and set again those that drifted; returns the drift found.
    :class:`MpsDaemonStopped` if the daemon exited meanwhile, MpsError if it does not answer or keeps a
    changed limit. A client that holds the daemon silent through the whole first try is let go
    (``holders.py``) and the limits read again."""
    trim_log(record.log_dir / CONTROL_LOG_NAME, MAX_LOG_BYTES)  # every read-back adds lines to it
    held = held_connection(record.pid)
    try:
        if held is None:
            return _check_and_restore(control, record, deadline)
        # Already waiting on a connection: a short first try (a read-back takes milliseconds), the rest of the
        # time for one after letting the connection go.
        first = deadline.capped(min(_FIRST_TRY_S, deadline.remaining() / 2))
        try:
            return _check_and_restore(control, record, first)
        except MpsNoAnswer:
            if held_connection(record.pid) != held or not release(held):
                raise
        return _check_and_restore(control, record, deadline)
    except MpsError as exc:
        # A busy or silent socket is a daemon at work: only look, do not wait (the GPU's locks are held).
        held_up = isinstance(exc, (MpsNoAnswer, MpsBusy)) or isinstance(exc.__cause__, (MpsNoAnswer, MpsBusy))
        if wait_for_exit(record.pid, record.process_start_time, 0.0 if held_up else STOPPED_EXIT_WAIT_S):
            raise MpsDaemonStopped(f"MPS control daemon {record.spec.daemon_id} (pid {record.pid}) stopped while "
                                   f"its limits were checked: {exc}") from exc
        raise


def _check_and_restore(control: MpsControl, record: MpsDaemonRecord, deadline: Deadline) -> list[LimitDrift]:
    drift = find_drift(control, record.spec, record.pipe_dir, record.log_dir, deadline)
    if drift:
        try:
            restore_limits(control, record.spec, drift, record.pipe_dir, record.log_dir, deadline)
        except MpsError as exc:  # what was found is reported all the same
            raise DriftNotRestored(f"{'; '.join(d.describe() for d in drift)}, not confirmed: {exc}", drift) from exc
    # A client may have raised a limit within what its read-back shows (up to 1023 MiB of pinned
    # memory): undetectable, so those limits are set again every time, unreported.
    restored = {d.limit for d in drift}
    hidden = [limit.set_command for limit in _limits(record.spec) if limit.hides_changes and limit.name not in restored]
    if hidden:
        try:
            control.set_all(record.pipe_dir, record.log_dir, hidden, deadline)
        except MpsError as exc:  # the next round sets them again; the drift restored now must still be reported
            log.info("could not set the MPS daemon's whole-G pinned limits again this round",
                     extra={"daemon_id": record.spec.daemon_id, "reason": str(exc)})
    return drift
