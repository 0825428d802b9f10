"""The driver's durable record of what it did on this node: prepared claims and MPS daemons.

Written atomically (temporary file, fsync, rename, directory fsync) after every state change,
read under the node lock before every change: kept in memory and parsed only when the file
changed since this process last wrote it (another plugin pod of a rolling update wrote it). The on-disk form is
``{"version": N, "checksum": "sha256:...", "data": {...}}``; the checksum covers the parsed
``data`` object rather than the model, so a newer driver that adds fields does not invalidate
it for an older one (the failure behind NVIDIA's checkpoint upgrade bug). A file that cannot be
read, parsed or verified is set aside, never crash-looped on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cdi.atomicswap import SwappedFile
from driver.gpu.claimconfig.choices import DeviceKind, MpsClients, TimeSliceInterval
from driver.gpu.discovery.inventory import ComputeMode
from driver.gpu.mps.model import MpsDaemonRecord
from driver.gpu.published.sharelayout import Enforcement, GpuForm
from driver.gpu.record.migrecord import DynamicMigRecord
from driver.kubeletplugin.types import PreparedDevice

log = logging.getLogger(__name__)

CHECKPOINT_VERSION = 1


class ClaimPhase(StrEnum):
    PREPARE_STARTED = "PrepareStarted"
    PREPARE_COMPLETED = "PrepareCompleted"


class _Record(BaseModel):
    # Ignore unknown fields so a checkpoint written by a newer driver still loads after a rollback.
    model_config = ConfigDict(extra="ignore")


class PreparedDeviceRecord(_Record):
    """One allocated device and everything needed to rebuild its CDI edits after a reboot."""

    device: PreparedDevice
    kind: DeviceKind
    gpu_uuid: str  # the physical GPU
    gpu_minor: int
    mig_uuid: str | None = None
    mig_gi_id: int | None = None
    mig_ci_id: int | None = None
    mps_daemon_id: str | None = None
    # A consumable share (kind "consumable"): what the claim consumed of the GPU, so unprepare releases
    # exactly that and the prepare of the GPU's next claim re-checks its capacity.
    consumed_memory_bytes: int | None = None
    consumed_multiprocessors: int | None = None
    # Admin access (Kubernetes' adminAccess): a device other claims may hold too, for monitoring. Its
    # claim changes nothing on it and is in no other claim's way. False in older checkpoints.
    admin_access: bool = False
    # Dynamic MIG: the instance prepare creates (profile, placement), recorded before it is created;
    # the mig_* fields above are the created instance's. None for every other device.
    dynamic_mig: DynamicMigRecord | None = None

    @property
    def layout_key(self) -> str:
        """The sharing layout's key for the form this device was published in: a share of a MIG instance is
        keyed by the instance's MIG UUID, everything else (a dynamic MIG device too) by its GPU's UUID."""
        if self.kind in (DeviceKind.MPS, DeviceKind.TIMESLICE) and self.mig_uuid is not None:
            return self.mig_uuid
        return self.gpu_uuid


class TimeSliceRecord(_Record):
    gpu_uuids: list[str]
    interval: TimeSliceInterval


class ClaimRecord(_Record):
    uid: str
    namespace: str
    name: str
    phase: ClaimPhase
    devices: list[PreparedDeviceRecord] = Field(default_factory=list)
    # Daemons this claim started for itself (per-claim config) or holds a reference on (plan shares).
    owned_mps_daemons: list[str] = Field(default_factory=list)
    shared_mps_daemons: list[str] = Field(default_factory=list)
    timeslice: TimeSliceRecord | None = None
    # Whole GPUs this claim's MPS daemons need in EXCLUSIVE_PROCESS; a GPU goes back to its
    # previous mode (Checkpoint.compute_modes) when no claim lists it any more.
    exclusive_gpus: list[str] = Field(default_factory=list)
    cdi_spec_file: str
    updated_at: str = ""
    # The pods the claim was reserved for at prepare (status.reservedFor): their processes' GPU
    # usage is this claim's. Empty in checkpoints written before it was recorded.
    pod_uids: list[str] = Field(default_factory=list)
    # Who the claim's MPS daemon admitted at prepare, and how its limits hold for them (claim/tenancy.py).
    # None: the claim has no MPS daemon, or the checkpoint was written before clients were checked.
    mps_clients: MpsClients | None = None
    mps_enforcement: Enforcement | None = None

    @property
    def gpu_uuids(self) -> set[str]:
        return {d.gpu_uuid for d in self.devices}

    @property
    def mps_daemon_ids(self) -> list[str]:
        return [*self.owned_mps_daemons, *self.shared_mps_daemons]

    @property
    def held_layout_keys(self) -> set[str]:
        """GPUs and MIG instances whose published form the claim depends on (layout keys): its admin-access
        devices depend on none (their CDI edits are the device nodes only), so a monitoring claim never pins a
        GPU's form. A MIG instance held whole must not become shares under its claim, nor shares whole."""
        held = [d for d in self.devices if not d.admin_access]
        return {d.gpu_uuid for d in held} | {d.mig_uuid for d in held if d.mig_uuid is not None}


