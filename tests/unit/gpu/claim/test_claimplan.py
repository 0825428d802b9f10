"""The claim plan: everything a prepare will do, worked out before any side effect (pure)."""

from __future__ import annotations

from typing import Any

import pytest

from driver.gpu.claim.claimplan import is_shared_daemon, plan_claim
from driver.gpu.errors import PrepareError
from driver.gpu.published.devices import make_view
from driver.gpu.published.sharelayout import GpuForm
from driver.gpu.published.targets import NodeView
from driver.simulation.discovery import SimulatedDiscovery
from tests.support.statenode import DRIVER, POOL, claim, gpu_config

INVENTORY = SimulatedDiscovery("demo", POOL).discover()
GPU0, GPU1, GPU2 = (g.uuid for g in INVENTORY.gpus)


def view(**layout: GpuForm) -> NodeView:
    return make_view(INVENTORY, {GPU0: layout["gpu0"]} if "gpu0" in layout else {})


def plan(*devices: str, configs: list[dict[str, Any]] | None = None, node: NodeView | None = None) -> Any:
    return plan_claim(claim("u1", *devices, configs=configs), driver_name=DRIVER, pool_name=POOL,
                      view=node or view())


def test_a_plain_claim_plans_no_runtime_and_locks_its_gpus() -> None:
    p = plan("gpu-2", "gpu-0")
    assert p.daemons == () and p.timeslice is None
    assert p.gpu_uuids == sorted([GPU0, GPU2])


def test_a_claim_of_another_driver_plans_nothing() -> None:
    other = claim("u1", "gpu-0")
    assert plan_claim(other, driver_name="gpu.other.example", pool_name=POOL, view=view()) is None


def test_plan_shares_use_the_gpus_shared_daemon_and_need_exclusive_process() -> None:
    shares = GpuForm(strategy="MPS", count=4, active_thread_percentage=25, memory_bytes_per_share=1 << 34)
    [daemon] = plan("gpu-0-mps-2", node=view(gpu0=shares)).daemons
    assert daemon.shared and is_shared_daemon(daemon.daemon_id) and daemon.device_names == ("gpu-0-mps-2",)
    assert daemon.spec.pinned_memory_limits == {GPU0: 1 << 34} and daemon.spec.active_thread_percentage == 25
    assert daemon.exclusive_gpus == [GPU0]


def test_a_claims_own_mps_config_makes_one_daemon_over_its_whole_gpus() -> None:
    mps = gpu_config(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 40})
    [daemon] = plan("gpu-2", "gpu-0", configs=[mps]).daemons
    assert not daemon.shared and daemon.spec.gpu_uuids == sorted([GPU0, GPU2])
    assert daemon.exclusive_gpus == sorted([GPU0, GPU2])


def test_a_mig_daemon_changes_no_compute_mode() -> None:
    mig = {"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS"}}}}
    [daemon] = plan("gpu-1-mig-3g40gb-0", configs=[mig]).daemons
    assert daemon.spec.gpu_uuids[0].startswith("MIG-") and daemon.exclusive_gpus == []


def test_a_time_slice_config_plans_the_whole_gpus_interval() -> None:
    ts = gpu_config(strategy="TimeSlicing", timeSlicingConfig={"interval": "Short"})
    p = plan("gpu-0", "gpu-2", configs=[ts])
    assert p.timeslice is not None and p.timeslice.interval == "Short"
    assert list(p.timeslice.gpu_uuids) == sorted([GPU0, GPU2]) and p.daemons == ()


def test_two_time_slice_intervals_in_one_claim_are_refused() -> None:
    short = {**gpu_config(strategy="TimeSlicing", timeSlicingConfig={"interval": "Short"}), "requests": ["r0"]}
    long = {**gpu_config(strategy="TimeSlicing", timeSlicingConfig={"interval": "Long"}), "requests": ["r1"]}
    with pytest.raises(PrepareError, match="different time-slice intervals"):
        plan("gpu-0", "gpu-2", configs=[short, long])


def test_an_invalid_mps_limit_is_refused_as_the_claims_config_error() -> None:
    mps = gpu_config(strategy="MPS", mpsConfig={"defaultPerDevicePinnedMemoryLimit": {"7": "1Gi"}})
    with pytest.raises(PrepareError, match="invalid opaque configuration"):
        plan("gpu-0", configs=[mps])


def test_plan_daemons_run_multi_user_only_when_the_node_supports_it() -> None:
    shares = GpuForm(strategy="MPS", count=2, memory_bytes_per_share=1 << 34)
    node = view(gpu0=shares)
    single = plan_claim(claim("u1", "gpu-0-mps-0"), driver_name=DRIVER, pool_name=POOL, view=node)
    multi = plan_claim(claim("u1", "gpu-0-mps-0"), driver_name=DRIVER, pool_name=POOL, view=node, multi_user=True)
    assert single is not None and multi is not None
    assert not single.daemons[0].spec.multi_user and multi.daemons[0].spec.multi_user
