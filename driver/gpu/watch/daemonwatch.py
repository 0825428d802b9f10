"""The MPS daemon watcher: limits read back every few seconds, changes reverted and reported, gone daemons restarted.

Any client that reaches a daemon's control socket as root (a tenant root in its container: the
read-only pipe-dir mount still allows ``connect()``) can change the daemon's default limits for
every share it serves, or ``quit`` it. A thread checks every recorded daemon every ``interval``
seconds (``--mps-limit-check-interval``): under that daemon's GPU locks, one daemon at a time, so
it never holds up a prepare on another GPU, and a GPU busy with a prepare is checked next round.
Each change it (or a prepare reusing the daemon) finds is set back at once and reported here: a
log line with what was found and what was restored, ``mps_limit_drift`` and
``mps_daemon_restarts`` counters, and a Warning Event on each claim the daemon serves.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from driver.gpu.mps.limits import LimitDrift
from driver.gpu.record.checkpoint import ClaimPhase, ClaimRecord
from driver.gpu.runtime.gpulocks import RESCAN_GPU_WAIT
from driver.gpu.runtime.interfaces import ServedClaim
from driver.gpu.runtime.migclaims import dynamic_devices
from driver.gpu.state import DeviceState
from driver.kubeletplugin.events import EventRecorder, EventSpec, ObjectRef
from driver.kubeletplugin.telemetry import Telemetry
from driver.kubeletplugin.types import ClaimRef

log = logging.getLogger(__name__)

LIMITS_REVERTED = "MpsLimitsReverted"
DAEMON_RESTARTED = "MpsDaemonRestarted"
LIMITS_UNCONFIRMED = "MpsLimitsUnconfirmed"
LIMITS_CONFIRMED = "MpsLimitsConfirmed"
# The drift counter's label for limits that could not be read back for longer than the watch interval.
UNCONFIRMED = "unconfirmed"
_CLAIM_API = "resource.k8s.io/v1"


class DaemonWatcher:
    """A thread that runs ``revive_daemons(state, limits=True)`` every ``interval`` seconds."""

    def __init__(self, state: DeviceState, interval: float, also: Sequence[Callable[[], object]] = ()) -> None:
        """``also``: further checks run each round before the daemons' (compute modes: ``modewatch.py``)."""
        self.state = state
        self.interval = interval
        self.also = tuple(also)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mps-daemon-watch", daemon=True)
            self._thread.start()

    def stop(self, timeout: float) -> None:
        """Stop after the check in progress (bounded by the MPS timeouts), waiting at most ``timeout``."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            for check in self.also:
                try:
                    check()
                except Exception:
                    log.exception("a watch check failed; will retry")
            try:
                revive_daemons(self.state, limits=True)
            except Exception:
                log.exception("checking the MPS daemons failed; will retry")


def revive_daemons(state: DeviceState, limits: bool = False) -> list[str]:
    """Restart MPS daemons that died since the last check (each rescan; with ``limits`` also revert limits
    a client changed), each under its GPUs' locks; a busy GPU is checked next time."""
    cp = state.ledger.read()
    restarted: list[str] = []
    for daemon_id in sorted(cp.mps_daemons):
        users = [r for r in cp.claims_using(daemon_id) if _still_served(r, daemon_id)]
        gpus = sorted({g for r in users for g in r.gpu_uuids})
        if not gpus:
            continue  # an orphan: stopped at the next start
        try:
            with state.gpu_locks.held(gpus, RESCAN_GPU_WAIT, f"checking MPS daemon {daemon_id}"):
                if not state.sharing.revive_daemon(daemon_id, limits):
                    continue
                restarted.append(daemon_id)
                current = state.ledger.read()
                for record in current.claims_using(daemon_id):
                    if _still_served(record, daemon_id):
                        state.write_cdi(record, current)
        except Exception as exc:
            log.error("checking an MPS daemon failed; retried at the next rescan",
                      extra={"daemon_id": daemon_id, "reason": str(exc)})
    if restarted:
        log.warning("restarted MPS daemons that had died; their clients must reconnect",
                    extra={"daemons": restarted})
    return restarted


def _still_served(record: ClaimRecord, daemon_id: str) -> bool:
    """Whether ``record``, a claim using ``daemon_id``, is still served by it. A PrepareStarted record is a failed
    prepare whose rollback is to be retried: reviving its daemon or spec would undo that rollback. Nor is a
    claim whose dynamic MIG device that the daemon serves lost its instance for good (ids forgotten: another
    tool took the placement after a reboot): the daemon would serve a MIG UUID that no longer exists, and the
    spec recovery removed (it named the GI/CI ids of an instance that may now be someone else's) would be back."""
    return record.phase == ClaimPhase.PREPARE_COMPLETED and not any(
        d.mps_daemon_id == daemon_id and d.mig_gi_id is None and not d.admin_access
        for _, d, _ in dynamic_devices(record))


