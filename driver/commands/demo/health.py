"""``python -m driver demo --health`` (SIMULATION): a GPU fails and recovers while the driver runs.

The demo appends events to the driver's ``TESSERA_SIM_EVENTS`` file (driver/simulation/healthevents.py)
and shows what each one changes: the device taints in the published ResourceSlices, what the kubelet
hears on the DRAResourceHealth stream, and the health metrics on ``/metrics``.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from driver.gpu.discovery.inventory import GpuInfo, NodeInventory
from driver.simulation.apiserver import FakeApiServer
from driver.simulation.kubelet import KubeletEmulator

_HTTP_PORT = re.compile(r"driver started .*http_port=(\d+)")
# XID 79: "GPU has fallen off the bus" (NVIDIA XID catalog), a device error that makes the GPU unhealthy.
FAILURE_XID = 79
_T = TypeVar("_T")


def failing_gpu(inventory: NodeInventory) -> GpuInfo:
    """The GPU the demo fails: the last one without MIG (the one the demo shares), else the first."""
    whole = [g for g in inventory.gpus if not g.mig_enabled]
    return whole[-1] if whole else inventory.gpus[0]


def devices_of(names: list[str], minor: int) -> list[str]:
    """The published devices that use GPU ``minor``: the GPU, its MIG devices and its shares."""
    return [n for n in names if n == f"gpu-{minor}" or n.startswith(f"gpu-{minor}-")]


def http_port(log: Path, timeout: float = 30.0) -> int:
    """The driver's /metrics port, from its "driver started" log line (it listens on port 0's pick)."""
    def started() -> re.Match[str] | None:
        return _HTTP_PORT.search(log.read_text(errors="replace")) if log.exists() else None

    return int(_wait(started, timeout, "the driver's 'driver started' log line").group(1))


def _wait(condition: Callable[[], _T | None], timeout: float, what: str) -> _T:
    """What ``condition`` answers once it is true."""
    deadline = time.monotonic() + timeout
    while not (answer := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)
    return answer


def _taints(api: FakeApiServer, driver: str, node: str) -> dict[str, list[dict[str, Any]]]:
    return {d["name"]: d.get("taints", []) for s in api.slices(driver, node) for d in s["spec"].get("devices", [])}


def _health_metrics(port: int, devices: list[str]) -> list[str]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    lines = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tessera_device_healthy" and sample.labels.get("device") in devices:
                # The exposition format's own label syntax (comma-separated), as /metrics shows it.
                reason = f',reason="{sample.labels["reason"]}"' if sample.labels.get("reason") else ""
                lines.append(f'  {sample.name}{{device="{sample.labels["device"]}"{reason}}} {sample.value:g}')
            elif sample.name == "tessera_gpu_xid_errors_total":
                lines.append(f'  {sample.name}{{xid="{sample.labels["xid"]}"}} {sample.value:g}')
    return lines


def show_failure_and_recovery(*, api: FakeApiServer, kubelet: KubeletEmulator, driver: str, node: str,
                              inventory: NodeInventory, events: Path, log: Path,
                              say: Callable[[str], None]) -> None:
    gpu = failing_gpu(inventory)
    devices = devices_of(sorted(_taints(api, driver, node)), gpu.minor)
    port = http_port(log)
    watch = kubelet.watch_health()
    try:
        def stream(name: str) -> str:
            reported = watch.device(node, name)
            return f"{reported.health} {reported.message}".strip() if reported else "(nothing yet)"

        def show(state: str) -> None:
            taints = _taints(api, driver, node)
            say(f"ResourceSlice taints ({state}):")
            for name in devices:
                shown = ", ".join(f"{t['key']}={t.get('value', '')}:{t['effect']}" for t in taints.get(name, []))
                say(f"  {name:<24} {shown or 'none'}")
            say(f"DRAResourceHealth stream ({watch.api_version}), what the kubelet puts in the pods' status:")
            for name in devices:
                say(f"  {name:<24} {stream(name)}")
            say("Metrics (/metrics):")
            for line in _health_metrics(port, devices):
                say(line)

        _wait(lambda: all(stream(n).startswith("Healthy") for n in devices), 15, "the health stream at connect")
        say(f"GPU {gpu.minor} ({gpu.uuid}) is used by {', '.join(devices)}.")
        say(f"Injecting XID {FAILURE_XID} (GPU has fallen off the bus) into {events.name}: "
            + json.dumps({"uuid": gpu.uuid, "xid": FAILURE_XID}))
        _append(events, {"uuid": gpu.uuid, "xid": FAILURE_XID})
        _wait(lambda: all(_taints(api, driver, node).get(n) for n in devices), 15, "the taints")
        _wait(lambda: all(stream(n).startswith("Unhealthy") for n in devices), 15, "the health stream")
        show("after the XID")
        say("")
        say("The GPU is reset and answers again: " + json.dumps({"uuid": gpu.uuid, "recovered": True}))
        _append(events, {"uuid": gpu.uuid, "recovered": True})
        _wait(lambda: not any(_taints(api, driver, node).get(n) for n in devices), 15, "the taints to go")
        _wait(lambda: all(stream(n).startswith("Healthy") for n in devices), 15, "the health stream")
        show("after recovery")
    finally:
        watch.close()


def _append(events: Path, event: dict[str, Any]) -> None:
    with events.open("a") as handle:
        handle.write(json.dumps(event) + "\n")
