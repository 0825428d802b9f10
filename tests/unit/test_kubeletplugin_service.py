"""The DRA gRPC services, called over a real Unix socket with a fake driver and a fake claim source."""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client.parser import text_string_to_metric_families

from driver.kubeletplugin.api import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from driver.kubeletplugin.claimfetch import ClaimError
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.service import KUBELET_GAVE_UP, ClaimBatch, add_dra_services
from driver.kubeletplugin.telemetry import Telemetry
from driver.kubeletplugin.types import ClaimRef, Deadline, PreparedDevice, PrepareResult

DRIVER = "gpu.tessera.dev"


def make_claim(ref: ClaimRef) -> ResourceClaim:
    return ResourceClaim.model_validate(
        {
            "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
            "status": {
                "allocation": {
                    "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0"}]}
                }
            },
        }
    )


def device(name: str, share_id: str | None = None) -> PreparedDevice:
    return PreparedDevice(
        request_names=["gpu"],
        pool_name="node-a",
        device_name=name,
        cdi_device_ids=[f"k8s.gpu.tessera.dev/claim=uid-{name}"],
        share_id=share_id,
    )


@dataclass
class FakeClaims:
    """Claims by UID; a ClaimError (or any exception) for the UIDs listed in ``errors``."""

    errors: dict[str, Exception] = field(default_factory=dict)
    fetched: list[ClaimRef] = field(default_factory=list)

    def fetch(self, ref: ClaimRef) -> ResourceClaim:
        self.fetched.append(ref)
        if ref.uid in self.errors:
            raise self.errors[ref.uid]
        return make_claim(ref)


@dataclass
class FakeDriver:
    """Answers per claim UID from ``outcomes``: a PrepareResult, or a callable that may raise."""

    outcomes: dict[str, PrepareResult | Callable[[], PrepareResult]] = field(default_factory=dict)
    unprepare_outcomes: dict[str, str | Exception] = field(default_factory=dict)
    prepared: list[str] = field(default_factory=list)
    unprepared: list[str] = field(default_factory=list)
    deadlines: list[Deadline] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def prepare_claim(self, claim: ResourceClaim, deadline: Deadline) -> PrepareResult:
        with self.lock:
            self.prepared.append(claim.metadata.uid)
            self.deadlines.append(deadline)
        outcome = self.outcomes.get(claim.metadata.uid, PrepareResult(devices=[device("gpu-0")]))
        return outcome() if callable(outcome) else outcome

    def unprepare_claim(self, claim: ClaimRef) -> str | None:
        with self.lock:
            self.unprepared.append(claim.uid)
        outcome = self.unprepare_outcomes.get(claim.uid)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


@dataclass
class Served:
    driver: FakeDriver
    claims: FakeClaims
    spans: InMemorySpanExporter
    telemetry: Telemetry
    channel: grpc.Channel

    def v1(self) -> dra_v1_pb2_grpc.DRAPluginStub:
        return dra_v1_pb2_grpc.DRAPluginStub(self.channel)

    def v1beta1(self) -> dra_v1beta1_pb2_grpc.DRAPluginStub:
        return dra_v1beta1_pb2_grpc.DRAPluginStub(self.channel)

    def metric(self, name: str, result: str) -> float:
        for family in text_string_to_metric_families(self.telemetry.render_metrics().decode()):
            for sample in family.samples:
                if sample.name == name and sample.labels.get("result") == result:
                    return float(sample.value)
        return 0.0


@pytest.fixture
def served() -> Iterator[Served]:
    tmp = Path(tempfile.mkdtemp(dir="/tmp", prefix="svc-"))
    spans = InMemorySpanExporter()
    telemetry = Telemetry("test", "tessera", span_exporter=spans)
    driver, claims = FakeDriver(), FakeClaims()
    server = grpc.server(ThreadPoolExecutor(4))
    add_dra_services(server, ClaimBatch(driver, claims, telemetry))
    socket = tmp / "dra.sock"
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    channel = grpc.insecure_channel(f"unix://{socket}")
    try:
        yield Served(driver, claims, spans, telemetry, channel)
    finally:
        channel.close()
        server.stop(0).wait()
        telemetry.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def refs(*uids: str) -> list[ClaimRef]:
    return [ClaimRef(namespace="ns", name=f"claim-{uid}", uid=uid) for uid in uids]


