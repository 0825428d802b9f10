"""Device health: XID table, event rule, device mapping and taints, the monitor, NVML and simulated sources."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from driver.gpu.claim.healthgate import check_device_health
from driver.gpu.errors import PrepareError
from driver.gpu.health.model import EventKind, HealthEvent, apply_event
from driver.gpu.health.monitor import HealthMonitor
from driver.gpu.health.nvmlsource import NO_INSTANCE, NvmlHealthSource
from driver.gpu.health.published import taint_key, taints_decision, unhealthy_devices, with_taints
from driver.gpu.health.xids import XID_TABLE, XidImpact, classify_xid, parse_ignored_xids
from driver.gpu.published.devices import make_view
from driver.gpu.published.sharelayout import GpuForm
from driver.simulation.discovery import SimulatedDiscovery
from driver.simulation.healthevents import SimulatedHealthEvents, parse_line

DRIVER = "gpu.tessera.dev"


@pytest.fixture
def inventory() -> Any:
    return SimulatedDiscovery("demo", "node-1").discover()


def gpu(inventory: Any, minor: int) -> Any:
    found = inventory.gpu_by_minor(minor)
    assert found is not None
    return found


# --- XIDs --------------------------------------------------------------------------------------


@pytest.mark.parametrize("xid", [13, 31, 43])
def test_application_xids_leave_the_device_healthy(xid: int) -> None:
    assert not classify_xid(xid).makes_unhealthy
    assert XID_TABLE[xid].impact is XidImpact.APPLICATION


@pytest.mark.parametrize("xid", [48, 64, 74, 79, 92, 94, 95])
def test_device_xids_make_it_unhealthy(xid: int) -> None:
    verdict = classify_xid(xid)
    assert verdict.makes_unhealthy and f"XID {xid}" in verdict.why


@pytest.mark.parametrize(("xid", "state"), [(154, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"),
                                            (63, "nvmlDeviceGetRemappedRows")])
def test_an_xid_announcing_a_state_change_leaves_the_decision_to_that_state(xid: int, state: str) -> None:
    # XID 154 is logged when the recovery action changes, back to none after a reset too; XID 63 when a row remap
    # is recorded, which is pending until the next reset and no fault (NVIDIA's memory-error guide).
    verdict = classify_xid(xid)
    assert not verdict.makes_unhealthy and XID_TABLE[xid].impact is XidImpact.STATE and state in verdict.why


def test_unknown_xids_count_as_device_errors_and_the_operator_can_ignore_any() -> None:
    assert classify_xid(9999).makes_unhealthy
    assert not classify_xid(79, ignored={79}).makes_unhealthy
    assert "ignored by the operator" in classify_xid(79, ignored={79}).why


def test_ignored_xids_parse_and_name_a_bad_entry() -> None:
    assert parse_ignored_xids(" 74, 79,,") == {74, 79}
    assert parse_ignored_xids("") == frozenset()
    with pytest.raises(ValueError, match="entry 1 '7x'"):
        parse_ignored_xids("74,7x")


# --- the event rule -----------------------------------------------------------------------------


def test_events_mark_unhealthy_keep_the_first_reason_and_recovery_clears_mig_children() -> None:
    health = apply_event({}, HealthEvent("MIG-a", EventKind.XID, xid=94, parent_uuid="GPU-1"), (), now=5.0)
    assert health["MIG-a"].reason == "xid-94" and health["MIG-a"].since == 5.0
    health = apply_event(health, HealthEvent("MIG-a", EventKind.LOST), (), now=6.0)
    assert health["MIG-a"].reason == "xid-94"
    health = apply_event(health, HealthEvent("GPU-2", EventKind.DOUBLE_BIT_ECC), (), now=7.0)
    assert apply_event(health, HealthEvent("GPU-2", EventKind.XID, xid=13), (), now=8.0) == health
    recovered = apply_event(health, HealthEvent("GPU-1", EventKind.RECOVERED), (), now=9.0)
    assert set(recovered) == {"GPU-2"} and recovered["GPU-2"].reason == "ecc-double-bit"
    # A recovery from one condition leaves a device unhealthy for another.
    other = HealthEvent("GPU-2", EventKind.RECOVERED, clears="recovery-action")
    assert apply_event(health, other, (), now=9.0) == health
    same = HealthEvent("GPU-2", EventKind.RECOVERED, clears="ecc-double-bit")
    assert "GPU-2" not in apply_event(health, same, (), now=9.0)


def test_the_monitor_counts_every_xid_and_tells_listeners_only_of_changes() -> None:
    monitor = HealthMonitor(ignored_xids={74}, clock=lambda: 1.0)
    heard: list[set[str]] = []
    monitor.add_listener(lambda health: heard.append(set(health)))
    for xid in (13, 74, 79, 79):
        monitor.handle(HealthEvent("GPU-1", EventKind.XID, xid=xid))
    assert monitor.xid_counts() == {13: 1, 74: 1, 79: 2}
    assert heard == [{"GPU-1"}]
    monitor.handle(HealthEvent("GPU-1", EventKind.RECOVERED))
    assert heard == [{"GPU-1"}, set()] and monitor.health() == {}


# --- published devices --------------------------------------------------------------------------


def test_health_reaches_the_whole_gpu_its_mig_devices_and_its_shares(inventory: Any) -> None:
    shares = GpuForm(strategy="TimeSlicing", count=2, memory_bytes_per_share=1 << 30)
    view = make_view(inventory, {gpu(inventory, 2).uuid: shares})
    mig = gpu(inventory, 1).mig_instances[0]
    health = apply_event({}, HealthEvent(gpu(inventory, 2).uuid, EventKind.LOST), (), now=1.0)
    health = apply_event(health, HealthEvent(mig.uuid, EventKind.XID, xid=95, parent_uuid=gpu(inventory, 1).uuid),
                         (), now=2.0)
    health = apply_event(health, HealthEvent(gpu(inventory, 0).uuid, EventKind.XID, xid=79), (), now=3.0)
    unhealthy = unhealthy_devices(view.targets, health)
    assert {name: c.reason for name, c in unhealthy.items()} == {
        "gpu-0": "xid-79", "gpu-1-mig-3g40gb-0": "xid-95", "gpu-2-ts-0": "gpu-lost", "gpu-2-ts-1": "gpu-lost"}

    tainted = with_taints(view.devices, unhealthy, DRIVER, "NoExecute")
    by_name = {d.name: d for d in tainted}
    assert [t.model_dump() for t in by_name["gpu-2-ts-1"].taints] == [
        {"key": taint_key(DRIVER), "value": "gpu-lost", "effect": "NoExecute", "time_added": None}]
    assert by_name["gpu-1-mig-2g20gb-4"].taints == []
    # Healthy again: the taint goes, other taints stay untouched.
    assert all(not d.taints for d in with_taints(tainted, {}, DRIVER, "NoSchedule"))


def test_taints_only_go_to_servers_that_support_them() -> None:
    assert taints_decision("auto", 37)[0] and taints_decision("auto", 36)[0]
    published, why = taints_decision("auto", 35)
    assert not published and "DRADeviceTaints" in why and "--device-taints=always" in why
    assert taints_decision("always", 34)[0]
    assert not taints_decision("never", 37)[0]


def test_prepare_refuses_a_new_claim_on_an_unhealthy_device(inventory: Any) -> None:
    view = make_view(inventory, {})
    plan = SimpleNamespace(targets=(view.targets["gpu-0"], view.targets["gpu-2"]))
    check_device_health(plan, {"gpu-1-mig-1g10gb-6": "xid-79: ..."})  # type: ignore[arg-type]
    with pytest.raises(PrepareError, match=r"device gpu-2 \(gpu-lost: fell off\) is unhealthy"):
        check_device_health(plan, {"gpu-2": "gpu-lost: fell off"})  # type: ignore[arg-type]


# --- NVML source (pynvml faked with the names and numbers of nvml.h) ----------------------------


class FakeNvmlError(Exception):
    def __init__(self, value: int):
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNvml:
    NVMLError = FakeNvmlError
    NVML_ERROR_TIMEOUT = 10
    NVML_ERROR_NOT_FOUND = 6
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_TEMPERATURE_GPU = 0
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
    nvmlEventTypeDoubleBitEccError = 0x2
    nvmlEventTypeXidCriticalError = 0x8
    nvmlEventTypeGpuUnavailableError = 0x4000
    nvmlEventTypeGpuRecoveryAction = 0x8000

    def __init__(self, uuids: list[str]):
        self.uuids = uuids
        self.supported_events = 0x8 | 0x2  # no GPU-unavailable or recovery-action events on this "driver"
        self.field_return = 0  # nvmlReturn of field 230: 3 = NOT_SUPPORTED
        self.remap_error: int | None = None  # nvmlDeviceGetRemappedRows raises this NVML error
        self.mig_devices: dict[str, list[tuple[int, int, str]]] = {}  # GPU UUID -> (GI, CI, MIG UUID) NVML lists now
        self.events: list[Any] = []
        self.lost: set[str] = set()
        self.recovery_action: dict[str, int] = {}
        self.remap: dict[str, tuple[int, int]] = {}
        self.registered: dict[str, int] = {}
        self.calls: list[str] = []
        self.stop = threading.Event()
        self.waits_left = 0

    def nvmlInit(self) -> None:
        self.calls.append("init")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlEventSetFree(self, event_set: str) -> None:
        self.calls.append("free")

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid not in self.uuids:
            raise FakeNvmlError(self.NVML_ERROR_NOT_FOUND)
        return f"h:{uuid}"

    def nvmlDeviceGetUUID(self, handle: str | tuple[int, int, str]) -> str:
        return handle[2] if isinstance(handle, tuple) else handle.removeprefix("h:")

    def nvmlDeviceGetSupportedEventTypes(self, handle: str) -> int:
        return self.supported_events

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: str) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: str, index: int) -> tuple[int, int, str]:
        listed = self.mig_devices.get(handle.removeprefix("h:"), [])
        if index >= len(listed):
            raise FakeNvmlError(self.NVML_ERROR_NOT_FOUND)
        return listed[index]

    def nvmlDeviceGetGpuInstanceId(self, mig: tuple[int, int, str]) -> int:
        return mig[0]

    def nvmlDeviceGetComputeInstanceId(self, mig: tuple[int, int, str]) -> int:
        return mig[1]

    def nvmlDeviceRegisterEvents(self, handle: str, types: int, event_set: str) -> None:
        self.registered[handle.removeprefix("h:")] = types

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        self.waits_left -= 1
        if self.waits_left <= 0:
            self.stop.set()
        if not self.events:
            raise FakeNvmlError(self.NVML_ERROR_TIMEOUT)
        item = self.events.pop(0)
        return item() if callable(item) else item  # a callable changes the GPU's state as its event arrives

    def nvmlDeviceGetTemperature(self, handle: str, sensor: int) -> int:
        if handle.removeprefix("h:") in self.lost:
            raise FakeNvmlError(self.NVML_ERROR_GPU_IS_LOST)
        return 41

    def nvmlDeviceGetPowerUsage(self, handle: str) -> int:
        return 123456  # milliwatts

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        return SimpleNamespace(used=5 << 30)

    def nvmlDeviceGetRemappedRows(self, handle: str) -> tuple[int, int, int, int]:
        if self.remap_error is not None:
            raise FakeNvmlError(self.remap_error)
        pending, failed = self.remap.get(handle.removeprefix("h:"), (0, 0))
        return 0, 1, pending, failed

    def nvmlDeviceGetFieldValues(self, handle: str, fields: list[int]) -> list[Any]:
        action = self.recovery_action.get(handle.removeprefix("h:"), 0)
        assert fields == [230], "the recovery action is field 230 (nvml.h)"
        return [SimpleNamespace(nvmlReturn=self.field_return, value=SimpleNamespace(uiVal=action))]


def event(uuid: str, kind: int, data: int = 0, gi: int = NO_INSTANCE, ci: int = NO_INSTANCE) -> Any:
    return SimpleNamespace(device=f"h:{uuid}", eventType=kind, eventData=data, gpuInstanceId=gi, computeInstanceId=ci)


def run_source(source: NvmlHealthSource, nvml: FakeNvml, waits: int) -> list[HealthEvent]:
    """Run the source until it has waited for events ``waits`` times (each fake wait returns at once)."""
    seen: list[HealthEvent] = []
    nvml.stop = threading.Event()
    nvml.waits_left = waits
    source.run(seen.append, nvml.stop)
    return seen


def test_nvml_events_map_to_the_mig_device_of_their_gpu_instance(inventory: Any) -> None:
    whole, migged = gpu(inventory, 0), gpu(inventory, 1)
    mig = migged.mig_instances[1]
    nvml = FakeNvml([g.uuid for g in inventory.gpus])
    nvml.events = [event(migged.uuid, 0x8, 94, gi=mig.gi_id, ci=mig.ci_id), event(whole.uuid, 0x8, 13),
                   event(whole.uuid, 0x2)]
    source = NvmlHealthSource(nvml, lambda: inventory, poll_interval=3600)
    seen = run_source(source, nvml, 4)
    assert [(e.uuid, e.kind, e.xid, e.parent_uuid) for e in seen] == [
        (mig.uuid, EventKind.XID, 94, migged.uuid), (whole.uuid, EventKind.XID, 13, None),
        (whole.uuid, EventKind.DOUBLE_BIT_ECC, None, None)]
    assert nvml.registered[whole.uuid] == 0x8 | 0x2  # only the supported types
    assert nvml.calls == ["init", "free", "shutdown"]


def test_polling_reports_a_lost_gpu_once_its_recovery_and_the_recovery_action(inventory: Any) -> None:
    uuid = gpu(inventory, 0).uuid
    nvml = FakeNvml([g.uuid for g in inventory.gpus])
    source = NvmlHealthSource(nvml, lambda: inventory, poll_interval=0)
    nvml.lost.add(uuid)
    assert [(e.uuid, e.kind) for e in run_source(source, nvml, 2)] == [(uuid, EventKind.LOST)]
    nvml.lost.clear()
    nvml.recovery_action[uuid] = 1
    seen = run_source(source, nvml, 2)
    assert [(e.kind, e.detail) for e in seen] == [(EventKind.RECOVERED, "the GPU answers NVML again"),
                                                  (EventKind.RECOVERY_ACTION, "GPU reset")]
    nvml.recovery_action[uuid] = 0
    assert [(e.kind, e.clears) for e in run_source(source, nvml, 1)] == [(EventKind.RECOVERED, "recovery-action")]
    nvml.remap[uuid] = (0, 1)
    assert [(e.kind, e.detail) for e in run_source(source, nvml, 1)] == [(EventKind.ROW_REMAPPING, "remapping failed")]
    assert run_source(source, nvml, 1) == []  # reported once
    nvml.remap[uuid] = (0, 0)
    assert [(e.kind, e.clears) for e in run_source(source, nvml, 1)] == [(EventKind.RECOVERED, "row-remapping")]
    sample = source.sample()[uuid]
    assert (sample.temperature_celsius, sample.power_watts, sample.memory_used_bytes) == (41.0, 123.456, 5 << 30)


def test_a_pending_row_remap_leaves_the_gpu_healthy_and_is_logged_once(
        inventory: Any, caplog: pytest.LogCaptureFixture) -> None:
    # NVIDIA's memory-error guide: with a remap pending, unaffected work runs and new work may start.
    uuid = gpu(inventory, 0).uuid
    nvml = FakeNvml([g.uuid for g in inventory.gpus])
    source = NvmlHealthSource(nvml, lambda: inventory, poll_interval=0)
    nvml.remap[uuid] = (1, 0)
    with caplog.at_level(logging.INFO, logger="driver.gpu.health.conditions"):
        assert run_source(source, nvml, 2) == []
        nvml.remap[uuid] = (0, 0)
        assert run_source(source, nvml, 1) == []
    assert [r.message for r in caplog.records if "row remap" in r.message] == [
        "a memory row remap is pending on a GPU: it applies at the next GPU reset; running and new work is "
        "unaffected until then, so the GPU stays schedulable",
        "no memory row remap pending on the GPU any more"]


def test_a_recovery_action_event_reads_the_action_and_leaves_an_xid_79_gpu_unhealthy(inventory: Any) -> None:
    # nvml.h: eventData is 0 for every event but an XID's, so it says nothing about the recovery action.
    uuid = gpu(inventory, 0).uuid
    nvml = FakeNvml([g.uuid for g in inventory.gpus])
    nvml.events = [event(uuid, 0x8, 79), event(uuid, 0x8000, 0)]
    nvml.recovery_action[uuid] = 1  # NVML asks for a GPU reset
    source = NvmlHealthSource(nvml, lambda: inventory, poll_interval=3600)
    seen = run_source(source, nvml, 3)
    # The first poll may see the action before its event arrives: reported once either way, never RECOVERED.
    assert sorted((e.kind, e.xid or 0, e.detail) for e in seen) == [(EventKind.RECOVERY_ACTION, 0, "GPU reset"),
                                                                    (EventKind.XID, 79, "")]
    health: dict[str, Any] = {}
    for e in seen:
        health = apply_event(health, e, (), now=1.0)
    nvml.recovery_action[uuid] = 0  # the action is done (or withdrawn): its own reason goes, the XID's stays
    nvml.events = [event(uuid, 0x8000, 0)]
    for e in run_source(source, nvml, 2):
        health = apply_event(health, e, (), now=2.0)
    assert health[uuid].reason == "xid-79"
    sample = source.sample()[uuid]
    assert (sample.temperature_celsius, sample.power_watts, sample.memory_used_bytes) == (41.0, 123.456, 5 << 30)


def test_xid_154_reads_the_recovery_action_at_once_and_the_gpu_is_healthy_after_the_reset(inventory: Any) -> None:
    # What a GPU asking for a reset reports: XID 154 with field 230 at "GPU reset", then after the reset XID 154
    # again with field 230 back at none. The XID decides nothing; the field does, read when the XID arrives.
    uuid = gpu(inventory, 0).uuid
    nvml = FakeNvml([g.uuid for g in inventory.gpus])

    def action_changes(action: int) -> Any:
        def arrive() -> Any:
            nvml.recovery_action[uuid] = action
            return event(uuid, 0x8, 154)
        return arrive

    nvml.events = [action_changes(1)]
    source = NvmlHealthSource(nvml, lambda: inventory, poll_interval=3600)  # one poll, at the start
    seen = run_source(source, nvml, 2)
    assert [(e.kind, e.xid, e.detail) for e in seen] == [(EventKind.XID, 154, ""),
                                                         (EventKind.RECOVERY_ACTION, None, "GPU reset")]
    health: dict[str, Any] = {}
    for e in seen:
        health = apply_event(health, e, (), now=1.0)
    assert health[uuid].reason == "recovery-action"
    nvml.events = [action_changes(0)]
    for e in run_source(source, nvml, 2):
        health = apply_event(health, e, (), now=2.0)
    assert health == {}, "the reset GPU carries no taint: neither the action's nor XID 154's"


class OldNvml(FakeNvml):
    """nvidia-ml-py 12.560: no name for field 230 or the recovery-action and GPU-unavailable event bits."""

    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = None  # type: ignore[assignment]
    nvmlEventTypeGpuUnavailableError = None  # type: ignore[assignment]
    nvmlEventTypeGpuRecoveryAction = None  # type: ignore[assignment]


def test_an_old_pynvml_uses_nvml_h_values_and_what_the_driver_lacks_is_logged_once(
        inventory: Any, caplog: pytest.LogCaptureFixture) -> None:
    whole = gpu(inventory, 0)
    nvml = OldNvml([whole.uuid])
    one = inventory.model_copy(update={"gpus": (whole,)})
    nvml.supported_events = 0x8 | 0x2 | 0x4000 | 0x8000
    nvml.recovery_action[whole.uuid] = 4
    nvml.events = [event(whole.uuid, 0x8000), event(whole.uuid, 0x4000)]
    source = NvmlHealthSource(nvml, lambda: one, poll_interval=3600)
    with caplog.at_level(logging.INFO, logger="driver.gpu.health.nvmlsource"):
        seen = run_source(source, nvml, 3)
    assert nvml.registered[whole.uuid] == 0x8 | 0x2 | 0x4000 | 0x8000, "nvml.h's bits registered"
    assert [(e.kind, e.detail) for e in seen] == [(EventKind.RECOVERY_ACTION, "drain and reset"),
                                                  (EventKind.LOST, "NVML reported the GPU unavailable")]
    assert any(r.message.startswith("this pynvml lacks some NVML names") for r in caplog.records)

    # A driver older than the recovery action: the missing event types and field are said once, not per poll.
    caplog.clear()
    nvml.supported_events, nvml.field_return = 0x8 | 0x2, 3
    source = NvmlHealthSource(nvml, lambda: one, poll_interval=0)
    with caplog.at_level(logging.INFO, logger="driver.gpu.health"):
        assert run_source(source, nvml, 5) == []
        nvml.field_return = 0
        run_source(source, nvml, 2)
    said = [(r.message, getattr(r, "events_not_reported", None)) for r in caplog.records
            if "this pynvml" not in r.message]
    assert [m for m, _ in said if "cannot be read" in m] == [
        "the recovery action of a GPU cannot be read: the driver answers NVML field 230 with error 3 (older than "
        "r570, or not on this GPU); a GPU asking for a reset is seen only through its XIDs (XID 154 is then taken "
        "as asking for one)"]
    assert [lacking for m, lacking in said if "event types" in m] == [["GPU unavailable", "recovery action"]]
    assert [m for m, _ in said if "can be read again" in m] == ["the recovery action of a GPU can be read again"]


def test_xid_154_where_field_230_cannot_be_read_is_taken_as_asking_for_a_reset(inventory: Any) -> None:
    uuid = gpu(inventory, 0).uuid
    nvml = FakeNvml([g.uuid for g in inventory.gpus])
    nvml.field_return = 3  # NOT_SUPPORTED: a driver before the field
    nvml.events = [event(uuid, 0x8, 154)]
    source = NvmlHealthSource(nvml, lambda: inventory, poll_interval=3600)
    seen = run_source(source, nvml, 2)
    assert [(e.kind, e.detail) for e in seen] == [
        (EventKind.XID, ""),
        (EventKind.RECOVERY_ACTION, "XID 154 reported and NVML field 230 unreadable: a reset is assumed")]
    nvml.field_return = 0  # the field readable again (a driver update) and none asked for: the assumption goes
    assert [(e.kind, e.clears) for e in run_source(source, nvml, 1)] == [(EventKind.RECOVERED, "recovery-action")]


def test_remapped_rows_not_supported_on_a_mig_gpu_with_instances_is_said_once_and_shown(
        inventory: Any, caplog: pytest.LogCaptureFixture) -> None:
    # nvml.h: "On MIG-enabled GPUs with active instances, querying the number of remapped rows is not supported".
    migged = gpu(inventory, 1)
    assert migged.mig_enabled and migged.mig_instances
    nvml = FakeNvml([migged.uuid])
    nvml.remap_error = 3
    one = inventory.model_copy(update={"gpus": (migged,)})
    source = NvmlHealthSource(nvml, lambda: one, poll_interval=0)
    with caplog.at_level(logging.WARNING, logger="driver.gpu.health"):
        assert run_source(source, nvml, 4) == []
    said = [r.message for r in caplog.records if "remapping" in r.message]
    assert said == ["memory row remapping of a GPU cannot be read: NVML does not report remapped rows on a GPU in MIG "
                    "mode with instances (nvml.h); a failed remap is not detected while instances exist (XID 64 still "
                    "is)"]
    assert list(source.not_watched()) == [migged.uuid] and "MIG mode" in source.not_watched()[migged.uuid][
        "memory row remapping"]
    nvml.remap_error = None
    run_source(source, nvml, 1)
    assert source.not_watched() == {}


def test_an_event_in_a_gpu_instance_made_since_the_inventory_was_read_reaches_only_that_instance(
        inventory: Any) -> None:
    migged = gpu(inventory, 1)
    known = {m.gi_id for m in migged.mig_instances}
    new_gi = next(i for i in range(1, 15) if i not in known)
    nvml = FakeNvml([g.uuid for g in inventory.gpus])
    nvml.mig_devices[migged.uuid] = [(m.gi_id, m.ci_id, m.uuid) for m in migged.mig_instances] + [
        (new_gi, 0, "MIG-made-since")]
    nvml.events = [event(migged.uuid, 0x8, 94, gi=new_gi, ci=0), event(migged.uuid, 0x8, 94, gi=new_gi + 1, ci=0)]
    source = NvmlHealthSource(nvml, lambda: inventory, poll_interval=3600)
    seen = run_source(source, nvml, 3)
    assert [(e.uuid, e.parent_uuid) for e in seen] == [("MIG-made-since", migged.uuid), (migged.uuid, None)], \
        "the new instance alone; an instance gone by now still reaches its GPU"


# --- simulated events ---------------------------------------------------------------------------


def test_simulated_event_lines_are_checked() -> None:
    assert parse_line('{"uuid": "GPU-1", "xid": 79}', "f line 1").kind() is EventKind.XID
    assert parse_line('{"uuid": "GPU-1", "recovered": true}', "f line 1").kind() is EventKind.RECOVERED
    with pytest.raises(ValueError, match="f line 3: not a health event"):
        parse_line('{"uuid": "GPU-1", "xid": 79, "lost": true}', "f line 3")
    assert parse_line('{"uuid": "GPU-1", "xid": 94, "gpu_instance": 3}', "f line 4").gpu_instance == 3
    with pytest.raises(ValueError, match="compute_instance needs gpu_instance"):
        parse_line('{"uuid": "GPU-1", "xid": 94, "compute_instance": 0}', "f line 5")
    with pytest.raises(ValueError, match="gpu_instance goes with an xid or double_bit_ecc event"):
        parse_line('{"uuid": "GPU-1", "lost": true, "gpu_instance": 3}', "f line 6")
    with pytest.raises(ValueError, match="f line 4"):
        parse_line("{not json", "f line 4")


def test_the_simulated_source_follows_the_file_and_skips_bad_lines(tmp_path: Any, inventory: Any) -> None:
    path = tmp_path / "events.jsonl"
    mig = gpu(inventory, 1).mig_instances[0]
    seen: list[HealthEvent] = []
    stop = threading.Event()
    source = SimulatedHealthEvents(path, lambda: inventory)
    thread = threading.Thread(target=source.run, args=(seen.append, stop))
    thread.start()
    try:
        path.write_text(f'garbage\n{{"uuid": "{mig.uuid}", "xid": 94}}\n{{"uuid": "GPU-x", "lost": tr')
        deadline = threading.Event()
        for _ in range(100):
            if seen:
                break
            deadline.wait(0.05)
        with path.open("a") as handle:
            handle.write('ue}\n')
        for _ in range(100):
            if len(seen) == 2:
                break
            deadline.wait(0.05)
    finally:
        stop.set()
        thread.join()
    assert [(e.uuid, e.kind, e.parent_uuid) for e in seen] == [
        (mig.uuid, EventKind.XID, gpu(inventory, 1).uuid), ("GPU-x", EventKind.LOST, None)]


# --- the node's health as the driver uses it ----------------------------------------------------


def test_node_health_feeds_board_report_taints_and_refusals(tmp_path: Any, inventory: Any) -> None:
    from driver.gpu.health.node import NodeHealth
    from driver.gpu.health.report import add_to_inspect
    from driver.kubeletplugin.healthservice import Health, HealthBoard

    clock = {"now": 100.0}
    monitor = HealthMonitor(clock=lambda: clock["now"])
    board = HealthBoard()
    node = NodeHealth(monitor, board, driver_name=DRIVER, pool_name="node-1", taint_effect="NoSchedule",
                      report_path=tmp_path / "health.json", clock=lambda: clock["now"])
    view = make_view(inventory, {})
    node.update_board(view)
    first = board.current()
    assert {e.health for e in first} == {Health.HEALTHY} and {e.updated_at for e in first} == {100.0}
    clock["now"] = 130.0
    node.update_board(view)
    assert board.current() == first  # nothing changed: the same list, the same times

    monitor.handle(HealthEvent(gpu(inventory, 0).uuid, EventKind.XID, xid=79))
    node.update_board(view)
    by_name = {e.device: e for e in board.current()}
    assert by_name["gpu-0"].health is Health.UNHEALTHY and by_name["gpu-0"].updated_at == 130.0
    assert by_name["gpu-0"].message.startswith("xid-79: XID 79") and by_name["gpu-2"].updated_at == 100.0
    assert node.problems(view) == {"gpu-0": by_name["gpu-0"].message}
    assert all(not d.taints for d in node.devices(view))  # taints are off until the server supports them
    node.taints_enabled = True
    assert [d.name for d in node.devices(view) if d.taints] == ["gpu-0"]

    report: dict[str, Any] = {"claims": [{"claim": "ns/c", "devices": [{"device": "gpu-0"}]}], "problems": []}
    add_to_inspect(report, tmp_path / "health.json")
    assert report["device_health"]["gpu-0"]["health"] == "Unhealthy"
    assert report["claims"][0]["devices"][0]["health"] == "Unhealthy"
    assert "claim ns/c: device gpu-0 is unhealthy" in report["problems"][0]


def test_a_failed_source_makes_every_device_unknown_not_healthy(inventory: Any) -> None:
    from driver.gpu.health.node import NodeHealth
    from driver.kubeletplugin.healthservice import Health, HealthBoard

    class Broken:
        def describe(self) -> str:
            return "broken source"

        def run(self, emit: Any, stop: threading.Event) -> None:
            raise RuntimeError("NVML went away")

    monitor = HealthMonitor()
    node = NodeHealth(monitor, HealthBoard(), driver_name=DRIVER, pool_name="node-1", taint_effect="NoSchedule")
    view = make_view(inventory, {})
    heard = threading.Event()

    def listener(_health: Any) -> None:
        node.update_board(view)
        heard.set()

    monitor.add_listener(listener)
    monitor.start(Broken())
    assert heard.wait(10)
    monitor.stop()
    entries = node.board.current()
    assert {e.health for e in entries} == {Health.UNKNOWN}
    assert "broken source failed: NVML went away" in entries[0].message


def test_the_health_probe_reports_what_a_node_tells_and_what_the_source_cannot_read(
        inventory: Any, tmp_path: Any) -> None:
    # scripts/health-probe.py runs on real GPUs (scripts/gpu-machine-check.sh); here over the NVML fake.
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("health_probe", Path(__file__).parents[4] / "scripts/health-probe.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    whole = gpu(inventory, 0)
    nvml = OldNvml([whole.uuid])
    nvml.field_return = 3
    nvml.nvmlDeviceGetCount = lambda: 1  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetHandleByIndex = lambda index: f"h:{whole.uuid}"  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetMigMode = lambda handle: (0, 1)  # type: ignore[attr-defined]
    (tmp_path / "proc/driver/nvidia/capabilities/mig").mkdir(parents=True)
    (tmp_path / "proc/driver/nvidia/capabilities/mig/monitor").write_text("DeviceFileMinor: 2\n")
    report = module.probe(nvml, tmp_path)
    assert report["pynvml_lacks"] == ["NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", "nvmlEventTypeGpuUnavailableError",
                                      "nvmlEventTypeGpuRecoveryAction"]
    [entry] = report["gpus"]
    assert entry["mig_mode"] == {"current": 0, "pending": 1}
    assert entry["event_types"] == {"mask": "0xa", "gpu_unavailable": False, "recovery_action": False}
    assert entry["field_230"] == {"nvmlReturn": 3, "value": 0} and entry["remapped_rows"] == [0, 1, 0, 0]
    assert list(report["not_watched"][whole.uuid]) == ["the recovery action"]
    assert report["capabilities"] == {"mig/config": None, "mig/monitor": "DeviceFileMinor: 2\n",
                                      "dev_nvidia_caps": None}
