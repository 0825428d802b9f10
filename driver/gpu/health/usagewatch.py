"""Per-claim GPU usage, watched: sampled periodically and at each metrics scrape, exported as
metrics, logged when a share goes beyond an entitlement nothing enforces, and written for ``inspect``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from driver.gpu.health.processes import ProcessSource
from driver.gpu.health.usage import ClaimDeviceUsage, claim_usage
from driver.gpu.health.usagereport import write_usage_report
from driver.gpu.published.targets import NodeView
from driver.gpu.record.checkpoint import Checkpoint
from driver.kubeletplugin.telemetry import Telemetry

log = logging.getLogger(__name__)

Series = Iterable[tuple[float, Mapping[str, str]]]
# One sample serves every metric of one scrape (they are read one after another).
_REUSE_S = 1.0
DEFAULT_INTERVAL_S = 10.0


class ClaimUsageWatch:
    def __init__(self, source: ProcessSource, checkpoint: Callable[[], Checkpoint], view: Callable[[], NodeView],
                 *, report_path: Path | None = None, clock: Callable[[], float] = time.monotonic):
        """``report_path``: where to keep the usage file that ``inspect`` reads."""
        self.source = source
        self._checkpoint = checkpoint
        self._view = view
        self._report_path = report_path
        self._clock = clock
        self._lock = threading.Lock()
        self._last: tuple[float, list[ClaimDeviceUsage]] | None = None
        self._over: set[tuple[str, str, str, str]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def usage(self) -> list[ClaimDeviceUsage]:
        """The current usage (a sample at most a second old)."""
        with self._lock:
            now = self._clock()
            if self._last is not None and now - self._last[0] < _REUSE_S:
                return self._last[1]
            cp, view = self._checkpoint(), self._view()
            usage = claim_usage(cp.claims.values(), self.source.processes(), view.targets, cp.layout,
                                mps_daemon_pids={d.pid for d in cp.mps_daemons.values()})
            self._note_entitlements(usage)
            self._last = (now, usage)
        if self._report_path is not None:
            try:
                write_usage_report(self._report_path, usage)
            except OSError as exc:
                log.warning("cannot write the claim usage file for inspect", extra={"reason": str(exc)})
        return usage

    def _note_entitlements(self, usage: list[ClaimDeviceUsage]) -> None:
        over = set()
        for u in usage:
            for what in u.over_entitlement:
                key = (u.namespace, u.claim, u.device, what)
                over.add(key)
                if key not in self._over:
                    log.warning("a claim's processes use more than its share's entitlement, which nothing enforces",
                                extra={"claim": f"{u.namespace}/{u.claim}", "device": u.device, "resource": what,
                                       "used": u.memory_bytes if what == "memory" else u.sm_percent,
                                       "entitled": u.memory_limit_bytes if what == "memory" else u.sm_limit_percent,
                                       "pids": list(u.pids)})
        for namespace, claim, device, what in self._over - over:
            log.info("a claim's processes are back within their share's entitlement",
                     extra={"claim": f"{namespace}/{claim}", "device": device, "resource": what})
        self._over = over

    def start(self, interval: float = DEFAULT_INTERVAL_S) -> None:
        """Sample every ``interval`` seconds, so the log and ``inspect`` see usage without a scrape."""
        def run() -> None:
            while not self._stop.wait(interval):
                try:
                    self.usage()
                except Exception:
                    log.exception("sampling per-claim GPU usage failed")
        self._thread = threading.Thread(target=run, name="claim-usage", daemon=True)
        self._thread.start()
        log.info("per-claim GPU usage watched", extra={"source": self.source.describe(), "interval_s": interval})

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def register_metrics(self, telemetry: Telemetry) -> None:
        def labels(u: ClaimDeviceUsage) -> dict[str, str]:
            return {"namespace": u.namespace, "claim": u.claim, "device": u.device, "kind": u.kind,
                    "enforced": "true" if u.enforced else "false"}

        def series(pick: Callable[[ClaimDeviceUsage], float | None]) -> Callable[[], Series]:
            def read() -> Series:
                for u in self.usage():
                    value = pick(u)
                    if value is not None:
                        yield float(value), labels(u)
            return read

        def over() -> Series:
            # Only where use and limit are both known: 0 would claim "within" for an unknown use (MPS or MIG
            # SM utilisation) or a device with no entitlement (admin access).
            for u in self.usage():
                for what in u.judged:
                    yield (1.0 if what in u.over_entitlement else 0.0), {**labels(u), "resource": what}

        telemetry.observe_labelled("claim_gpu_memory_used_bytes", "GPU memory used by the processes of a claim's "
                                   "pods on one of its devices (absent where NVML gives no figure)",
                                   series(lambda u: u.memory_bytes))
        telemetry.observe_labelled("claim_gpu_memory_limit_bytes", "The memory a claim's device may use: its limit "
                                   "(enforced=true) or entitlement (enforced=false)",
                                   series(lambda u: u.memory_limit_bytes))
        telemetry.observe_labelled("claim_gpu_sm_utilization_percent", "SM utilisation of a claim's processes on "
                                   "one of its devices (absent where NVML has no sample, and always on MPS shares "
                                   "and MIG devices, whose SM use NVML cannot attribute)",
                                   series(lambda u: u.sm_percent))
        telemetry.observe_labelled("claim_gpu_sm_limit_percent", "The SM share a claim's device may use: MPS active "
                                   "thread percentage, or a time-slice share's equal part", series(
                                       lambda u: u.sm_limit_percent))
        telemetry.observe_labelled("claim_gpu_processes", "Processes of a claim's pods on one of its devices",
                                   series(lambda u: len(u.pids)))
        telemetry.observe_labelled("claim_gpu_over_entitlement", "1 while a claim's processes use more memory or "
                                   "SM than a share entitles them to and nothing enforces it (time slicing, "
                                   "advisory MPS limits)", over)
