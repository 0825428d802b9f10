"""Admin access (``adminAccess: true`` results) and tolerated health taints, below the driver process.

The plan of an admin-access result, DeviceState with recording fakes (tests.support.statenode:
demo layout, gpu-0 H100 whole, gpu-1 H100 MIG, gpu-2 L4), the checkpoint's compatibility, the
rebuild from CDI annotations, and Kubernetes' toleration rule.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from driver.gpu.claim.claimplan import plan_claim
from driver.gpu.claim.healthgate import check_device_health
from driver.gpu.discovery.inventory import ComputeMode
from driver.gpu.errors import PrepareError
from driver.gpu.published.devices import make_view
from driver.gpu.published.sharingplan import SharingPlans, resolve_layout
from driver.gpu.record.checkpoint import Checkpoint, CheckpointStore, ClaimPhase
from driver.gpu.recovery import recover
from driver.gpu.state import DeviceState
from driver.kubeletplugin.claimmodel import DeviceToleration, ResourceClaim
from driver.kubeletplugin.slicemodel import DeviceTaint
from driver.kubeletplugin.tolerations import tolerates, untolerated
from driver.simulation.discovery import SimulatedDiscovery
from tests.support.pods import NonRootPods
from tests.support.statenode import DRIVER, POOL, StateNode, device_env, gpu_config, mps_shares, ref, ts_shares

MIG_MPS = {"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": {
    "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS"}}}}
INVENTORY = SimulatedDiscovery("demo", POOL).discover()
TAINT = DeviceTaint(key=f"{DRIVER}/unhealthy", value="xid-79", effect="NoSchedule")


def result(device: str, request: str = "r0", *, admin: bool = False, **extra: Any) -> dict[str, Any]:
    return {"request": request, "driver": DRIVER, "pool": POOL, "device": device,
            **({"adminAccess": True} if admin else {}), **extra}


def allocated(uid: str, *results: dict[str, Any], configs: list[dict[str, Any]] | None = None) -> ResourceClaim:
    return ResourceClaim.model_validate({
        "metadata": {"name": f"claim-{uid}", "namespace": "default", "uid": uid},
        "status": {"allocation": {"devices": {"results": list(results), "config": configs or []}},
                   "reservedFor": [{"resource": "pods", "name": f"pod-{uid}", "uid": f"pod-{uid}"}]}}
    ).with_pod_reader(NonRootPods())


def admin(uid: str, device: str, **extra: Any) -> ResourceClaim:
    return allocated(uid, result(device, admin=True, **extra))


def workload(uid: str, device: str, configs: list[dict[str, Any]] | None = None, **extra: Any) -> ResourceClaim:
    return allocated(uid, result(device, **extra), configs=configs)


def consumable_layout(state_node: StateNode) -> Any:
    plans = SharingPlans.model_validate({"plans": {"p": {"gpus": [{"match": {"minor": 0}, "consumable": {}}]}}})
    return resolve_layout(plans.plans["p"], state_node.inventory, "p")


def side_effects(state_node: StateNode, state: DeviceState) -> tuple[Any, ...]:
    """Everything a claim may change besides its own CDI spec and checkpoint entry."""
    cp = state.ledger.read()
    return (list(state_node.mps.calls), dict(state_node.mps.running), list(state_node.modes.sets),
            dict(state_node.modes.modes),
            list(state_node.timeslicer.calls), dict(cp.mps_daemons), dict(cp.compute_modes))


# ----------------------------------------------------------------------------- the plan


def test_an_admin_result_plans_its_device_and_nothing_else() -> None:
    node_view = make_view(INVENTORY, {})
    mps = gpu_config(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 40})
    ts = gpu_config(strategy="TimeSlicing", timeSlicingConfig={"interval": "Short"})
    for configs in ([mps], [ts], [MIG_MPS]):
        p = plan_claim(allocated("a", result("gpu-0", admin=True), result("gpu-1-mig-1g10gb-6", "r1", admin=True),
                                 configs=configs), driver_name=DRIVER, pool_name=POOL, view=node_view)
        assert p is not None and [t.name for t in p.targets] == ["gpu-0", "gpu-1-mig-1g10gb-6"]
        assert p.daemons == () and p.timeslice is None and p.consumed == () and p.held_targets == []
        assert p.gpu_uuids == sorted(t.gpu.uuid for t in p.targets), "its GPUs are still locked while it prepares"
    # Next to a workload result of the same claim, only the workload's device gets the config.
    mixed = plan_claim(allocated("m", result("gpu-0", admin=True), result("gpu-2", "r1"), configs=[mps]),
                       driver_name=DRIVER, pool_name=POOL, view=node_view)
    assert mixed is not None and [d.spec.gpu_uuids for d in mixed.daemons] == [[mixed.targets[1].gpu.uuid]]
    assert [t.name for t in mixed.held_targets] == ["gpu-2"]


def test_admin_shares_of_one_gpu_and_admin_consumable_results_are_not_workload_refusals(state_node: StateNode) -> None:
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(2): mps_shares(2),
                                                             **consumable_layout(state_node)})
    # Two shares of one GPU in one claim are refused for a workload, not for a look at both.
    p = plan_claim(allocated("a", result("gpu-2-mps-0", admin=True), result("gpu-2-mps-1", "r1", admin=True)),
                   driver_name=DRIVER, pool_name=POOL, view=state.view)
    assert p is not None and p.daemons == ()
    # An admin result on a consumable device consumes nothing, whatever its consumedCapacity says.
    p = plan_claim(admin("c", "gpu-0-shared", shareID="s-1", consumedCapacity={"memory": "79Gi"}),
                   driver_name=DRIVER, pool_name=POOL, view=state.view)
    assert p is not None and p.consumed == () and p.daemons == ()


# ----------------------------------------------------------------------------- prepare and unprepare


@pytest.mark.parametrize("form", ["gpu", "mig", "mps", "timeslice"])
def test_admin_access_shares_a_held_device_in_both_orders_and_changes_nothing(state_node: StateNode, form: str) -> None:
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(2): mps_shares(2),
                                                             state_node.uuid(0): ts_shares(2)}
                       if form in ("mps", "timeslice") else {})
    device, configs = {"gpu": ("gpu-0", [gpu_config(strategy="MPS")]), "mig": ("gpu-1-mig-1g10gb-6", [MIG_MPS]),
                       "mps": ("gpu-2-mps-0", None), "timeslice": ("gpu-0-ts-1", None)}[form]

    # Workload first: the admin claim changes nothing, preparing or unpreparing.
    state.prepare(workload("w", device, configs))
    if form in ("gpu", "mps"):
        assert ComputeMode.EXCLUSIVE_PROCESS in state_node.modes.modes.values()
    before = side_effects(state_node, state)
    [answer] = state.prepare(admin("adm", device))
    assert answer.device_name == device and side_effects(state_node, state) == before
    spec = state_node.spec_json("adm")
    edits = spec["devices"][0]["containerEdits"]
    assert edits["deviceNodes"][0]["path"].startswith("/dev/nvidia") and "mounts" not in edits
    assert not [e for e in device_env(spec) if e.startswith("CUDA_MPS")]
    assert spec["devices"][0]["annotations"][f"{DRIVER}/admin-access"] == "true"
    assert spec["containerEdits"]["env"], "the driver libraries' edits are there"
    state.unprepare(ref("adm"))
    assert side_effects(state_node, state) == before
    state.unprepare(ref("w"))
    assert state_node.mps.running == {} and state.ledger.read().compute_modes == {}

    # Admin first: the workload is not refused, gets its daemon, and its unprepare stops it though
    # the admin claim still holds the device.
    state.prepare(admin("adm", device))
    state.prepare(workload("w2", device, configs))
    if form != "timeslice":
        assert state_node.mps.running, "the workload's own daemon runs"
    state.unprepare(ref("w2"))
    assert state_node.mps.running == {} and state.ledger.read().compute_modes == {}
    assert set(state_node.modes.modes.values()) <= {ComputeMode.DEFAULT}
    assert [r.uid for r in state.prepared_claims()] == ["adm"]
    [record] = state.prepared_claims()
    assert record.devices[0].admin_access and record.owned_mps_daemons == record.shared_mps_daemons == []
    assert record.exclusive_gpus == [] and record.timeslice is None


def test_an_admin_claim_consumes_no_capacity_and_does_not_pin_the_gpus_form(state_node: StateNode) -> None:
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), consumable_layout(state_node))
    state.prepare(admin("adm", "gpu-0-shared", shareID="s-adm", consumedCapacity={"memory": "70Gi",
                                                                                "multiprocessors": "130"}))
    assert state_node.mps.calls == []
    [share] = state.prepare(workload("w", "gpu-0-shared", shareID="s-w",
                                     consumedCapacity={"memory": "60Gi", "multiprocessors": "100"}))
    assert share.share_id == "s-w" and len(state_node.mps.running) == 1
    state.unprepare(ref("w"))
    # Only the admin claim left: a plan change is not deferred for it.
    view, deferred = state.apply_layout(make_view(state_node.inventory, {}), {})
    assert deferred == set() and "gpu-0" in view.targets
    state.prepare(workload("whole", "gpu-0"))  # the whole GPU is free for a workload
    state.unprepare(ref("adm"))
    assert [r.uid for r in state.prepared_claims()] == ["whole"]


def test_a_workload_still_refuses_a_second_workload_next_to_an_admin_claim(state_node: StateNode) -> None:
    state = state_node.state()
    state.prepare(admin("adm", "gpu-0"))
    state.prepare(workload("w", "gpu-0"))
    with pytest.raises(PrepareError, match="already prepared for claim default/claim-w"):
        state.prepare(workload("w2", "gpu-0"))


def test_health_refusals_apply_to_admin_claims_too(state_node: StateNode) -> None:
    state = state_node.state()
    state.device_problems = lambda: {"gpu-0": "xid-79: fell off the bus"}
    state.device_taints = lambda: {"gpu-0": [TAINT]}
    with pytest.raises(PrepareError, match=r"device gpu-0 \(xid-79: fell off the bus\) is unhealthy"):
        state.prepare(admin("adm", "gpu-0"))
    tolerating = [{"key": TAINT.key, "operator": "Exists", "effect": "NoSchedule"}]
    state.prepare(admin("adm", "gpu-0", tolerations=tolerating))


# ----------------------------------------------------------------------------- checkpoint and rebuild


def test_a_checkpoint_without_admin_access_loads_and_the_flag_round_trips(state_node: StateNode) -> None:
    state = state_node.state()
    state.prepare(workload("w", "gpu-0"))
    state.prepare(admin("adm", "gpu-0"))
    path = state_node.paths.state_dir / "checkpoint.json"
    raw = json.loads(path.read_text())
    assert raw["data"]["claims"]["adm"]["devices"][0]["admin_access"] is True
    # As an older driver wrote it: no admin_access field at all.
    for record in raw["data"]["claims"].values():
        for device in record["devices"]:
            device.pop("admin_access")
    old = Checkpoint.model_validate(raw["data"])
    store = CheckpointStore(state_node.root / "old.json")
    store.save(old)
    loaded = CheckpointStore(state_node.root / "old.json").load()
    assert [d.admin_access for r in loaded.claims.values() for d in r.devices] == [False, False]
    assert CheckpointStore(path).load().claims["adm"].devices[0].admin_access


def test_a_rebuilt_checkpoint_knows_admin_claims_and_gives_them_no_daemon(state_node: StateNode) -> None:
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(2): mps_shares(2)})
    state.prepare(workload("w", "gpu-2-mps-0"))
    state.prepare(admin("adm", "gpu-2-mps-0"))
    [daemon_id] = state_node.mps.started()
    (state_node.paths.state_dir / "checkpoint.json").write_text("{garbage")
    restarted = state_node.state()
    assert recover(restarted).rebuilt_from_cdi
    records = {r.uid: r for r in restarted.prepared_claims()}
    assert records["adm"].devices[0].admin_access and not records["w"].devices[0].admin_access
    assert records["adm"].phase == ClaimPhase.PREPARE_COMPLETED
    assert records["adm"].shared_mps_daemons == [] and records["adm"].exclusive_gpus == []
    assert records["w"].shared_mps_daemons == [daemon_id]
    restarted.unprepare(ref("w"))
    assert daemon_id not in state_node.mps.running, (
        "the last share's unprepare stops the daemon despite the admin claim")
    assert state_node.cdi_files() == ["k8s.gpu.tessera.dev-claim_adm.json"]


def test_recovery_rewrites_a_lost_admin_spec_as_it_was(state_node: StateNode) -> None:
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(2): mps_shares(2)})
    state.prepare(workload("w", "gpu-2-mps-1"))
    state.prepare(admin("adm", "gpu-2-mps-1"))
    written = state_node.spec_path("adm").read_text()
    state_node.spec_path("adm").unlink()
    report = recover(state_node.state())
    assert report.cdi_recreated == ["adm"] and state_node.spec_path("adm").read_text() == written
    assert not [e for e in device_env(state_node.spec_json("adm")) if e.startswith("CUDA_MPS")]


# ----------------------------------------------------------------------------- tolerations


@pytest.mark.parametrize(("toleration", "expected"), [
    ({"key": TAINT.key, "operator": "Exists"}, True),
    ({"key": TAINT.key, "operator": "Exists", "effect": "NoSchedule"}, True),
    ({"key": TAINT.key, "operator": "Exists", "effect": "NoExecute"}, False),
    ({"key": TAINT.key, "value": "xid-79"}, True),  # operator defaults to Equal
    ({"key": TAINT.key, "operator": "Equal", "value": "xid-48"}, False),
    ({"key": TAINT.key, "operator": "Equal"}, False),  # Equal with no value matches only an empty value
    ({"operator": "Exists"}, True),  # empty key with Exists: every taint
    ({"operator": "Exists", "effect": "NoExecute"}, False),
    ({"key": "example.com/other", "operator": "Exists"}, False),
    ({"key": TAINT.key, "operator": "Lt", "value": "xid-79"}, False),
    ({"key": TAINT.key, "operator": "Exists", "tolerationSeconds": 300}, True),
])
def test_tolerations_match_taints_as_kubernetes_does(toleration: dict[str, Any], expected: bool) -> None:
    assert tolerates(DeviceToleration.model_validate(toleration), TAINT) is expected


def test_every_taint_must_be_tolerated() -> None:
    other = DeviceTaint(key="example.com/maintenance", effect="NoExecute")
    only_ours = [DeviceToleration(key=TAINT.key, operator="Exists")]
    assert untolerated(only_ours, [TAINT, other]) == [other]
    assert untolerated([*only_ours, DeviceToleration(operator="Exists", effect="NoExecute")], [TAINT, other]) == []


def test_a_tolerating_claim_is_admitted_with_a_log_line_and_others_are_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    view = make_view(INVENTORY, {})
    problems = {"gpu-0": "xid-79: fell off the bus", "gpu-2": "ecc-double-bit: ..."}
    taints = {"gpu-0": [TAINT], "gpu-2": [TAINT.model_copy(update={"value": "ecc-double-bit"})]}

    def plan(*results: dict[str, Any]) -> Any:
        return plan_claim(allocated("u", *results), driver_name=DRIVER, pool_name=POOL, view=view)

    exists = [{"key": TAINT.key, "operator": "Exists"}]
    with caplog.at_level(logging.INFO, logger="driver.gpu.claim.healthgate"):
        check_device_health(plan(result("gpu-0", tolerations=exists)), problems, taints)
    [line] = [r for r in caplog.records if r.name == "driver.gpu.claim.healthgate"]
    assert line.levelno == logging.INFO and "tolerates" in line.getMessage()
    assert line.__dict__["device"] == "gpu-0" and line.__dict__["tolerated"] == [f"{TAINT.key}=xid-79:NoSchedule"]
    # Tolerating xid-79 only: gpu-2's ECC taint is not tolerated.
    only_79 = [{"key": TAINT.key, "value": "xid-79", "effect": "NoSchedule"}]
    with pytest.raises(PrepareError, match=r"device gpu-2 \(ecc-double-bit: \.\.\.\) is unhealthy"):
        check_device_health(plan(result("gpu-0", tolerations=only_79), result("gpu-2", "r1", tolerations=only_79)),
                            problems, taints)
    with pytest.raises(PrepareError, match="add a toleration for the taint"):
        check_device_health(plan(result("gpu-0")), problems, taints)
    # A problem whose taint is unknown is never tolerated.
    with pytest.raises(PrepareError, match="gpu-0"):
        check_device_health(plan(result("gpu-0", tolerations=[{"operator": "Exists"}])), problems, {})


def test_prepare_reads_the_taints_and_tolerations_of_the_claim(state_node: StateNode) -> None:
    state = state_node.state()
    state.device_problems = lambda: {"gpu-0": "xid-79: fell off the bus"}
    state.device_taints = lambda: {"gpu-0": [TAINT]}
    with pytest.raises(PrepareError, match="is unhealthy"):
        state.prepare(workload("plain", "gpu-0"))
    state.prepare(workload("diag", "gpu-0", tolerations=[{"key": TAINT.key, "operator": "Exists"}]))
    assert [r.uid for r in state.prepared_claims()] == ["diag"]
    assert state_node.spec_json("diag")["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
