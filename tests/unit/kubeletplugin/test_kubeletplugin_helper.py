"""The kubelet-plugin layer's single entry point (driver.kubeletplugin.helper), driven by the kubelet
emulator and the API server double, and the layer's independence from the GPU code."""

from __future__ import annotations

import ast
import pkgutil
import re
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import driver.kubeletplugin
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.helper import Helper, HttpEndpoint, TelemetryNames, start
from driver.kubeletplugin.types import ClaimRef, Deadline, PreparedDevice, PrepareResult
from driver.simulation.apiserver import FakeApiServer
from driver.simulation.kubelet import KubeletEmulator
from tests.support.kubeletplugin import DRIVER, NODE, Dirs, eventually, gpu, gpus

NAMES = TelemetryNames(service="acme-plugin", metric_prefix="acme")


class OneDeviceDriver:
    """Prepares a claim as the devices of its allocation; remembers what it unprepared."""

    def __init__(self) -> None:
        self.unprepared: list[str] = []

    def prepare_claim(self, claim: ResourceClaim, deadline: Deadline) -> PrepareResult:
        return PrepareResult(devices=[
            PreparedDevice(request_names=[r.base_request], pool_name=r.pool, device_name=r.device,
                           cdi_device_ids=[f"example.com/dev={r.device}"])
            for r in claim.results_for(DRIVER)])

    def unprepare_claim(self, claim: ClaimRef) -> str | None:
        self.unprepared.append(claim.uid)
        return None


class Refusals:
    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.called = threading.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self.called.set()


@pytest.fixture
def started(dirs: Dirs, node_apiserver: FakeApiServer) -> Iterator[dict[str, Any]]:
    """Keyword arguments for ``start`` against the double and ``dirs``; every helper made is stopped."""
    helpers: list[Helper] = []
    args: dict[str, Any] = dict(driver_name=DRIVER, node_name=NODE, api=node_apiserver.api_client(), names=NAMES,
                                registrar_dir=dirs.registrar, plugin_dir=dirs.plugin, resync_delay=0.05,
                                on_registration_failed=Refusals())
    args["_helpers"] = helpers
    yield args
    for helper in helpers:
        helper.stop()


def start_helper(args: dict[str, Any], **overrides: Any) -> Helper:
    options = {k: v for k, v in args.items() if k != "_helpers"}
    options.update(overrides)
    driver = options.pop("driver", None) or OneDeviceDriver()
    helper = start(driver, **options)
    args["_helpers"].append(helper)
    return helper


