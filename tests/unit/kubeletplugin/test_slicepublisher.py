"""The ResourceSlice publisher (driver.kubeletplugin.slicepublisher) end to end against the API server
double over real HTTP: writes, watch, repair, backoff."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from driver.kubeletplugin.kubeclient import request_json
from driver.kubeletplugin.slicemodel import Device, DeviceTaint
from driver.kubeletplugin.sliceplanner import slice_name_prefix
from driver.kubeletplugin.slicepublisher import ResourceSlicePublisher
from driver.kubeletplugin.slicewriter import SLICES_PATH
from driver.kubeletplugin.telemetry import Telemetry
from driver.simulation.apiserver import FakeApiServer
from tests.support.kubeletplugin import DRIVER, NODE, eventually, gpu, gpus

LOGGER = "driver.kubeletplugin.slicepublisher"


@pytest.fixture
def server(node_apiserver: FakeApiServer) -> FakeApiServer:
    return node_apiserver


@pytest.fixture
def start_publisher(server: FakeApiServer, telemetry: Telemetry) -> Iterator[Callable[..., ResourceSlicePublisher]]:
    started: list[ResourceSlicePublisher] = []

    def start(fake: FakeApiServer = server, node: str = NODE, **options: Any) -> ResourceSlicePublisher:
        options.setdefault("resync_delay", 0.05)
        publisher = ResourceSlicePublisher(fake.api_client(), DRIVER, node, telemetry, **options)
        publisher.start()
        started.append(publisher)
        return publisher

    yield start
    for publisher in started:
        assert publisher.stop(timeout=5)


def writes(server: FakeApiServer) -> list[tuple[str, str]]:
    return [r for r in server.requests if r[0] in ("POST", "PUT", "DELETE")]


def test_initial_publish(server: FakeApiServer, start_publisher: Callable[..., ResourceSlicePublisher],
                         spans: InMemorySpanExporter, telemetry: Telemetry) -> None:
    node_uid = server.add_node("node-2")
    publisher = start_publisher(node="node-2")
    publisher.update(gpus(130))
    assert publisher.wait_synced(10)
    slices = server.slices(node="node-2")
    assert [s["metadata"]["name"][:-5] for s in slices] == [
        "00000-gpu.tessera.dev-node-2-", "00001-gpu.tessera.dev-node-2-"]
    assert [len(s["spec"]["devices"]) for s in slices] == [128, 2]
    assert [s["spec"]["pool"] for s in slices] == [{"name": "node-2", "generation": 1, "resourceSliceCount": 2}] * 2
    assert all(s["spec"]["nodeName"] == "node-2" and s["spec"]["driver"] == DRIVER for s in slices)
    assert slices[0]["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": "node-2", "uid": node_uid, "controller": True}]
    assert slices[1]["spec"]["devices"][1] == gpu(129).to_wire()
    assert publisher.published_device_count == 130
    assert publisher.kubernetes_minor_version == 36  # read from the server's /version

    rounds = [s for s in spans.get_finished_spans() if s.name == "tessera.publish_resourceslices"]
    assert rounds and rounds[-1].attributes is not None
    assert rounds[-1].attributes["tessera.resourceslice.device_count"] == 130
    assert rounds[-1].attributes["tessera.resourceslice.slice_count"] == 2
    assert rounds[-1].attributes["tessera.resourceslice.generation"] == 1
    metrics = telemetry.render_metrics().decode()
    assert re.search(r'tessera_resourceslice_syncs_total\{[^}]*result="changed"[^}]*\} 1\.0$', metrics, re.M)
    assert re.search(r'tessera_resourceslice_syncs_total\{[^}]*result="unchanged"', metrics)


def test_nothing_is_published_before_the_first_update(server: FakeApiServer,
                                                      start_publisher: Callable[..., ResourceSlicePublisher]) -> None:
    publisher = start_publisher()
    assert not publisher.wait_synced(0.2)
    assert writes(server) == []


def test_zero_devices_publish_one_empty_slice(server: FakeApiServer,
                                              start_publisher: Callable[..., ResourceSlicePublisher]) -> None:
    publisher = start_publisher()
    publisher.update([])
    assert publisher.wait_synced(10)
    (only,) = server.slices(node=NODE)
    assert only["spec"]["pool"]["resourceSliceCount"] == 1
    assert only["spec"].get("devices", []) == []
    assert publisher.published_device_count == 0


def test_change_in_one_slice_keeps_generation_and_slice(server: FakeApiServer,
                                                       start_publisher: Callable[..., ResourceSlicePublisher]) -> None:
    publisher = start_publisher()
    publisher.update(gpus(130))
    assert publisher.wait_synced(10)
    before = server.slices(node=NODE)
    changed = gpus(130)
    changed[129] = gpu(129, product="NVIDIA H200")
    publisher.update(changed)
    assert publisher.wait_synced(10)
    after = server.slices(node=NODE)
    assert [s["metadata"]["name"] for s in after] == [s["metadata"]["name"] for s in before]
    assert {s["spec"]["pool"]["generation"] for s in after} == {1}
    assert after[0]["metadata"]["resourceVersion"] == before[0]["metadata"]["resourceVersion"]  # untouched
    assert after[1]["spec"]["devices"][1]["attributes"]["productName"] == {"string": "NVIDIA H200"}


def test_changes_in_two_slices_bump_generation(server: FakeApiServer,
                                               start_publisher: Callable[..., ResourceSlicePublisher]) -> None:
    publisher = start_publisher()
    publisher.update(gpus(130))
    assert publisher.wait_synced(10)
    names = [s["metadata"]["name"] for s in server.slices(node=NODE)]
    publisher.update(gpus(130, product="NVIDIA H200"))
    assert publisher.wait_synced(10)
    after = server.slices(node=NODE)
    assert [s["metadata"]["name"] for s in after] == names  # updated in place
    assert {s["spec"]["pool"]["generation"] for s in after} == {2}


def test_stale_slices_are_removed(server: FakeApiServer,
                                  start_publisher: Callable[..., ResourceSlicePublisher]) -> None:
    api = server.api_client()

    def leftover(name_field: dict[str, str], node: str = NODE) -> None:
        request_json(api, "POST", SLICES_PATH, body={"metadata": name_field, "spec": {
            "driver": DRIVER, "nodeName": node, "pool": {"name": node, "generation": 9, "resourceSliceCount": 3},
            "devices": [{"name": "gone-0"}]}})

    leftover({"generateName": f"{NODE}-{DRIVER}-"})             # old 1.34 naming
    leftover({"generateName": slice_name_prefix(2, DRIVER, NODE)})  # index beyond what we publish
    leftover({"generateName": slice_name_prefix(0, DRIVER, "node-2")}, node="node-2")  # not our node
    publisher = start_publisher()
    publisher.update(gpus(2))
    assert publisher.wait_synced(10)
    (ours,) = server.slices(node=NODE)
    assert [d["name"] for d in ours["spec"]["devices"]] == ["gpu-0", "gpu-1"]
    assert ours["spec"]["pool"]["generation"] == 10  # above the leftovers' generation
    assert len(server.slices(node="node-2")) == 1

    publisher.update([gpu(0)])
    assert publisher.wait_synced(10)
    (ours,) = server.slices(node=NODE)
    assert [d["name"] for d in ours["spec"]["devices"]] == ["gpu-0"]


def test_shrinking_deletes_before_updating(server: FakeApiServer,
                                           start_publisher: Callable[..., ResourceSlicePublisher]) -> None:
    publisher = start_publisher()
    publisher.update(gpus(130))
    assert publisher.wait_synced(10)
    first_write = len(writes(server))
    publisher.update(gpus(3))
    assert publisher.wait_synced(10)
    assert [verb for verb, _ in writes(server)[first_write:]] == ["DELETE", "PUT"]
    (only,) = server.slices(node=NODE)
    assert only["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}


def test_wiped_slices_are_recreated_through_the_watch(server: FakeApiServer,
                                                      start_publisher: Callable[..., ResourceSlicePublisher]) -> None:
    publisher = start_publisher()
    publisher.update(gpus(130))
    assert publisher.wait_synced(10)
    before = {s["metadata"]["name"] for s in server.slices(node=NODE)}
    assert eventually(lambda: server.requests[-1][0] == "WATCH")
    assert server.wipe_slices(NODE) == 2  # what the kubelet does when it starts
    assert eventually(lambda: len(server.slices(node=NODE)) == 2)
    assert publisher.wait_synced(10)
    after = server.slices(node=NODE)
    assert {s["metadata"]["name"] for s in after}.isdisjoint(before)
    assert sum(len(s["spec"]["devices"]) for s in after) == 130


def test_slices_changed_by_someone_else_are_repaired(server: FakeApiServer,
                                                     start_publisher: Callable[..., ResourceSlicePublisher]) -> None:
    publisher = start_publisher()
    publisher.update(gpus(2))
    assert publisher.wait_synced(10)
    assert eventually(lambda: server.requests[-1][0] == "WATCH")
    (tampered,) = server.slices(node=NODE)
    tampered["spec"]["devices"] = [{"name": "intruder"}]
    request_json(server.api_client(), "PUT", f"{SLICES_PATH}/{tampered['metadata']['name']}", body=tampered)
    assert eventually(lambda: [d["name"] for d in server.slices(node=NODE)[0]["spec"]["devices"]] == ["gpu-0", "gpu-1"])


def test_invalid_devices_are_not_sent_and_previous_state_stays(
        server: FakeApiServer, start_publisher: Callable[..., ResourceSlicePublisher],
        caplog: pytest.LogCaptureFixture) -> None:
    publisher = start_publisher()
    publisher.update(gpus(2))
    assert publisher.wait_synced(10)
    before, sent = server.slices(node=NODE), len(writes(server))
    with caplog.at_level(logging.ERROR):
        refused = publisher.update([gpu(0, product="x" * 80), Device(name="gpu-0")])
    assert refused == [
        'device "gpu-0": attribute "productName": string value is 80 bytes, the limit is 64',
        'device "gpu-0": name is used more than once in the pool (indexes 0 and 1)']
    assert all(p in caplog.text for p in refused)
    assert publisher.wait_synced(1)
    assert server.slices(node=NODE) == before and len(writes(server)) == sent
    assert publisher.published_device_count == 2


def test_rejected_writes_are_retried_with_backoff(server: FakeApiServer,
                                                  start_publisher: Callable[..., ResourceSlicePublisher],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    server.reject_next_slice_writes(1000, "etcdserver: leader changed", status=503, reason="ServiceUnavailable")
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        publisher = start_publisher(initial_backoff=0.05, max_backoff=0.2)
        publisher.update(gpus(2))
        assert not publisher.wait_synced(1.0)
        assert publisher.stop(timeout=5)
    attempts = [r for r in server.requests if r[0] == "POST"]
    # Waits of 0.05, 0.1, then 0.2 s: about 7 attempts in a second. A hot loop would make hundreds.
    assert 3 <= len(attempts) <= 12
    failures = [r for r in caplog.records if "publishing ResourceSlices failed" in r.getMessage()]
    assert len(failures) == len(attempts)  # one log line per attempt
    assert all("etcdserver: leader changed" in r.getMessage() for r in failures)
    assert [getattr(r, "reason", None) for r in failures][:1] == ["ServiceUnavailable"]
    assert [getattr(r, "retry_in_s", None) for r in failures][:4] == [0.05, 0.1, 0.2, 0.2]


def test_default_backoff_starts_at_one_second(server: FakeApiServer,
                                              start_publisher: Callable[..., ResourceSlicePublisher]) -> None:
    server.reject_next_slice_writes(1000)
    publisher = start_publisher()
    publisher.update(gpus(1))
    assert not publisher.wait_synced(1.5)
    assert 1 <= len([r for r in server.requests if r[0] == "POST"]) <= 2


def test_success_after_rejections_resets_and_syncs(server: FakeApiServer,
                                                   start_publisher: Callable[..., ResourceSlicePublisher]) -> None:
    server.reject_next_slice_writes(2)
    publisher = start_publisher(initial_backoff=0.05)
    publisher.update(gpus(2))
    assert publisher.wait_synced(10)
    assert len([r for r in server.requests if r[0] == "POST"]) == 3
    assert len(server.slices(node=NODE)) == 1


def test_server_validation_error_is_logged_with_its_message(
        server: FakeApiServer, start_publisher: Callable[..., ResourceSlicePublisher],
        caplog: pytest.LogCaptureFixture) -> None:
    # The publisher believes it talks to 1.34 (no 64-device cap for tainted devices); the 1.36
    # server rejects the 100-device slice, with its reason and message in our log.
    taint = [DeviceTaint(key="example.com/maintenance", effect="NoSchedule")]
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        publisher = start_publisher(minor_version=34, initial_backoff=0.05)
        publisher.update([gpu(i, taints=taint) for i in range(100)])
        assert eventually(lambda: "Too many: 100: must have at most 64 items" in caplog.text)
    record = next(r for r in caplog.records if "publishing ResourceSlices failed" in r.getMessage())
    assert getattr(record, "status", None) == 422 and getattr(record, "reason", None) == "Invalid"
    assert server.slices(node=NODE) == []


def test_dropped_fields_are_reported_once_and_adopted(start_publisher: Callable[..., ResourceSlicePublisher],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    gate_off = FakeApiServer(minor_version=36, dropped_device_fields=("taints",))
    gate_off.start()
    try:
        gate_off.add_node(NODE)
        taint = [DeviceTaint(key="example.com/maintenance", effect="NoSchedule")]
        devices = [gpu(0, taints=taint), gpu(1)]
        with caplog.at_level(logging.ERROR, logger=LOGGER):
            publisher = start_publisher(fake=gate_off)
            publisher.update(devices)
            assert publisher.wait_synced(10)
            publisher.update(devices)  # a fresh round: the stored object must count as in sync
            assert publisher.wait_synced(10)
        dropped = [r for r in caplog.records if "dropped or changed fields" in r.getMessage()]
        assert len(dropped) == 1
        assert "spec.devices[*].taints" in dropped[0].getMessage() and "DRADeviceTaints" in dropped[0].getMessage()
        assert [verb for verb, _ in writes(gate_off)] == ["POST"]
    finally:
        gate_off.stop()


def test_unreadable_node_means_no_owner_reference(server: FakeApiServer,
                                                  start_publisher: Callable[..., ResourceSlicePublisher],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        publisher = start_publisher(node="ghost")
        publisher.update(gpus(1))
        assert publisher.wait_synced(10)
    (published,) = server.slices(node="ghost")
    assert "ownerReferences" not in published["metadata"]
    assert "cannot read Node ghost" in caplog.text

    uid = server.add_node("ghost")  # the Node shows up: the next round adds the owner reference
    publisher.resync()
    assert eventually(lambda: [r["uid"] for s in server.slices(node="ghost")
                               for r in s["metadata"].get("ownerReferences", [])] == [uid])


def test_update_during_watch_is_published_promptly(server: FakeApiServer,
                                                   start_publisher: Callable[..., ResourceSlicePublisher]) -> None:
    publisher = start_publisher(resync_delay=30.0)
    publisher.update(gpus(1))
    assert publisher.wait_synced(10)
    assert eventually(lambda: server.requests[-1][0] == "WATCH")
    publisher.update(gpus(2))
    # A watch lasts 30 s; the update must interrupt it rather than wait for it to end.
    assert publisher.wait_synced(5)
    assert len(server.slices(node=NODE)[0]["spec"]["devices"]) == 2


def test_update_is_thread_safe(server: FakeApiServer, start_publisher: Callable[..., ResourceSlicePublisher]) -> None:
    publisher = start_publisher()
    threads = [threading.Thread(target=publisher.update, args=(gpus(n),)) for n in range(1, 9)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    publisher.update(gpus(5))
    assert publisher.wait_synced(10)
    assert [d["name"] for d in server.slices(node=NODE)[0]["spec"]["devices"]] == [f"gpu-{i}" for i in range(5)]


def test_stop_returns_promptly_while_watching(server: FakeApiServer,
                                              start_publisher: Callable[..., ResourceSlicePublisher]) -> None:
    publisher = start_publisher()
    publisher.update(gpus(1))
    assert publisher.wait_synced(10)
    assert eventually(lambda: server.requests[-1][0] == "WATCH")
    assert publisher.stop(timeout=3)
    requests_after_stop = len(server.requests)
    publisher.update(gpus(2))
    assert not publisher.wait_synced(0.3)
    assert len(server.requests) == requests_after_stop


def test_invalid_driver_or_node_name_is_refused_at_construction(server: FakeApiServer, telemetry: Telemetry) -> None:
    with pytest.raises(ValueError, match='pool name "Node_1": part "Node_1" must be a DNS subdomain'):
        ResourceSlicePublisher(server.api_client(), DRIVER, "Node_1", telemetry, minor_version=36)


def test_the_same_devices_again_cost_no_request(server: FakeApiServer,
                                                start_publisher: Callable[..., ResourceSlicePublisher]) -> None:
    server.add_node("node-2")
    publisher = start_publisher(node="node-2")
    publisher.update(gpus(3))
    assert publisher.wait_synced(10)
    assert eventually(lambda: server.requests[-1][0] == "WATCH")
    before = len(server.requests)
    for _ in range(5):  # what every rescan of an unchanged node does
        assert publisher.update(gpus(3)) == []
    assert publisher.wait_synced(10)
    assert len(server.requests) == before, "no list, no write and the watch goes on"


def test_the_node_uid_from_a_watch_saves_reading_the_node(
        server: FakeApiServer, start_publisher: Callable[..., ResourceSlicePublisher]) -> None:
    publisher = start_publisher(node="node-2", node_uid=lambda: "0b9f3c1e-5a55-4c8e-9d0e-3f1c2b7a9e11")
    publisher.update(gpus(1))
    assert publisher.wait_synced(10)
    (published,) = server.slices(node="node-2")
    assert [r["uid"] for r in published["metadata"]["ownerReferences"]] == ["0b9f3c1e-5a55-4c8e-9d0e-3f1c2b7a9e11"]
    assert eventually(lambda: server.requests[-1][0] == "WATCH")
    assert not [r for r in server.requests if r[1].startswith("/api/v1/nodes")]
    watches = [q for verb, _, q in server.request_queries if verb == "WATCH"]
    assert watches and all(int(q["timeoutSeconds"]) >= 300 and q["allowWatchBookmarks"] == "true" for q in watches)