def v1_request(*uids: str) -> dra_v1_pb2.NodePrepareResourcesRequest:
    return dra_v1_pb2.NodePrepareResourcesRequest(
        claims=[dra_v1_pb2.Claim(namespace=r.namespace, name=r.name, uid=r.uid) for r in refs(*uids)]
    )


def v1_unprepare_request(*uids: str) -> dra_v1_pb2.NodeUnprepareResourcesRequest:
    return dra_v1_pb2.NodeUnprepareResourcesRequest(
        claims=[dra_v1_pb2.Claim(namespace=r.namespace, name=r.name, uid=r.uid) for r in refs(*uids)]
    )


def raise_boom() -> PrepareResult:
    raise RuntimeError("boom in driver")


def test_every_claim_is_answered_and_one_failure_does_not_fail_the_batch(served: Served) -> None:
    served.claims.errors["fetch-fails"] = ClaimError("ResourceClaim ns/claim-fetch-fails not found: it was deleted")
    served.driver.outcomes["driver-error"] = PrepareResult(devices=[device("gpu-9")], error="GPU 9 is unhealthy")
    served.driver.outcomes["driver-raises"] = raise_boom

    response = served.v1().NodePrepareResources(
        v1_request("ok", "fetch-fails", "driver-error", "driver-raises"), timeout=10
    )

    assert set(response.claims) == {"ok", "fetch-fails", "driver-error", "driver-raises"}
    ok = response.claims["ok"]
    assert ok.error == ""
    assert [(d.pool_name, d.device_name, list(d.request_names), list(d.cdi_device_ids)) for d in ok.devices] == [
        ("node-a", "gpu-0", ["gpu"], ["k8s.gpu.tessera.dev/claim=uid-gpu-0"])
    ]
    assert response.claims["fetch-fails"].error == "ResourceClaim ns/claim-fetch-fails not found: it was deleted"
    assert response.claims["driver-error"].error == "GPU 9 is unhealthy"
    assert list(response.claims["driver-error"].devices) == []  # the kubelet ignores them; send none
    assert "RuntimeError: boom in driver" in response.claims["driver-raises"].error
    assert list(response.claims["driver-raises"].devices) == []
    # A claim that could not be fetched never reaches the driver.
    assert sorted(served.driver.prepared) == ["driver-error", "driver-raises", "ok"]


