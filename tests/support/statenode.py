"""A simulated node for DeviceState tests: its directories, recording fakes for the MPS manager,
time slicer and compute modes (each can be told to fail), and claims as the API server returns them.

The host tree is built from the ``demo`` layout: gpu-0 H100 whole, gpu-1 H100 with MIG
3g.40gb@0, 2g.20gb@4, 1g.10gb@6, gpu-2 L4. The fakes satisfy the Protocols of
``driver/gpu/runtime/interfaces.py``, so DeviceState takes them as they are.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from driver.gpu.claimcdi.toolkit import ToolkitEdits, load_toolkit_edits
from driver.gpu.claimconfig.choices import TimeSliceInterval
from driver.gpu.discovery.inventory import ComputeMode, NodeInventory
from driver.gpu.mps.limits import LimitDrift
from driver.gpu.mps.model import MpsDaemonRecord, MpsDaemonSpec, MpsError
from driver.gpu.published.devices import make_view
from driver.gpu.published.sharelayout import GpuForm
from driver.gpu.record.checkpoint import CheckpointStore
from driver.gpu.runtime.computemode import ComputeModeError
from driver.gpu.runtime.timeslice import TimeSliceError
from driver.gpu.state import DeviceState, StatePaths
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.types import ClaimRef, Deadline
from driver.simulation.discovery import SimulatedDiscovery
from driver.simulation.hostroot import build_host_root
from driver.units import GIB
from tests.support.pods import NonRootPods

DRIVER = "gpu.tessera.dev"
POOL = "node-a"


# ----------------------------------------------------------------------------- fakes


class FakeMps:
    """Stands in for MpsManager: daemons are records in ``running``; every call is logged in ``calls``."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self.running: dict[str, MpsDaemonRecord] = {}
        self.calls: list[tuple[str, str]] = []
        self.fail_start = False
        self.on_disk: list[str] = []
        self.drift: dict[str, list[LimitDrift]] = {}  # found by the next check_and_restore_limits of that daemon
        self.verified: list[str] = []
        self._next_pid = 1000

    def start(self, spec: MpsDaemonSpec, deadline: Deadline | None = None) -> MpsDaemonRecord:
        self.calls.append(("start", spec.daemon_id))
        if self.fail_start:
            raise MpsError(f"starting MPS control daemon {spec.daemon_id} failed: simulated")
        self._next_pid += 1
        record = MpsDaemonRecord(spec=spec, pid=self._next_pid, pipe_dir=self.base_dir / spec.daemon_id / "pipe",
                                 log_dir=self.base_dir / spec.daemon_id / "log", started_at="2025-01-01T00:00:00+00:00",
                                 process_start_time=1)
        self.running[spec.daemon_id] = record
        return record

    def process_running(self, record: MpsDaemonRecord) -> bool:
        current = self.running.get(record.spec.daemon_id)
        return current is not None and current.pid == record.pid

    def ensure_running(self, record: MpsDaemonRecord, deadline: Deadline | None = None,
                       retry_stopped: bool = False) -> MpsDaemonRecord:
        self.calls.append(("ensure_running", record.spec.daemon_id))
        if self.process_running(record):
            return record
        self.running.pop(record.spec.daemon_id, None)
        return self.start(record.spec)

    def check_and_restore_limits(self, record: MpsDaemonRecord, deadline: Deadline | None = None) -> list[LimitDrift]:
        """The drift a test put in ``drift`` for this daemon (once); reads are counted in ``verified``."""
        self.verified.append(record.spec.daemon_id)
        return self.drift.pop(record.spec.daemon_id, [])

    def adopt(self, spec: MpsDaemonSpec, deadline: Deadline | None = None,
              restore: bool = False) -> MpsDaemonRecord | None:
        self.calls.append(("adopt", spec.daemon_id))
        running = self.running.get(spec.daemon_id)
        return running if running is not None and (restore or running.spec == spec) else None

    def stop(self, record: MpsDaemonRecord, deadline: Deadline | None = None) -> None:
        self.calls.append(("stop", record.spec.daemon_id))
        self.running.pop(record.spec.daemon_id, None)

    def stop_by_id(self, daemon_id: str, deadline: Deadline | None = None) -> None:
        self.calls.append(("stop_by_id", daemon_id))
        self.running.pop(daemon_id, None)

    def daemon_ids_on_disk(self) -> list[str]:
        return sorted({*self.running, *self.on_disk})

    def stopped_after_start(self, daemon_id: str) -> bool:
        """Whether ``daemon_id`` was stopped after its last start (the stop before a start clears leftovers)."""
        last_start = max(i for i, call in enumerate(self.calls) if call == ("start", daemon_id))
        return any(op in ("stop", "stop_by_id") and d == daemon_id for op, d in self.calls[last_start:])

    def started(self) -> list[str]:
        return [d for op, d in self.calls if op == "start"]


@dataclass
class FakeTimeSlicer:
    """Stands in for TimeSlicer: remembers each GPU's interval; ``fail_apply`` makes apply raise."""

    intervals: dict[str, str] = field(default_factory=dict)
    calls: list[tuple[str, tuple[str, ...], str | None]] = field(default_factory=list)
    fail_apply: bool = False

    def apply(self, gpu_uuids: Sequence[str], interval: TimeSliceInterval, deadline: Deadline | None = None) -> None:
        self.calls.append(("apply", tuple(gpu_uuids), interval))
        if self.fail_apply:
            raise TimeSliceError(f"setting time slice {interval} failed: simulated nvidia-smi exit 3")
        for uuid in gpu_uuids:
            self.intervals[uuid] = interval

    def reset(self, gpu_uuids: Sequence[str]) -> None:
        self.calls.append(("reset", tuple(gpu_uuids), None))
        for uuid in gpu_uuids:
            self.intervals.pop(uuid, None)


