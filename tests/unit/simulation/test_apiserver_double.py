"""The Kubernetes API server double (driver.simulation.apiserver), driven by the real kubernetes client,
and the raw-JSON client helpers of driver.kubeletplugin.kubeclient against it."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from driver.kubeletplugin.kubeclient import (
    KubeApiError,
    KubeConfigError,
    load_api_client,
    open_json_lines,
    parse_minor_version,
    request_json,
    server_minor_version,
)
from driver.simulation.apiserver import FakeApiServer

DRIVER = "gpu.tessera.dev"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"


@pytest.fixture
def resource_api(server: FakeApiServer) -> client.ResourceV1Api:
    return client.ResourceV1Api(server.api_client())


def slice_body(node: str = "node-1", devices: list[dict[str, Any]] | None = None, **spec: Any) -> dict[str, Any]:
    body_spec: dict[str, Any] = {"driver": DRIVER, "nodeName": node,
                                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                                 "devices": devices if devices is not None else [{"name": "gpu-0"}]}
    body_spec.update(spec)
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
            "metadata": {"generateName": f"00000-{DRIVER}-{node}-"}, "spec": body_spec}


def status_of(err: client.ApiException) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(err.body or "{}")
    return body


# ----- basics -------------------------------------------------------------------------------


def test_version_and_nodes_through_the_typed_client(server: FakeApiServer) -> None:
    api = server.api_client()
    assert client.VersionApi(api).get_code().minor == "36"
    uid = server.add_node("node-1")
    core: Any = client.CoreV1Api(api)
    assert core.read_node("node-1").metadata.uid == uid
    with pytest.raises(client.ApiException) as missing:
        core.read_node("node-2")
    assert missing.value.status == 404


def test_create_with_generate_name_and_list_by_field_selector(resource_api: Any,
                                                              server: FakeApiServer) -> None:
    created = resource_api.create_resource_slice(slice_body("node-1"))
    resource_api.create_resource_slice(slice_body("node-2"))
    name = created.metadata.name
    assert name.startswith(f"00000-{DRIVER}-node-1-") and len(name) == len(f"00000-{DRIVER}-node-1-") + 5
    assert created.metadata.uid and created.metadata.resource_version and created.metadata.creation_timestamp
    listed = resource_api.list_resource_slice(field_selector=f"spec.driver={DRIVER},spec.nodeName=node-1")
    assert [s.metadata.name for s in listed.items] == [name]
    assert resource_api.list_resource_slice(field_selector="spec.driver=other.dev").items == []
    assert [s["metadata"]["name"] for s in server.slices(node="node-1")] == [name]
    with pytest.raises(client.ApiException) as bad:
        resource_api.list_resource_slice(field_selector="spec.devices=x")
    assert bad.value.status == 400


def test_generate_name_is_cut_to_58_characters_like_the_apiserver(server: FakeApiServer) -> None:
    node = "ip-10-0-12-34.us-west-2.compute.internal"
    stored = request_json(server.api_client(), "POST", SLICES, body=slice_body(node))
    assert stored["metadata"]["name"][:58] == f"00000-{DRIVER}-{node}-"[:58]
    assert len(stored["metadata"]["name"]) == 63


def test_replace_checks_resource_version(resource_api: Any) -> None:
    created = resource_api.create_resource_slice(slice_body())
    body = slice_body()
    body["metadata"] = {"name": created.metadata.name, "resourceVersion": created.metadata.resource_version}
    body["spec"]["pool"]["generation"] = 2
    replaced = resource_api.replace_resource_slice(created.metadata.name, body)
    assert replaced.spec.pool.generation == 2
    assert replaced.metadata.uid == created.metadata.uid
    assert int(replaced.metadata.resource_version) > int(created.metadata.resource_version)
    with pytest.raises(client.ApiException) as stale:
        resource_api.replace_resource_slice(created.metadata.name, body)  # still the old resourceVersion
    assert stale.value.status == 409 and status_of(stale.value)["reason"] == "Conflict"


def test_delete_with_preconditions(resource_api: Any, server: FakeApiServer) -> None:
    created = resource_api.create_resource_slice(slice_body())
    name = created.metadata.name
    wrong = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid="someone-else"))
    with pytest.raises(client.ApiException) as conflict:
        resource_api.delete_resource_slice(name, body=wrong)
    assert conflict.value.status == 409 and "Precondition failed: UID" in status_of(conflict.value)["message"]
    right = client.V1DeleteOptions(preconditions=client.V1Preconditions(
        uid=created.metadata.uid, resource_version=created.metadata.resource_version))
    resource_api.delete_resource_slice(name, body=right)
    assert server.slices() == []
    with pytest.raises(client.ApiException) as gone:
        resource_api.delete_resource_slice(name)
    assert gone.value.status == 404


def test_delete_collection_and_wipe_only_touch_the_selected_node(resource_api: Any,
                                                                 server: FakeApiServer) -> None:
    for node in ("node-1", "node-1", "node-2", "node-3"):
        resource_api.create_resource_slice(slice_body(node))
    resource_api.delete_collection_resource_slice(field_selector="spec.nodeName=node-1")
    assert sorted(s["spec"]["nodeName"] for s in server.slices()) == ["node-2", "node-3"]
    assert server.wipe_slices("node-2") == 1
    assert [s["spec"]["nodeName"] for s in server.slices()] == ["node-3"]


def test_request_log_names_watches(server: FakeApiServer) -> None:
    api = server.api_client()
    request_json(api, "GET", SLICES)
    open_json_lines(api, SLICES, query=[("watch", "true"), ("timeoutSeconds", "1")], timeout=5).close()
    assert server.requests == [("GET", SLICES), ("WATCH", SLICES)]


# ----- validation ---------------------------------------------------------------------------


def rejection(server: FakeApiServer, body: dict[str, Any]) -> dict[str, Any]:
    with pytest.raises(KubeApiError) as err:
        request_json(server.api_client(), "POST", SLICES, body=body)
    assert err.value.status == 422 and err.value.reason == "Invalid"
    return {"message": err.value.message}


def test_duplicate_device_names_in_a_slice_rejected(server: FakeApiServer) -> None:
    answer = rejection(server, slice_body(devices=[{"name": "gpu-0"}, {"name": "gpu-0"}]))
    assert 'spec.devices[1].name: Duplicate value: "gpu-0"' in answer["message"]
    assert answer["message"].startswith('ResourceSlice.resource.k8s.io "00000-gpu.tessera.dev-node-1-')


def test_device_name_must_be_dns_label(server: FakeApiServer) -> None:
    answer = rejection(server, slice_body(devices=[{"name": "GPU_0"}]))
    assert 'spec.devices[0].name: Invalid value: "GPU_0"' in answer["message"]


def test_exactly_one_node_selection_field(server: FakeApiServer) -> None:
    answer = rejection(server, slice_body(allNodes=True))
    assert "exactly one of `nodeName`, `nodeSelector`, `allNodes`, `perDeviceNodeSelection`" in answer["message"]
    assert "found 2" in answer["message"]


def test_required_fields(server: FakeApiServer) -> None:
    body = slice_body()
    body["spec"]["driver"] = ""
    body["spec"]["pool"] = {"name": "", "generation": 1, "resourceSliceCount": 0}
    message = rejection(server, body)["message"]
    for expected in ("spec.driver: Required value", "spec.pool.name: Required value",
                     "spec.pool.resourceSliceCount: Invalid value"):
        assert expected in message


def test_attribute_union_and_string_length(server: FakeApiServer) -> None:
    device = {"name": "gpu-0", "attributes": {"both": {"string": "a", "int": 1}, "long": {"string": "x" * 65}}}
    message = rejection(server, slice_body(devices=[device]))["message"]
    assert "spec.devices[0].attributes[both]: Invalid value: exactly one value must be specified (found 2)" in message
    assert "spec.devices[0].attributes[long].string: Too long: may not be more than 64 bytes" in message


def test_devices_per_slice_limit_follows_the_release() -> None:
    tainted = [{"name": f"gpu-{i}", "taints": [{"key": "k", "effect": "NoSchedule"}]} for i in range(65)]
    plain = [{"name": f"gpu-{i}"} for i in range(129)]
    for minor, devices, allowed in ((34, tainted, True), (35, tainted, False), (36, plain, False),
                                    (36, plain[:128], True)):
        fake = FakeApiServer(minor_version=minor)
        fake.start()
        try:
            if allowed:
                request_json(fake.api_client(), "POST", SLICES, body=slice_body(devices=devices))
            else:
                limit = 64 if devices is tainted else 128
                assert f"Too many: {len(devices)}: must have at most {limit} items" in rejection(
                    fake, slice_body(devices=devices))["message"]
        finally:
            fake.stop()


def test_immutable_fields_on_update(server: FakeApiServer) -> None:
    api = server.api_client()
    created = request_json(api, "POST", SLICES, body=slice_body())
    changed = {**created, "spec": {**created["spec"], "nodeName": "node-2"}}
    with pytest.raises(KubeApiError) as err:
        request_json(api, "PUT", f"{SLICES}/{created['metadata']['name']}", body=changed)
    assert err.value.status == 422 and "spec.nodeName: Invalid value: field is immutable" in err.value.message


def test_status_body_lists_causes(server: FakeApiServer) -> None:
    with pytest.raises(client.ApiException) as err:
        resource_api: Any = client.ResourceV1Api(server.api_client())
        resource_api.create_resource_slice(slice_body(devices=[{"name": "A"}]))
    status = status_of(err.value)
    assert status["kind"] == "Status" and status["code"] == 422 and status["reason"] == "Invalid"
    assert status["details"]["causes"][0]["field"] == "spec.devices[0].name"


# ----- failure injection and feature-gate simulation ----------------------------------------


def test_rejected_writes_then_success(server: FakeApiServer) -> None:
    api = server.api_client()
    server.reject_next_slice_writes(2, "etcdserver: request timed out")
    for _ in range(2):
        with pytest.raises(KubeApiError) as err:
            request_json(api, "POST", SLICES, body=slice_body())
        assert (err.value.status, err.value.reason, err.value.message) == (
            500, "InternalError", "etcdserver: request timed out")
    request_json(api, "POST", SLICES, body=slice_body())
    assert len(server.slices()) == 1


def test_dropped_device_fields_imitate_a_disabled_feature_gate() -> None:
    fake = FakeApiServer(minor_version=34, dropped_device_fields=("taints",))
    fake.start()
    try:
        device = {"name": "gpu-0", "taints": [{"key": "k", "effect": "NoSchedule"}]}
        stored = request_json(fake.api_client(), "POST", SLICES, body=slice_body(devices=[device]))
        assert stored["spec"]["devices"] == [{"name": "gpu-0"}]
    finally:
        fake.stop()


# ----- watch --------------------------------------------------------------------------------


def collect(server: FakeApiServer, query: list[tuple[str, str]]) -> list[dict[str, Any]]:
    stream = open_json_lines(server.api_client(), SLICES, query=[("watch", "true"), *query], timeout=10)
    try:
        return list(stream)
    finally:
        stream.close()


def test_watch_from_resource_version_sends_later_events_and_ends_at_timeout(server: FakeApiServer) -> None:
    api = server.api_client()
    request_json(api, "POST", SLICES, body=slice_body("node-1"))
    start_rv = request_json(api, "GET", SLICES)["metadata"]["resourceVersion"]
    created = request_json(api, "POST", SLICES, body=slice_body("node-1"))
    request_json(api, "POST", SLICES, body=slice_body("node-2"))
    request_json(api, "PUT", f"{SLICES}/{created['metadata']['name']}", body=created)
    server.wipe_slices("node-1")
    events = collect(server, [("resourceVersion", start_rv), ("timeoutSeconds", "1"),
                              ("fieldSelector", "spec.nodeName=node-1")])
    assert [e["type"] for e in events] == ["ADDED", "MODIFIED", "DELETED", "DELETED"]
    assert {e["object"]["spec"]["nodeName"] for e in events} == {"node-1"}


def test_watch_without_resource_version_starts_with_current_objects(server: FakeApiServer) -> None:
    request_json(server.api_client(), "POST", SLICES, body=slice_body("node-1"))
    events = collect(server, [("timeoutSeconds", "1")])
    assert [e["type"] for e in events] == ["ADDED"]


def test_watch_from_expired_resource_version_gets_410(server: FakeApiServer) -> None:
    api = server.api_client()
    first = request_json(api, "POST", SLICES, body=slice_body())
    request_json(api, "POST", SLICES, body=slice_body())
    server.expire_watch_history()
    events = collect(server, [("resourceVersion", first["metadata"]["resourceVersion"]), ("timeoutSeconds", "1")])
    assert len(events) == 1 and events[0]["type"] == "ERROR"
    assert events[0]["object"]["code"] == 410 and events[0]["object"]["reason"] == "Expired"


def test_typed_client_watch_works(server: FakeApiServer, resource_api: Any) -> None:
    from kubernetes import watch

    resource_api.create_resource_slice(slice_body())
    events = watch.Watch().stream(resource_api.list_resource_slice, timeout_seconds=1)  # type: ignore[no-untyped-call]
    names = [e["object"].metadata.name for e in events]
    assert len(names) == 1 and names[0].startswith("00000-")


# ----- claims and device classes ------------------------------------------------------------


def claim(name: str = "claim-1", uid: str = "uid-1") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "team-a", "uid": uid},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
            "status": {"allocation": {"devices": {"results": [
                {"request": "gpu", "driver": DRIVER, "pool": "node-1", "device": "gpu-0"}]}}}}


def test_claims_put_read_status_and_delete(server: FakeApiServer, resource_api: Any) -> None:
    server.put_claim(claim())
    read = resource_api.read_namespaced_resource_claim("claim-1", "team-a")
    assert read.metadata.uid == "uid-1"
    assert read.status.allocation.devices.results[0].device == "gpu-0"
    replaced = server.put_claim({**claim(), "status": {}})  # replacing keeps the UID
    assert replaced["metadata"]["uid"] == "uid-1" and replaced["status"] == {}

    raw = request_json(server.api_client(), "GET", "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/claim-1")
    raw["status"] = {"devices": [{"driver": DRIVER, "pool": "node-1", "device": "gpu-0"}]}
    request_json(server.api_client(), "PUT",
                 "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/claim-1/status", body=raw)
    assert resource_api.read_namespaced_resource_claim("claim-1", "team-a").status.devices[0].device == "gpu-0"

    recreated = server.put_claim(claim(uid="uid-2"))  # a different UID: the claim was replaced
    assert recreated["metadata"]["uid"] == "uid-2"
    assert resource_api.read_namespaced_resource_claim("claim-1", "team-a").metadata.uid == "uid-2"

    server.delete_claim("team-a", "claim-1")
    with pytest.raises(client.ApiException) as gone:
        resource_api.read_namespaced_resource_claim("claim-1", "team-a")
    assert gone.value.status == 404


def test_claims_created_through_the_client_get_a_uid(resource_api: Any) -> None:
    body = claim("claim-2")
    del body["metadata"]["uid"], body["status"]
    created = resource_api.create_namespaced_resource_claim("team-a", body)
    assert created.metadata.uid and created.metadata.namespace == "team-a"
    assert [c.metadata.name for c in resource_api.list_namespaced_resource_claim("team-a").items] == ["claim-2"]
    assert resource_api.list_namespaced_resource_claim("team-b").items == []


def test_device_classes(resource_api: Any) -> None:
    body = {"metadata": {"name": DRIVER}, "spec": {"selectors": [
        {"cel": {"expression": f"device.driver == '{DRIVER}'"}}]}}
    resource_api.create_device_class(body)
    assert resource_api.read_device_class(DRIVER).spec.selectors[0].cel.expression.startswith("device.driver")
    assert [c.metadata.name for c in resource_api.list_device_class().items] == [DRIVER]
    with pytest.raises(client.ApiException) as duplicate:
        resource_api.create_device_class(body)
    assert duplicate.value.status == 409


# ----- kubeclient helpers -------------------------------------------------------------------


def test_load_api_client_from_kubeconfig(server: FakeApiServer, tmp_path: Path) -> None:
    api = load_api_client(str(server.kube_config(tmp_path / "kubeconfig")))
    assert server_minor_version(api) == 36


def test_load_api_client_errors_are_clear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(KubeConfigError, match=r"cannot use kubeconfig .*missing"):
        load_api_client(str(tmp_path / "missing"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeConfigError, match="no kubeconfig given and not running in a pod"):
        load_api_client(None)


@pytest.mark.parametrize(("minor", "expected"), [("36", 36), ("36+", 36), (" 34 ", 34), ("", None), ("x", None),
                                               ("\u0663\u0666", None)])
def test_parse_minor_version(minor: str, expected: int | None) -> None:
    assert parse_minor_version(minor) == expected


def test_server_minor_version_falls_back_to_oldest_supported_when_unreachable(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    api = client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{port}"))
    assert server_minor_version(api) == 34
    assert "cannot read the API server version" in caplog.text


def test_request_errors_carry_status_reason_and_message(server: FakeApiServer) -> None:
    with pytest.raises(KubeApiError) as err:
        request_json(server.api_client(), "GET", f"{SLICES}/nope")
    assert (err.value.status, err.value.reason) == (404, "NotFound")
    assert err.value.message == 'resourceslices.resource.k8s.io "nope" not found'


def test_runnable_as_a_module_for_manual_use() -> None:
    command = [sys.executable, "-m", "driver.simulation.apiserverrun", "--port", "0", "--node", "node-1"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[3])
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert "test double" in line
        url = line.rsplit(" ", 1)[-1].strip()
        api = client.ApiClient(client.Configuration(host=url))
        assert request_json(api, "GET", "/api/v1/nodes/node-1")["metadata"]["name"] == "node-1"
    finally:
        process.terminate()
        process.wait(timeout=10)
