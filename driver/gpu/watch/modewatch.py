"""The compute mode of GPUs serving MPS claims, checked every watch round and set back to EXCLUSIVE_PROCESS.

Why: the mode is what keeps a CUDA client that misses the MPS daemon from running outside every MPS
limit (``runtime/computemode.py``). It does not stay put on its own: nvml.h says it "always resets to
Default" and a GPU reset does exactly that; the control daemon holds no GPU context while it has no
clients, so a reset (``nvidia-smi -r``, a recovery action) can succeed under prepared MPS claims; and any
root process on the node can set another mode. Start-up reconciliation (``SharingRuntime
.reconcile_compute_modes``) covers only what happened while the driver was down; this check covers the
rest, on the daemon watcher's thread and interval (``--mps-limit-check-interval``).

Each GPU is checked under its own GPU lock, so a prepare or unprepare on it (which may be changing the
mode itself) is never raced; a busy GPU waits for the next round. Only claims whose prepare completed
count: a PrepareStarted record is a prepare in flight or a rollback to be retried. A GPU found in another
mode is set back, then reported: a log line, the ``compute_mode_restored`` counter (by GPU) and a
Warning Event on each claim the GPU serves, as drifted MPS limits are (``daemonwatch.py``).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from driver.gpu.discovery.inventory import ComputeMode
from driver.gpu.record.checkpoint import ClaimPhase, ClaimRecord
from driver.gpu.runtime.computemode import ComputeModeError
from driver.gpu.runtime.gpulocks import RESCAN_GPU_WAIT
from driver.kubeletplugin.events import EventRecorder, EventSpec, ObjectRef
from driver.kubeletplugin.telemetry import Telemetry

if TYPE_CHECKING:
    from driver.gpu.state import DeviceState

log = logging.getLogger(__name__)

MODE_RESTORED = "ComputeModeRestored"
_CLAIM_API = "resource.k8s.io/v1"


def exclusive_holders(claims: Iterable[ClaimRecord]) -> dict[str, list[ClaimRecord]]:
    """GPU UUID -> the completed claims whose MPS daemons need it EXCLUSIVE_PROCESS."""
    holders: dict[str, list[ClaimRecord]] = {}
    for record in claims:
        if record.phase == ClaimPhase.PREPARE_COMPLETED:
            for uuid in record.exclusive_gpus:
                holders.setdefault(uuid, []).append(record)
    return holders


class ComputeModeReports:
    """Log, counter and Events for compute modes found changed under MPS claims and set back."""

    def __init__(self, events: EventRecorder | None) -> None:
        self.events = events
        self._lock = threading.Lock()
        self._restored: Counter[str] = Counter()  # GPU UUID -> times set back

    def register_metrics(self, telemetry: Telemetry) -> None:
        telemetry.observe_labelled(
            "compute_mode_restored", "GPUs serving MPS claims found out of EXCLUSIVE_PROCESS (a GPU reset, or "
            "another root process) and set back, by GPU", self._series, counter=True)

    def _series(self) -> Iterable[tuple[float, Mapping[str, str]]]:
        with self._lock:
            return [(float(n), {"gpu": uuid}) for uuid, n in self._restored.items()]

    def mode_restored(self, gpu_uuid: str, found: str, claims: Sequence[ClaimRecord]) -> None:
        with self._lock:
            self._restored[gpu_uuid] += 1
        log.warning("a GPU serving MPS claims was out of EXCLUSIVE_PROCESS; set it back", extra={
            "gpu_uuid": gpu_uuid, "found": found, "restored": ComputeMode.EXCLUSIVE_PROCESS.value,
            "claims": [c.uid for c in claims]})
        if self.events is None:
            return
        note = (f"GPU {gpu_uuid}, whose MPS daemon serves this claim, was found in compute mode {found} (a GPU "
                f"reset puts it back to DEFAULT; any root process can change it); the driver set "
                f"EXCLUSIVE_PROCESS again. Meanwhile a CUDA client that missed the MPS daemon could run on the "
                f"GPU outside every MPS limit.")
        for claim in claims:
            regarding = ObjectRef(apiVersion=_CLAIM_API, kind="ResourceClaim", namespace=claim.namespace,
                                  name=claim.name, uid=claim.uid)
            self.events.post(EventSpec(regarding=regarding, reason=MODE_RESTORED, action="RestoreComputeMode",
                                       note=note))


def check_compute_modes(state: DeviceState, reports: ComputeModeReports) -> list[str]:
    """Set back to EXCLUSIVE_PROCESS every GPU completed MPS claims hold that is in another mode, each under
    its GPU lock (a busy GPU is checked next round); the GPUs set back."""
    restored: list[str] = []
    for uuid in sorted(exclusive_holders(state.ledger.read().claims.values())):
        try:
            with state.gpu_locks.held([uuid], RESCAN_GPU_WAIT, f"checking the compute mode of {uuid}"):
                # Read again under the lock: the last claim may have been unprepared (mode restored) meanwhile.
                claims = exclusive_holders(state.ledger.read().claims.values()).get(uuid, [])
                if not claims:
                    continue
                try:
                    found = state.sharing.compute_modes.get(uuid).value
                except ComputeModeError as exc:
                    found = f"unreadable ({exc})"  # EXCLUSIVE_THREAD or an unknown value: set it all the same
                if found == ComputeMode.EXCLUSIVE_PROCESS.value:
                    continue
                state.sharing.compute_modes.set(uuid, ComputeMode.EXCLUSIVE_PROCESS)
            restored.append(uuid)
            try:  # best effort: a failed report must not make the next GPU wait for the next round
                reports.mode_restored(uuid, found, claims)
            except Exception:
                log.exception("reporting a restored compute mode failed")
        except Exception as exc:
            log.error("checking the compute mode of a GPU serving MPS claims failed; retried next round",
                      extra={"gpu_uuid": uuid, "reason": str(exc)})
    return restored
