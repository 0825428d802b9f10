"""Limits are watched: drift found by a prepare or the watcher is reported (log, metrics, Events), restarts too.

The daemons are FakeMps records (tests/support/statenode.py); test_mps.py covers the read-back
against real daemons, tests/integration/test_mps_limit_watch.py the whole path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime

import pytest
from prometheus_client.parser import text_string_to_metric_families

from driver.gpu.mps.limits import LimitDrift
from driver.gpu.mps.model import MpsDaemonRecord, MpsDaemonStopped, MpsNoAnswer
from driver.gpu.published.devices import make_view
from driver.gpu.runtime.interfaces import ServedClaim
from driver.gpu.runtime.sharing import WATCH_CHECK_S
from driver.gpu.state import DeviceState
from driver.gpu.watch.daemonwatch import DAEMON_RESTARTED, LIMITS_REVERTED, DaemonWatcher, MpsReports, revive_daemons
from driver.kubeletplugin.events import EventRecorder, EventSpec, ObjectRef
from driver.kubeletplugin.kubeclient import KubeApiError, plain_client, request_json
from driver.kubeletplugin.telemetry import Telemetry
from driver.kubeletplugin.types import Deadline
from driver.simulation.apiserver import FakeApiServer
from tests.support.statenode import StateNode, claim, mps_shares

DRIFT = [LimitDrift(limit="active_thread_percentage", found="100.0", expected="50"),
         LimitDrift(limit="pinned_mem_limit/0", found="79G", expected="19456M")]


class Recorded:
    def __init__(self) -> None:
        self.drift: list[tuple[str, list[LimitDrift], list[str]]] = []
        self.restarts: list[tuple[str, list[str]]] = []
        self.unconfirmed: list[tuple[str, list[str], bool]] = []
        self.confirmed: list[tuple[str, list[str]]] = []

    def limits_reverted(self, daemon_id: str, drift: Sequence[LimitDrift], claims: Sequence[ServedClaim]) -> None:
        self.drift.append((daemon_id, list(drift), sorted(c.uid for c in claims)))

    def daemon_restarted(self, daemon_id: str, claims: Sequence[ServedClaim]) -> None:
        self.restarts.append((daemon_id, sorted(c.uid for c in claims)))

    def limits_unconfirmed(self, daemon_id: str, reason: str, claims: Sequence[ServedClaim], first: bool) -> None:
        self.unconfirmed.append((daemon_id, sorted(c.uid for c in claims), first))

    def limits_confirmed(self, daemon_id: str, claims: Sequence[ServedClaim]) -> None:
        self.confirmed.append((daemon_id, sorted(c.uid for c in claims)))


@pytest.fixture
def api() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    server.start()
    yield server
    server.stop()


def _one_share(state_node: StateNode) -> tuple[DeviceState, Recorded, str]:
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(2): mps_shares(2)})
    reports = Recorded()
    state.sharing.reports = reports
    state.prepare(claim("a", "gpu-2-mps-0"))
    [daemon_id] = state_node.mps.started()
    return state, reports, daemon_id


def test_a_prepare_that_reuses_a_daemon_reads_its_limits_back_and_reports_drift(state_node: StateNode) -> None:
    state, reports, daemon_id = _one_share(state_node)
    state_node.mps.drift[daemon_id] = DRIFT
    state.prepare(claim("b", "gpu-2-mps-1"))
    assert state_node.mps.verified == [daemon_id]
    assert reports.drift == [(daemon_id, DRIFT, ["a", "b"])]


def test_the_watcher_reverts_drift_and_restarts_a_stopped_daemon(state_node: StateNode) -> None:
    state, reports, daemon_id = _one_share(state_node)
    state_node.mps.drift[daemon_id] = DRIFT
    assert revive_daemons(state, limits=True) == []
    assert reports.drift == [(daemon_id, DRIFT, ["a"])]
    state_node.mps.running.pop(daemon_id)  # a client sent quit
    assert revive_daemons(state, limits=True) == [daemon_id]
    assert reports.restarts == [(daemon_id, ["a"])]
    assert revive_daemons(state) == [], "the rescan's check reads /proc only"
    assert state_node.mps.verified == [daemon_id], "a gone daemon is restarted, not asked"


def test_a_prepare_goes_on_when_a_client_keeps_stopping_the_daemon(
        state_node: StateNode, monkeypatch: pytest.MonkeyPatch) -> None:
    state, reports, daemon_id = _one_share(state_node)
    state_node.mps.running.pop(daemon_id)  # the tenant's quit

    def stopped_again(record: MpsDaemonRecord, deadline: Deadline | None = None,
                      retry_stopped: bool = False) -> MpsDaemonRecord:
        assert retry_stopped and deadline is not None, "a prepare retries within its deadline"
        raise MpsDaemonStopped("starting it failed: the daemon exited before it became ready")

    monkeypatch.setattr(state_node.mps, "ensure_running", stopped_again)
    state.prepare(claim("b", "gpu-2-mps-1"))  # neither fails nor waits for the tenant
    assert [r.uid for r in state.prepared_claims()] == ["a", "b"]
    assert reports.restarts == []


def test_a_prepare_goes_on_when_a_client_holds_the_daemons_control_session(
    state_node: StateNode, monkeypatch: pytest.MonkeyPatch
) -> None:
    state, reports, daemon_id = _one_share(state_node)
    asked: list[float | None] = []

    def silent(record: MpsDaemonRecord, deadline: Deadline | None = None) -> list[LimitDrift]:
        asked.append(None if deadline is None else deadline.remaining())
        raise MpsNoAnswer("control command 'get_default_active_thread_percentage' got no answer within 5s")

    monkeypatch.setattr(state_node.mps, "check_and_restore_limits", silent)
    state.prepare(claim("b", "gpu-2-mps-1"))
    assert asked[0] is not None and asked[0] <= 1.5, "a prepare waits little for the read-back"
    assert revive_daemons(state, limits=True) == [], "the watcher reports it and tries again next round"
    assert asked[-1] is not None and asked[-1] <= WATCH_CHECK_S, "a watcher check holds the GPU's locks briefly"
    assert reports.drift == []
    # No watch interval here: unconfirmed at once, reported once, each claim told once.
    assert reports.unconfirmed == [(daemon_id, ["a", "b"], True)]
    monkeypatch.setattr(state_node.mps, "check_and_restore_limits", lambda record, deadline=None: [])
    revive_daemons(state, limits=True)
    assert reports.confirmed == [(daemon_id, ["a", "b"])]


def test_the_watcher_thread_checks_every_interval_until_stopped(state_node: StateNode) -> None:
    state, _reports, daemon_id = _one_share(state_node)
    watcher = DaemonWatcher(state, interval=0.05)
    watcher.start()
    try:
        deadline = time.monotonic() + 10
        while len(state_node.mps.verified) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        watcher.stop(timeout=5)
    assert state_node.mps.verified[:3] == [daemon_id] * 3
    checked = len(state_node.mps.verified)
    time.sleep(0.2)
    assert len(state_node.mps.verified) == checked, "no check after stop"


def test_reports_count_drift_and_restarts_and_post_an_event_per_claim(
        state_node: StateNode, api: FakeApiServer) -> None:
    state, _reports, daemon_id = _one_share(state_node)
    state.prepare(claim("b", "gpu-2-mps-1"))
    served = state.prepared_claims()
    recorder = EventRecorder(api.api_client(), "gpu.tessera.dev/kubelet-plugin", "node-1")
    mps = MpsReports(recorder)
    telemetry = Telemetry("t", "tessera")
    mps.register_metrics(telemetry)
    recorder.start()
    try:
        mps.limits_reverted(daemon_id, DRIFT, served)
        mps.limits_reverted(daemon_id, DRIFT[:1], served)
        mps.daemon_restarted(daemon_id, served)
    finally:
        recorder.stop(timeout=10)
    samples = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if not k.startswith("otel_")))): s.value
               for f in text_string_to_metric_families(telemetry.render_metrics().decode()) for s in f.samples}
    telemetry.shutdown()
    assert samples[("tessera_mps_limit_drift_total",
                    (("daemon", daemon_id), ("limit", "active_thread_percentage")))] == 2
    assert samples[("tessera_mps_limit_drift_total", (("daemon", daemon_id), ("limit", "pinned_mem_limit/0")))] == 1
    assert samples[("tessera_mps_daemon_restarts_total", (("daemon", daemon_id),))] == 1
    events = api.events("default")
    # One event per claim and reason: the second drift within the recorder's interval is not posted again.
    assert sorted((e["regarding"]["name"], e["reason"]) for e in events) == [
        ("claim-a", DAEMON_RESTARTED), ("claim-a", LIMITS_REVERTED),
        ("claim-b", DAEMON_RESTARTED), ("claim-b", LIMITS_REVERTED)]
    reverted = next(e for e in events if e["reason"] == LIMITS_REVERTED and e["regarding"]["name"] == "claim-a")
    assert reverted["type"] == "Warning" and reverted["regarding"]["uid"] == "a"
    assert reverted["regarding"]["kind"] == "ResourceClaim"
    assert "active_thread_percentage was '100.0', restored to 50" in reverted["note"]
    assert "pinned_mem_limit/0 was '79G', restored to 19456M" in reverted["note"]


def test_posting_never_blocks_and_drops_what_the_queue_cannot_hold() -> None:
    # No API server listens here, and the worker is not even started: nothing drains the queue.
    recorder = EventRecorder(plain_client("http://127.0.0.1:9"), "c.example/x", "n", queue_size=2,
                             request_timeout=0.2)
    ref = ObjectRef(apiVersion="v1", kind="ResourceClaim", namespace="ns", name="c", uid="u")
    started = time.monotonic()
    posted = [recorder.post(EventSpec(regarding=ref.model_copy(update={"uid": f"u{i}"}), reason="R", action="A",
                                      note="n")) for i in range(5)]
    assert time.monotonic() - started < 1.0
    assert posted == [True, True, False, False, False]


def test_the_api_double_validates_events_as_the_api_server_does(api: FakeApiServer) -> None:
    good = EventSpec(regarding=ObjectRef(apiVersion="resource.k8s.io/v1", kind="ResourceClaim", namespace="ns",
                                         name="c", uid="u"), reason="R", action="A", note="x" * 2000)
    body = good.body("gpu.tessera.dev/kubelet-plugin", "node-1", datetime.now(UTC))
    assert len(str(body["note"])) == 1024, "a long note is cut to the server's limit"
    request_json(api.api_client(), "POST", "/apis/events.k8s.io/v1/namespaces/ns/events", body=body)
    [stored] = api.events("ns")
    assert stored["metadata"]["name"].startswith("c.") and stored["reportingInstance"] == "node-1"
    with pytest.raises(KubeApiError, match=r"422.*reason"):
        request_json(api.api_client(), "POST", "/apis/events.k8s.io/v1/namespaces/ns/events",
                     body={**body, "reason": ""})
    with pytest.raises(KubeApiError, match=r"422.*regarding\.namespace"):
        request_json(api.api_client(), "POST", "/apis/events.k8s.io/v1/namespaces/other/events", body=body)


def test_a_nodes_event_is_posted_in_default_which_is_the_only_user_namespace_the_api_server_takes_it_in(
        api: FakeApiServer) -> None:
    node = EventSpec(regarding=ObjectRef(apiVersion="v1", kind="Node", namespace="", name="node-1", uid="u"),
                     reason="R", action="A", note="n")
    assert node.namespace() == "default"
    body = node.body("gpu.tessera.dev/kubelet-plugin", "node-1", datetime.now(UTC))
    assert body["metadata"] == {"generateName": "node-1.", "namespace": "default"}
    request_json(api.api_client(), "POST", "/apis/events.k8s.io/v1/namespaces/default/events", body=body)
    assert [e["regarding"]["kind"] for e in api.events("default")] == ["Node"]
    with pytest.raises(KubeApiError, match=r"422.*regarding\.namespace"):
        request_json(api.api_client(), "POST", "/apis/events.k8s.io/v1/namespaces/tessera/events", body=body)
