"""Per-claim GPU usage: pods from cgroups, processes attributed to claims, entitlements, the watch and inspect."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from driver.gpu.health.processes import NvmlProcesses, read_pod_uid
from driver.gpu.health.usage import (
    SM_UNKNOWN_MIG,
    SM_UNKNOWN_MPS,
    ClaimDeviceUsage,
    ProcessUsage,
    claim_usage,
    pod_uid_from_cgroup,
)
from driver.gpu.health.usagereport import USAGE_FILE, add_to_inspect, render_usage, write_usage_report
from driver.gpu.health.usagewatch import ClaimUsageWatch
from driver.gpu.published.devices import make_view
from driver.gpu.published.targets import DeviceTarget, NodeView
from driver.gpu.record.checkpoint import ClaimRecord, PreparedDeviceRecord
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.telemetry import Telemetry
from driver.kubeletplugin.types import PreparedDevice
from driver.simulation.processes import SimulatedProcesses, parse_processes
from driver.units import GIB
from tests.support.pods import NonRootPods
from tests.support.statenode import StateNode, claim, mps_shares, ts_shares

POD_A = "0f3c8a52-1b2d-4e5f-8a9b-0c1d2e3f4a5b"
POD_B = "11111111-2222-4333-8444-555555555555"


def test_pod_uid_from_cgroupfs_v1_and_systemd_v2_paths() -> None:
    v1 = f"12:memory:/kubepods/burstable/pod{POD_A}/0123abcd\n11:cpu:/kubepods/burstable/pod{POD_A}/0123abcd\n"
    v2 = ("0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
          f"{POD_A.replace('-', '_')}.slice/cri-containerd-0123abcd.scope\n")
    assert pod_uid_from_cgroup(v1) == POD_A
    assert pod_uid_from_cgroup(v2) == POD_A
    assert pod_uid_from_cgroup("0::/system.slice/sshd.service\n") is None


def test_read_pod_uid_reads_the_host_proc_and_tolerates_a_gone_process(tmp_path: Path) -> None:
    (tmp_path / "proc" / "42").mkdir(parents=True)
    (tmp_path / "proc" / "42" / "cgroup").write_text(f"0::/kubepods/pod{POD_B}/c1\n")
    assert read_pod_uid(tmp_path, 42) == POD_B
    assert read_pod_uid(tmp_path, 43) is None


def test_claim_records_the_pods_it_is_reserved_for_and_old_checkpoints_load() -> None:
    parsed = ResourceClaim.model_validate({
        "metadata": {"name": "c", "namespace": "ns", "uid": "u"},
        "status": {"reservedFor": [{"resource": "pods", "name": "p", "uid": POD_A},
                                   {"resource": "jobs", "apiGroup": "batch", "name": "j", "uid": POD_B}]}})
    assert parsed.pod_uids == [POD_A]
    old = ClaimRecord.model_validate({"uid": "u", "namespace": "ns", "name": "c", "phase": "PrepareCompleted",
                                      "cdi_spec_file": "x.json"})
    assert old.pod_uids == []


def reserved(c: ResourceClaim, *pods: str) -> ResourceClaim:
    data = c.model_dump(by_alias=True)
    data["status"]["reservedFor"] = [{"resource": "pods", "name": f"pod-{p[:4]}", "uid": p} for p in pods]
    return ResourceClaim.model_validate(data).with_pod_reader(NonRootPods())


def shared_node(state_node: StateNode) -> tuple[Any, NodeView]:
    state = state_node.state()
    view, _ = state.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(0): mps_shares(2),
                                                                  state_node.uuid(2): ts_shares(2)})
    return state, view


def test_prepare_records_pod_uids_and_usage_is_set_against_each_share(state_node: StateNode) -> None:
    state, view = shared_node(state_node)
    state.prepare(reserved(claim("u1", "gpu-0-mps-0", name="mps-claim"), POD_A))
    state.prepare(reserved(claim("u2", "gpu-2-ts-0", name="ts-claim"), POD_B))
    state.prepare(reserved(claim("u3", "gpu-1-mig-1g10gb-6", name="mig-claim"), POD_A))
    cp = state.ledger.read()
    assert cp.claims["u1"].pod_uids == [POD_A]
    mig_uuid = view.targets["gpu-1-mig-1g10gb-6"].cuda_uuid
    processes = [
        ProcessUsage(pid=10, uuid=state_node.uuid(0), memory_bytes=3 * GIB, sm_percent=20.0, pod_uid=POD_A),
        ProcessUsage(pid=11, uuid=state_node.uuid(0), memory_bytes=GIB, sm_percent=None, pod_uid=POD_A),
        ProcessUsage(pid=20, uuid=state_node.uuid(2), memory_bytes=12 * GIB, sm_percent=70.0, pod_uid=POD_B),
        ProcessUsage(pid=30, uuid=mig_uuid, memory_bytes=GIB, pod_uid=POD_A),
        ProcessUsage(pid=40, uuid=state_node.uuid(0), memory_bytes=5 * GIB, pod_uid=None),  # not a pod's
        ProcessUsage(pid=41, uuid=state_node.uuid(2), memory_bytes=5 * GIB, pod_uid=POD_A),  # not that claim's pod
    ]
    usage = {u.claim: u for u in claim_usage(cp.claims.values(), processes, view.targets, cp.layout)}
    mps, ts, mig = usage["mps-claim"], usage["ts-claim"], usage["mig-claim"]
    # An MPS share's SM use is the server's in NVML's eyes: pid 10's sample is not the claim's (see below).
    assert (mps.pids, mps.memory_bytes, mps.sm_percent, mps.sm_unknown) == ((10, 11), 4 * GIB, None, SM_UNKNOWN_MPS)
    assert (mps.memory_limit_bytes, mps.sm_limit_percent, mps.enforced) == (10 * GIB, 50.0, True)
    assert mps.over_entitlement == []
    assert (ts.pids, ts.memory_limit_bytes, ts.sm_limit_percent, ts.enforced) == ((20,), 10 * GIB, 50.0, False)
    assert ts.over_entitlement == ["memory", "sm"]
    assert mig.pids == (30,) and mig.memory_limit_bytes == view.targets["gpu-1-mig-1g10gb-6"].memory_bytes


def test_a_claim_without_processes_reports_zero_not_nothing(state_node: StateNode) -> None:
    state, view = shared_node(state_node)
    state.prepare(reserved(claim("u1", "gpu-0-mps-1"), POD_A))
    cp = state.ledger.read()
    [u] = claim_usage(cp.claims.values(), [], view.targets, cp.layout)
    assert (u.pids, u.memory_bytes, u.sm_percent, u.over_entitlement) == ((), 0, None, [])


def test_simulated_processes_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "procs.json"
    source = SimulatedProcesses(path)
    assert source.processes() == []  # no file yet: nothing runs
    path.write_text(json.dumps([{"uuid": "GPU-a", "pid": 7, "pod_uid": POD_A, "memory_bytes": 5, "sm_percent": 9}]))
    assert source.processes() == [ProcessUsage(pid=7, uuid="GPU-a", memory_bytes=5, sm_percent=9.0, pod_uid=POD_A)]
    path.write_text('[{"uuid": "GPU-a", "pid": 0}]')
    with caplog.at_level(logging.ERROR):
        assert source.processes() == []
        assert source.processes() == []
    assert len([r for r in caplog.records if "simulated GPU processes" in r.message]) == 1
    with pytest.raises(ValueError, match=r"x: not a process list \(entry 0.pid: Input should be greater than 0\)"):
        parse_processes('[{"uuid": "GPU-a", "pid": -1}]', "x")


class FakeNvml:
    """pynvml's process calls as nvml.h documents them (pid, usedGpuMemory, instance ids; smUtil samples)."""

    class NVMLError(Exception):
        pass

    def __init__(self, gpu_uuid: str, running: list[Any], mps: list[Any], samples: list[Any] | None) -> None:
        self.gpu_uuid, self.running, self.mps, self.samples = gpu_uuid, running, mps, samples

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid != self.gpu_uuid:
            raise self.NVMLError("not found")
        return uuid

    def nvmlDeviceGetComputeRunningProcesses(self, _handle: str) -> list[Any]:
        return self.running

    def nvmlDeviceGetMPSComputeRunningProcesses(self, _handle: str) -> list[Any]:
        return self.mps

    def nvmlDeviceGetProcessUtilization(self, _handle: str, _since: int) -> list[Any]:
        if self.samples is None:
            raise self.NVMLError("Not Supported")
        return self.samples


