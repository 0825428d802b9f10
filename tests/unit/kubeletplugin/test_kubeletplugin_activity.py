"""CallActivity: calls in flight and time since progress, driven by a fake clock."""

from __future__ import annotations

import pytest

from driver.kubeletplugin.activity import CallActivity, DraActivity


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_idle_activity_counts_from_creation() -> None:
    clock = FakeClock()
    activity = CallActivity(clock)
    clock.now += 5
    assert activity.snapshot() == DraActivity(in_flight=0, seconds_since_progress=5.0)


def test_start_and_finish_of_a_call_are_progress() -> None:
    clock = FakeClock()
    activity = CallActivity(clock)
    clock.now += 50
    with activity.track():
        clock.now += 3
        assert activity.snapshot() == DraActivity(1, 3.0)
        with activity.track():
            clock.now += 2
            assert activity.snapshot() == DraActivity(2, 2.0)
        clock.now += 7
        assert activity.snapshot() == DraActivity(1, 7.0)
    clock.now += 1
    assert activity.snapshot() == DraActivity(0, 1.0)


def test_a_failing_call_still_leaves_the_count() -> None:
    activity = CallActivity(FakeClock())
    with pytest.raises(RuntimeError), activity.track():
        raise RuntimeError("driver bug")
    assert activity.snapshot().in_flight == 0
