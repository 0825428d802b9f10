"""Consumable GPUs against hostile input: allocations the scheduler would never write, and a tenant
that retunes its own daemon where the read-back cannot see it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import cast

import pytest

from driver.gpu.errors import PrepareError
from driver.gpu.mps.control import MpsControl
from driver.gpu.mps.limits import check_and_restore_limits
from driver.gpu.mps.model import MpsDaemonRecord, MpsDaemonSpec
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.types import Deadline
from driver.units import GIB
from tests.support.statenode import DRIVER, POOL, StateNode
from tests.unit.gpu.published.test_consumable import consumable_state

GPU = "GPU-192ee73f-f0c4-5207-b5c2-78bdcf4fae4d"


def consumed_claim(uid: str, consumed: dict[str, str]) -> ResourceClaim:
    return ResourceClaim.model_validate({
        "metadata": {"name": f"claim-{uid}", "namespace": "default", "uid": uid},
        "status": {"allocation": {"devices": {"config": [], "results": [{
            "request": "gpu", "driver": DRIVER, "pool": POOL, "device": "gpu-0-shared", "shareID": f"share-{uid}",
            "consumedCapacity": consumed}]}}}})


@pytest.mark.parametrize(("consumed", "field"), [
    # 2.5 SMs were limited as 2 (and 131.99 as 131): floor of an amount no integer grid allows.
    ({"memory": "10Gi", "multiprocessors": "2.5"}, "multiprocessors"),
    ({"memory": "10Gi", "multiprocessors": "131.99"}, "multiprocessors"),
    ({"memory": "10Gi", "multiprocessors": "33500m"}, "multiprocessors"),
    ({"memory": "10737418240.9", "multiprocessors": "33"}, "memory"),
])
def test_a_fractional_consumed_amount_is_refused_not_rounded(state_node: StateNode, consumed: dict[str, str],
                                                              field: str) -> None:
    state = consumable_state(state_node)
    with pytest.raises(PrepareError, match=rf"consumedCapacity\.{field}: .* is not a whole number"):
        state.prepare(consumed_claim("a", consumed))
    assert state.prepared_claims() == [] and state_node.mps.running == {}


def test_one_capacity_named_with_and_without_the_driver_domain_is_refused(state_node: StateNode) -> None:
    # Which amount the scheduler counted is unknowable; the driver took the last one (1Gi) as the limit.
    state = consumable_state(state_node)
    with pytest.raises(PrepareError, match="consumedCapacity names 'memory' twice"):
        state.prepare(consumed_claim("a", {"memory": "10Gi", "multiprocessors": "33",
                                           f"{DRIVER}/memory": "1Gi"}))
    assert state.prepared_claims() == [] and state_node.mps.running == {}
    # One form alone, qualified or not, is the normal case.
    state.prepare(consumed_claim("b", {f"{DRIVER}/memory": "10Gi", "multiprocessors": "33"}))
    [daemon] = state_node.mps.running.values()
    assert daemon.spec.pinned_memory_limits == {state_node.uuid(0): 10 * GIB}


class DisplayingDaemon:
    """The control side of a daemon with NVIDIA's display rule: a pinned limit of 1 GiB or more reads back
    in whole G, rounded down (measured, docs/sharing.md)."""

    def __init__(self) -> None:
        self.pinned_mib: dict[str, int] = {}
        self.percentage = 100.0

    def send(self, pipe_dir: Path, log_dir: Path, command: str, deadline: Deadline | None = None) -> str:
        return "\n".join(self._one(line.split()) for line in command.splitlines())

    def set_all(self, pipe_dir: Path, log_dir: Path, commands: Sequence[str], deadline: Deadline) -> None:
        self.send(pipe_dir, log_dir, "\n".join(commands), deadline)

    def _one(self, words: list[str]) -> str:
        match words:
            case ["set_default_device_pinned_mem_limit", dev, value]:
                self.pinned_mib[dev] = int(value.removesuffix("M"))
            case ["get_default_device_pinned_mem_limit", dev]:
                mib = self.pinned_mib[dev]
                return f"{mib // 1024}G" if mib >= 1024 else f"{mib}M"
            case ["set_default_active_thread_percentage", value]:
                self.percentage = float(value)
            case ["get_default_active_thread_percentage"]:
                return f"{self.percentage:.1f}"
        return ""


def test_a_pinned_limit_raised_within_its_displayed_gib_is_set_back(tmp_path: Path) -> None:
    # A client that reaches its share daemon's control socket (root in the container; any UID with R535)
    # raises 10240M to 11263M: it still reads "10G", so the watcher found no drift and left it raised.
    spec = MpsDaemonSpec(daemon_id="share-0123456789ab", gpu_uuids=[GPU], active_thread_percentage=25,
                         pinned_memory_limits={GPU: 10 * GIB})
    record = MpsDaemonRecord(spec=spec, pid=1, pipe_dir=tmp_path / "pipe", log_dir=tmp_path / "log",
                             started_at="2025-01-01T00:00:00+00:00", process_start_time=0)
    (tmp_path / "log").mkdir()
    daemon = DisplayingDaemon()
    control = cast(MpsControl, daemon)
    deadline = Deadline.after(5.0, purpose="test")
    daemon.send(record.pipe_dir, record.log_dir, "set_default_device_pinned_mem_limit 0 10240M\n"
                                                 "set_default_active_thread_percentage 25")
    daemon.send(record.pipe_dir, record.log_dir, "set_default_device_pinned_mem_limit 0 11263M")  # the tenant
    assert check_and_restore_limits(control, record, deadline) == []  # nothing it can see changed: none reported
    assert daemon.pinned_mib == {"0": 10240}, "the raised limit must not stay"
    # A change the read-back shows is still found, reported and restored once.
    daemon.send(record.pipe_dir, record.log_dir, "set_default_device_pinned_mem_limit 0 20480M")
    drift = check_and_restore_limits(control, record, deadline)
    assert [(d.limit, d.found) for d in drift] == [("pinned_mem_limit/0", "20G")]
    assert daemon.pinned_mib == {"0": 10240}