def proc(pid: int, memory: int | None, gi: int = 0xFFFFFFFF, ci: int = 0xFFFFFFFF) -> Any:
    return SimpleNamespace(pid=pid, usedGpuMemory=memory, gpuInstanceId=gi, computeInstanceId=ci)


def test_nvml_processes_map_mig_instances_dedup_mps_and_take_the_latest_sample(state_node: StateNode) -> None:
    gpu = state_node.inventory.gpu_by_minor(1)
    assert gpu is not None
    mig = gpu.mig_instances[0]
    (state_node.host / "proc" / "5").mkdir(parents=True)
    (state_node.host / "proc" / "5" / "cgroup").write_text(f"0::/kubepods/pod{POD_A}/c\n")
    samples = [SimpleNamespace(pid=5, timeStamp=1, smUtil=10), SimpleNamespace(pid=5, timeStamp=2, smUtil=30)]
    nvml = FakeNvml(gpu.uuid, [proc(5, 2 * GIB, mig.gi_id, mig.ci_id), proc(6, None)], [proc(5, 2 * GIB, mig.gi_id)],
                    samples)
    found = NvmlProcesses(nvml, lambda: state_node.inventory, state_node.host).processes()
    assert found == [ProcessUsage(pid=5, uuid=mig.uuid, memory_bytes=2 * GIB, sm_percent=30.0, pod_uid=POD_A,
                                  mps_client=True),
                     ProcessUsage(pid=6, uuid=gpu.uuid, memory_bytes=None, sm_percent=None, pod_uid=None)]
    nvml.samples = None  # utilisation not supported: memory still reported
    assert [p.sm_percent for p in NvmlProcesses(nvml, lambda: state_node.inventory,
                                                state_node.host).processes()] == [None, None]