def get(port: int | None, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_registers_prepares_claims_read_from_the_api_and_publishes(
        started: dict[str, Any], dirs: Dirs, node_apiserver: FakeApiServer) -> None:
    driver = OneDeviceDriver()
    helper = start_helper(started, driver=driver)
    assert helper.registration_status is None and not helper.registered
    assert helper.kubernetes_minor_version == 36  # read from the double's /version

    with KubeletEmulator(dirs.registrar) as kubelet:
        plugin = kubelet.wait_for_plugin(DRIVER, timeout=10)
        assert plugin.endpoint == str(dirs.plugin / "dra.sock") == str(helper.dra_socket)
        assert helper.wait_registered(5) and helper.registered
        assert helper.registration_status is not None and helper.registration_status.registered

        stored = node_apiserver.put_claim({"metadata": {"name": "c1", "namespace": "ns"}, "status": {"allocation": {
            "devices": {"results": [{"request": "gpu", "driver": DRIVER, "pool": NODE, "device": "gpu-0"}]}}}})
        ref = ClaimRef(namespace="ns", name="c1", uid=stored["metadata"]["uid"])
        answer = kubelet.prepare([ref])[ref.uid]
        assert answer.error is None
        assert [d.device_name for d in answer.devices] == ["gpu-0"]
        assert kubelet.unprepare([ref]) == {ref.uid: None} and driver.unprepared == [ref.uid]

    assert helper.publish(gpus(130)) == []
    assert helper.wait_published(10)
    slices = node_apiserver.slices(DRIVER, NODE)
    assert [len(s["spec"]["devices"]) for s in slices] == [128, 2]
    assert helper.published_device_count == 130

    helper.stop()
    assert not helper.dra_socket.exists() and not helper.registration_socket.exists()
    assert len(node_apiserver.slices(DRIVER, NODE)) == 2, "slices stay published after stop"
    helper.stop()  # a second stop does nothing


def test_invalid_devices_are_refused_and_the_previous_ones_stay(
        started: dict[str, Any], node_apiserver: FakeApiServer) -> None:
    helper = start_helper(started, kubernetes_minor_version=36)
    helper.publish([gpu(0)])
    assert helper.wait_published(10)
    problems = helper.publish([gpu(0), gpu(0)])
    assert problems == ['device "gpu-0": name is used more than once in the pool (indexes 0 and 1)']
    assert helper.wait_published(1)
    assert [d["name"] for d in node_apiserver.slices(DRIVER, NODE)[0]["spec"]["devices"]] == ["gpu-0"]


def test_a_refused_registration_is_reported(started: dict[str, Any], dirs: Dirs) -> None:
    refusals = Refusals()
    helper = start_helper(started, on_registration_failed=refusals, pod_uid="pod-1")
    assert helper.registration_socket.name == f"{DRIVER}-pod-1-reg.sock"
    with KubeletEmulator(dirs.registrar) as kubelet:
        kubelet.wait_for_plugin(DRIVER, timeout=10, reject_with="plugin validation failed: wrong version")
    assert refusals.called.wait(5)
    assert refusals.reasons == ["plugin validation failed: wrong version"]
    status = helper.registration_status
    assert status is not None and not status.registered and not helper.registered


def test_http_endpoint_serves_metrics_liveness_and_readiness(started: dict[str, Any], dirs: Dirs) -> None:
    helper = start_helper(started, http=HttpEndpoint(port=0, host="127.0.0.1",
                                                     routes={"/extra": lambda: (200, "driver's own\n")}))
    assert get(helper.http_port, "/healthz")[0] == 200
    assert get(helper.http_port, "/readyz") == (503, "not yet registered with the kubelet\n")
    with KubeletEmulator(dirs.registrar) as kubelet:
        kubelet.wait_for_plugin(DRIVER, timeout=10)
        assert eventually(lambda: get(helper.http_port, "/readyz") == (200, "ok\n"))
    assert get(helper.http_port, "/extra") == (200, "driver's own\n")
    helper.publish(gpus(3))
    assert helper.wait_published(10)
    status, metrics = get(helper.http_port, "/metrics")
    assert status == 200
    assert re.search(r'^acme_published_devices 3\.0$', metrics, re.M)
    assert "acme_resourceslice_syncs_total" in metrics
    helper.dra_socket.unlink()  # the kubelet can no longer reach the plugin
    assert eventually(lambda: get(helper.http_port, "/healthz") == (503, "DRA socket: missing\n"))


def test_tracer_and_metric_names_are_parameters(started: dict[str, Any]) -> None:
    spans = InMemorySpanExporter()
    helper = start_helper(started, names=TelemetryNames(service="other", metric_prefix="other", scope="otherscope"),
                          span_exporter=spans)
    helper.publish(gpus(1))
    assert helper.wait_published(10)
    assert helper.telemetry.scope == "otherscope"
    names = {s.name for s in spans.get_finished_spans()}
    assert "otherscope.publish_resourceslices" in names
    assert not any(n.startswith("tessera") for n in names)
    metrics = helper.telemetry.render_metrics().decode()
    assert "other_resourceslice_syncs_total" in metrics and "tessera" not in metrics


def test_a_failed_start_leaves_nothing_running(started: dict[str, Any], dirs: Dirs) -> None:
    (dirs.registrar / f"{DRIVER}-reg.sock").mkdir(parents=True)  # a directory where the socket must go
    with pytest.raises(IsADirectoryError, match="directory is in the way"):
        start_helper(started)
    assert not (dirs.plugin / "dra.sock").exists()
    # The API server double's own connection threads may linger; the plugin's must not.
    assert eventually(lambda: not plugin_threads()), f"threads left running: {plugin_threads()}"


def plugin_threads() -> list[str]:
    return [t.name for t in threading.enumerate()
            if t.name == "resourceslice-publisher" or t.name.startswith(("grpc-", "metrics-http"))]


def test_bad_names_are_refused_before_anything_is_served(started: dict[str, Any], dirs: Dirs) -> None:
    with pytest.raises(ValueError, match='pool name "Node_1"'):
        start_helper(started, node_name="Node_1")
    assert not dirs.registrar.exists() and not dirs.plugin.exists()


# ----- the layer stands alone ---------------------------------------------------------------


def _imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # a relative import stays inside the package by construction
                continue
            found.add(node.module or "")
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_the_layer_imports_nothing_of_the_driver_outside_itself() -> None:
    package = Path(driver.kubeletplugin.__file__).parent
    modules = [info for info in pkgutil.walk_packages([str(package)], "driver.kubeletplugin.")]
    assert "driver.kubeletplugin.helper" in {m.name for m in modules}
    outside: dict[str, list[str]] = {}
    for info in modules:
        relative = Path(*info.name.split(".")[2:])
        path = package / (relative / "__init__.py" if info.ispkg else relative.with_suffix(".py"))
        imports = _imported_modules(path)
        leaks = sorted(m for m in imports if (m == "driver" or m.startswith("driver."))
                       and not m.startswith("driver.kubeletplugin"))
        if leaks:
            outside[info.name] = leaks
    assert outside == {}, f"the kubelet-plugin layer must not import the GPU code, the simulation or the app: {outside}"


def test_the_import_check_sees_a_leak(tmp_path: Path) -> None:
    leaky = tmp_path / "leaky.py"
    leaky.write_text("from driver.gpu.published.devices import make_view\nimport driver.simulation.apiserver\n"
                     "def f() -> None:\n    from driver import commands\n")
    assert {"driver.gpu.published.devices", "driver.simulation.apiserver", "driver",
            "driver.commands"} <= _imported_modules(leaky)
