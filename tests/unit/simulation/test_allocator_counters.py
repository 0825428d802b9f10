"""The simulated allocator (SIMULATION) places counter-consuming devices only where their counters are
still free: dynamic MIG placements of an H100 published as the driver publishes them."""

from __future__ import annotations

from typing import Any

import pytest

from driver.gpu.published.devices import make_view
from driver.gpu.published.sharelayout import DynamicMigPolicy, GpuForm
from driver.kubeletplugin.slicelimits import limits_for
from driver.kubeletplugin.sliceplanner import plan_slices, slice_writes
from driver.simulation.allocator import AllocationError, allocate
from tests.support.mig import H100_MEMORY, h100, instance, inventory_of

DRIVER = "gpu.tessera.dev"
NODE = "node-1"
ALL_H100 = ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")  # table order
Obj = dict[str, Any]


@pytest.fixture(params=[34, 36], ids=["combined-1.34", "split-1.36"])
def slices(request: pytest.FixtureRequest) -> list[Obj]:
    gpus = (h100(0), h100(1))
    shares = GpuForm(strategy="DynamicMig", count=1, memory_bytes_per_share=H100_MEMORY,
                       dynamic_mig=DynamicMigPolicy(profiles=ALL_H100))
    view = make_view(inventory_of(*gpus), {g.uuid: shares for g in gpus})
    planned = plan_slices(list(view.devices), DRIVER, limits_for(request.param), list(view.counter_sets))
    creates = slice_writes([], planned, driver_name=DRIVER, node_name=NODE, owner=None, adopted={}).creates
    return [{"spec": c["spec"]} for c in creates]


def request(profile: str | None, name: str = "r") -> Obj:
    """A request for one MIG device of ``profile`` on GPU 0 (None: the whole GPU 0)."""
    if profile is None:
        exactly: Obj = {"deviceClassName": DRIVER, "selectors": [
            {"cel": {"expression": f"device.attributes['{DRIVER}'].uuid == 'GPU-h100-0'"}}]}
    else:
        exactly = {"deviceClassName": f"mig.{DRIVER}", "selectors": [{"cel": {"expression": (
            f"device.attributes['{DRIVER}'].profile == '{profile}' && "
            f"device.attributes['{DRIVER}'].parentUUID == 'GPU-h100-0'")}}]}
    return {"name": name, "exactly": exactly}


def claim(*requests: Obj) -> Obj:
    return {"metadata": {"name": "c", "namespace": "default", "uid": "u"},
            "spec": {"devices": {"requests": list(requests)}}}


def place(slices: list[Obj], taken: set[str], *profiles: str | None) -> list[str]:
    allocated = allocate(claim(*(request(p, f"r{i}") for i, p in enumerate(profiles))), slices, DRIVER, taken)
    return [r["device"] for r in allocated["status"]["allocation"]["devices"]["results"]]


def test_seven_1g10gb_fit_on_an_h100_an_eighth_does_not(slices: list[Obj]) -> None:
    taken: set[str] = set()
    placed = [place(slices, taken, "1g.10gb")[0] for _ in range(7)]
    assert placed == [f"gpu-0-dynmig-1g10gb-{s}" for s in range(7)]
    for profile in ("1g.10gb", "1g.10gb+me", "1g.20gb", None):
        with pytest.raises(AllocationError, match="no free"):
            place(slices, taken, profile)


def test_4g40gb_and_3g40gb_fit_together(slices: list[Obj]) -> None:
    taken: set[str] = set()
    assert place(slices, taken, "4g.40gb", "3g.40gb") == ["gpu-0-dynmig-4g40gb-0", "gpu-0-dynmig-3g40gb-4"]
    with pytest.raises(AllocationError):
        place(slices, taken, "1g.10gb")


def test_4g40gb_twice_does_not_fit(slices: list[Obj]) -> None:
    taken: set[str] = set()
    place(slices, taken, "4g.40gb")
    with pytest.raises(AllocationError, match="no free mig device"):
        place(slices, taken, "4g.40gb")


def test_a_3g40gb_first_leaves_no_room_for_a_4g40gb_by_counters(slices: list[Obj]) -> None:
    # 4g.40gb has the one placement 0, which the first 3g.40gb takes slices 0-3 of: only counters tell.
    taken: set[str] = set()
    assert place(slices, taken, "3g.40gb") == ["gpu-0-dynmig-3g40gb-0"]
    assert "gpu-0-dynmig-4g40gb-0" not in taken
    with pytest.raises(AllocationError):
        place(slices, taken, "4g.40gb")
    assert place(slices, taken, "3g.40gb") == ["gpu-0-dynmig-3g40gb-4"]