class OldDriverNvml(FakeNvml):
    """A driver without the _v3 process calls: pynvml's unversioned calls raise its NVMLLibraryMismatchError."""

    class NVMLLibraryMismatchError(Exception):  # pynvml's is a plain Exception, not an NVMLError
        pass

    def nvmlDeviceGetComputeRunningProcesses(self, _handle: str) -> list[Any]:
        raise self.NVMLLibraryMismatchError("Unversioned function called and the pyNVML version does not match")

    def nvmlDeviceGetMPSComputeRunningProcesses(self, _handle: str) -> list[Any]:
        raise self.NVMLLibraryMismatchError("Unversioned function called and the pyNVML version does not match")

    def nvmlDeviceGetComputeRunningProcesses_v2(self, _handle: str) -> list[Any]:
        return self.running

    def nvmlDeviceGetMPSComputeRunningProcesses_v2(self, _handle: str) -> list[Any]:
        return self.mps


def test_nvml_processes_fall_back_to_v2_on_a_driver_without_the_v3_calls(state_node: StateNode) -> None:
    gpu = state_node.inventory.gpu_by_minor(0)
    assert gpu is not None
    nvml = OldDriverNvml(gpu.uuid, [proc(7, GIB)], [proc(8, GIB)], None)
    found = NvmlProcesses(nvml, lambda: state_node.inventory, state_node.host).processes()
    assert [(p.pid, p.memory_bytes) for p in found] == [(7, GIB), (8, GIB)]


