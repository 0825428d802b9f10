"""An MPS daemon start during a prepare is bounded by what is left of the prepare's deadline."""

from __future__ import annotations

import pytest

from driver.gpu.devices import make_view
from driver.gpu.mps.model import MpsDaemonRecord, MpsDaemonSpec
from driver.kubeletplugin.types import Deadline
from tests.support.statenode import Node, claim, gpu_config, mps_shares


@pytest.mark.parametrize("shared", [True, False], ids=["plan-share", "per-claim"])
def test_the_daemon_start_gets_the_rest_of_the_deadline(node: Node, monkeypatch: pytest.MonkeyPatch,
                                                         shared: bool) -> None:
    timeouts: list[float | None] = []
    real_start = node.mps.start

    def start(spec: MpsDaemonSpec, timeout: float | None = None) -> MpsDaemonRecord:
        timeouts.append(timeout)
        return real_start(spec, timeout)

    monkeypatch.setattr(node.mps, "start", start)
    state = node.state()
    if shared:
        state.apply_layout(make_view(node.inventory, {}), {node.uuid(0): mps_shares(2)})
        wanted = claim("6f0c2d1e-8a4b-4c3d-9e2f-1a0b3c4d5e6f", "gpu-0-mps-0")
    else:
        wanted = claim("6f0c2d1e-8a4b-4c3d-9e2f-1a0b3c4d5e70", "gpu-0", configs=[gpu_config(strategy="MPS")])
    state.prepare(wanted, Deadline.after(7.0))
    [timeout] = timeouts
    assert timeout is not None and 0 < timeout <= 7.0, "a start may not outlast the prepare's deadline"
