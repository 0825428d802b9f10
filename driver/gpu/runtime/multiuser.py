"""Whether plan MPS daemons run in multi-user mode, found out without delaying the plugin's start.

The only way to know whether the driver's ``nvidia-cuda-mps-control`` knows multi-user mode is to
start one with the flag (:func:`supports_multi_user`; 535.x and 550.x do not know it).
That costs a daemon start, so it runs in a background thread once the plugin is registered; until
it answers, and where it answers no, the node publishes ``mpsMultiUser: false``. A plan daemon
started single-user stays so while claims use it: a client of a second Linux UID then waits until
the first UID's clients are done (nvidia-cuda-mps-control(1); docs/sharing.md, "Several
UIDs on one daemon"). So a prepare that would start one waits for the answer first (:class:`MultiUserGate`),
bounded by its deadline.

The pure functions decide which GPU to probe with and which GPUs' plan shares stay single-user;
:class:`MultiUserProbe` only runs the probe once and keeps its answer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from driver.gpu.claim.claimplan import ClaimPlan
from driver.gpu.discovery.inventory import NodeInventory, multi_user_capable
from driver.gpu.errors import NodeBusy
from driver.gpu.mps.manager import MpsManager
from driver.gpu.mps.model import MpsDaemonSpec, MpsError
from driver.gpu.published.sharelayout import SharingLayout

log = logging.getLogger(__name__)


def supports_multi_user(mps: MpsManager, gpu_uuid: str) -> bool:
    """Whether this driver's control daemon runs in multi-user mode: starts a throwaway one with it.

    535.x and 550.x do not know the flag and exit at once; that, or any other start failure, is False.
    """
    probe = MpsDaemonSpec(daemon_id="probe-multi-user", gpu_uuids=[gpu_uuid], multi_user=True)
    try:
        mps.stop_by_id(probe.daemon_id)
        record = mps.start(probe)
    except MpsError as exc:
        log.info("MPS multi-user mode is not available", extra={"reason": str(exc).splitlines()[0]})
        return False
    mps.stop(record)
    return True


def plan_mps_gpus(inventory: NodeInventory, layout: SharingLayout) -> list[str]:
    """UUIDs of the GPUs the layout splits into MPS shares, and MIG UUIDs of the instances it splits so (each
    has a plan daemon of its own), in minor order."""
    return [uuid for g in sorted(inventory.gpus, key=lambda g: g.minor)
            for uuid in (g.uuid, *(m.uuid for m in g.mig_instances))
            if (shares := layout.get(uuid)) is not None and shares.strategy == "MPS"]


def _capable(inventory: NodeInventory) -> set[str]:
    """GPUs (and their MIG instances) whose compute capability allows multi-user mode."""
    return {uuid for g in inventory.gpus if multi_user_capable(g.cuda_compute_capability)
            for uuid in (g.uuid, *(m.uuid for m in g.mig_instances))}


def probe_gpu(inventory: NodeInventory, layout: SharingLayout) -> str | None:
    """The GPU (or MIG instance) to probe multi-user mode with: the first with plan MPS shares that could use it.

    None when no GPU could (no plan MPS shares, or only GPUs below compute capability 7.0):
    then nothing needs probing."""
    capable = _capable(inventory)
    return next((uuid for uuid in plan_mps_gpus(inventory, layout) if uuid in capable), None)


def single_user_gpus(inventory: NodeInventory, layout: SharingLayout, multi_user: bool) -> list[str]:
    """GPUs (and MIG instances) whose plan MPS shares are served one Linux UID at a time under ``multi_user``."""
    capable = _capable(inventory)
    return [uuid for uuid in plan_mps_gpus(inventory, layout) if not (multi_user and uuid in capable)]


class MultiUserProbe:
    """Runs ``probe(gpu_uuid)`` once in a background thread; :attr:`result` is None until it answers."""

    def __init__(self, probe: Callable[[str], bool]) -> None:
        self._probe = probe
        self._thread: threading.Thread | None = None
        self._result: bool | None = None
        self._lock = threading.Lock()
        self._answered = threading.Event()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def result(self) -> bool | None:
        with self._lock:
            return self._result

    def start(self, gpu_uuid: str) -> None:
        """Start the probe with ``gpu_uuid`` unless it was started already (by the main thread's tick or a
        prepare's wait, whichever comes first: one probe, one throwaway daemon)."""
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, args=(gpu_uuid,), name="mps-multi-user-probe",
                                            daemon=True)
            self._thread.start()

    def wait(self, timeout: float) -> bool | None:
        """The answer, waiting up to ``timeout`` seconds for a running probe; None if it has not answered."""
        self._answered.wait(max(timeout, 0.0))
        return self.result

    def join(self, timeout: float) -> None:
        """Wait for a running probe, so its throwaway daemon is stopped before the process exits."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self, gpu_uuid: str) -> None:
        try:
            answer = self._probe(gpu_uuid)
        except Exception:
            # Single-user is the safe answer: it only makes the limitation visible, never hides one.
            log.exception("probing MPS multi-user mode failed; plan MPS daemons run single-user")
            answer = False
        with self._lock:
            self._result = answer
        self._answered.set()


class MultiUserGate:
    """Holds a prepare that would start a plan daemon single-user until the probe has answered.

    ``inventory``: the node's GPUs now; ``take``: called with a yes before the prepare plans again, so
    the daemon it starts is multi-user."""

    def __init__(self, probe: MultiUserProbe, inventory: Callable[[], NodeInventory],
                 take: Callable[[], None]) -> None:
        self._probe = probe
        self._inventory = inventory
        self._take = take

    def wait(self, claim_plan: ClaimPlan, seconds: float) -> bool:
        """True when the answer is yes and ``claim_plan`` has a plan daemon that would start single-user: plan
        again. Raises :class:`MultiUserPending` if no answer came within ``seconds`` (what is left of the
        prepare's deadline): starting single-user then would be for good."""
        capable_gpus = {g.uuid for g in self._inventory().gpus if multi_user_capable(g.cuda_compute_capability)}
        capable = [u for d in claim_plan.daemons if d.shared and not d.spec.multi_user
                   for u in d.spec.gpu_uuids if u in capable_gpus]
        if not capable:
            return False
        answer = self._probe.result
        if answer is None:
            self._probe.start(capable[0])  # none started yet: a plan change brought the first plan MPS shares
            log.info("a plan MPS daemon waits for the multi-user probe's answer before it starts",
                     extra={"gpu_uuids": capable})
            answer = self._probe.wait(seconds)
        if answer is None:
            raise MultiUserPending(f"MPS multi-user mode is still being probed after {seconds:.1f}s; the daemon "
                                   f"for the shares of {capable[0]} starts once it is known")
        if answer:
            self._take()
        return answer


class MultiUserPending(NodeBusy):
    """The probe had no answer within a prepare's deadline; the message says so."""