def test_watch_logs_once_when_over_an_unenforced_entitlement_and_inspect_shows_it(
        state_node: StateNode, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state, view = shared_node(state_node)
    state.prepare(reserved(claim("u2", "gpu-2-ts-0", name="ts-claim"), POD_B))
    procs = tmp_path / "procs.json"
    procs.write_text(json.dumps([{"uuid": state_node.uuid(2), "pid": 20, "pod_uid": POD_B, "memory_bytes": 12 * GIB}]))
    clock = iter(range(0, 100, 5))
    watch = ClaimUsageWatch(SimulatedProcesses(procs), state.ledger.read, lambda: view,
                            report_path=tmp_path / USAGE_FILE, clock=lambda: float(next(clock)))
    with caplog.at_level(logging.INFO):
        watch.usage()
        watch.usage()
        procs.write_text("[]")
        watch.usage()
    messages = [r.message for r in caplog.records if "entitlement" in r.message]
    assert messages == ["a claim's processes use more than its share's entitlement, which nothing enforces",
                        "a claim's processes are back within their share's entitlement"]
    procs.write_text(json.dumps([{"uuid": state_node.uuid(2), "pid": 20, "pod_uid": POD_B, "memory_bytes": 12 * GIB}]))
    watch.usage()
    report: dict[str, Any] = {"claims": [{"claim": "default/ts-claim", "devices": [{"device": "gpu-2-ts-0"}]}],
                              "problems": []}
    add_to_inspect(report, tmp_path / USAGE_FILE)
    usage = report["claims"][0]["devices"][0]["usage"]
    assert usage["pids"] == [20] and usage["over_entitlement"] == ["memory"] and not usage["enforced"]
    assert report["device_usage"]["gpu-2-ts-0"]["claims"] == ["default/ts-claim"]
    text = "\n".join(render_usage(report))
    assert "default/ts-claim gpu-2-ts-0: memory 12288MiB of 10240MiB entitled" in text
    assert "OVER ENTITLEMENT (memory)" in text


def test_inspect_names_an_unreadable_usage_file(tmp_path: Path) -> None:
    (tmp_path / USAGE_FILE).write_text("{")
    report: dict[str, Any] = {"claims": [], "problems": []}
    add_to_inspect(report, tmp_path / USAGE_FILE)
    assert report["problems"] and USAGE_FILE in report["problems"][0]
    assert render_usage(report) == []


def test_a_consumable_share_is_entitled_to_what_it_consumed_and_as_its_limits_are_advisory_going_over_shows(
        state_node: StateNode) -> None:
    gpu = state_node.inventory.gpu_by_minor(0)
    assert gpu is not None and gpu.multiprocessors == 132
    device = PreparedDeviceRecord(
        device=PreparedDevice(request_names=["r"], pool_name="p", device_name="gpu-0-shared", cdi_device_ids=[]),
        kind="consumable", gpu_uuid=gpu.uuid, gpu_minor=0, consumed_memory_bytes=4 * GIB, consumed_multiprocessors=33)
    record = ClaimRecord(uid="u", namespace="ns", name="c", phase="PrepareCompleted", cdi_spec_file="x",
                         devices=[device], pod_uids=[POD_A])
    targets = {"gpu-0-shared": DeviceTarget(name="gpu-0-shared", kind="consumable", gpu=gpu)}
    [u] = claim_usage([record], [ProcessUsage(pid=1, uuid=gpu.uuid, memory_bytes=5 * GIB, pod_uid=POD_A)],
                      targets, {})
    # Its GPU stays in compute mode DEFAULT, so a process that skips its daemon is not held (mps-advisory).
    assert (u.memory_limit_bytes, u.sm_limit_percent, u.enforced) == (4 * GIB, 25.0, False)
    assert u.over_memory and u.over_entitlement == ["memory"]


# What NVML cannot attribute is unknown, never zero; admin-access devices hold no share.
POD_MPS_HOST = "22222222-3333-4444-8555-666666666666"


def proc_files(host: Path, pid: int, pod: str | None, parent: int = 1) -> None:
    """``/proc/<pid>/{cgroup,stat}`` under the host root, as the kernel writes them."""
    (host / "proc" / str(pid)).mkdir(parents=True)
    (host / "proc" / str(pid) / "cgroup").write_text(f"0::/kubepods/pod{pod}/c\n" if pod else "0::/system.slice\n")
    (host / "proc" / str(pid) / "stat").write_text(f"{pid} (some (proc)) S {parent} {pid} {pid} 0 -1 " + "0 " * 30)


def metric_samples(watch: ClaimUsageWatch) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    telemetry = Telemetry("t", "tessera")
    watch.register_metrics(telemetry)
    try:
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if not k.startswith("otel_")))): s.value
                for f in text_string_to_metric_families(telemetry.render_metrics().decode()) for s in f.samples}
    finally:
        telemetry.shutdown()


