"""ClaimFetcher against a tiny local HTTP API server, through the real kubernetes client."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import kubernetes.client
import pytest

from driver.kubeletplugin.claimfetch import ClaimError, ClaimFetcher, claim_uid_problem
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.types import ClaimRef

CLAIM_PATH = "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaims/{name}"
REF = ClaimRef(namespace="team-a", name="gpu-claim", uid="0c7d3a4e-5b1f-4c2a-9e8d-7f6a5b4c3d2e")


def claim_json(uid: str = REF.uid, allocated: bool = True) -> dict[str, object]:
    claim: dict[str, object] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": REF.name, "namespace": REF.namespace, "uid": uid, "resourceVersion": "42"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.dev"}}]}},
    }
    if allocated:
        claim["status"] = {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": "gpu",
                            "driver": "gpu.tessera.dev",
                            "pool": "node-a",
                            "device": "gpu-0",
                            "shareID": "3f1b-share",
                        }
                    ],
                    "config": [
                        {
                            "source": "FromClaim",
                            "requests": ["gpu"],
                            "opaque": {"driver": "gpu.tessera.dev", "parameters": {"kind": "GpuConfig"}},
                        }
                    ],
                }
            }
        }
    return claim


def status_json(code: int, reason: str, message: str) -> dict[str, object]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


@dataclass
class FakeApiServer:
    """Serves fixed (status, body) answers by path and records the requests it got."""

    routes: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    authorizations: list[str | None] = field(default_factory=list)
    port: int = 0

    def answer(self, status: int, body: object, ref: ClaimRef = REF) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.routes[CLAIM_PATH.format(namespace=ref.namespace, name=ref.name)] = (status, raw)


@pytest.fixture
def apiserver() -> Iterator[FakeApiServer]:
    fake = FakeApiServer()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            fake.requests.append(("GET", path))
            fake.authorizations.append(self.headers.get("Authorization"))
            status, body = fake.routes.get(path, (404, json.dumps(status_json(404, "NotFound", "nope")).encode()))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    fake.port = int(server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        server.shutdown()
        server.server_close()


def client_config(port: int) -> kubernetes.client.Configuration:
    config = kubernetes.client.Configuration()
    config.host = f"http://127.0.0.1:{port}"
    return config


def fetch(apiserver: FakeApiServer, ref: ClaimRef = REF) -> ResourceClaim:
    with kubernetes.client.ApiClient(client_config(apiserver.port)) as api:
        return ClaimFetcher(api, read_timeout_s=5).fetch(ref)


def test_fetches_and_parses_an_allocated_claim(apiserver: FakeApiServer) -> None:
    apiserver.answer(200, claim_json())
    claim = fetch(apiserver)

    assert apiserver.requests == [("GET", "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/gpu-claim")]
    assert claim.metadata.uid == REF.uid
    (result,) = claim.results_for("gpu.tessera.dev")
    assert (result.pool, result.device, result.share_id) == ("node-a", "gpu-0", "3f1b-share")
    assert [c.opaque.parameters for c in claim.configs_for("gpu.tessera.dev") if c.opaque] == [{"kind": "GpuConfig"}]


def test_every_read_sends_the_current_token_of_a_rotating_service_account(apiserver: FakeApiServer) -> None:
    # In-cluster configs refresh the projected token through refresh_api_key_hook; the plain GET
    # must ask the configuration for it on every request, as the generated client does.
    apiserver.answer(200, claim_json())
    config = client_config(apiserver.port)
    config.api_key = {"BearerToken": "token-0"}
    config.api_key_prefix = {"BearerToken": "Bearer"}
    rotations = iter(["token-1", "token-2"])

    def rotate(configuration: kubernetes.client.Configuration) -> None:
        configuration.api_key["BearerToken"] = next(rotations)

    config.refresh_api_key_hook = rotate  # type: ignore[assignment]  # the stubs type it as None
    with kubernetes.client.ApiClient(config) as api:
        fetcher = ClaimFetcher(api, read_timeout_s=5)
        fetcher.fetch(REF)
        fetcher.fetch(REF)
    assert apiserver.authorizations == ["Bearer token-1", "Bearer token-2"]


def test_missing_claim_says_it_was_deleted(apiserver: FakeApiServer) -> None:
    apiserver.answer(404, status_json(404, "NotFound", 'resourceclaims "gpu-claim" not found'))
    with pytest.raises(ClaimError, match=r"ResourceClaim team-a/gpu-claim not found: it was deleted"):
        fetch(apiserver)


def test_replaced_claim_names_both_uids(apiserver: FakeApiServer) -> None:
    apiserver.answer(200, claim_json(uid="99e0c1d2-0000-4000-8000-000000000001"))
    with pytest.raises(ClaimError) as caught:
        fetch(apiserver)
    message = str(caught.value)
    assert "got replaced" in message
    assert REF.uid in message and "99e0c1d2-0000-4000-8000-000000000001" in message


def test_unallocated_claim_is_refused(apiserver: FakeApiServer) -> None:
    apiserver.answer(200, claim_json(allocated=False))
    with pytest.raises(ClaimError, match=r"team-a/gpu-claim .* is not allocated"):
        fetch(apiserver)


def test_forbidden_reports_status_reason_message_and_the_fix(apiserver: FakeApiServer) -> None:
    apiserver.answer(403, status_json(403, "Forbidden", 'User "system:serviceaccount:x:y" cannot get resource'))
    with pytest.raises(ClaimError) as caught:
        fetch(apiserver)
    message = str(caught.value)
    assert "HTTP 403 Forbidden" in message
    assert "cannot get resource" in message
    assert "'get' on resourceclaims.resource.k8s.io" in message


def test_server_error_without_status_body(apiserver: FakeApiServer) -> None:
    apiserver.answer(503, b"etcd is on fire")
    with pytest.raises(ClaimError) as caught:
        fetch(apiserver)
    message = str(caught.value)
    assert "HTTP 503" in message and "etcd is on fire" in message


def test_unreadable_object_names_the_bad_field(apiserver: FakeApiServer) -> None:
    apiserver.answer(200, {"metadata": {"name": REF.name, "namespace": REF.namespace}})
    with pytest.raises(ClaimError, match=r"metadata\.uid: Field required"):
        fetch(apiserver)


def test_invalid_json_is_a_claim_error(apiserver: FakeApiServer) -> None:
    apiserver.answer(200, b"{not json")
    with pytest.raises(ClaimError, match="cannot read"):
        fetch(apiserver)


def test_unreachable_api_server() -> None:
    # A port that was just free: nothing listens there, so the connection is refused.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    config = client_config(port)
    config.retries = 0
    with kubernetes.client.ApiClient(config) as api, pytest.raises(ClaimError, match="cannot reach the API server"):
        ClaimFetcher(api, read_timeout_s=5).fetch(REF)


@pytest.mark.parametrize(
    "uid",
    [
        "../../etc/cron.d/x",
        "0c7d3a4e-5b1f-4c2a-9e8d-7f6a5b4c3d2e/../x",
        "0C7D3A4E-5B1F-4C2A-9E8D-7F6A5B4C3D2E",  # the API server writes lower case
        "0c7d3a4e5b1f4c2a9e8d7f6a5b4c3d2e",
        "0c7d3a4e-5b1f-4c2a-9e8d-7f6a5b4c3d2e\n",
        "0c7d3a4e-5b1f-4c2a-9e8d-7f6a5b4c3d2\u0661",  # isdigit() would take this
        "",
        pytest.param("a" * 100_000, id="huge"),
    ],
)
def test_a_uid_that_is_not_a_kubernetes_uid_is_refused_before_the_api_is_read(
    apiserver: FakeApiServer, uid: str
) -> None:
    ref = ClaimRef(namespace=REF.namespace, name=REF.name, uid=uid)
    apiserver.answer(200, claim_json(uid=uid), ref)
    with pytest.raises(ClaimError) as caught:
        fetch(apiserver, ref)
    message = str(caught.value)
    assert message.startswith("ResourceClaim team-a/gpu-claim: claim uid ")
    assert "is not a Kubernetes UID" in message
    assert len(message) < 400  # a huge uid is not echoed whole
    assert apiserver.requests == []


def test_claim_uid_problem_accepts_the_api_servers_form() -> None:
    assert claim_uid_problem(REF.uid) is None
    assert claim_uid_problem("00000000-0000-0000-0000-000000000000") is None
    assert claim_uid_problem("0c7d3a4e-uid") is not None