def test_driver_exception_is_logged_with_traceback_and_claim_uid(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    served.driver.outcomes["bad"] = raise_boom
    with caplog.at_level(logging.INFO, logger="driver.kubeletplugin.service"):
        served.v1().NodePrepareResources(v1_request("bad"), timeout=10)

    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert len(tracebacks) == 1
    assert vars(tracebacks[0]).get("claim_uid") == "bad"
    assert isinstance(tracebacks[0].exc_info[1], RuntimeError)  # type: ignore[index]


def test_one_outcome_log_line_per_claim_with_context(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    served.driver.outcomes["failing"] = PrepareResult(error="no such GPU")
    with caplog.at_level(logging.INFO, logger="driver.kubeletplugin.service"):
        served.v1().NodePrepareResources(v1_request("good", "failing"), timeout=10)

    outcomes = {vars(r)["claim_uid"]: r for r in caplog.records if "duration_ms" in vars(r)}
    assert set(outcomes) == {"good", "failing"}
    assert vars(outcomes["failing"])["error"] == "no such GPU"
    assert outcomes["failing"].levelno == logging.WARNING
    assert "error" not in vars(outcomes["good"])
    for uid, record in outcomes.items():
        assert vars(record)["claim_namespace"] == "ns"
        assert vars(record)["claim_name"] == f"claim-{uid}"
        assert vars(record)["duration_ms"] >= 0


def test_share_id_is_set_only_when_the_driver_gives_one(served: Served) -> None:
    served.driver.outcomes["shared"] = PrepareResult(
        devices=[device("gpu-0-mps-1", share_id="5e8f1f4c-share"), device("gpu-1")]
    )
    response = served.v1().NodePrepareResources(v1_request("shared"), timeout=10)

    with_share, without_share = response.claims["shared"].devices
    assert with_share.HasField("share_id")
    assert with_share.share_id == "5e8f1f4c-share"
    assert not without_share.HasField("share_id")


def test_v1beta1_service_prepares_without_share_id(served: Served) -> None:
    served.driver.outcomes["shared"] = PrepareResult(devices=[device("gpu-0-mps-1", share_id="5e8f1f4c-share")])
    served.driver.outcomes["failing"] = PrepareResult(error="no such GPU")
    request = dra_v1beta1_pb2.NodePrepareResourcesRequest(
        claims=[
            dra_v1beta1_pb2.Claim(namespace="ns", name="claim-shared", uid="shared"),
            dra_v1beta1_pb2.Claim(namespace="ns", name="claim-failing", uid="failing"),
        ]
    )
    response = served.v1beta1().NodePrepareResources(request, timeout=10)

    (only,) = response.claims["shared"].devices
    assert (only.pool_name, only.device_name, list(only.request_names)) == ("node-a", "gpu-0-mps-1", ["gpu"])
    assert "share_id" not in dra_v1beta1_pb2.Device.DESCRIPTOR.fields_by_name
    assert response.claims["failing"].error == "no such GPU"

    unprepared = served.v1beta1().NodeUnprepareResources(
        dra_v1beta1_pb2.NodeUnprepareResourcesRequest(
            claims=[dra_v1beta1_pb2.Claim(namespace="ns", name="claim-shared", uid="shared")]
        ),
        timeout=10,
    )
    assert set(unprepared.claims) == {"shared"}
    assert unprepared.claims["shared"].error == ""


def test_unprepare_answers_every_claim_without_reading_the_api(served: Served) -> None:
    served.driver.unprepare_outcomes["stuck"] = "MPS daemon for GPU 0 did not stop"
    served.driver.unprepare_outcomes["raises"] = OSError("checkpoint unreadable")

    response = served.v1().NodeUnprepareResources(v1_unprepare_request("never-prepared", "stuck", "raises"), timeout=10)

    assert set(response.claims) == {"never-prepared", "stuck", "raises"}
    assert response.claims["never-prepared"].error == ""
    assert response.claims["stuck"].error == "MPS daemon for GPU 0 did not stop"
    assert "OSError: checkpoint unreadable" in response.claims["raises"].error
    assert served.claims.fetched == []
    assert sorted(served.driver.unprepared) == ["never-prepared", "raises", "stuck"]


def test_empty_request_gets_an_empty_answer(served: Served) -> None:
    assert len(served.v1().NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(), timeout=10).claims) == 0
    assert len(served.v1().NodeUnprepareResources(dra_v1_pb2.NodeUnprepareResourcesRequest(), timeout=10).claims) == 0


def test_a_claim_listed_twice_is_prepared_once(served: Served) -> None:
    request = v1_request("dup")
    request.claims.append(request.claims[0])
    response = served.v1().NodePrepareResources(request, timeout=10)
    assert set(response.claims) == {"dup"}
    assert served.driver.prepared == ["dup"]


def test_unexpected_fetch_failure_becomes_the_claim_error(served: Served) -> None:
    served.claims.errors["flaky"] = ConnectionResetError("peer reset")
    response = served.v1().NodePrepareResources(v1_request("flaky", "fine"), timeout=10)
    assert "ConnectionResetError: peer reset" in response.claims["flaky"].error
    assert response.claims["fine"].error == ""


def test_claims_of_one_request_run_concurrently(served: Served) -> None:
    # Each prepare waits for the other two; run one after another they would break the barrier.
    barrier = threading.Barrier(3, timeout=10)

    def meet() -> PrepareResult:
        barrier.wait()
        return PrepareResult(devices=[device("gpu-0")])

    served.driver.outcomes.update({"a": meet, "b": meet, "c": meet})
    response = served.v1().NodePrepareResources(v1_request("a", "b", "c"), timeout=30)
    assert {uid: entry.error for uid, entry in response.claims.items()} == {"a": "", "b": "", "c": ""}


def test_spans_and_metrics_per_claim(served: Served) -> None:
    served.driver.outcomes["failing"] = PrepareResult(error="no such GPU")
    served.driver.unprepare_outcomes["stuck"] = "still in use"
    served.v1().NodePrepareResources(v1_request("good", "failing"), timeout=10)
    served.v1().NodeUnprepareResources(v1_unprepare_request("good", "stuck"), timeout=10)

    spans = {(s.name, (s.attributes or {}).get("dra.claim.uid")): s for s in served.spans.get_finished_spans()}
    assert set(spans) == {
        ("tessera.prepare_claim", "good"),
        ("tessera.prepare_claim", "failing"),
        ("tessera.unprepare_claim", "good"),
        ("tessera.unprepare_claim", "stuck"),
    }
    failing = spans[("tessera.prepare_claim", "failing")]
    assert failing.status.status_code is StatusCode.ERROR
    assert failing.status.description == "no such GPU"
    assert dict(failing.attributes or {})["dra.claim.namespace"] == "ns"
    assert dict(failing.attributes or {})["dra.claim.name"] == "claim-failing"
    assert spans[("tessera.prepare_claim", "good")].status.status_code is not StatusCode.ERROR
    assert spans[("tessera.unprepare_claim", "stuck")].status.status_code is StatusCode.ERROR

    assert served.metric("tessera_prepare_claims_total", "success") == 1
    assert served.metric("tessera_prepare_claims_total", "error") == 1
    assert served.metric("tessera_unprepare_claims_total", "success") == 1
    assert served.metric("tessera_unprepare_claims_total", "error") == 1
    text = served.telemetry.render_metrics().decode()
    assert "tessera_prepare_claim_duration_seconds_count" in text
    assert "tessera_unprepare_claim_duration_seconds_count" in text


def test_claims_are_not_started_once_the_kubelet_gave_up() -> None:
    driver, claims = FakeDriver(), FakeClaims()
    telemetry = Telemetry("test", "tessera")
    batch = ClaimBatch(driver, claims, telemetry)
    try:
        prepared = batch.prepare(refs("late-1", "late-2"), is_active=lambda: False)
        unprepared = batch.unprepare(refs("late-3"), is_active=lambda: False)
    finally:
        telemetry.shutdown()

    assert {uid: r.error for uid, r in prepared.items()} == {"late-1": KUBELET_GAVE_UP, "late-2": KUBELET_GAVE_UP}
    assert unprepared == {"late-3": KUBELET_GAVE_UP}
    assert "kubelet" in KUBELET_GAVE_UP
    assert driver.prepared == [] and driver.unprepared == [] and claims.fetched == []


def test_the_driver_gets_the_kubelets_deadline_less_a_margin_to_answer(served: Served) -> None:
    response = served.v1().NodePrepareResources(v1_request("a", "b"), timeout=5)
    assert {uid: c.error for uid, c in response.claims.items()} == {"a": "", "b": ""}
    first, second = served.driver.deadlines
    assert first is second, "the claims of one request share its deadline"
    assert 0 < first.remaining() <= 4.5 and first.is_active() is False, "the call is over by now"


def test_without_a_kubelet_deadline_the_drivers_own_limit_applies() -> None:
    driver, claims = FakeDriver(), FakeClaims()
    telemetry = Telemetry("test", "tessera")
    try:
        ClaimBatch(driver, claims, telemetry, prepare_deadline=7).prepare(refs("a"), is_active=lambda: True)
        late = ClaimBatch(driver, claims, telemetry).prepare(refs("late"), lambda: True, time_remaining=0.5)
    finally:
        telemetry.shutdown()
    [deadline] = driver.deadlines
    assert 0 < deadline.remaining() <= 7
    assert late["late"].error == KUBELET_GAVE_UP, "no time left to answer: the claim is not started"
    assert driver.prepared == ["a"]
    with pytest.raises(ValueError, match="prepare_deadline"):
        ClaimBatch(driver, claims, telemetry, prepare_deadline=0)