def test_mps_clients_memory_is_each_claims_while_their_sm_is_unknown_and_the_server_is_nobodys(
        state_node: StateNode) -> None:
    state, view = shared_node(state_node)
    state.prepare(reserved(claim("u1", "gpu-0-mps-0", name="a"), POD_A))
    state.prepare(reserved(claim("u2", "gpu-0-mps-1", name="b"), POD_B))
    cp = state.ledger.read()
    [daemon] = cp.mps_daemons.values()
    gpu = state_node.inventory.gpu_by_minor(0)
    assert gpu is not None
    # As NVML reports MPS: the server in the compute list (with all the SM work), the clients in the MPS
    # list with their own memory, and no utilisation of their own (0 where NVML lists them at all).
    proc_files(state_node.host, 100, POD_MPS_HOST, parent=daemon.pid)
    proc_files(state_node.host, 101, POD_A)
    proc_files(state_node.host, 102, POD_B)
    samples = [SimpleNamespace(pid=100, timeStamp=5, smUtil=80), SimpleNamespace(pid=101, timeStamp=5, smUtil=0),
               SimpleNamespace(pid=102, timeStamp=5, smUtil=0)]
    nvml = FakeNvml(gpu.uuid, [proc(100, 300 << 20)], [proc(101, 3 * GIB), proc(102, GIB)], samples)
    found = NvmlProcesses(nvml, lambda: state_node.inventory, state_node.host).processes()
    assert [(p.pid, p.mps_client, p.parent_pid, p.pod_uid) for p in found] == [
        (100, False, daemon.pid, POD_MPS_HOST), (101, True, 1, POD_A), (102, True, 1, POD_B)]
    usage = {u.claim: u for u in claim_usage(cp.claims.values(), found, view.targets, cp.layout,
                                             mps_daemon_pids={daemon.pid})}
    assert (usage["a"].pids, usage["a"].memory_bytes) == ((101,), 3 * GIB)
    assert (usage["b"].pids, usage["b"].memory_bytes) == ((102,), GIB)
    for u in usage.values():
        assert (u.sm_percent, u.sm_unknown, u.over_entitlement) == (None, SM_UNKNOWN_MPS, [])


def test_the_mps_server_is_no_claims_even_from_a_claims_pod(state_node: StateNode) -> None:
    state, view = shared_node(state_node)
    state.prepare(reserved(claim("u1", "gpu-0-mps-0", name="a"), POD_A))
    cp = state.ledger.read()
    [daemon] = cp.mps_daemons.values()
    # Its cgroup is whatever its launcher's is; the daemon's parentage, not its pod, says it serves every client.
    server = ProcessUsage(pid=100, uuid=state_node.uuid(0), memory_bytes=GIB, sm_percent=80.0, pod_uid=POD_A,
                          parent_pid=daemon.pid)
    client = ProcessUsage(pid=101, uuid=state_node.uuid(0), memory_bytes=2 * GIB, pod_uid=POD_A, mps_client=True,
                          parent_pid=1)
    [u] = claim_usage(cp.claims.values(), [server, client], view.targets, cp.layout, mps_daemon_pids={daemon.pid})
    assert (u.pids, u.memory_bytes, u.sm_percent) == ((101,), 2 * GIB, None)


