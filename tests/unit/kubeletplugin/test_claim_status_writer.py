"""Claim status writes (driver.kubeletplugin.claimstatus) against the API server double over real HTTP: server-side
apply of status.devices leaves other managers' entries and the allocation alone, marks coalesce, unchanged entries
cost nothing, and a server that drops or refuses the field is left alone."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from driver.kubeletplugin.claimstatus import ClaimStatusWriter, Condition, DeviceStatus, device_entries
from driver.kubeletplugin.kubeclient import APPLY_PATCH, KubeApiError, request_json
from driver.kubeletplugin.types import ClaimRef
from driver.simulation.apiserver import FakeApiServer

DRIVER = "gpu.tessera.dev"
OTHER = "nic.example.com"
NODE = "node-a"
CLAIMS = "/apis/resource.k8s.io/v1/namespaces/default/resourceclaims"


class Source:
    """A driver's answer per claim UID, changed by the tests."""

    def __init__(self) -> None:
        self.answers: dict[str, list[DeviceStatus]] = {}
        self.calls = 0
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, ref: ClaimRef) -> Sequence[DeviceStatus]:
        self.gate.wait(10)
        self.calls += 1
        return self.answers.get(ref.uid, [])


def ready(device: str, healthy: bool = True, **data: Any) -> DeviceStatus:
    return DeviceStatus(pool=NODE, device=device, conditions=(
        Condition("Ready", True, "Prepared"), Condition("Healthy", healthy, "Healthy" if healthy else "XidError")),
        data={"gpuUUID": f"GPU-{device}", **data})


@pytest.fixture
def source() -> Source:
    return Source()


@pytest.fixture
def writers() -> Iterator[list[ClaimStatusWriter]]:
    started: list[ClaimStatusWriter] = []
    yield started
    for writer in started:
        assert writer.stop()


def start_writer(server: FakeApiServer, source: Source, writers: list[ClaimStatusWriter],
                 **options: Any) -> ClaimStatusWriter:
    writer = ClaimStatusWriter(server.api_client(), DRIVER, DRIVER, source, initial_backoff=0.01, **options)
    writer.start()
    writers.append(writer)
    return writer


def put_claim(server: FakeApiServer, name: str = "c", devices: Sequence[tuple[str, str]] = ((DRIVER, "gpu-0"),)
              ) -> ClaimRef:
    results = [{"request": "r", "driver": d, "pool": NODE, "device": dev} for d, dev in devices]
    stored = server.put_claim({"metadata": {"name": name, "namespace": "default"},
                               "status": {"allocation": {"devices": {"results": results}}}})
    return ClaimRef(namespace="default", name=name, uid=stored["metadata"]["uid"])


def status_of(server: FakeApiServer, ref: ClaimRef) -> dict[str, Any]:
    claim = next(c for c in server.claims() if c["metadata"]["uid"] == ref.uid)
    return dict(claim.get("status") or {})


def patches(server: FakeApiServer) -> list[tuple[str, str]]:
    return [r for r in server.requests if r[0] == "PATCH"]


def apply_as(server: FakeApiServer, ref: ClaimRef, manager: str, devices: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": ref.name, "namespace": ref.namespace}, "status": {"devices": devices}}
    return request_json(server.api_client(), "PATCH", f"{CLAIMS}/{ref.name}/status", body=body,
                        content_type=APPLY_PATCH, query=[("fieldManager", manager)])


def other_entry() -> dict[str, Any]:
    return {"driver": OTHER, "pool": NODE, "device": "nic-0", "data": {"ip": "10.0.0.7"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "Up", "message": "",
                            "lastTransitionTime": "2026-01-01T00:00:00Z"}]}


def test_entries_are_applied_and_removed_leaving_other_drivers_entries_and_the_allocation(
        server: FakeApiServer, source: Source, writers: list[ClaimStatusWriter]) -> None:
    ref = put_claim(server, devices=[(DRIVER, "gpu-0"), (OTHER, "nic-0")])
    allocation = status_of(server, ref)["allocation"]
    apply_as(server, ref, OTHER, [other_entry()])
    writer = start_writer(server, source, writers)
    source.answers[ref.uid] = [ready("gpu-0", memory="80Gi")]
    writer.mark(ref)
    assert writer.wait_idle(10)
    status = status_of(server, ref)
    assert status["allocation"] == allocation
    by_driver = {e["driver"]: e for e in status["devices"]}
    assert by_driver[OTHER] == other_entry()
    mine = by_driver[DRIVER]
    assert (mine["pool"], mine["device"], mine["data"]) == (NODE, "gpu-0", {"gpuUUID": "GPU-gpu-0", "memory": "80Gi"})
    assert [(c["type"], c["status"]) for c in mine["conditions"]] == [("Ready", "True"), ("Healthy", "True")]

    source.answers[ref.uid] = []  # unprepared
    writer.mark(ref)
    assert writer.wait_idle(10)
    status = status_of(server, ref)
    assert status["devices"] == [other_entry()] and status["allocation"] == allocation


