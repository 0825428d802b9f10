"""Which GPU the multi-user probe uses, which plan shares stay single-user, and the probe's one run."""

from __future__ import annotations

import threading

from driver.gpu.discovery.inventory import GpuInfo, NodeInventory
from driver.gpu.mps.multiuser import MultiUserProbe, plan_mps_gpus, probe_gpu, single_user_gpus
from driver.gpu.sharelayout import GpuShares
from driver.units import GIB


def _gpu(minor: int, capability: str | None) -> GpuInfo:
    return GpuInfo(minor=minor, index=minor, uuid=f"GPU-{minor:08d}-0000-0000-0000-000000000000",
                   product_name="simulated", memory_bytes=16 * GIB, cuda_compute_capability=capability)


NODE = NodeInventory(gpus=(_gpu(2, "8.9"), _gpu(0, "6.0"), _gpu(1, "9.0"), _gpu(3, "9.0")))
U0, U1, U2, U3 = (NODE.gpu_by_minor(m).uuid for m in range(4))  # type: ignore[union-attr]
MPS = GpuShares(strategy="MPS", count=2, memory_bytes_per_share=8 * GIB)
TS = GpuShares(strategy="TimeSlicing", count=2, memory_bytes_per_share=8 * GIB)


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
