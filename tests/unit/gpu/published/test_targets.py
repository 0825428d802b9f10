"""What each device name stands for (whole GPUs, MIG devices, shares) and the busy-GPU-aware layout merge."""

from __future__ import annotations

from driver.gpu.discovery.inventory import GpuInfo, MigInstance, NodeInventory
from driver.gpu.published.devices import make_view
from driver.gpu.published.sharelayout import DynamicMigPolicy, GpuForm, SharingLayout
from driver.gpu.published.targets import DeviceTarget, drop_unfit, merge_layout
from driver.units import GIB


def index_devices(inventory: NodeInventory, layout: SharingLayout) -> dict[str, DeviceTarget]:
    return make_view(inventory, layout).targets


def _mps(count: int = 2) -> GpuForm:
    return GpuForm(strategy="MPS", count=count, active_thread_percentage=50, memory_bytes_per_share=10 * GIB)


def _ts(count: int = 2) -> GpuForm:
    return GpuForm(strategy="TimeSlicing", count=count, memory_bytes_per_share=10 * GIB, interval="Long")


def test_without_a_layout_whole_gpus_and_only_mig_devices_of_mig_gpus(demo: NodeInventory) -> None:
    targets = index_devices(demo, {})
    assert set(targets) == {"gpu-0", "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6", "gpu-2"}
    assert "gpu-1" not in targets, "a MIG-enabled GPU is never published whole"
    assert {n: t.kind for n, t in targets.items()} == {
        "gpu-0": "gpu", "gpu-2": "gpu",
        "gpu-1-mig-3g40gb-0": "mig", "gpu-1-mig-2g20gb-4": "mig", "gpu-1-mig-1g10gb-6": "mig"}
    for name, target in targets.items():
        assert target.name == name


def test_whole_gpu_target_addresses_the_gpu(demo: NodeInventory) -> None:
    target = index_devices(demo, {})["gpu-0"]
    gpu0 = demo.gpus[0]
    assert target.gpu == gpu0 and target.mig is None and target.form is None
    assert target.cuda_uuid == gpu0.uuid
    assert target.memory_bytes == gpu0.memory_bytes


def test_mig_target_addresses_the_mig_instance(demo: NodeInventory) -> None:
    target = index_devices(demo, {})["gpu-1-mig-1g10gb-6"]
    mig = next(m for m in demo.gpus[1].mig_instances if m.placement_start == 6)
    assert target.mig == mig
    assert target.gpu == demo.gpus[1]
    assert target.cuda_uuid == mig.uuid != demo.gpus[1].uuid
    assert target.memory_bytes == mig.memory_bytes


def test_gpus_in_the_layout_are_published_as_shares_only(demo: NodeInventory) -> None:
    gpu0, gpu2 = demo.gpus[0], demo.gpus[2]
    targets = index_devices(demo, {gpu0.uuid: _mps(3), gpu2.uuid: _ts(2)})
    assert "gpu-0" not in targets and "gpu-2" not in targets
    mps = {n: t for n, t in targets.items() if n.startswith("gpu-0-")}
    assert sorted(mps) == ["gpu-0-mps-0", "gpu-0-mps-1", "gpu-0-mps-2"]
    for k in range(3):
        t = mps[f"gpu-0-mps-{k}"]
        assert (t.kind, t.share_index, t.gpu, t.form) == ("mps", k, gpu0, _mps(3))
    ts = {n: t for n, t in targets.items() if n.startswith("gpu-2-")}
    assert sorted(ts) == ["gpu-2-ts-0", "gpu-2-ts-1"]
    assert {t.kind for t in ts.values()} == {"timeslice"}
    # The MIG GPU is untouched by a layout that does not name it.
    assert "gpu-1-mig-3g40gb-0" in targets


def test_layout_entry_for_an_absent_gpu_publishes_nothing(demo: NodeInventory) -> None:
    targets = index_devices(demo, {"GPU-not-on-this-node": _mps()})
    assert set(targets) == set(index_devices(demo, {}))


def _mig(ci_id: int, placement_start: int = 0, uuid_suffix: str = "a") -> MigInstance:
    return MigInstance(uuid=f"MIG-{uuid_suffix}", profile="1g.10gb", gi_profile_id=19, placement_start=placement_start,
                       placement_size=1, gi_id=1, ci_id=ci_id)


def _inventory(*gpus: GpuInfo) -> NodeInventory:
    return NodeInventory(gpus=gpus)