def test_a_condition_keeps_its_transition_time_until_its_status_changes(
        server: FakeApiServer, source: Source, writers: list[ClaimStatusWriter]) -> None:
    ref = put_claim(server)
    times = iter(["2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z", "2026-01-01T00:02:00Z"])
    writer = start_writer(server, source, writers, clock=lambda: next(times))
    source.answers[ref.uid] = [ready("gpu-0")]
    writer.mark(ref)
    assert writer.wait_idle(10)
    source.answers[ref.uid] = [ready("gpu-0", healthy=False)]
    writer.mark(ref)
    assert writer.wait_idle(10)
    [entry] = status_of(server, ref)["devices"]
    conditions = {c["type"]: c for c in entry["conditions"]}
    assert conditions["Ready"]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert (conditions["Healthy"]["status"], conditions["Healthy"]["reason"]) == ("False", "XidError")
    assert conditions["Healthy"]["lastTransitionTime"] == "2026-01-01T00:01:00Z"


def test_marks_while_a_write_waits_coalesce_and_unchanged_entries_are_not_sent(
        server: FakeApiServer, source: Source, writers: list[ClaimStatusWriter]) -> None:
    ref = put_claim(server)
    source.answers[ref.uid] = [ready("gpu-0")]
    source.gate.clear()  # the first write is held inside the driver's answer
    writer = start_writer(server, source, writers)
    writer.mark(ref)
    for _ in range(50):
        writer.mark(ref)  # never blocks, however many
    source.gate.set()
    assert writer.wait_idle(10)
    assert len(patches(server)) <= 2
    sent = len(patches(server))
    writer.mark(ref)
    assert writer.wait_idle(10)
    assert len(patches(server)) == sent, "nothing changed: nothing sent"


def test_entries_naming_a_device_the_claim_was_not_allocated_are_refused(server: FakeApiServer) -> None:
    ref = put_claim(server)
    with pytest.raises(KubeApiError) as refused:
        apply_as(server, ref, DRIVER, [{"driver": DRIVER, "pool": NODE, "device": "gpu-7"}])
    assert refused.value.status == 422 and "must be an allocated device" in refused.value.message


def test_another_manager_owning_an_entry_is_a_conflict_unless_forced(server: FakeApiServer, source: Source,
                                                                     writers: list[ClaimStatusWriter]) -> None:
    ref = put_claim(server)
    entry = {"driver": DRIVER, "pool": NODE, "device": "gpu-0", "data": {"by": "someone else"}}
    apply_as(server, ref, "someone-else", [entry])
    with pytest.raises(KubeApiError) as conflict:
        apply_as(server, ref, "third", [entry])
    assert conflict.value.status == 409
    writer = start_writer(server, source, writers)  # the driver forces: the entry is its own
    source.answers[ref.uid] = [ready("gpu-0")]
    writer.mark(ref)
    assert writer.wait_idle(10)
    [stored] = status_of(server, ref)["devices"]
    assert stored["data"] == {"gpuUUID": "GPU-gpu-0"}


def test_a_server_that_drops_the_field_is_logged_once_and_left_alone(
        source: Source, writers: list[ClaimStatusWriter], caplog: pytest.LogCaptureFixture) -> None:
    server = FakeApiServer(minor_version=36, claim_device_status_gate=False)
    server.start()
    try:
        refs = [put_claim(server, name=f"c{i}") for i in range(3)]
        writer = start_writer(server, source, writers)
        with caplog.at_level(logging.ERROR, logger="driver.kubeletplugin.claimstatus"):
            for ref in refs:
                source.answers[ref.uid] = [ready("gpu-0")]
                writer.mark(ref)
                assert writer.wait_idle(10)
        assert writer.disabled is not None and "DRAResourceClaimDeviceStatus" in writer.disabled
        assert len(patches(server)) == 1, "one write showed the field is dropped; no more were sent"
        assert len([r for r in caplog.records if "DRAResourceClaimDeviceStatus" in r.getMessage()]) == 1
        assert "devices" not in status_of(server, refs[0])
    finally:
        server.stop()


def test_a_server_that_refuses_the_write_is_logged_once_and_left_alone(
        server: FakeApiServer, source: Source, writers: list[ClaimStatusWriter],
        caplog: pytest.LogCaptureFixture) -> None:
    server.refuse_claim_status(403)
    refs = [put_claim(server, name=f"c{i}") for i in range(3)]
    writer = start_writer(server, source, writers)
    with caplog.at_level(logging.ERROR, logger="driver.kubeletplugin.claimstatus"):
        for ref in refs:
            source.answers[ref.uid] = [ready("gpu-0")]
            writer.mark(ref)
            assert writer.wait_idle(10)
    assert len(patches(server)) == 1
    assert writer.disabled is not None and "resourceclaims/status" in writer.disabled
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 1


