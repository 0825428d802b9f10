"""SIMULATION: the GPUs' processes, read from a JSON file standing in for NVML's process lists.

``TESSERA_SIM_PROCESSES`` names the file; it holds what is running *now* (a test or the demo
rewrites it), as NVML's ``nvmlDeviceGetComputeRunningProcesses`` answers the current processes
rather than events::

    [{"uuid": "GPU-...", "pid": 4242, "pod_uid": "<pod UID>", "memory_bytes": 1073741824, "sm_percent": 35}]

``uuid`` is the GPU's, or the MIG device's for a process in a GPU instance; ``pod_uid`` stands in
for what the real source reads from ``/proc/<pid>/cgroup`` (omit it for a process outside any
pod); ``memory_bytes`` and ``sm_percent`` may be omitted where NVML would not report them.
``"mps_client": true`` says NVML lists the process with ``nvmlDeviceGetMPSComputeRunningProcesses``
(an MPS client: its ``sm_percent``, if given, is read as NVML's would be, the server's work and no
claim's); ``parent_pid`` stands in for ``/proc/<pid>/stat`` (an MPS server's parent is its control
daemon). A missing file means no processes; a file that cannot be parsed is logged and read as none.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from driver.gpu.health.usage import ProcessUsage

log = logging.getLogger(__name__)

PROCESSES_ENV = "TESSERA_SIM_PROCESSES"


class SimulatedProcess(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    uuid: str
    pid: int = Field(gt=0)
    pod_uid: str | None = None
    memory_bytes: int | None = Field(default=None, ge=0)
    sm_percent: float | None = Field(default=None, ge=0, le=100)
    mps_client: bool = False
    parent_pid: int | None = Field(default=None, gt=0)


_FILE = TypeAdapter(list[SimulatedProcess])


def parse_processes(text: str, where: str) -> list[ProcessUsage]:
    example = '[{"uuid": "GPU-...", "pid": 4242, "pod_uid": "...", "memory_bytes": 1073741824}]'
    try:
        entries = _FILE.validate_python(json.loads(text))
    except json.JSONDecodeError as err:
        raise ValueError(f"{where}: not JSON ({err}); expected e.g. {example}") from err
    except ValidationError as err:
        problems = "; ".join(f"entry {'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}"
                             for e in err.errors())
        raise ValueError(f"{where}: not a process list ({problems}); expected e.g. {example}") from err
    return [ProcessUsage(pid=e.pid, uuid=e.uuid, memory_bytes=e.memory_bytes, sm_percent=e.sm_percent,
                         pod_uid=e.pod_uid, mps_client=e.mps_client, parent_pid=e.parent_pid) for e in entries]


class SimulatedProcesses:
    """A :class:`driver.gpu.health.processes.ProcessSource` over the file at ``path`` (None: no processes)."""

    def __init__(self, path: Path | None):
        self._path = path
        self._reported: str | None = None

    def describe(self) -> str:
        return f"SIMULATION: processes from {self._path}" if self._path else \
            f"SIMULATION: no processes ({PROCESSES_ENV} unset)"

    def processes(self) -> list[ProcessUsage]:
        if self._path is None:
            return []
        try:
            return parse_processes(self._path.read_text(), str(self._path))
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as err:
            if str(err) != self._reported:  # once per distinct problem, not at every sample
                self._reported = str(err)
                log.error("SIMULATION: cannot read the simulated GPU processes", extra={"reason": str(err)})
            return []
