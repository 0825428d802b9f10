"""What an MPS daemon is, as the driver records it: the spec, the checkpointed record, client edits,
and the pure rules about limits and modes (no processes, no files).

Facts: NVIDIA's MPS documentation, nvidia-cuda-mps-control(1); docs/sharing.md, "NVIDIA's daemon, as
measured".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

import cdi
from driver.gpu.errors import DriverError
from driver.units import MIB

# sun_path is 108 bytes including the NUL; an MPS daemon binds its sockets inside its pipe dir.
SUN_PATH_MAX_BYTES = 107

_DAEMON_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
# GPU-<uuid>, MIG-<uuid>, and the older MIG-GPU-<uuid>/<gi>/<ci>; commas would split CUDA_VISIBLE_DEVICES.
_DEVICE_UUID = re.compile(r"^(GPU|MIG)-[A-Za-z0-9/-]+$")
# get_default_device_pinned_mem_limit prints "<n>M" below 1 GiB and "<n>G", rounded down, from 1 GiB
# up (measured: 1023M -> "1023M", 1025M -> "1G", 3840M -> "3G", 20389M -> "19G"; docs/sharing.md).
_DISPLAYED_LIMIT = re.compile(r"^(\d+)([MG])$")


class MpsError(DriverError):
    """An MPS daemon could not be started, checked or stopped; the message says what and why."""


class MpsNoAnswer(MpsError):
    """A control command got no answer in time. The daemon serves one control client at a time
    (measured, 535.261 and 550.163): any client that connects to its 0666 ``control`` socket and
    stays silent holds every other command up."""


class MpsBusy(MpsError):
    """Another client held the daemon's one control session until the caller's time ran out. While one
    session is open, NVIDIA's front-end exits at once: 1 with "Cannot send command to MPS control daemon
    process" or nothing, or 0 with nothing printed, and the daemon carries out none of its commands
    (measured with 550.163 and 535.261, scripts/measure-mps-control.py)."""


class MpsDaemonStopped(MpsError):
    """The daemon had come up (it listened, or answered) and then exited: a client sent ``quit``, say.
    Unlike a daemon that fails to start, starting it again at once is expected to work."""


def check_daemon_id(value: str) -> str:
    """``value`` if it is safe as a directory name, else ValueError."""
    if not _DAEMON_ID.fullmatch(value):
        raise ValueError(
            f"daemon_id {value!r} must be 1-63 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


def pinned_limit_taken(answer: str, mib: int) -> bool:
    """Whether ``get_default_device_pinned_mem_limit`` printing ``answer`` shows a limit of ``mib`` MiB.

    Only the daemon's own display rounding is forgiven: an empty answer (limit not set, or set from
    an invalid value), another number or another format means the limit was not taken.
    """
    match = _DISPLAYED_LIMIT.fullmatch(answer.strip())
    if match is None:
        return False
    value, unit = int(match.group(1)), match.group(2)
    if unit == "M":
        return value == mib
    return mib >= 1024 and value == mib // 1024


class MpsDaemonSpec(BaseModel):
    """What one daemon serves and the limits its servers get."""

    # extra="ignore": specs are stored inside checkpointed records, which must survive a downgrade.
    model_config = ConfigDict(extra="ignore", frozen=True)

    daemon_id: Annotated[str, AfterValidator(check_daemon_id)]  # names the daemon's directory: a safe file name
    gpu_uuids: list[str] = Field(min_length=1)  # becomes the daemon's CUDA_VISIBLE_DEVICES, in this order
    active_thread_percentage: int | None = Field(default=None, ge=1, le=100)
    pinned_memory_limits: dict[str, int] = Field(default_factory=dict)  # GPU UUID -> bytes
    # One MPS server for clients of every UID (NVIDIA's -M) instead of one UID at a time.
    multi_user: bool = False
    # Bytes of the daemon's own /dev/shm tmpfs, where the launcher mounts one; None (also in records
    # written before it existed): the node's default, --mps-shm-size. Its range is checked where it is
    # written (plan, claim, flag), not here: a record must load even if the range changes later.
    shm_size: int | None = Field(default=None, gt=0)

    @field_validator("gpu_uuids")
    @classmethod
    def _device_uuids(cls, value: list[str]) -> list[str]:
        for uuid in value:
            if not _DEVICE_UUID.fullmatch(uuid):
                raise ValueError(f"gpu_uuids entry {uuid!r} is not a GPU-... or MIG-... UUID")
        if len(set(value)) != len(value):
            raise ValueError(f"gpu_uuids {value} lists a device more than once")
        return value

    @model_validator(mode="after")
    def _limits_name_served_gpus(self) -> MpsDaemonSpec:
        for uuid, limit in self.pinned_memory_limits.items():
            if uuid not in self.gpu_uuids:
                raise ValueError(f"pinned_memory_limits names {uuid}, which is not in gpu_uuids {self.gpu_uuids}")
            if limit < MIB:
                raise ValueError(
                    f"pinned_memory_limits[{uuid}] is {limit} bytes; MPS takes whole MiB, so it must be at least "
                    f"{MIB} bytes (1 MiB)"
                )
        return self

    def pinned_limits_mib(self) -> list[tuple[int, int]]:
        """``(ordinal, MiB)`` per limited GPU, ordinal = index in ``gpu_uuids`` as the daemon numbers them."""
        return [
            (ordinal, self.pinned_memory_limits[uuid] // MIB)
            for ordinal, uuid in enumerate(self.gpu_uuids)
            if uuid in self.pinned_memory_limits
        ]


class MpsDaemonRecord(BaseModel):
    """A started daemon, as the checkpoint stores it."""

    # extra="ignore": a checkpoint written by a newer driver must still load after a rollback.
    model_config = ConfigDict(extra="ignore", frozen=True)

    version: int = 1
    spec: MpsDaemonSpec
    pid: int = Field(gt=0)
    pipe_dir: Path
    log_dir: Path
    started_at: str  # ISO 8601, UTC
    # /proc/<pid>/stat field 22 (clock ticks after boot): tells our daemon from a process that got its PID later.
    process_start_time: int = Field(ge=0)
    # The host directory the daemon sees as /dev/shm (clients mount the same); None in records
    # written before it was recorded: the shared MPS shm directory then.
    shm_dir: Path | None = None


@dataclass(frozen=True)
class MpsClientEdits:
    """What a client container needs to reach a daemon; the caller turns it into CDI edits."""

    env: list[str]
    mounts: list[cdi.Mount]


def client_edits(
    record: MpsDaemonRecord, container_pipe_dir: str = "/tmp/nvidia-mps", shm_host_dir: Path | None = None
) -> MpsClientEdits:
    """Environment and mounts that connect a container to the daemon of ``record``.

    The pipe directory is mounted read-only: clients only connect to sockets the daemon and its
    servers create there (docs/sharing.md, "The pipe directory"). ``/dev/shm`` is the one the
    daemon really sees: ``record.shm_dir``, else ``shm_host_dir``. The limit variables repeat the
    daemon's defaults; MPS applies them per client process, so they only restrict further.
    """
    spec = record.spec
    env = [f"CUDA_MPS_PIPE_DIRECTORY={container_pipe_dir}"]
    if spec.active_thread_percentage is not None:
        env.append(f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={spec.active_thread_percentage}")
    limits = spec.pinned_limits_mib()
    if limits:
        env.append("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=" + ",".join(f"{o}={mib}M" for o, mib in limits))
    mounts = [cdi.Mount(host_path=str(record.pipe_dir), container_path=container_pipe_dir,
                        options=["ro", "nosuid", "nodev", "bind"])]
    shm = record.shm_dir or shm_host_dir
    if shm is not None:
        mounts.append(cdi.Mount(host_path=str(shm), container_path="/dev/shm",
                                options=["rw", "nosuid", "nodev", "bind"]))
    return MpsClientEdits(env=env, mounts=mounts)
