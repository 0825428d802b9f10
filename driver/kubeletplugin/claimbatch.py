"""Preparing and unpreparing the claims of one kubelet request, every claim answered on its own.

The kubelet fails a whole pod setup when the RPC itself fails, so every claim of a request is
answered individually: fetch errors, driver errors and driver exceptions all become that claim's
``error``. Every prepare request gets one :class:`Deadline`: the kubelet's gRPC deadline less a margin
to answer, capped by ``prepare_deadline`` (30 s), and tied to the call's liveness, so the driver stops
and rolls back work the kubelet gave up on. A claim whose UID is not a Kubernetes UID is refused
(prepare and unprepare) before anything else sees it: UIDs name checkpoint entries, CDI spec files and
MPS daemon directories. Each claim gets its own span, metric and log line (per-claim telemetry).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from opentelemetry.trace import Span, Status, StatusCode, get_current_span

from driver.kubeletplugin.activity import CallActivity
from driver.kubeletplugin.claimfetch import ClaimError, ClaimSource, claim_uid_problem
from driver.kubeletplugin.telemetry import Telemetry
from driver.kubeletplugin.types import DEFAULT_PREPARE_DEADLINE, ClaimRef, Deadline, DRADriver, PrepareResult

log = logging.getLogger(__name__)

# Claims of one request are independent (DRADriver allows concurrent calls); a pod rarely has
# more than a handful, so a small per-request pool is enough.
MAX_PARALLEL_CLAIMS = 8

# A kubelet deadline shorter than our own (DEFAULT_PREPARE_DEADLINE) wins, less this margin to reply.
ANSWER_MARGIN = 1.0

KUBELET_GAVE_UP = "the kubelet cancelled the call or its deadline passed before this claim was started; it will retry"

_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


class ClaimBatch:
    """Prepares or unprepares the claims of one kubelet request, answering every claim.

    Every request counts in :attr:`activity` while it runs, so a liveness probe can see the
    server is busy rather than wedged.
    """

    def __init__(self, driver: DRADriver, claims: ClaimSource, telemetry: Telemetry,
                 max_parallel: int = MAX_PARALLEL_CLAIMS, activity: CallActivity | None = None,
                 prepare_deadline: float = DEFAULT_PREPARE_DEADLINE,
                 changed: Callable[[ClaimRef], None] | None = None):
        """``changed``: told of each claim prepared or unprepared (it must not block: the call waits for it)."""
        if prepare_deadline <= 0:
            raise ValueError(f"prepare_deadline must be positive seconds, got {prepare_deadline!r}")
        self._prepare_deadline = prepare_deadline
        self._driver = driver
        self._claims = claims
        self._telemetry = telemetry
        self._max_parallel = max_parallel
        self._activity = activity if activity is not None else CallActivity()
        self._changed = changed

    @property
    def activity(self) -> CallActivity:
        return self._activity

    def deadline(self, is_active: Callable[[], bool], time_remaining: float | None) -> Deadline:
        """The deadline of one request: ours, or the caller's (less a margin to answer) if sooner."""
        seconds = self._prepare_deadline
        if time_remaining is not None:
            seconds = min(seconds, time_remaining - ANSWER_MARGIN)
        return Deadline.after(seconds, is_active)

    def prepare(self, refs: Sequence[ClaimRef], is_active: Callable[[], bool],
                time_remaining: float | None = None) -> dict[str, PrepareResult]:
        """Result per claim UID; a failed claim has ``error`` set and no devices.

        ``time_remaining`` is the caller's deadline in seconds (gRPC ``context.time_remaining()``),
        None without one. All claims of the request share one :class:`Deadline`.
        """
        deadline = self.deadline(is_active, time_remaining)
        with self._activity.track():
            results = _map(lambda ref: self._prepare_one(ref, deadline), _unique(refs), self._max_parallel)
        return {ref.uid: result for ref, result in results}

    def unprepare(self, refs: Sequence[ClaimRef], is_active: Callable[[], bool],
                  time_remaining: float | None = None) -> dict[str, str | None]:
        """Error per claim UID, None for success (claims the driver never prepared included).

        Unprepare reads only local state and has no deadline of its own: ``time_remaining`` is accepted
        for :class:`driver.kubeletplugin.service.ClaimCalls` and not used; ``is_active`` stops claims
        not yet started once the kubelet gave up."""
        with self._activity.track():
            results = _map(lambda ref: self._unprepare_one(ref, is_active), _unique(refs), self._max_parallel)
        return {ref.uid: error for ref, error in results}

    def _prepare_one(self, ref: ClaimRef, deadline: Deadline) -> tuple[ClaimRef, PrepareResult]:
        start = time.monotonic()
        with self._telemetry.tracer.start_as_current_span(f"{self._telemetry.scope}.prepare_claim") as span:
            _describe_claim(span, ref)
            result = self._run_prepare(ref, deadline)
            if result.error:
                result = PrepareResult(error=bounded_error(result.error))
                span.set_status(Status(StatusCode.ERROR, result.error))
            else:
                span.set_attribute("dra.claim.devices", len(result.devices))
        seconds = time.monotonic() - start
        if not result.error and self._changed is not None:
            self._changed(ref)
        self._telemetry.prepare_total.add(1, {"result": "error" if result.error else "success"})
        self._telemetry.prepare_duration.record(seconds)
        _log_outcome("prepare", ref, seconds, result.error, devices=len(result.devices))
        return ref, result

    def _run_prepare(self, ref: ClaimRef, deadline: Deadline) -> PrepareResult:
        # Before the claim source and the driver: both may build paths or names from the UID, and
        # a ClaimSource other than the API fetcher need not check it.
        problem = _uid_problem(ref, "prepare")
        if problem is not None:
            return PrepareResult(error=problem)
        if deadline.expired():
            return PrepareResult(error=KUBELET_GAVE_UP)
        try:
            claim = self._claims.fetch(ref)
        except ClaimError as err:
            return PrepareResult(error=str(err))
        except Exception as err:
            return PrepareResult(error=_unexpected("reading the claim", ref, err))
        try:
            return self._driver.prepare_claim(claim, deadline)
        except Exception as err:
            return PrepareResult(error=_unexpected("preparing the claim", ref, err))

    def _unprepare_one(self, ref: ClaimRef, is_active: Callable[[], bool]) -> tuple[ClaimRef, str | None]:
        start = time.monotonic()
        with self._telemetry.tracer.start_as_current_span(f"{self._telemetry.scope}.unprepare_claim") as span:
            _describe_claim(span, ref)
            error = self._run_unprepare(ref, is_active)
            if error:
                error = bounded_error(error)
                span.set_status(Status(StatusCode.ERROR, error))
        seconds = time.monotonic() - start
        if not error and self._changed is not None:
            self._changed(ref)
        self._telemetry.unprepare_total.add(1, {"result": "error" if error else "success"})
        self._telemetry.unprepare_duration.record(seconds)
        _log_outcome("unprepare", ref, seconds, error)
        return ref, error

    def _run_unprepare(self, ref: ClaimRef, is_active: Callable[[], bool]) -> str | None:
        problem = _uid_problem(ref, "unprepare")
        if problem is not None:
            return problem
        if not is_active():
            return KUBELET_GAVE_UP
        try:
            return self._driver.unprepare_claim(ref) or None
        except Exception as err:
            return _unexpected("unpreparing the claim", ref, err)