def test_a_failed_write_is_retried_with_backoff_until_it_succeeds(server: FakeApiServer, source: Source,
                                                                   writers: list[ClaimStatusWriter]) -> None:
    ref = put_claim(server)
    server.refuse_claim_status(503, "ServiceUnavailable")
    writer = start_writer(server, source, writers)
    source.answers[ref.uid] = [ready("gpu-0")]
    writer.mark(ref)
    deadline = threading.Event()
    while len(patches(server)) < 3 and not deadline.wait(0.01):
        pass
    server.refuse_claim_status(None)
    assert writer.wait_idle(10)
    assert writer.disabled is None
    assert [e["device"] for e in status_of(server, ref)["devices"]] == ["gpu-0"]


def test_a_claim_deleted_before_its_write_costs_one_request_and_no_retry(
        server: FakeApiServer, source: Source, writers: list[ClaimStatusWriter]) -> None:
    ref = put_claim(server)
    server.delete_claim("default", "c")
    writer = start_writer(server, source, writers)
    source.answers[ref.uid] = [ready("gpu-0")]
    writer.mark(ref)
    assert writer.wait_idle(10)
    assert len(patches(server)) == 1 and writer.disabled is None


def test_the_queue_is_bounded(server: FakeApiServer, source: Source, writers: list[ClaimStatusWriter]) -> None:
    source.gate.clear()
    writer = start_writer(server, source, writers, max_pending=2)
    refs = [ClaimRef(namespace="default", name=f"c{i}", uid=f"00000000-0000-0000-0000-00000000000{i}")
            for i in range(6)]
    for ref in refs:
        writer.mark(ref)
    source.gate.set()
    assert writer.wait_idle(10)
    assert source.calls <= 3, "one in flight and two queued; the rest were dropped"


def test_data_over_the_apis_10_kib_is_replaced_by_a_note_and_conditions_stop_at_8() -> None:
    big = DeviceStatus(pool=NODE, device="gpu-0", data={"blob": "x" * 11000},
                       conditions=tuple(Condition(f"C{i}", True, "Why") for i in range(10)))
    [entry] = device_entries(DRIVER, [big], [], "2026-01-01T00:00:00Z")
    assert "blob" not in entry["data"] and "10240 bytes" in entry["data"]["note"]
    assert len(entry["conditions"]) == 8


def test_a_conditions_since_is_used_only_when_nothing_earlier_is_known() -> None:
    ready = DeviceStatus(pool=NODE, device="gpu-0",
                         conditions=(Condition("Ready", True, "Prepared", since="2026-01-01T00:00:00Z"),))
    [first] = device_entries(DRIVER, [ready], [], "2026-02-02T00:00:00Z")
    assert first["conditions"][0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"  # e.g. after a restart
    flipped = DeviceStatus(pool=NODE, device="gpu-0",
                           conditions=(Condition("Ready", False, "Gone", since="2026-01-01T00:00:00Z"),))
    [second] = device_entries(DRIVER, [flipped], [first], "2026-02-02T00:00:00Z")
    assert second["conditions"][0]["lastTransitionTime"] == "2026-02-02T00:00:00Z"


def test_a_burst_of_marks_is_written_once_the_node_is_quiet_each_claim_once(
        server: FakeApiServer, source: Source, writers: list[ClaimStatusWriter]) -> None:
    # A kubelet preparing many pods at once: the writes wait for a quiet moment instead of taking GIL time between
    # the prepares, and a claim marked several times in the burst is written once, with its latest state.
    first, second = put_claim(server, "a"), put_claim(server, "b")
    source.answers = {first.uid: [ready("gpu-0")], second.uid: [ready("gpu-1")]}
    writer = start_writer(server, source, writers, quiet=2.0, max_delay=60.0)
    for _ in range(10):
        writer.mark(first)
        writer.mark(second)
        assert patches(server) == [], "nothing is written while marks keep coming"
        threading.Event().wait(0.02)
    assert writer.wait_idle(30)
    assert len(patches(server)) == 2
    assert status_of(server, first)["devices"][0]["device"] == "gpu-0"


def test_marks_that_never_stop_still_get_each_claim_written_within_the_longest_delay(
        server: FakeApiServer, source: Source, writers: list[ClaimStatusWriter]) -> None:
    ref, busy = put_claim(server, "a"), put_claim(server, "b")
    source.answers = {ref.uid: [ready("gpu-0")]}
    writer = start_writer(server, source, writers, quiet=60.0, max_delay=0.3)
    writer.mark(ref)
    while not patches(server):  # another claim keeps the node busy; the first is written all the same
        writer.mark(busy)
        threading.Event().wait(0.02)
    assert status_of(server, ref)["devices"][0]["device"] == "gpu-0"