def test_several_compute_instances_of_one_gpu_instance_publish_the_lowest_ci() -> None:
    gpu = GpuInfo(minor=3, index=0, uuid="GPU-x", product_name="H100", mig_capable=True, mig_enabled=True,
                  mig_instances=(_mig(ci_id=2, uuid_suffix="ci2"), _mig(ci_id=0, uuid_suffix="ci0")))
    targets = index_devices(_inventory(gpu), {})
    assert list(targets) == ["gpu-3-mig-1g10gb-0"]
    mig = targets["gpu-3-mig-1g10gb-0"].mig
    assert mig is not None and mig.ci_id == 0 and mig.uuid == "MIG-ci0"


def test_mig_enabled_gpu_without_instances_publishes_nothing() -> None:
    gpu = GpuInfo(minor=0, index=0, uuid="GPU-x", product_name="H100", mig_capable=True, mig_enabled=True)
    assert index_devices(_inventory(gpu), {}) == {}


def test_device_names_use_the_minor_not_the_index() -> None:
    gpu = GpuInfo(minor=5, index=0, uuid="GPU-x", product_name="L4")
    assert list(index_devices(_inventory(gpu), {})) == ["gpu-5"]


def test_make_view_holds_its_own_copy_of_the_layout(demo: NodeInventory) -> None:
    layout = {demo.gpus[0].uuid: _mps()}
    view = make_view(demo, layout)
    layout.clear()
    assert set(view.layout) == {demo.gpus[0].uuid}
    assert "gpu-0-mps-0" in view.targets and view.inventory == demo


# ----------------------------------------------------------------------------- merge_layout


def test_idle_gpus_take_the_desired_form() -> None:
    effective, deferred = merge_layout({"A": _mps()}, {"A": _ts(), "B": _mps(4)}, busy_gpus=set())
    assert effective == {"A": _ts(), "B": _mps(4)}
    assert deferred == set()


def test_busy_gpu_keeps_its_shares_and_is_deferred() -> None:
    effective, deferred = merge_layout({"A": _mps(2)}, {"A": _mps(4)}, busy_gpus={"A"})
    assert effective == {"A": _mps(2)}
    assert deferred == {"A"}


def test_busy_gpu_is_not_removed_from_the_layout() -> None:
    effective, deferred = merge_layout({"A": _mps()}, {}, busy_gpus={"A"})
    assert effective == {"A": _mps()}
    assert deferred == {"A"}


def test_busy_whole_gpu_is_not_split_into_shares() -> None:
    effective, deferred = merge_layout({}, {"A": _mps()}, busy_gpus={"A"})
    assert effective == {}
    assert deferred == {"A"}


def test_idle_removals_and_additions_apply() -> None:
    effective, deferred = merge_layout({"A": _mps(), "B": _ts()}, {"C": _mps()}, busy_gpus={"Z"})
    assert effective == {"C": _mps()}
    assert deferred == set()


def test_busy_gpu_whose_form_does_not_change_is_not_deferred() -> None:
    effective, deferred = merge_layout({"A": _mps(), "B": _ts()}, {"A": _mps(), "B": _mps()}, busy_gpus={"A", "B"})
    assert effective == {"A": _mps(), "B": _ts()}
    assert deferred == {"B"}


def test_merge_does_not_modify_its_inputs() -> None:
    current, desired = {"A": _mps()}, {"B": _ts()}
    merge_layout(current, desired, busy_gpus={"A"})
    assert current == {"A": _mps()} and desired == {"B": _ts()}


# ----------------------------------------------------------------------------- drop_unfit


def test_forms_the_gpus_mig_mode_no_longer_allows_are_dropped_or_replaced_by_a_fitting_one() -> None:
    # A busy GPU keeps its form (merge_layout), unless an operator switched its MIG mode (a GPU reset): then
    # keeping it would make every view of the node fail.
    dynamic = GpuForm(strategy="DynamicMig", count=1, memory_bytes_per_share=80 * GIB,
                        dynamic_mig=DynamicMigPolicy(profiles=("1g.10gb",)))
    into_mig = GpuInfo(minor=0, index=0, uuid="A", product_name="H100", mig_capable=True, mig_enabled=True)
    out_of_mig = GpuInfo(minor=1, index=1, uuid="B", product_name="H100", mig_capable=True, mig_enabled=False)
    unchanged = GpuInfo(minor=2, index=2, uuid="C", product_name="L4")
    inventory = _inventory(into_mig, out_of_mig, unchanged)
    layout = {"A": _mps(), "B": dynamic, "C": _ts(), "gone": _mps()}
    fitting, dropped = drop_unfit(layout, {"A": dynamic, "B": dynamic}, inventory)
    assert fitting == {"A": dynamic, "C": _ts(), "gone": _mps()}, "A takes its desired form, which fits; B none"
    assert dropped == {"A", "B"}
    make_view(inventory, fitting)  # no longer refused