class Checkpoint(_Record):
    boot_id: str | None = None
    claims: dict[str, ClaimRecord] = Field(default_factory=dict)
    mps_daemons: dict[str, MpsDaemonRecord] = Field(default_factory=dict)
    # The sharing layout in force (GPU UUID -> shares): what the previous process published, so a
    # restart with a changed plan cannot re-publish a GPU that still has prepared claims.
    layout: dict[str, GpuForm] = Field(default_factory=dict)
    # Time-slice intervals this driver applied to GPUs because of the node sharing plan.
    plan_timeslices: dict[str, TimeSliceInterval] = Field(default_factory=dict)
    # GPUs this driver set to EXCLUSIVE_PROCESS, with the mode each had before: written before
    # the change, removed after the mode is restored, so a crash in between is repaired at start.
    compute_modes: dict[str, ComputeMode] = Field(default_factory=dict)
    # MPS daemons whose limits could not be read back for longer than the watch interval (a client holds
    # the control socket), with since when and why: `inspect` shows them; removed once confirmed again.
    mps_limits_unconfirmed: dict[str, str] = Field(default_factory=dict)

    def claims_using(self, daemon_id: str) -> list[ClaimRecord]:
        """The claims the MPS daemon serves: those that started it for themselves or hold a reference on it."""
        return [c for c in self.claims.values() if daemon_id in c.mps_daemon_ids]


def _working_copy(checkpoint: Checkpoint) -> Checkpoint:
    """A copy to change: dumped and validated again, what re-reading the file would give. Several
    times faster than ``model_copy(deep=True)``, whose generic deepcopy dominated a prepare's
    checkpoint work."""
    return Checkpoint.model_validate(checkpoint.model_dump())


def _canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def _checksum(data: Any) -> str:
    return "sha256:" + hashlib.sha256(_canonical(data)).hexdigest()


class CheckpointCorrupt(Exception):
    """The file exists but cannot be trusted; it has been set aside as ``set_aside``."""

    def __init__(self, reason: str, set_aside: Path):
        super().__init__(reason)
        self.reason = reason
        self.set_aside = set_aside


