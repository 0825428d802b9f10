"""An MPS daemon start during a prepare is bounded by what is left of the prepare's deadline."""

from __future__ import annotations

from typing import Any

import pytest

from driver.gpu.errors import PrepareError
from driver.gpu.mps.model import MpsDaemonRecord, MpsDaemonSpec
from driver.gpu.published.devices import make_view
from driver.gpu.state import ROLLBACK_BUDGET_S
from driver.kubeletplugin.types import Deadline
from tests.support.statenode import StateNode, claim, gpu_config, mps_shares


def _timeout_given_to(
        state_node: StateNode, monkeypatch: pytest.MonkeyPatch, method: str, shared: bool) -> float | None:
    """Prepare a plan share (``shared``) or a per-claim MPS claim under a 7 s deadline; the seconds left
    of the deadline ``node.mps.<method>`` was called with, when it was called."""
    timeouts: list[float | None] = []
    real = getattr(state_node.mps, method)

    def recording(first: Any, deadline: Deadline | None = None) -> Any:
        timeouts.append(None if deadline is None else deadline.remaining())
        return real(first, deadline)

    monkeypatch.setattr(state_node.mps, method, recording)
    state = state_node.state()
    if shared:
        state.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(0): mps_shares(2)})
        wanted = claim("6f0c2d1e-8a4b-4c3d-9e2f-1a0b3c4d5e6f", "gpu-0-mps-0")
    else:
        wanted = claim("6f0c2d1e-8a4b-4c3d-9e2f-1a0b3c4d5e70", "gpu-0", configs=[gpu_config(strategy="MPS")])
    state.prepare(wanted, Deadline.after(7.0))
    [timeout] = timeouts
    return timeout


@pytest.mark.parametrize("shared", [True, False], ids=["plan-share", "per-claim"])
def test_the_daemon_start_gets_the_rest_of_the_deadline(state_node: StateNode, monkeypatch: pytest.MonkeyPatch,
                                                         shared: bool) -> None:
    timeout = _timeout_given_to(state_node, monkeypatch, "start", shared)
    assert timeout is not None and 0 < timeout <= 7.0, "a start may not outlast the prepare's deadline"


@pytest.mark.parametrize("shared", [True, False], ids=["plan-share", "per-claim"])
def test_the_stop_before_a_start_gets_the_rest_of_the_deadline(state_node: StateNode, monkeypatch: pytest.MonkeyPatch,
                                                                shared: bool) -> None:
    # A daemon left by a crash is stopped before the start: a stop that does not end (processes that
    # ignore SIGTERM) may not outlast the prepare either.
    timeout = _timeout_given_to(state_node, monkeypatch, "stop_by_id", shared)
    assert timeout is not None and 0 < timeout <= 7.0


def test_a_prepare_that_runs_out_is_rolled_back_within_a_budget_of_its_own(state_node: StateNode,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[str] = []
    stop_timeouts: list[float | None] = []
    real_start, real_stop = state_node.mps.start, state_node.mps.stop

    def start(spec: MpsDaemonSpec, deadline: Deadline | None = None) -> MpsDaemonRecord:
        started.append(spec.daemon_id)
        return real_start(spec, deadline)

    def stop(record: MpsDaemonRecord, deadline: Deadline | None = None) -> None:
        stop_timeouts.append(None if deadline is None else deadline.remaining())
        real_stop(record, deadline)

    monkeypatch.setattr(state_node.mps, "start", start)
    monkeypatch.setattr(state_node.mps, "stop", stop)
    uid = "6f0c2d1e-8a4b-4c3d-9e2f-1a0b3c4d5e71"
    # The kubelet gives up once the daemon runs: the rollback comes after the prepare's deadline.
    deadline = Deadline.after(7.0, is_active=lambda: not started)
    with pytest.raises(PrepareError, match="rolled back"):
        state_node.state().prepare(claim(uid, "gpu-0", configs=[gpu_config(strategy="MPS")]), deadline)
    [timeout] = stop_timeouts
    assert timeout is not None and 0 < timeout <= ROLLBACK_BUDGET_S, "bounded, and not the prepare's spent time"
    assert uid not in state_node.store.load().claims, "nothing left PrepareStarted"
    assert state_node.mps.running == {}