class MpsReports:
    """The app's :class:`~driver.gpu.runtime.interfaces.DaemonReports`: log, counters and Events."""

    def __init__(self, events: EventRecorder | None) -> None:
        self.events = events
        self._lock = threading.Lock()
        self._drift: Counter[tuple[str, ...]] = Counter()  # (daemon id, limit) -> reverted changes
        self._restarts: Counter[tuple[str, ...]] = Counter()  # (daemon id,) -> restarts
        # Told of the claims whose daemon's limits were restored (their status.devices says so).
        self.restored: Callable[[list[ClaimRef]], None] | None = None
        self._unconfirmed: set[str] = set()  # daemons whose limits are unconfirmed now
        self.on_change: Callable[[], None] | None = None  # called when a daemon's limits turn (un)confirmed

    def register_metrics(self, telemetry: Telemetry) -> None:
        # Labels name daemons and limits, never a tenant's claim or namespace.
        telemetry.observe_labelled(
            "mps_limit_drift", "MPS daemon default limits found changed by a client and restored, by daemon and limit",
            lambda: self._series(self._drift, ("daemon", "limit")), counter=True)
        telemetry.observe_labelled(
            "mps_daemon_restarts", "MPS daemons found gone (stopped by a client, or exited) and started again",
            lambda: self._series(self._restarts, ("daemon",)), counter=True)
        telemetry.observe_labelled(
            "mps_limits_unconfirmed", "1 while an MPS daemon's limits could not be read back for longer than the "
            "watch interval (a client holds its control socket): they count as changed until read back again",
            lambda: self._series(Counter({(d,): 1 for d in self._unconfirmed}), ("daemon",)))

    def _series(self, counts: Mapping[tuple[str, ...], int],
                names: tuple[str, ...]) -> Iterable[tuple[float, Mapping[str, str]]]:
        with self._lock:
            return [(float(n), dict(zip(names, key, strict=True))) for key, n in counts.items()]

    def limits_reverted(self, daemon_id: str, drift: Sequence[LimitDrift], claims: Sequence[ServedClaim]) -> None:
        with self._lock:
            for d in drift:
                self._drift[(daemon_id, d.limit)] += 1
        changes = "; ".join(d.describe() for d in drift)
        log.warning("a client changed an MPS daemon's limits; restored them", extra={
            "daemon_id": daemon_id, "changes": changes, "claims": [c.uid for c in claims],
            "found": {d.limit: d.found for d in drift}, "restored": {d.limit: d.expected for d in drift}})
        if self.restored is not None:
            self.restored([ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in claims])
        self._post(claims, LIMITS_REVERTED, "RevertMpsLimits",
                   f"A client of the MPS control daemon {daemon_id} serving this claim changed its default limits "
                   f"(any process that runs as root and can reach the daemon's pipe directory can); the driver "
                   f"restored them: {changes}. MPS servers started while they were changed keep the changed limits "
                   f"until their clients exit.")

    def daemon_restarted(self, daemon_id: str, claims: Sequence[ServedClaim]) -> None:
        with self._lock:
            self._restarts[(daemon_id,)] += 1
        log.warning("an MPS daemon was gone (stopped by a client, or exited) and was started again with its limits",
                    extra={"daemon_id": daemon_id, "claims": [c.uid for c in claims]})
        self._post(claims, DAEMON_RESTARTED, "RestartMpsDaemon",
                   f"The MPS control daemon {daemon_id} serving this claim was gone (a client sent quit, or it "
                   f"exited) and was started again with the claim's limits; CUDA clients that used it must reconnect.")

    def limits_unconfirmed(self, daemon_id: str, reason: str, claims: Sequence[ServedClaim], first: bool) -> None:
        if first:
            with self._lock:
                self._drift[(daemon_id, UNCONFIRMED)] += 1
                self._unconfirmed.add(daemon_id)
            if self.on_change is not None:
                self.on_change()
            log.warning("an MPS daemon's limits could not be read back for longer than the watch interval; they "
                        "count as changed until they are", extra={"daemon_id": daemon_id, "reason": reason,
                                                                  "claims": [c.uid for c in claims]})
        self._post(claims, LIMITS_UNCONFIRMED, "ConfirmMpsLimits",
                   f"The limits of the MPS control daemon {daemon_id} serving this claim cannot be confirmed: a "
                   f"client holds the daemon's control socket (any process that can reach the daemon's pipe directory "
                   f"can), so the driver cannot read them back and they may have been changed. The claim's MPS limits "
                   f"are not assured until the driver confirms them again (reason {LIMITS_CONFIRMED}). {reason}")

    def limits_confirmed(self, daemon_id: str, claims: Sequence[ServedClaim]) -> None:
        with self._lock:
            self._unconfirmed.discard(daemon_id)
        if self.on_change is not None:
            self.on_change()
        log.info("an MPS daemon's limits read back as promised again", extra={"daemon_id": daemon_id})
        self._post(claims, LIMITS_CONFIRMED, "ConfirmMpsLimits",
                   f"The limits of the MPS control daemon {daemon_id} serving this claim read back as promised again "
                   f"(any change found was reverted and reported as {LIMITS_REVERTED}).", warning=False)

    def _post(self, claims: Sequence[ServedClaim], reason: str, action: str, note: str, warning: bool = True) -> None:
        if self.events is None:
            return
        for claim in claims:
            regarding = ObjectRef(apiVersion=_CLAIM_API, kind="ResourceClaim", namespace=claim.namespace,
                                  name=claim.name, uid=claim.uid)
            self.events.post(EventSpec(regarding=regarding, reason=reason, action=action, note=note,
                                       type="Warning" if warning else "Normal"))
