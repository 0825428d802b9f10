"""The DRA gRPC services, called over a real Unix socket with a fake driver and a fake claim source."""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client.parser import text_string_to_metric_families

from driver.kubeletplugin.api import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from driver.kubeletplugin.claimbatch import KUBELET_GAVE_UP, ClaimBatch
from driver.kubeletplugin.claimfetch import ClaimError
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.service import add_dra_services
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


def uid(label: str) -> str:
    """A claim UID in the API server's form, derived from a readable label (the batch refuses others)."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"claim/{label}"))


def label(claim_uid: str) -> str:
    return _LABELS.get(claim_uid, claim_uid)


def labels(claim_uids: Iterable[str]) -> list[str]:
    return [label(u) for u in claim_uids]


_LABELS = {uid(name): name for name in (
    "ok", "fetch-fails", "driver-error", "driver-raises", "bad", "good", "failing", "shared", "never-prepared",
    "stuck", "raises", "dup", "flaky", "fine", "a", "b", "c", "late", "late-1", "late-2", "late-3")}


def refs(*uids: str) -> list[ClaimRef]:
    return [ClaimRef(namespace="ns", name=f"claim-{label}", uid=uid(label)) for label in uids]


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
    gone = ClaimError("ResourceClaim ns/claim-fetch-fails not found: it was deleted")
    served.claims.errors[uid("fetch-fails")] = gone
    served.driver.outcomes[uid("driver-error")] = PrepareResult(devices=[device("gpu-9")], error="GPU 9 is unhealthy")
    served.driver.outcomes[uid("driver-raises")] = raise_boom

    response = served.v1().NodePrepareResources(
        v1_request("ok", "fetch-fails", "driver-error", "driver-raises"), timeout=10
    )

    assert set(labels(response.claims)) == {"ok", "fetch-fails", "driver-error", "driver-raises"}
    ok = response.claims[uid("ok")]
    assert ok.error == ""
    assert [(d.pool_name, d.device_name, list(d.request_names), list(d.cdi_device_ids)) for d in ok.devices] == [
        ("node-a", "gpu-0", ["gpu"], ["k8s.gpu.tessera.dev/claim=uid-gpu-0"])
    ]
    assert response.claims[uid("fetch-fails")].error == "ResourceClaim ns/claim-fetch-fails not found: it was deleted"
    assert response.claims[uid("driver-error")].error == "GPU 9 is unhealthy"
    assert list(response.claims[uid("driver-error")].devices) == []  # the kubelet ignores them; send none
    assert "RuntimeError: boom in driver" in response.claims[uid("driver-raises")].error
    assert list(response.claims[uid("driver-raises")].devices) == []
    # A claim that could not be fetched never reaches the driver.
    assert sorted(labels(served.driver.prepared)) == ["driver-error", "driver-raises", "ok"]


def test_driver_exception_is_logged_with_traceback_and_claim_uid(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    served.driver.outcomes[uid("bad")] = raise_boom
    with caplog.at_level(logging.INFO, logger="driver.kubeletplugin.claimbatch"):
        served.v1().NodePrepareResources(v1_request("bad"), timeout=10)

    tracebacks = [r for r in caplog.records if r.exc_info is not None]
    assert len(tracebacks) == 1
    assert vars(tracebacks[0]).get("claim_uid") == uid("bad")
    assert isinstance(tracebacks[0].exc_info[1], RuntimeError)  # type: ignore[index]


def test_one_outcome_log_line_per_claim_with_context(served: Served, caplog: pytest.LogCaptureFixture) -> None:
    served.driver.outcomes[uid("failing")] = PrepareResult(error="no such GPU")
    with caplog.at_level(logging.INFO, logger="driver.kubeletplugin.claimbatch"):
        served.v1().NodePrepareResources(v1_request("good", "failing"), timeout=10)

    outcomes = {label(vars(r)["claim_uid"]): r for r in caplog.records if "duration_ms" in vars(r)}
    assert set(outcomes) == {"good", "failing"}
    assert vars(outcomes["failing"])["error"] == "no such GPU"
    assert outcomes["failing"].levelno == logging.WARNING
    assert "error" not in vars(outcomes["good"])
    for name, record in outcomes.items():
        assert vars(record)["claim_namespace"] == "ns"
        assert vars(record)["claim_name"] == f"claim-{name}"
        assert vars(record)["duration_ms"] >= 0


def test_share_id_is_set_only_when_the_driver_gives_one(served: Served) -> None:
    served.driver.outcomes[uid("shared")] = PrepareResult(
        devices=[device("gpu-0-mps-1", share_id="5e8f1f4c-share"), device("gpu-1")]
    )
    response = served.v1().NodePrepareResources(v1_request("shared"), timeout=10)

    with_share, without_share = response.claims[uid("shared")].devices
    assert with_share.HasField("share_id")
    assert with_share.share_id == "5e8f1f4c-share"
    assert not without_share.HasField("share_id")


def test_v1beta1_service_prepares_without_share_id(served: Served) -> None:
    served.driver.outcomes[uid("shared")] = PrepareResult(devices=[device("gpu-0-mps-1", share_id="5e8f1f4c-share")])
    served.driver.outcomes[uid("failing")] = PrepareResult(error="no such GPU")
    request = dra_v1beta1_pb2.NodePrepareResourcesRequest(
        claims=[
            dra_v1beta1_pb2.Claim(namespace="ns", name="claim-shared", uid=uid("shared")),
            dra_v1beta1_pb2.Claim(namespace="ns", name="claim-failing", uid=uid("failing")),
        ]
    )
    response = served.v1beta1().NodePrepareResources(request, timeout=10)

    (only,) = response.claims[uid("shared")].devices
    assert (only.pool_name, only.device_name, list(only.request_names)) == ("node-a", "gpu-0-mps-1", ["gpu"])
    assert "share_id" not in dra_v1beta1_pb2.Device.DESCRIPTOR.fields_by_name
    assert response.claims[uid("failing")].error == "no such GPU"

    unprepared = served.v1beta1().NodeUnprepareResources(
        dra_v1beta1_pb2.NodeUnprepareResourcesRequest(
            claims=[dra_v1beta1_pb2.Claim(namespace="ns", name="claim-shared", uid=uid("shared"))]
        ),
        timeout=10,
    )
    assert set(labels(unprepared.claims)) == {"shared"}
    assert unprepared.claims[uid("shared")].error == ""


def test_unprepare_answers_every_claim_without_reading_the_api(served: Served) -> None:
    served.driver.unprepare_outcomes[uid("stuck")] = "MPS daemon for GPU 0 did not stop"
    served.driver.unprepare_outcomes[uid("raises")] = OSError("checkpoint unreadable")

    response = served.v1().NodeUnprepareResources(v1_unprepare_request("never-prepared", "stuck", "raises"), timeout=10)

    assert set(labels(response.claims)) == {"never-prepared", "stuck", "raises"}
    assert response.claims[uid("never-prepared")].error == ""
    assert response.claims[uid("stuck")].error == "MPS daemon for GPU 0 did not stop"
    assert "OSError: checkpoint unreadable" in response.claims[uid("raises")].error
    assert served.claims.fetched == []
    assert sorted(labels(served.driver.unprepared)) == ["never-prepared", "raises", "stuck"]


def test_empty_request_gets_an_empty_answer(served: Served) -> None:
    assert len(served.v1().NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(), timeout=10).claims) == 0
    assert len(served.v1().NodeUnprepareResources(dra_v1_pb2.NodeUnprepareResourcesRequest(), timeout=10).claims) == 0


def test_a_claim_listed_twice_is_prepared_once(served: Served) -> None:
    request = v1_request("dup")
    request.claims.append(request.claims[0])
    response = served.v1().NodePrepareResources(request, timeout=10)
    assert set(labels(response.claims)) == {"dup"}
    assert labels(served.driver.prepared) == ["dup"]


def test_unexpected_fetch_failure_becomes_the_claim_error(served: Served) -> None:
    served.claims.errors[uid("flaky")] = ConnectionResetError("peer reset")
    response = served.v1().NodePrepareResources(v1_request("flaky", "fine"), timeout=10)
    assert "ConnectionResetError: peer reset" in response.claims[uid("flaky")].error
    assert response.claims[uid("fine")].error == ""


def test_claims_of_one_request_run_concurrently(served: Served) -> None:
    # Each prepare waits for the other two; run one after another they would break the barrier.
    barrier = threading.Barrier(3, timeout=10)

    def meet() -> PrepareResult:
        barrier.wait()
        return PrepareResult(devices=[device("gpu-0")])

    served.driver.outcomes.update({uid("a"): meet, uid("b"): meet, uid("c"): meet})
    response = served.v1().NodePrepareResources(v1_request("a", "b", "c"), timeout=30)
    assert {label(u): entry.error for u, entry in response.claims.items()} == {"a": "", "b": "", "c": ""}


def test_spans_and_metrics_per_claim(served: Served) -> None:
    served.driver.outcomes[uid("failing")] = PrepareResult(error="no such GPU")
    served.driver.unprepare_outcomes[uid("stuck")] = "still in use"
    served.v1().NodePrepareResources(v1_request("good", "failing"), timeout=10)
    served.v1().NodeUnprepareResources(v1_unprepare_request("good", "stuck"), timeout=10)

    spans = {(s.name, label(str((s.attributes or {}).get("dra.claim.uid")))): s
             for s in served.spans.get_finished_spans()}
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

    assert {label(u): r.error for u, r in prepared.items()} == {"late-1": KUBELET_GAVE_UP, "late-2": KUBELET_GAVE_UP}
    assert {label(u): e for u, e in unprepared.items()} == {"late-3": KUBELET_GAVE_UP}
    assert "kubelet" in KUBELET_GAVE_UP
    assert driver.prepared == [] and driver.unprepared == [] and claims.fetched == []


def test_the_driver_gets_the_kubelets_deadline_less_a_margin_to_answer(served: Served) -> None:
    response = served.v1().NodePrepareResources(v1_request("a", "b"), timeout=5)
    assert {label(u): c.error for u, c in response.claims.items()} == {"a": "", "b": ""}
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
    assert late[uid("late")].error == KUBELET_GAVE_UP, "no time left to answer: the claim is not started"
    assert labels(driver.prepared) == ["a"]
    with pytest.raises(ValueError, match="prepare_deadline"):
        ClaimBatch(driver, claims, telemetry, prepare_deadline=0)


def test_a_claim_uid_that_is_no_uid_is_refused_per_claim_before_any_work(served: Served) -> None:
    # A UID names checkpoint entries, CDI spec files and daemon directories: "../x" must never get there.
    hostile = [ClaimRef(namespace="ns", name="evil", uid="../../etc/passwd"), *refs("fine")]
    prepared = served.v1().NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(
        claims=[dra_v1_pb2.Claim(namespace=r.namespace, name=r.name, uid=r.uid) for r in hostile]), timeout=10)
    unprepared = served.v1().NodeUnprepareResources(dra_v1_pb2.NodeUnprepareResourcesRequest(
        claims=[dra_v1_pb2.Claim(namespace=r.namespace, name=r.name, uid=r.uid) for r in hostile]), timeout=10)

    for answer in (prepared.claims["../../etc/passwd"].error, unprepared.claims["../../etc/passwd"].error):
        assert answer.startswith('ResourceClaim ns/evil: claim uid "../../etc/passwd" is not a Kubernetes UID')
    assert "refusing to prepare it" in prepared.claims["../../etc/passwd"].error
    assert "refusing to unprepare it" in unprepared.claims["../../etc/passwd"].error
    assert prepared.claims[uid("fine")].error == "" and unprepared.claims[uid("fine")].error == ""
    assert labels(served.driver.prepared) == ["fine"] and labels(served.driver.unprepared) == ["fine"]
    assert labels(r.uid for r in served.claims.fetched) == ["fine"]


def test_span_names_come_from_the_telemetry_scope() -> None:
    spans = InMemorySpanExporter()
    telemetry = Telemetry("test", "acme", span_exporter=spans, scope="acme.gpu")
    batch = ClaimBatch(FakeDriver(), FakeClaims(), telemetry)
    try:
        batch.prepare(refs("a"), is_active=lambda: True)
        batch.unprepare(refs("a"), is_active=lambda: True)
    finally:
        telemetry.shutdown()
    assert sorted(s.name for s in spans.get_finished_spans()) == ["acme.gpu.prepare_claim", "acme.gpu.unprepare_claim"]


def test_one_claims_huge_error_does_not_cost_the_other_claims_their_answer(served: Served) -> None:
    # All answers travel in one gRPC message, which the kubelet takes up to 4 MiB: an error grown from what a
    # tenant wrote must be cut, or the whole request fails (RESOURCE_EXHAUSTED) and no claim is answered.
    served.driver.outcomes[uid("huge")] = PrepareResult(error="x" * (5 << 20))
    served.driver.unprepare_outcomes[uid("huge")] = "y" * (5 << 20)
    response = served.v1().NodePrepareResources(v1_request("ok", "huge"), timeout=10)
    assert response.claims[uid("ok")].error == "" and len(response.claims[uid("ok")].devices) == 1
    huge = response.claims[uid("huge")].error
    assert huge.startswith("xxx") and len(huge) < 10_000 and huge.endswith("more characters not shown)")
    unprepared = served.v1().NodeUnprepareResources(v1_unprepare_request("ok", "huge"), timeout=10)
    assert unprepared.claims[uid("ok")].error == "" and len(unprepared.claims[uid("huge")].error) < 10_000