class CheckpointStore:
    """Atomic load/save of the checkpoint file, with a cheap re-read check.

    ``load`` skips parsing when the file is unchanged since this process last read or wrote
    it; another pod of a rolling update writing the file makes it re-read.
    """

    def __init__(self, path: Path):
        self.path = path
        self._path_text = os.fspath(path)
        # Durable saves go through a companion file swapped into place (cdi/atomicswap.py).
        self._file = SwappedFile(path, mode=0o600)
        self._cached: tuple[tuple[int, int, int], Checkpoint] | None = None

    def _stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self._path_text)  # several times per prepare: no Path conversion each time
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def load(self, shared: bool = False) -> Checkpoint:
        """Current checkpoint; an empty one if none exists. Raises CheckpointCorrupt after setting it aside.

        ``shared=True`` returns the cached object itself, for callers that only read it: it saves
        a deep copy per read (most reads of a prepare), and changing it would corrupt the cache.
        """
        stamp = self._stamp()
        if stamp is None:
            return Checkpoint()
        if self._cached is not None and self._cached[0] == stamp:
            return self._cached[1] if shared else _working_copy(self._cached[1])
        # Not the file this process last wrote: the other plugin pod's, whose swap may not be durable yet.
        self._file.written_elsewhere()
        try:
            checkpoint = self._parse(self.path.read_bytes())
        except (ValueError, ValidationError, OSError) as exc:
            aside = self._set_aside_name()
            os.replace(self.path, aside)
            self._cached = None
            log.error(
                "CHECKPOINT CORRUPT: set aside and rebuilding state from the CDI specs on disk",
                extra={"checkpoint": str(self.path), "set_aside_as": str(aside), "reason": str(exc)},
            )
            raise CheckpointCorrupt(str(exc), aside) from exc
        self._cached = (stamp, checkpoint)
        return checkpoint if shared else _working_copy(checkpoint)

    def current(self) -> Checkpoint | None:
        """The cached checkpoint (shared: read it, never change it) if the file is still the one it came
        from, else None. Without the node lock: the file is only ever replaced by a rename, so a match
        means the cache is the last committed state (as a locked read that released the lock would be)."""
        cached = self._cached
        if cached is None or self._stamp() != cached[0]:
            return None
        return cached[1]

    def peek(self) -> Checkpoint | None:
        """Read without side effects (for ``inspect``): None if there is no file; ValueError if it is bad."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            return self._parse(raw)
        except ValidationError as exc:
            raise ValueError(str(exc)) from exc

    def _set_aside_name(self) -> Path:
        # Never overwrite the evidence of an earlier corruption, even within the same second.
        stamp = time.strftime("%Y%m%dT%H%M%S")
        candidate = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
        n = 1
        while candidate.exists():
            candidate = self.path.with_name(f"{self.path.name}.corrupt-{stamp}-{n}")
            n += 1
        return candidate

    @staticmethod
    def _parse(raw: bytes) -> Checkpoint:
        envelope = json.loads(raw)
        if not isinstance(envelope, dict) or "data" not in envelope:
            raise ValueError("not a checkpoint envelope (missing 'data')")
        version = envelope.get("version")
        if not isinstance(version, int) or version < 1:
            raise ValueError(f"invalid checkpoint version {version!r}")
        if envelope.get("checksum") != _checksum(envelope["data"]):
            raise ValueError("checksum mismatch: the file was modified or partially written")
        if version > CHECKPOINT_VERSION:
            # Written by a newer driver (we were rolled back). Unknown fields are ignored; if the
            # known ones no longer parse, pydantic raises and the file is set aside.
            log.warning("checkpoint written by a newer driver version; reading the fields this version knows",
                        extra={"checkpoint_version": version, "supported_version": CHECKPOINT_VERSION})
        return Checkpoint.model_validate(envelope["data"])

    def sync_directory(self) -> None:
        """The directory fsync of a save made with ``defer_directory_sync``."""
        self._file.sync_directory()

    def save(self, checkpoint: Checkpoint, *, durable: bool = True, adopt: bool = False,
             defer_directory_sync: bool = False) -> None:
        """Replace the file atomically with ``checkpoint``.

        ``durable=False`` skips the directory fsync: the new file is complete (its data is
        synced before the rename) and visible to every reader at once, but a power failure may
        bring back the previous file. Only for a change that is safe to lose that way (a claim's
        reservation: see ``driver/gpu/state.py``); a later durable save makes it durable too.
        ``adopt=True``: the caller never changes ``checkpoint`` again, so it becomes the cached
        copy as it is (no deep copy).
        """
        # The checksum's canonical encoding is also the file's "data": one encode per save, and a
        # compact one (json's C encoder is used only without indent; with it, the pure-Python one
        # cost more CPU than the rest of the save).
        canonical = _canonical(checkpoint.model_dump(mode="json"))
        checksum = "sha256:" + hashlib.sha256(canonical).hexdigest()
        payload = (b'{"version": ' + str(CHECKPOINT_VERSION).encode() + b', "checksum": "' + checksum.encode()
                   + b'", "data": ' + canonical + b"}\n")
        try:
            self._file.write(payload, durable=durable, defer_directory_sync=defer_directory_sync)
        except FileNotFoundError:  # the first save: the directory is made then, not checked at every save
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file.write(payload, durable=durable, defer_directory_sync=defer_directory_sync)
        stamp = self._stamp()
        cached = checkpoint if adopt else _working_copy(checkpoint)
        self._cached = (stamp, cached) if stamp is not None else None


def current_boot_id(host_root: Path | None = None) -> str | None:
    """The kernel's boot ID: a changed value means the node rebooted since the checkpoint was written.

    Read under ``host_root`` first (where the host's /proc is; a simulated node's tree may hold its own),
    else from this process's /proc: the boot ID is the kernel's, the same in every container."""
    for root in ([host_root] if host_root is not None else []) + [Path("/")]:
        try:
            found = (root / "proc/sys/kernel/random/boot_id").read_text().strip()
        except OSError:
            continue
        if found:
            return found
    return None