@dataclass
class FakeComputeModes:
    """Stands in for NvmlComputeModes: each GPU's mode (DEFAULT until set); ``fail_set`` names a GPU that refuses."""

    modes: dict[str, ComputeMode] = field(default_factory=dict)
    sets: list[tuple[str, ComputeMode]] = field(default_factory=list)
    fail_set: str | None = None

    def get(self, uuid: str, deadline: Deadline | None = None) -> ComputeMode:
        return self.modes.get(uuid, ComputeMode.DEFAULT)

    def set(self, uuid: str, mode: ComputeMode, deadline: Deadline | None = None) -> None:
        self.sets.append((uuid, mode))
        if uuid == self.fail_set:
            raise ComputeModeError(f"compute mode of {uuid}: `nvidia-smi -i {uuid} -c {mode}` exited 3 (simulated)")
        self.modes[uuid] = mode


# ----------------------------------------------------------------------------- node


def state_parts(root: Path,
                host: Path) -> tuple[StatePaths, ToolkitEdits, FakeMps, FakeTimeSlicer, FakeComputeModes]:
    """A DeviceState's directories under ``root``, the host tree's toolkit spec, and recording fakes."""
    paths = StatePaths(state_dir=root / "state", cdi_root=root / "cdi", host_root=host,
                       mps_shm_dir=root / "state" / "mps" / "shm")
    return (paths, load_toolkit_edits(host / "etc" / "cdi" / "nvidia.yaml"), FakeMps(root / "state" / "mps"),
            FakeTimeSlicer(), FakeComputeModes())


class StateNode:
    """One simulated node's directories, fakes and inventory; ``state()`` is a driver process on it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.inventory: NodeInventory = SimulatedDiscovery("demo", POOL).discover()
        self.host = root / "host"
        build_host_root(self.host, self.inventory)
        self.paths, self.toolkit, self.mps, self.timeslicer, self.modes = state_parts(root, self.host)

    def uuid(self, minor: int) -> str:
        gpu = self.inventory.gpu_by_minor(minor)
        assert gpu is not None
        return gpu.uuid

    def state(self) -> DeviceState:
        """A fresh DeviceState on the same directories and fakes, as after a driver restart."""
        return DeviceState(driver_name=DRIVER, pool_name=POOL, paths=self.paths, toolkit=self.toolkit,
                           mps=self.mps, timeslicer=self.timeslicer, compute_modes=self.modes,
                           view=make_view(self.inventory, {}), lock_timeout=5)

    @property
    def store(self) -> CheckpointStore:
        return CheckpointStore(self.paths.state_dir / "checkpoint.json")

    def spec_path(self, uid: str) -> Path:
        return self.paths.cdi_root / f"k8s.gpu.tessera.dev-claim_{uid}.json"

    def cdi_files(self) -> list[str]:
        return sorted(p.name for p in self.paths.cdi_root.iterdir()) if self.paths.cdi_root.exists() else []

    def spec_json(self, uid: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.spec_path(uid).read_text())
        return data


def claim(uid: str, *devices: str, configs: list[dict[str, Any]] | None = None, pool: str = POOL,
          name: str | None = None) -> ResourceClaim:
    """A ResourceClaim allocated to ``devices`` (request ``r<i>`` for the i-th), as the API server returns it,
    reserved for one pod (``pod-<uid>``) that a ``clients: nonRoot`` share admits."""
    results = [{"request": f"r{i}", "driver": DRIVER, "pool": pool, "device": d} for i, d in enumerate(devices)]
    return ResourceClaim.model_validate({
        "metadata": {"name": name or f"claim-{uid}", "namespace": "default", "uid": uid},
        "status": {"allocation": {"devices": {"results": results, "config": configs or []}},
                   "reservedFor": [{"resource": "pods", "name": f"pod-{uid}", "uid": f"pod-{uid}"}]},
    }).with_pod_reader(NonRootPods())


def ref(uid: str) -> ClaimRef:
    return ClaimRef(namespace="default", name=f"claim-{uid}", uid=uid)


def gpu_config(**sharing: Any) -> dict[str, Any]:
    return {"source": "FromClaim", "requests": [],
            "opaque": {"driver": DRIVER, "parameters": {"apiVersion": "gpu.tessera.dev/v1alpha1",
                                                        "kind": "GpuConfig", "sharing": sharing}}}


def mps_shares(count: int = 2) -> GpuForm:
    return GpuForm(strategy="MPS", count=count, active_thread_percentage=50, memory_bytes_per_share=10 * GIB)


def ts_shares(count: int = 2) -> GpuForm:
    return GpuForm(strategy="TimeSlicing", count=count, memory_bytes_per_share=10 * GIB, interval="Long")


def device_env(spec: dict[str, Any], index: int = 0) -> list[str]:
    env: list[str] = spec["devices"][index]["containerEdits"].get("env", [])
    return env