def _unique(refs: Sequence[ClaimRef]) -> list[ClaimRef]:
    """One entry per UID: the response is keyed by UID, so a repeated claim is handled once."""
    by_uid: dict[str, ClaimRef] = {}
    for ref in refs:
        by_uid.setdefault(ref.uid, ref)
    return list(by_uid.values())


def _map(fn: Callable[[_Item], _Result], items: list[_Item], max_parallel: int) -> list[_Result]:
    if len(items) <= 1 or max_parallel <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(len(items), max_parallel), thread_name_prefix="claim") as pool:
        return list(pool.map(fn, items))


def _uid_problem(ref: ClaimRef, action: str) -> str | None:
    problem = claim_uid_problem(ref.uid)
    if problem is None:
        return None
    return f"ResourceClaim {ref.namespace}/{ref.name}: {problem}; refusing to {action} it"


def _describe_claim(span: Span, ref: ClaimRef) -> None:
    span.set_attribute("dra.claim.uid", ref.uid)
    span.set_attribute("dra.claim.namespace", ref.namespace)
    span.set_attribute("dra.claim.name", ref.name)


# Every claim of a request is answered in one gRPC message, which the kubelet's client takes up to 4 MiB (grpc-go's
# default): one claim's error, long because of what a tenant wrote into it, must not cost the others their answer.
# Paths a tenant reaches are bounded where their text is made; this is the last line.
MAX_ERROR_CHARS = 8192


def bounded_error(error: str) -> str:
    """``error``, cut to :data:`MAX_ERROR_CHARS` characters with a note of how much was left out."""
    if len(error) <= MAX_ERROR_CHARS:
        return error
    return f"{error[:MAX_ERROR_CHARS]} ... ({len(error) - MAX_ERROR_CHARS} more characters not shown)"


def _unexpected(action: str, ref: ClaimRef, err: Exception) -> str:
    get_current_span().record_exception(err)
    log.error("unexpected error while %s", action, exc_info=err,
              extra={"claim_uid": ref.uid, "claim_namespace": ref.namespace, "claim_name": ref.name})
    return (f"internal error in the DRA driver while {action} ({type(err).__name__}: {err}); "
            "the kubelet will retry, see the driver pod's log for details")


def _log_outcome(action: str, ref: ClaimRef, seconds: float, error: str | None, **fields: object) -> None:
    extra: dict[str, object] = {"claim_uid": ref.uid, "claim_namespace": ref.namespace, "claim_name": ref.name,
                                "duration_ms": round(seconds * 1000, 3), **fields}
    if error:
        log.warning("%s failed", action, extra={**extra, "error": error})
    else:
        log.info("%s succeeded", action, extra=extra)
