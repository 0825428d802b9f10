"""Registration first, initialisation behind the open sockets (driver/commands/run/startup.py): a prepare the
kubelet sends before the driver is ready waits for it and then succeeds, and /readyz says not ready until then.

The driver's initialisation is held up the way a slow API server holds it up in production: with a
sharing plans file it reads its Node to choose the plan, and that read waits in front of the API
server double (tests/support/heldapi.py) until the test lets it through.
"""

from __future__ import annotations

import json
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from driver.kubeletplugin.types import ClaimRef
from driver.simulation.kubelet import PrepareAnswer
from tests.support.heldapi import HeldApi
from tests.support.node import DRIVER, PLAN_LABEL, SimulatedNode, wait_until

# GPU 0 of the demo node is shared by the plan; the claim takes GPU 2, published whole.
PLANS = {"plans": {"p": {"gpus": [{"match": {"minor": 0}, "mps": {"shares": 2}}]}}}


@pytest.fixture
def held() -> Iterator[tuple[SimulatedNode, HeldApi]]:
    sim_node = SimulatedNode("demo", plans=PLANS, plan="p")
    api = HeldApi(sim_node.api.url, hold_prefix=b"GET /api/v1/nodes?")
    kubeconfig = json.loads(sim_node.kubeconfig.read_text())
    kubeconfig["clusters"][0]["cluster"]["server"] = api.url
    sim_node.kubeconfig.write_text(json.dumps(kubeconfig))
    try:
        yield sim_node, api
    finally:
        api.close()
        sim_node.close()


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def http_port(sim_node: SimulatedNode) -> int:
    """The driver's HTTP port, from the log line of its first moments (it listens on port 0's pick)."""
    def logged() -> bool:
        return any(line.get("msg") == "plugin sockets served; initialising behind them" for line in sim_node.log())

    wait_until(logged, 30, "the driver to serve its sockets")
    return int(next(line["http_port"] for line in sim_node.log()
                    if line.get("msg") == "plugin sockets served; initialising behind them"))


def test_a_prepare_sent_while_the_driver_initialises_waits_for_it_then_succeeds(
        held: tuple[SimulatedNode, HeldApi]) -> None:
    sim_node, api = held
    sim_node.start(register=False)
    sim_node.kubelet.wait_for_plugin(DRIVER, timeout=30)  # registration needs no API server
    assert api.wait_held(30), "initialisation reads the Node for the sharing plan"
    port = http_port(sim_node)
    assert get(port, "/readyz") == (503, "initialising: registered, prepares wait until the driver is ready\n")
    assert get(port, "/healthz")[0] == 200, "the sockets answer while the driver initialises"

    ref = sim_node.claim("early", [("gpu", "gpu-2")])
    answers: list[PrepareAnswer] = []
    sent = threading.Thread(target=lambda: answers.append(sim_node.kubelet.prepare([ref])[ref.uid]))
    sent.start()
    # The prepare is in the driver, waiting: liveness counts it as a call in flight.
    wait_until(lambda: "1 calls in flight" in get(port, "/healthz")[1], 30, "the prepare to wait in the driver")
    assert not answers and not any(line.get("msg") == "driver started" for line in sim_node.log())

    api.release()
    sent.join(timeout=60)
    [answer] = answers
    assert answer.error is None, answer.error
    assert [d.device_name for d in answer.devices] == ["gpu-2"]
    assert sim_node.cdi_spec(ref.uid).exists()
    wait_until(lambda: get(port, "/readyz") == (200, "ok\n"), 30, "/readyz to say ready")
    # What initialisation does in order: recovery before the claim was served, slices after discovery.
    messages = [line.get("msg") for line in sim_node.log()]
    assert messages.index("state recovered") < messages.index("prepare succeeded")
    sim_node.wait_for_devices(["gpu-0-mps-0", "gpu-0-mps-1", "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4",
                               "gpu-1-mig-1g10gb-6", "gpu-2"])


def prepared_while_held(sim_node: SimulatedNode, api: HeldApi, *extra: str) -> PrepareAnswer | Exception:
    """Start the driver (with ``extra`` flags) while its first API read is held, send a prepare, let the read
    through once the prepare waits in the driver: the prepare's answer, or the RPC's own failure."""
    sim_node.start(*extra, register=False)
    sim_node.kubelet.wait_for_plugin(DRIVER, timeout=30)
    assert api.wait_held(30)
    ref = ClaimRef(namespace="default", name="early", uid="0c7d3a4e-5b1f-4c2a-9e8d-7f6a5b4c3d2e")
    answers: list[PrepareAnswer | Exception] = []

    def send() -> None:
        try:
            answers.append(sim_node.kubelet.prepare([ref])[ref.uid])
        except Exception as exc:  # the RPC itself failed: the caller's assertion shows it
            answers.append(exc)

    sent = threading.Thread(target=send)
    sent.start()
    port = http_port(sim_node)
    wait_until(lambda: "1 calls in flight" in get(port, "/healthz")[1], 30, "the prepare to wait in the driver")
    api.release()
    sent.join(timeout=60)
    [answer] = answers
    return answer


def test_a_failed_initialisation_answers_the_waiting_prepare_and_exits_with_its_reason(
        held: tuple[SimulatedNode, HeldApi]) -> None:
    sim_node, api = held
    sim_node.api.stop()  # the Node read, once let through, finds no API server
    answer = prepared_while_held(sim_node, api)
    assert isinstance(answer, PrepareAnswer), answer
    assert answer.error is not None and "failed to start" in answer.error and "sharing plan" in answer.error
    assert sim_node.proc is not None and sim_node.proc.wait(timeout=30) == 1
    assert any("the driver could not start" in str(line.get("msg")) for line in sim_node.log())


def test_a_failure_to_start_serving_answers_the_waiting_prepare_with_its_reason(
        held: tuple[SimulatedNode, HeldApi]) -> None:
    # A node name the ResourceSlices cannot carry as their pool name passes discovery and recovery and fails
    # only when the claims are handed over: the prepare waiting then must get that reason, not be cut off
    # when the sockets stop.
    sim_node, api = held
    sim_node.api.add_node("Node_A", labels={PLAN_LABEL: "p"})
    answer = prepared_while_held(sim_node, api, "--node-name", "Node_A")
    assert isinstance(answer, PrepareAnswer), answer
    assert answer.error is not None and "failed to start" in answer.error and "pool name" in answer.error
    assert sim_node.proc is not None and sim_node.proc.wait(timeout=30) == 1


def test_a_stop_while_initialising_waits_for_it_and_exits_cleanly(held: tuple[SimulatedNode, HeldApi]) -> None:
    sim_node, api = held
    sim_node.start(register=False)
    sim_node.kubelet.wait_for_plugin(DRIVER, timeout=30)
    assert api.wait_held(30)
    assert sim_node.proc is not None
    sim_node.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: any(line.get("msg") == "signal received; shutting down" for line in sim_node.log()), 30,
               "the driver to take the signal")
    api.release()  # the initialisation finishes, sees the stop, and stops what it started
    assert sim_node.proc.wait(timeout=60) == 0
    messages = [line.get("msg") for line in sim_node.log()]
    assert "driver stopped" in messages and "driver started" not in messages
    assert not (sim_node.state_dir / "dra.sock").exists(), "its sockets are removed"
