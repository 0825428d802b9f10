"""Telemetry: Prometheus rendering of the instruments and gauges, spans, the HTTP endpoint (httpendpoint.py)
and independence of objects."""

from __future__ import annotations

import errno
import socket
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from driver.kubeletplugin.httpendpoint import CachedRoute, Route, RouteServer
from driver.kubeletplugin.telemetry import CONTENT_TYPE, Telemetry


@pytest.fixture
def serve(telemetry: Telemetry) -> Iterator[Callable[..., int]]:
    """Start a RouteServer with ``telemetry`` on /metrics; its port. Every server started is shut down."""
    servers: list[RouteServer] = []

    def start(host: str, port: int, routes: dict[str, Route] | None = None, **options: Any) -> int:
        server = RouteServer(host, port, routes or {}, **options)
        server.serve_metrics(telemetry.render_metrics, CONTENT_TYPE)
        servers.append(server)
        return server.port

    yield start
    for server in servers:
        server.shutdown()


def _samples(t: Telemetry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, labels without the OTel scope labels) -> value."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(t.render_metrics().decode()):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if not k.startswith("otel_")))
            out[(sample.name, labels)] = sample.value
    return out


def _get(port: int, path: str, host: str = "127.0.0.1") -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def test_counters_are_rendered_with_the_prefix(telemetry: Telemetry) -> None:
    telemetry.prepare_total.add(1, {"result": "success"})
    telemetry.prepare_total.add(2, {"result": "success"})
    telemetry.prepare_total.add(1, {"result": "error"})
    telemetry.unprepare_total.add(1, {"result": "success"})
    telemetry.slice_sync_total.add(4, {"result": "success"})
    samples = _samples(telemetry)
    assert samples[("tessera_prepare_claims_total", (("result", "success"),))] == 3
    assert samples[("tessera_prepare_claims_total", (("result", "error"),))] == 1
    assert samples[("tessera_unprepare_claims_total", (("result", "success"),))] == 1
    assert samples[("tessera_resourceslice_syncs_total", (("result", "success"),))] == 4


def test_histograms_use_the_latency_buckets(telemetry: Telemetry) -> None:
    telemetry.prepare_duration.record(0.02, {"result": "success"})
    telemetry.prepare_duration.record(30.0, {"result": "success"})
    telemetry.unprepare_duration.record(0.004)
    samples = _samples(telemetry)
    ok = (("result", "success"),)
    assert samples[("tessera_prepare_claim_duration_seconds_count", ok)] == 2
    assert samples[("tessera_prepare_claim_duration_seconds_sum", ok)] == pytest.approx(30.02)

    def bucket(le: str) -> float:
        return samples[("tessera_prepare_claim_duration_seconds_bucket", (("le", le), ("result", "success")))]

    # Buckets reach the kubelet's 45 s limit, so a slow MPS start is still resolved.
    assert bucket("0.01") == 0 and bucket("0.025") == 1 and bucket("20") == 1 and bucket("45") == 2
    assert samples[("tessera_unprepare_claim_duration_seconds_count", ())] == 1


def test_observed_gauge_is_read_at_scrape_time(telemetry: Telemetry) -> None:
    value = [3.0]
    telemetry.observe_gauge("prepared_claims", "Claims prepared on this node", lambda: value[0])
    assert _samples(telemetry)[("tessera_prepared_claims", ())] == 3.0
    value[0] = 5.0
    assert _samples(telemetry)[("tessera_prepared_claims", ())] == 5.0


def test_two_objects_in_one_process_keep_their_own_metrics() -> None:
    first, second = Telemetry("a", "tessera"), Telemetry("b", "tessera")
    try:
        first.prepare_total.add(1, {"result": "success"})
        second.prepare_total.add(7, {"result": "success"})
        second.observe_gauge("prepared_claims", "x", lambda: 2.0)
        key = ("tessera_prepare_claims_total", (("result", "success"),))
        assert _samples(first)[key] == 1
        assert _samples(second)[key] == 7
        assert ("tessera_prepared_claims", ()) not in _samples(first)
    finally:
        first.shutdown()
        second.shutdown()


def test_spans_reach_the_given_exporter() -> None:
    exporter = InMemorySpanExporter()
    t = Telemetry("tessera-test", "tessera", span_exporter=exporter)
    try:
        with t.tracer.start_as_current_span("NodePrepareResources") as span:
            span.set_attribute("claim_uid", "uid-1")
        [finished] = exporter.get_finished_spans()
        assert finished.name == "NodePrepareResources"
        assert finished.attributes is not None and finished.attributes["claim_uid"] == "uid-1"
        assert finished.resource.attributes["service.name"] == "tessera-test"
    finally:
        t.shutdown()


def test_http_server_serves_metrics_routes_and_404(telemetry: Telemetry, serve: Callable[..., int]) -> None:
    telemetry.prepare_total.add(1, {"result": "success"})
    port = serve("127.0.0.1", 0, {"/healthz": lambda: (200, "ok\n"),
                                  "/readyz": lambda: (503, "not ready: no slices\n")})
    assert port > 0
    status, ctype, body = _get(port, "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    assert 'tessera_prepare_claims_total{' in body
    assert _get(port, "/healthz")[::2] == (200, "ok\n")
    assert _get(port, "/healthz?verbose=1")[::2] == (200, "ok\n")
    assert _get(port, "/readyz")[::2] == (503, "not ready: no slices\n")
    assert _get(port, "/nope")[0] == 404


def test_routes_are_evaluated_per_request_without_a_cache(serve: Callable[..., int]) -> None:
    ready = [False]
    port = serve("127.0.0.1", 0, {"/readyz": lambda: (200, "ok") if ready[0] else (503, "no")}, route_cache_s=0)
    assert _get(port, "/readyz")[0] == 503
    ready[0] = True
    assert _get(port, "/readyz")[0] == 200


def test_a_flood_of_probes_runs_the_health_check_once_per_interval(serve: Callable[..., int]) -> None:
    calls: list[int] = []

    def healthz() -> tuple[int, str]:
        calls.append(1)
        return 200, f"check {len(calls)}\n"

    # A long interval: every request below falls inside it however slow the machine.
    port = serve("127.0.0.1", 0, {"/healthz": healthz}, route_cache_s=3600)
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _get(port, "/healthz")[::2], range(40)))
    assert answers == [(200, "check 1\n")] * 40
    assert len(calls) == 1