def test_sm_on_a_mig_device_is_unknown_not_zero_and_inspect_says_so(state_node: StateNode, tmp_path: Path) -> None:
    state, view = shared_node(state_node)
    state.prepare(reserved(claim("u3", "gpu-1-mig-1g10gb-6", name="mig-claim"), POD_A))
    mig_uuid = view.targets["gpu-1-mig-1g10gb-6"].cuda_uuid
    procs = tmp_path / "procs.json"
    # A zero sample, as a simulated or misreporting source might give: nvml.h defines no process utilisation on MIG.
    procs.write_text(json.dumps([{"uuid": mig_uuid, "pid": 30, "pod_uid": POD_A, "memory_bytes": GIB,
                                  "sm_percent": 0}]))
    watch = ClaimUsageWatch(SimulatedProcesses(procs), state.ledger.read, lambda: view,
                            report_path=tmp_path / USAGE_FILE)
    [u] = watch.usage()
    assert (u.pids, u.memory_bytes, u.sm_percent, u.sm_unknown) == ((30,), GIB, None, SM_UNKNOWN_MIG)
    labels = (("claim", "mig-claim"), ("device", "gpu-1-mig-1g10gb-6"), ("enforced", "true"), ("kind", "mig"),
              ("namespace", "default"))
    scraped = metric_samples(watch)
    assert scraped[("tessera_claim_gpu_memory_used_bytes", labels)] == GIB
    assert ("tessera_claim_gpu_sm_utilization_percent", labels) not in scraped
    assert ("tessera_claim_gpu_over_entitlement", tuple(sorted((*labels, ("resource", "sm"))))) not in scraped
    report: dict[str, Any] = {"claims": [{"claim": "default/mig-claim",
                                          "devices": [{"device": "gpu-1-mig-1g10gb-6"}]}], "problems": []}
    add_to_inspect(report, tmp_path / USAGE_FILE)
    assert f"SM unknown ({SM_UNKNOWN_MIG}) of 100%" in "\n".join(render_usage(report))


def consumable_record(gpu_uuid: str, *, admin: bool = False, kind: str = "consumable",
                      name: str = "gpu-0-shared") -> ClaimRecord:
    device = PreparedDeviceRecord(
        device=PreparedDevice(request_names=["r"], pool_name="p", device_name=name, cdi_device_ids=[]),
        kind=kind, gpu_uuid=gpu_uuid, gpu_minor=0, consumed_memory_bytes=None if admin else 4 * GIB,
        consumed_multiprocessors=None if admin else 33, admin_access=admin)
    return ClaimRecord(uid="u", namespace="ns", name="c", phase="PrepareCompleted", cdi_spec_file="x",
                       devices=[device], pod_uids=[POD_A])


def test_no_over_entitlement_is_found_or_published_on_an_unknown_use(state_node: StateNode) -> None:
    gpu = state_node.inventory.gpu_by_minor(0)
    assert gpu is not None
    targets = {"gpu-0-shared": DeviceTarget(name="gpu-0-shared", kind="consumable", gpu=gpu)}
    # A consumable share's client with a high sample (the server's work, as NVML gives it) and no memory figure.
    client = ProcessUsage(pid=1, uuid=gpu.uuid, memory_bytes=None, sm_percent=90.0, pod_uid=POD_A, mps_client=True)
    [u] = claim_usage([consumable_record(gpu.uuid)], [client], targets, {})
    assert (u.memory_bytes, u.sm_percent, u.sm_limit_percent, u.enforced) == (None, None, 25.0, False)
    assert (u.over_entitlement, u.judged) == ([], [])
    # Known again: judged again.
    known = ProcessUsage(pid=1, uuid=gpu.uuid, memory_bytes=5 * GIB, pod_uid=POD_A, mps_client=True)
    [u] = claim_usage([consumable_record(gpu.uuid)], [known], targets, {})
    assert (u.over_entitlement, u.judged) == (["memory"], ["memory"])


