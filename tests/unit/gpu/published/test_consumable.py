"""Consumable GPUs: plan form, published device, prepare with per-claim limits, capacity re-check."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from driver.gpu.discovery.inventory import NodeInventory
from driver.gpu.errors import PrepareError
from driver.gpu.published.consumable import (
    ConsumedShare,
    HeldShare,
    KernelMemoryLimits,
    check_fits,
    consumable_supported,
    thread_percentage,
)
from driver.gpu.published.devices import make_view
from driver.gpu.published.sharelayout import Enforcement, GpuForm
from driver.gpu.published.sharingplan import PlanError, SharingPlan, SharingPlans, resolve_layout
from driver.gpu.recovery import recover
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.simulation.allocator import AllocationError, allocate
from driver.simulation.apiobjects import slice_errors
from driver.simulation.capacitypolicy import strip_consumable
from driver.simulation.discovery import SimulatedDiscovery
from driver.units import GIB
from tests.support.statenode import DRIVER, POOL, StateNode, device_env, ref

INVENTORY = SimulatedDiscovery("demo", POOL).discover()
H100 = INVENTORY.gpus[0]  # 85520809984 bytes (79.6 GiB), 132 SMs


def plan(consumable: dict[str, Any] | None = None, minor: int = 0) -> SharingPlan:
    return SharingPlans.model_validate(
        {"plans": {"p": {"gpus": [{"match": {"minor": minor}, "consumable": consumable or {}}]}}}).plans["p"]


def layout(consumable: dict[str, Any] | None = None, **kw: Any) -> dict[str, GpuForm]:
    return resolve_layout(plan(consumable), INVENTORY, "p", **kw)


def shares_claim(uid: str, memory: str | None, sms: str | None, device: str = "gpu-0-shared") -> ResourceClaim:
    consumed = {k: v for k, v in (("memory", memory), ("multiprocessors", sms)) if v is not None}
    result: dict[str, Any] = {"request": "gpu", "driver": DRIVER, "pool": POOL, "device": device,
                              "shareID": f"share-{uid}"}
    if consumed:
        result["consumedCapacity"] = consumed
    return ResourceClaim.model_validate({
        "metadata": {"name": f"claim-{uid}", "namespace": "default", "uid": uid},
        "status": {"allocation": {"devices": {"results": [result], "config": []}}}})


# ----------------------------------------------------------------------------- plan and publishing


def test_the_plan_publishes_one_device_with_request_policies_and_enforcement() -> None:
    view = make_view(INVENTORY, layout())
    [device] = [d for d in view.devices if d.name == "gpu-0-shared"]
    wire = device.to_wire()
    assert wire["allowMultipleAllocations"] is True
    assert wire["capacity"]["memory"] == {"value": "81559Mi", "requestPolicy": {
        "default": "1Gi", "validRange": {"min": "1Gi", "max": "79Gi", "step": "1Gi"}}}
    assert wire["capacity"]["multiprocessors"] == {"value": "132", "requestPolicy": {
        "default": "2", "validRange": {"min": "2", "max": "132", "step": "1"}}}
    attrs = wire["attributes"]
    assert attrs["type"] == {"string": "consumable"} and attrs["sharingStrategy"] == {"string": "Consumable"}
    assert attrs["memoryLimitEnforcement"] == {"string": "mps-advisory"}
    assert attrs["computeLimitEnforcement"] == {"string": "mps-advisory"}
    assert "gpu-0" not in view.targets and view.targets["gpu-0-shared"].kind == "consumable"
    assert slice_errors({"spec": {"driver": DRIVER, "pool": {"name": POOL, "resourceSliceCount": 1},
                                  "nodeName": "n", "devices": [wire]}}, None, 36) == []


def test_kernel_enforcement_is_published_only_where_detected() -> None:
    kernel = layout(kernel=KernelMemoryLimits(True, "test"))[H100.uuid]
    assert kernel.memory_enforcement(None) == Enforcement.KERNEL
    assert layout()[H100.uuid].memory_enforcement(None) == Enforcement.MPS_ADVISORY


def test_plan_steps_and_defaults_are_checked_against_the_gpu() -> None:
    policy = layout({"memoryMin": "4Gi", "memoryDefault": "8Gi", "multiprocessorsStep": 4,
                     "multiprocessorsMin": 4, "multiprocessorsDefault": 32})[H100.uuid].consumable
    assert policy is not None
    assert (policy.memory_max_bytes, policy.multiprocessors_max, policy.multiprocessors_default) == (79 * GIB, 132, 32)
    with pytest.raises(PlanError, match=r"memoryMin must be a whole number of GiB"):
        layout({"memoryMin": "1500Mi"})
    with pytest.raises(PlanError, match=r"memoryMin must be a whole number of GiB, at least 1Gi, got 0 bytes$"):
        layout({"memoryMin": "0"})
    with pytest.raises(PlanError, match=r"multiprocessorsDefault 7 SMs is not one of 4, 8, \.\.\. 132"):
        layout({"multiprocessorsStep": 4, "multiprocessorsMin": 4, "multiprocessorsDefault": 7})
    with pytest.raises(PlanError, match=r"multiprocessorsMin 1 is less than 2"):
        layout({"multiprocessorsMin": 1})


def test_a_gpu_without_an_sm_count_cannot_be_consumable() -> None:
    gpu = H100.model_copy(update={"multiprocessors": None, "multiprocessors_missing": "libcuda not found"})
    inventory = NodeInventory.model_validate({**INVENTORY.model_dump(), "gpus": [gpu.model_dump()]})
    with pytest.raises(PlanError, match=r"SM count is unknown \(libcuda not found\)"):
        resolve_layout(plan(), inventory, "p")


def test_versions_without_consumable_capacity_fall_back_with_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    assert consumable_supported(36, False) and consumable_supported(34, True) and not consumable_supported(35, False)
    caplog.set_level(logging.WARNING)
    assert layout(consumable_supported=False) == {}  # no fallback: whole
    assert "publishing the plan's fallback" in caplog.text
    fallback = layout({"fallback": {"mps": {"shares": 4}}}, consumable_supported=False)[H100.uuid]
    assert fallback.strategy == "MPS" and fallback.count == 4


def test_consumable_and_allow_multiple_shares_do_not_mix() -> None:
    with pytest.raises(ValueError, match="allowMultipleSharesPerClaim applies only"):
        SharingPlans.model_validate({"plans": {"p": {"gpus": [
            {"match": {"all": True}, "consumable": {}, "allowMultipleSharesPerClaim": True}]}}})


def test_thread_percentage_rounds_down() -> None:
    assert thread_percentage(33, 132) == 25 and thread_percentage(2, 132) == 1 and thread_percentage(132, 132) == 100


# ----------------------------------------------------------------------------- prepare


def consumable_state(state_node: StateNode) -> Any:
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), resolve_layout(plan(), state_node.inventory, "p"))
    return state


def restarted(state_node: StateNode) -> Any:
    """The driver after a restart: recovery publishes what the checkpoint says, then the plan applies."""
    state = state_node.state()
    recover(state)
    state.apply_layout(state.view, resolve_layout(plan(), state_node.inventory, "p"))
    return state


def test_two_differently_sized_claims_get_their_own_daemons_and_limits(state_node: StateNode) -> None:
    state = consumable_state(state_node)
    [a] = state.prepare(shares_claim("a", "10Gi", "33"))
    [b] = state.prepare(shares_claim("b", "20Gi", "66"))
    assert (a.share_id, b.share_id) == ("share-a", "share-b")
    daemons = {d.spec.pinned_memory_limits[state_node.uuid(0)]: d.spec for d in state_node.mps.running.values()}
    assert daemons[10 * GIB].active_thread_percentage == 25 and daemons[20 * GIB].active_thread_percentage == 50
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in device_env(state_node.spec_json("a"))
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M" in device_env(state_node.spec_json("b"))
    assert state_node.modes.sets == [], "several MPS servers share the GPU: it stays in DEFAULT compute mode"
    recorded = {c.uid: c.devices[0] for c in state.prepared_claims()}
    assert (recorded["a"].consumed_memory_bytes, recorded["a"].consumed_multiprocessors) == (10 * GIB, 33)


def test_overcommit_is_refused_naming_the_amounts_and_unprepare_releases_exactly_one_share(
        state_node: StateNode) -> None:
    state = consumable_state(state_node)
    state.prepare(shares_claim("a", "40Gi", "66"))
    state.prepare(shares_claim("b", "30Gi", "33"))
    with pytest.raises(PrepareError, match=r"memory: 10Gi asked, 70Gi held by 2 other claim\(s\)"):
        state.prepare(shares_claim("c", "10Gi", "2"))
    with pytest.raises(PrepareError, match=r"multiprocessors: 34 asked, 99 held"):
        state.prepare(shares_claim("c", "9Gi", "34"))
    assert {c.uid for c in state.prepared_claims()} == {"a", "b"} and len(state_node.mps.running) == 2
    state.unprepare(ref("a"))
    assert len(state_node.mps.running) == 1
    state.prepare(shares_claim("c", "40Gi", "66"))  # a's share is free again, b's is still held
    with pytest.raises(PrepareError, match="would be overcommitted"):
        restarted(state_node).prepare(shares_claim("d", "10Gi", "2"))  # a restarted driver counts them too


@pytest.mark.parametrize(("memory", "sms", "message"), [
    (None, None, "records no consumedCapacity"),
    ("10Gi", None, "has no 'multiprocessors'"),
    ("1536Mi", "4", r"memory 1536Mi \(1610612736 bytes\) is not a whole number of GiB from 1Gi to 79Gi"),
    ("2Gi", "1", "multiprocessors 1 is not 2 to 132"),
])
def test_missing_or_out_of_policy_consumption_is_refused(state_node: StateNode, memory: str | None, sms: str | None,
                                                        message: str) -> None:
    state = consumable_state(state_node)
    with pytest.raises(PrepareError, match=message):
        state.prepare(shares_claim("a", memory, sms))
    assert state.prepared_claims() == [] and state_node.mps.running == {}


# ----------------------------------------------------------------------------- the doubles


def published_device() -> dict[str, Any]:
    return next(d.to_wire() for d in make_view(INVENTORY, layout()).devices if d.name == "gpu-0-shared")


def test_the_simulated_allocator_places_shares_by_capacity() -> None:
    device = published_device()
    slices = [{"spec": {"pool": {"name": POOL}, "devices": [device]}}]
    consumed: dict[str, dict[str, int]] = {}

    def claim(memory: str, sms: str) -> dict[str, Any]:
        return {"metadata": {"name": "c"}, "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
            "deviceClassName": f"consumable.{DRIVER}", "capacity": {"requests": {"memory": memory,
                                                                                 "multiprocessors": sms}}}}]}}}

    first = allocate(claim("10Gi", "33"), slices, DRIVER, set(), consumed)
    [result] = first["status"]["allocation"]["devices"]["results"]
    assert result["consumedCapacity"] == {"memory": str(10 * GIB), "multiprocessors": "33"} and result["shareID"]
    second = allocate(claim("1500Mi", "60"), slices, DRIVER, set(), consumed)  # rounded up to the 1Gi step
    assert second["status"]["allocation"]["devices"]["results"][0]["consumedCapacity"]["memory"] == str(2 * GIB)
    with pytest.raises(AllocationError, match="no free consumable device"):
        allocate(claim("1Gi", "40"), slices, DRIVER, set(), consumed)  # 93 of 132 SMs taken


def test_the_api_server_double_validates_and_drops_policies_per_version() -> None:
    device = published_device()

    def errors(d: dict[str, Any]) -> list[tuple[str, str]]:
        return slice_errors({"spec": {"driver": DRIVER, "pool": {"name": POOL, "resourceSliceCount": 1},
                                      "nodeName": "n", "devices": [d]}}, None, 36)

    bad = {**device, "capacity": {**device["capacity"], "memory": {
        "value": "80Gi", "requestPolicy": {"default": "3Gi", "validRange": {"min": "2Gi", "step": "2Gi"}}}}}
    assert errors(bad) == [("spec.devices[0].capacity[memory].requestPolicy.default",
                            "Invalid value: must be min plus a multiple of step")]
    without = {k: v for k, v in device.items() if k != "allowMultipleAllocations"}
    assert errors(without)[0][1].startswith("Forbidden: only allowed when allowMultipleAllocations")
    stripped = {**device, "capacity": {k: dict(v) for k, v in device["capacity"].items()}}
    strip_consumable(stripped)
    assert "allowMultipleAllocations" not in stripped and "requestPolicy" not in stripped["capacity"]["memory"]


def test_the_kubelet_stand_in_refuses_an_answer_without_the_allocations_share_id() -> None:
    from driver.simulation.kubelet import KubeletDevice, KubeletProtocolError, _check_share_ids

    device = KubeletDevice(("share",), POOL, "gpu-0-shared", ("k8s.gpu.tessera.dev/claim=x",), None)
    _check_share_ids("u", [device], {})  # a device without a shareID in its allocation needs none
    with pytest.raises(KubeletProtocolError, match="share_id None, but the allocation's shareID is 's1'"):
        _check_share_ids("u", [device], {"gpu-0-shared": "s1"})


def test_making_a_busy_gpu_consumable_is_deferred(state_node: StateNode) -> None:
    state = state_node.state()
    state.prepare(shares_claim("whole", None, None, device="gpu-0"))
    view, deferred = state.apply_layout(state.view, resolve_layout(plan(), state_node.inventory, "p"))
    assert deferred == {state_node.uuid(0)} and "gpu-0" in view.targets and "gpu-0-shared" not in view.targets


def test_a_gpu_held_in_another_form_refuses_a_share() -> None:
    policy = layout()[H100.uuid].consumable
    assert policy is not None
    wanted = ConsumedShare(GIB, 2, 1)
    check_fits("gpu-0-shared", wanted, [HeldShare("default/a", ConsumedShare(78 * GIB, 130, 98))], policy)
    with pytest.raises(PrepareError, match=r"prepared in another form for claim\(s\) default/whole"):
        check_fits("gpu-0-shared", wanted, [HeldShare("default/whole", None)], policy)


def test_one_claim_holding_a_consumable_gpu_twice_is_told_to_ask_once(state_node: StateNode) -> None:
    state = consumable_state(state_node)
    results = [{"request": request, "driver": DRIVER, "pool": POOL, "device": "gpu-0-shared", "shareID": request,
                "consumedCapacity": {"memory": "2Gi", "multiprocessors": "4"}} for request in ("one", "two")]
    twice = ResourceClaim.model_validate({"metadata": {"name": "twice", "namespace": "default", "uid": "t"},
                                          "status": {"allocation": {"devices": {"results": results}}}})
    with pytest.raises(PrepareError, match="holds 'gpu-0-shared' twice"):
        state.prepare(twice)