def test_the_whole_gpu_and_any_placement_never_both(slices: list[Obj]) -> None:
    taken: set[str] = set()
    assert place(slices, taken, None) == ["gpu-0"]
    for profile in ALL_H100:
        with pytest.raises(AllocationError):
            place(slices, taken, profile)
    taken = set()
    place(slices, taken, "1g.10gb")
    with pytest.raises(AllocationError):
        place(slices, taken, None)


def test_freeing_a_placement_frees_its_counters(slices: list[Obj]) -> None:
    taken: set[str] = set()
    place(slices, taken, "1g.10gb")
    taken.clear()  # the claim was deallocated
    assert place(slices, taken, "7g.80gb") == ["gpu-0-dynmig-7g80gb-0"]


def test_one_gpus_counters_do_not_limit_another(slices: list[Obj]) -> None:
    taken: set[str] = {"gpu-0"}
    other = {"name": "r", "exactly": {"deviceClassName": f"mig.{DRIVER}", "selectors": [{"cel": {
        "expression": f"device.attributes['{DRIVER}'].profile == '7g.80gb'"}}]}}
    [result] = allocate(claim(other), slices, DRIVER, taken)["status"]["allocation"]["devices"]["results"]
    assert result["device"] == "gpu-1-dynmig-7g80gb-0"


def test_admin_access_sees_a_placement_whose_counters_are_taken(slices: list[Obj]) -> None:
    taken: set[str] = {"gpu-0"}
    admin = request("1g.10gb")
    admin["exactly"]["adminAccess"] = True
    [result] = allocate(claim(admin), slices, DRIVER, taken)["status"]["allocation"]["devices"]["results"]
    assert result["device"] == "gpu-0-dynmig-1g10gb-0" and result["adminAccess"] is True


def test_synthetic_counters_other_than_memory_slices_limit_too() -> None:
    counter_slice = {"spec": {"pool": {"name": NODE}, "sharedCounters": [
        {"name": "s", "counters": {"multiprocessors": {"value": "10"}, "memory": {"value": "1Gi"}}}]}}

    def dev(name: str, sms: str, memory: str) -> Obj:
        return {"name": name, "attributes": {"type": {"string": "mig"}},
                "consumesCounters": [{"counterSet": "s", "counters": {
                    "multiprocessors": {"value": sms}, "memory": {"value": memory}}}]}

    device_slice = {"spec": {"pool": {"name": NODE}, "devices": [
        dev("a", "6", "256Mi"), dev("b", "6", "256Mi"), dev("c", "4", "800Mi"), dev("d", "4", "512Mi")]}}
    taken: set[str] = set()
    mig = {"name": "r", "exactly": {"deviceClassName": f"mig.{DRIVER}"}}
    picked = [allocate(claim(mig), [counter_slice, device_slice], DRIVER, taken)["status"]["allocation"]["devices"][
        "results"][0]["device"] for _ in range(2)]
    assert picked == ["a", "d"]  # b: too many SMs after a; c: too much memory after a
    with pytest.raises(AllocationError):
        allocate(claim(mig), [counter_slice, device_slice], DRIVER, taken)


@pytest.mark.parametrize("minor", [34, 36])
def test_a_gpu_kept_dynamic_for_its_claims_is_never_allocated_over_someone_elses_instance(minor: int) -> None:
    # GPU 0 keeps its dynamic form while a claim holds its 3g.40gb at 4; someone else then made a 1g.10gb at 0,
    # which no counter knows of. First fit must not land on it: every prepare of such a claim would fail.
    own, foreign = instance("3g.40gb", 4, gi_id=7, size=4), instance("1g.10gb", 0, gi_id=8)
    gpu = h100(0, instances=(own, foreign))
    shares = GpuForm(strategy="DynamicMig", count=1, memory_bytes_per_share=H100_MEMORY,
                       dynamic_mig=DynamicMigPolicy(profiles=ALL_H100))
    view = make_view(inventory_of(gpu), {gpu.uuid: shares}, own_instances={(gpu.uuid, 7)})
    planned = plan_slices(list(view.devices), DRIVER, limits_for(minor), list(view.counter_sets))
    published = [{"spec": c["spec"]} for c in slice_writes(
        [], planned, driver_name=DRIVER, node_name=NODE, owner=None, adopted={}).creates]
    taken = {"gpu-0-dynmig-3g40gb-4"}
    assert place(published, taken, "1g.10gb", "1g.10gb", "1g.10gb") == [
        "gpu-0-dynmig-1g10gb-1", "gpu-0-dynmig-1g10gb-2", "gpu-0-dynmig-1g10gb-3"]
    for profile in ("1g.10gb", "2g.20gb", "4g.40gb", "7g.80gb", None):
        with pytest.raises(AllocationError):
            place(published, taken, profile)