def test_admin_access_devices_have_no_entitlement_and_raise_no_alarm(
        state_node: StateNode, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    state, view = shared_node(state_node)
    cp = state.ledger.read()
    # A monitoring claim on a time-slice share whose process uses more than a share's part of the GPU.
    admin = consumable_record(state_node.uuid(2), admin=True, kind="timeslice", name="gpu-2-ts-0")
    procs = tmp_path / "procs.json"
    procs.write_text(json.dumps([{"uuid": state_node.uuid(2), "pid": 20, "pod_uid": POD_A, "memory_bytes": 12 * GIB,
                                  "sm_percent": 70}]))
    watch = ClaimUsageWatch(SimulatedProcesses(procs), lambda: cp.model_copy(update={"claims": {"u": admin}}),
                            lambda: view, report_path=tmp_path / USAGE_FILE)
    with caplog.at_level(logging.INFO):
        [u] = watch.usage()
    assert (u.memory_bytes, u.sm_percent, u.memory_limit_bytes, u.sm_limit_percent) == (12 * GIB, 70.0, None, None)
    assert (u.admin_access, u.enforced, u.over_entitlement, u.judged) == (True, False, [], [])
    assert not [r for r in caplog.records if "entitlement" in r.message]
    scraped = metric_samples(watch)
    assert not [key for key in scraped if key[0] in ("tessera_claim_gpu_over_entitlement",
                                                     "tessera_claim_gpu_memory_limit_bytes")]
    report: dict[str, Any] = {"claims": [{"claim": "ns/c", "devices": [{"device": "gpu-2-ts-0"}]}], "problems": []}
    add_to_inspect(report, tmp_path / USAGE_FILE)
    assert "ns/c gpu-2-ts-0: memory 12288MiB, SM 70%, 1 process(es), admin access: no entitlement" in \
        "\n".join(render_usage(report))


def test_a_device_total_is_unknown_when_one_claims_memory_is(tmp_path: Path) -> None:
    entries = [ClaimDeviceUsage(namespace="ns", claim=c, device="gpu-0-mps-0", kind="mps", pids=(p,),
                                memory_bytes=m, memory_limit_bytes=None, sm_percent=None, sm_limit_percent=None,
                                enforced=False, sm_unknown=SM_UNKNOWN_MPS)
               for c, p, m in (("a", 1, GIB), ("b", 2, None))]
    write_usage_report(tmp_path / USAGE_FILE, entries)
    report: dict[str, Any] = {"claims": [{"claim": f"ns/{c}", "devices": [{"device": "gpu-0-mps-0"}]} for c in "ab"],
                              "problems": []}
    add_to_inspect(report, tmp_path / USAGE_FILE)
    assert report["device_usage"]["gpu-0-mps-0"]["memory_bytes"] is None
    assert "device gpu-0-mps-0: memory ?, 2 process(es)" in "\n".join(render_usage(report))


def test_a_whole_gpu_reports_its_processes_sm_unless_its_claim_runs_mps_on_it(state_node: StateNode) -> None:
    gpu = state_node.inventory.gpu_by_minor(0)
    assert gpu is not None
    targets = {"gpu-0": DeviceTarget(name="gpu-0", kind="gpu", gpu=gpu)}
    plain = ProcessUsage(pid=1, uuid=gpu.uuid, memory_bytes=GIB, sm_percent=40.0, pod_uid=POD_A)

    def whole(daemon: str | None) -> ClaimRecord:
        record = consumable_record(gpu.uuid, kind="gpu", name="gpu-0")
        device = record.devices[0].model_copy(update={"mps_daemon_id": daemon, "consumed_memory_bytes": None,
                                                      "consumed_multiprocessors": None})
        return record.model_copy(update={"devices": [device]})

    [u] = claim_usage([whole(None)], [plain], targets, {})
    assert (u.sm_percent, u.sm_unknown, u.judged) == (40.0, None, ["memory", "sm"])
    # Per-claim GpuConfig.sharing MPS: the claim's processes are its daemon's clients.
    [u] = claim_usage([whole("claim-daemon")], [plain], targets, {})
    assert (u.sm_percent, u.sm_unknown) == (None, SM_UNKNOWN_MPS)
