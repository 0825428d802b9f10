"""StartGate: DRA calls that arrive before the driver is ready wait for it, bounded by their deadline; and the
health stream waits for the first device list (the kubelet takes every message as the complete list)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from driver.kubeletplugin.activity import CallActivity
from driver.kubeletplugin.calls import ClaimRef, PrepareResult
from driver.kubeletplugin.healthservice import DeviceHealthStatus, Health, HealthBoard
from driver.kubeletplugin.startgate import ANSWER_MARGIN_S, StartGate
from tests.support.kubeletplugin import eventually

REF = ClaimRef(namespace="ns", name="c", uid="0c7d3a4e-5b1f-4c2a-9e8d-7f6a5b4c3d2e")


class Calls:
    """The driver's calls: every claim prepared, and what each call was given."""

    def __init__(self) -> None:
        self.remaining: list[float | None] = []

    def prepare(self, refs: Sequence[ClaimRef], is_active: Callable[[], bool],
                time_remaining: float | None = None) -> Mapping[str, PrepareResult]:
        self.remaining.append(time_remaining)
        return {ref.uid: PrepareResult() for ref in refs}

    def unprepare(self, refs: Sequence[ClaimRef], is_active: Callable[[], bool],
                  time_remaining: float | None = None) -> Mapping[str, str | None]:
        return {ref.uid: None for ref in refs}


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    results: list[Any] = []
    thread = threading.Thread(target=lambda: results.append(call()))
    thread.start()
    return thread, results


def test_a_call_before_the_driver_is_ready_waits_and_then_goes_to_it() -> None:
    activity = CallActivity()
    gate, calls = StartGate(activity), Calls()
    thread, results = in_thread(lambda: gate.prepare([REF], lambda: True, 40.0))
    assert eventually(lambda: activity.snapshot().in_flight == 1), "the waiting call counts as in flight"
    assert results == [] and not gate.ready
    gate.open(calls)
    thread.join(10)
    assert results == [{REF.uid: PrepareResult()}]
    assert activity.snapshot().in_flight == 0
    [remaining] = calls.remaining
    assert remaining is not None and remaining <= 40.0, "the driver gets what is left of the kubelet's deadline"


def test_the_wait_ends_with_the_calls_deadline() -> None:
    gate = StartGate(CallActivity())
    # No time left beyond the margin to answer: the claim is refused at once with a reason to retry.
    [result] = gate.prepare([REF], lambda: True, ANSWER_MARGIN_S).values()
    assert result.error is not None and "still starting" in result.error and "will retry" in result.error
    assert gate.unprepare([REF], lambda: True, ANSWER_MARGIN_S)[REF.uid] == result.error


def test_a_cancelled_call_stops_waiting() -> None:
    gate = StartGate(CallActivity())
    [result] = gate.prepare([REF], lambda: False, 40.0).values()
    assert result.error is not None and "still starting" in result.error


def test_a_failed_start_answers_waiting_and_later_calls_with_its_reason() -> None:
    gate = StartGate(CallActivity())
    thread, results = in_thread(lambda: gate.prepare([REF], lambda: True, 40.0))
    gate.fail("GPU discovery failed: no NVML")
    thread.join(10)
    [[result]] = [list(r.values()) for r in results]
    assert result.error == ("the DRA driver failed to start (GPU discovery failed: no NVML); it is restarting, "
                            "the kubelet will retry")
    assert gate.unprepare([REF], lambda: True, 40.0)[REF.uid] == result.error


def test_a_request_without_claims_never_waits() -> None:
    # The liveness probe sends empty requests; they must not queue behind the initialisation.
    gate = StartGate(CallActivity())
    assert gate.prepare([], lambda: True, 40.0) == {}
    assert gate.unprepare([], lambda: True, None) == {}


def test_the_health_stream_waits_for_the_first_device_list() -> None:
    board = HealthBoard()
    received: list[tuple[DeviceHealthStatus, ...]] = []
    stop = threading.Event()

    def watch() -> None:
        for devices in board.stream(lambda: not stop.is_set()):
            received.append(devices)
            stop.set()

    thread = threading.Thread(target=watch)
    thread.start()
    assert eventually(lambda: board.open_streams == 1)
    assert received == [], "no list before the driver has one: an empty message would mean 'no devices'"
    board.update([])  # the first list may be empty: it is sent all the same
    thread.join(10)
    assert received == [()]
    healthy = DeviceHealthStatus("node-1", "gpu-0", Health.HEALTHY)
    board.update([healthy])
    assert next(iter(board.stream())) == (healthy,), "a stream opened later gets the list at once"
