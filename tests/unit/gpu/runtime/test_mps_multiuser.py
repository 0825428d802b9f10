"""Which GPU the multi-user probe uses, which plan shares stay single-user, and the probe's one run."""

from __future__ import annotations

import threading

import pytest

from driver.gpu.claim.claimplan import ClaimPlan, PlannedDaemon
from driver.gpu.discovery.inventory import GpuInfo, NodeInventory
from driver.gpu.mps.model import MpsDaemonSpec
from driver.gpu.published.sharelayout import GpuForm
from driver.gpu.runtime.multiuser import (
    MultiUserGate,
    MultiUserPending,
    MultiUserProbe,
    plan_mps_gpus,
    probe_gpu,
    single_user_gpus,
)
from driver.units import GIB
from tests.support.node import wait_until


def _gpu(minor: int, capability: str | None) -> GpuInfo:
    return GpuInfo(minor=minor, index=minor, uuid=f"GPU-{minor:08d}-0000-0000-0000-000000000000",
                   product_name="simulated", memory_bytes=16 * GIB, cuda_compute_capability=capability)


NODE = NodeInventory(gpus=(_gpu(2, "8.9"), _gpu(0, "6.0"), _gpu(1, "9.0"), _gpu(3, "9.0")))
U0, U1, U2, U3 = (NODE.gpu_by_minor(m).uuid for m in range(4))  # type: ignore[union-attr]
MPS = GpuForm(strategy="MPS", count=2, memory_bytes_per_share=8 * GIB)
TS = GpuForm(strategy="TimeSlicing", count=2, memory_bytes_per_share=8 * GIB)


def test_only_plan_mps_gpus_matter_and_the_probe_uses_the_first_that_could_be_multi_user() -> None:
    layout = {U0: MPS, U2: MPS, U1: TS, U3: MPS}
    assert plan_mps_gpus(NODE, layout) == [U0, U2, U3]
    assert probe_gpu(NODE, layout) == U2, "minor 0 is Pascal (6.0): no multi-user mode to probe there"
    assert probe_gpu(NODE, {U0: MPS, U1: TS}) is None
    assert probe_gpu(NODE, {}) is None


def test_single_user_gpus_name_every_plan_mps_gpu_that_cannot_serve_several_uids() -> None:
    layout = {U0: MPS, U2: MPS, U1: TS}
    assert single_user_gpus(NODE, layout, multi_user=False) == [U0, U2]
    assert single_user_gpus(NODE, layout, multi_user=True) == [U0]
    assert single_user_gpus(NODE, {U1: TS}, multi_user=False) == []


def test_the_probe_runs_once_in_the_background_and_keeps_its_answer() -> None:
    release, calls = threading.Event(), []

    def probe(uuid: str) -> bool:
        calls.append(uuid)
        release.wait(10)
        return True

    runner = MultiUserProbe(probe)
    assert not runner.started and runner.result is None
    runner.start(U2)
    runner.start(U3)
    assert runner.started and runner.result is None, "start returns before the probe answers"
    release.set()
    runner.join(10)
    assert runner.result is True and calls == [U2]


def test_a_probe_that_raises_counts_as_single_user() -> None:
    def probe(uuid: str) -> bool:
        raise RuntimeError("MPS host socket not there yet")

    runner = MultiUserProbe(probe)
    runner.start(U2)
    runner.join(10)
    assert runner.result is False


def _plan(*daemons: tuple[str, bool, bool]) -> ClaimPlan:
    """A plan with daemons of (GPU, shared, multi_user)."""
    return ClaimPlan(uid="u", namespace="ns", name="c", results=(), targets=(), timeslice=None, daemons=tuple(
        PlannedDaemon(MpsDaemonSpec(daemon_id=f"d{i}", gpu_uuids=[gpu], multi_user=multi), shared=shared,
                      device_names=()) for i, (gpu, shared, multi) in enumerate(daemons)))


def test_a_prepare_that_would_start_a_plan_daemon_single_user_waits_for_the_answer_and_plans_again() -> None:
    release, taken = threading.Event(), []

    def probe(uuid: str) -> bool:
        return release.wait(10)

    runner = MultiUserProbe(probe)
    gate = MultiUserGate(runner, lambda: NODE, lambda: taken.append(True))
    waiting = threading.Thread(target=lambda: taken.append(gate.wait(_plan((U2, True, False)), 30)))
    waiting.start()
    wait_until(lambda: runner.started, what="the gate to start the probe that was not started yet")
    assert runner.result is None and taken == [], "no answer yet: the prepare waits"
    release.set()
    waiting.join(10)
    assert taken == [True, True], "the answer was taken, then the prepare plans again"


def test_without_an_answer_in_time_the_prepare_fails_instead_of_starting_single_user_for_good() -> None:
    release = threading.Event()
    runner = MultiUserProbe(lambda uuid: release.wait(10))
    with pytest.raises(MultiUserPending, match="still being probed"):
        MultiUserGate(runner, lambda: NODE, lambda: None).wait(_plan((U3, True, False)), 0.01)
    release.set()
    runner.join(10)


def test_claims_that_start_no_single_user_plan_daemon_on_a_capable_gpu_never_wait() -> None:
    runner = MultiUserProbe(lambda uuid: pytest.fail("no probe needed"))
    gate = MultiUserGate(runner, lambda: NODE, lambda: pytest.fail("nothing to take"))
    assert gate.wait(_plan(), 0) is False
    assert gate.wait(_plan((U0, True, False)), 0) is False, "Pascal: never multi-user"
    assert gate.wait(_plan((U2, False, False)), 0) is False, "a claim's own daemon"
    assert gate.wait(_plan((U2, True, True)), 0) is False, "already multi-user"
    assert not runner.started