def test_cached_route_recomputes_once_the_interval_passed() -> None:
    now = [100.0]
    calls: list[float] = []

    def route() -> tuple[int, str]:
        calls.append(now[0])
        return 200, "ok"

    cached = CachedRoute(route, 1.0, clock=lambda: now[0])
    cached()
    now[0] = 100.9
    cached()
    assert calls == [100.0]
    now[0] = 101.0
    cached()
    assert calls == [100.0, 101.0]


def test_a_failing_route_answers_500_without_details_and_is_cached(caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def route() -> tuple[int, str]:
        calls.append(1)
        raise OSError("cannot stat /var/lib/kubelet/plugins/gpu.tessera.dev/dra.sock")

    cached = CachedRoute(route, 60.0)
    assert cached() == (500, "internal error; see the plugin log\n")
    assert cached() == (500, "internal error; see the plugin log\n")
    assert len(calls) == 1
    assert "/var/lib/kubelet" in caplog.text  # the detail is in the log


def test_shutdown_stops_the_server() -> None:
    server = RouteServer("127.0.0.1", 0, {})
    port = server.port
    assert _get(port, "/metrics")[0] == 503, "no telemetry attached yet: the plugin is starting"
    server.shutdown()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)


def test_shutdown_without_a_server_is_fine() -> None:
    Telemetry("tessera-test", "tessera").shutdown()


def test_a_client_that_sends_nothing_is_disconnected(serve: Callable[..., int]) -> None:
    port = serve("127.0.0.1", 0, connection_timeout_s=0.2)
    with socket.create_connection(("127.0.0.1", port)) as idle:
        idle.settimeout(10)  # far beyond the server's timeout: only a hang reaches it
        assert idle.recv(1024) == b""  # the server closed the connection
    assert _get(port, "/metrics")[0] == 200  # and keeps serving others


def _ipv6_loopback_works() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


def test_any_address_host_serves_ipv4_and_ipv6(serve: Callable[..., int]) -> None:
    port = serve("::", 0, {"/healthz": lambda: (200, "ok\n")})
    assert _get(port, "/healthz")[::2] == (200, "ok\n")
    if _ipv6_loopback_works():
        assert _get(port, "/healthz", host="[::1]")[::2] == (200, "ok\n")


class _SocketWithoutIPv6(socket.socket):
    """socket.socket on a machine whose kernel has no IPv6."""

    def __init__(self, family: Any = socket.AF_INET, *args: Any, **kwargs: Any) -> None:
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        super().__init__(family, *args, **kwargs)


def test_any_address_host_falls_back_to_ipv4_without_ipv6(serve: Callable[..., int],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "socket", _SocketWithoutIPv6)
    port = serve("::", 0, {"/healthz": lambda: (200, "ok\n")})
    monkeypatch.undo()
    assert _get(port, "/healthz")[::2] == (200, "ok\n")


def test_a_broken_reading_leaves_the_other_metrics_on_the_scrape(telemetry: Telemetry,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    def broken() -> list[tuple[float, dict[str, str]]]:
        raise RuntimeError("NVML went away")

    telemetry.observe_labelled("gpu_power_watts", "GPU power draw", broken)
    telemetry.observe_labelled("claim_gpu_processes", "Processes", lambda: [(2.0, {"claim": 'a"b\\c'})])
    samples = _samples(telemetry)
    assert samples[("tessera_claim_gpu_processes", (("claim", 'a"b\\c'),))] == 2.0
    assert not [name for name, _ in samples if name == "tessera_gpu_power_watts"]
    assert "reading a metric failed" in caplog.text


def test_a_metric_name_is_registered_once(telemetry: Telemetry) -> None:
    telemetry.observe_gauge("prepared_claims", "Claims prepared", lambda: 1.0)
    with pytest.raises(ValueError, match="registered twice"):
        telemetry.observe_gauge("prepared_claims", "Claims prepared", lambda: 1.0)


def test_clients_that_reset_mid_answer_or_send_garbage_leave_no_traceback_and_the_port_serving(
        serve: Callable[..., int], capsys: pytest.CaptureFixture[str]) -> None:
    # Anyone on the pod network reaches this port: a scraper hanging up mid-answer or bytes that are not
    # HTTP are not the driver's errors, and socketserver would print a traceback to stderr for the first.
    port = serve("127.0.0.1", 0, {"/big": lambda: (200, "x" * (8 << 20))}, route_cache_s=0.0)
    for _ in range(5):
        with socket.create_connection(("127.0.0.1", port)) as rude:
            rude.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            rude.recv(1)
            # Close with a reset (linger 0) while the 8 MiB answer is still being written.
            rude.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    with socket.create_connection(("127.0.0.1", port)) as garbage:
        garbage.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\xff" * 64 + b"\r\n\r\n")
        garbage.settimeout(10)
        garbage.recv(4096)
    assert _get(port, "/metrics")[0] == 200
    assert "Traceback" not in capsys.readouterr().err
