"""Device health: injected GPU events become taints, the kubelet's health stream, refusals and metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from driver.simulation.kubelethealth import HealthWatch, allocated_resources_status
from tests.support.node import DRIVER, NODE, SimulatedNode, wait_until

PLANS: dict[str, Any] = {"plans": {"mps": {"gpus": [{"match": {"product": "NVIDIA L4"}, "mps": {"shares": 2}}]}}}
MIG = ["gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6"]
SHARES = ["gpu-2-mps-0", "gpu-2-mps-1"]
ALL = ["gpu-0", *MIG, *SHARES]
TAINT_KEY = f"{DRIVER}/unhealthy"


def inject(sim_node: SimulatedNode, **event: Any) -> None:
    with sim_node.events_file.open("a") as handle:
        handle.write(json.dumps(event) + "\n")


def taints(sim_node: SimulatedNode) -> dict[str, list[dict[str, Any]]]:
    return {d["name"]: d.get("taints", []) for d in sim_node.devices()}


def tainted(sim_node: SimulatedNode) -> dict[str, str]:
    return {name: t[0]["value"] for name, t in taints(sim_node).items() if t}


def stream_health(watch: HealthWatch) -> dict[str, str]:
    """What the kubelet knows of each published device ("none" before the first message)."""
    reported = {name: watch.device(NODE, name) for name in ALL}
    return {name: (h.health if h else "none") for name, h in reported.items()}


def gpu_uuid(sim_node: SimulatedNode, minor: int) -> str:
    gpu = sim_node.inventory.gpu_by_minor(minor)
    assert gpu is not None
    return gpu.uuid


def start(sim_node: SimulatedNode, *extra: str) -> None:
    sim_node.start(*extra, env={"TESSERA_SIM_EVENTS": str(sim_node.events_file)})
    sim_node.wait_for_devices(ALL, timeout=30)


def metrics(sim_node: SimulatedNode) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels without OpenTelemetry's scope labels) -> value."""
    # Devices are published a moment before "driver started" is logged: wait for the line.
    wait_until(lambda: any(e.get("msg") == "driver started" for e in sim_node.log()), what="the driver started line")
    started = next(e for e in sim_node.log() if e.get("msg") == "driver started")
    text = urllib.request.urlopen(f"http://127.0.0.1:{started['http_port']}/metrics", timeout=10).read().decode()
    return {(sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if not k.startswith("otel_")))):
            sample.value for family in text_string_to_metric_families(text) for sample in family.samples}


def new_node(minor_version: int = 36) -> SimulatedNode:
    sim_node = SimulatedNode("demo", plans=PLANS, plan="mps", minor_version=minor_version)
    return sim_node


def test_critical_xid_taints_every_device_of_the_gpu_and_recovery_clears_it() -> None:
    sim_node = new_node()
    try:
        start(sim_node)
        watch = sim_node.kubelet.watch_health()
        try:
            assert watch.api_version == "v1.DRAResourceHealth"
            # At connect: every published device, healthy.
            wait_until(lambda: set(stream_health(watch).values()) == {"Healthy"}, 5, "all devices healthy at connect")
            inject(sim_node, uuid=gpu_uuid(sim_node, 0), xid=13)  # an application error: ignored
            inject(sim_node, uuid=gpu_uuid(sim_node, 1), xid=79)  # fallen off the bus: the GPU and all its MIG devices
            inject(sim_node, uuid=gpu_uuid(sim_node, 2), xid=48)  # double-bit ECC: the GPU's shares
            expected = {**dict.fromkeys(MIG, "xid-79"), **dict.fromkeys(SHARES, "xid-48")}
            wait_until(lambda: tainted(sim_node) == expected, 2, f"taints {expected} (have {tainted(sim_node)})")
            taint = taints(sim_node)["gpu-1-mig-1g10gb-6"][0]
            assert taint["key"] == TAINT_KEY and taint["effect"] == "NoSchedule"
            wait_until(lambda: stream_health(watch) == {"gpu-0": "Healthy", **dict.fromkeys(MIG + SHARES, "Unhealthy")},
                       5, "the health stream to report the change")
            mig = watch.device(NODE, "gpu-1-mig-3g40gb-0")
            assert mig is not None and "XID 79" in mig.message and mig.timeout_s == 30
            status = allocated_resources_status(watch, DRIVER, "gpu", [(NODE, "gpu-2-mps-1", ())])
            assert status["resources"][0]["health"] == "Unhealthy" and "XID 48" in status["resources"][0]["message"]
            assert status["resources"][0]["resourceID"] == f"{DRIVER}/{NODE}/gpu-2-mps-1"

            inject(sim_node, uuid=gpu_uuid(sim_node, 1), recovered=True)
            wait_until(lambda: tainted(sim_node) == dict.fromkeys(SHARES, "xid-48"), 5, "gpu-1's taints to go")
            wait_until(lambda: stream_health(watch)["gpu-1-mig-2g20gb-4"] == "Healthy", 5, "MIG healthy again")
            samples = metrics(sim_node)
            assert samples[("tessera_gpu_xid_errors_total", (("xid", "13"),))] == 1.0
            assert samples[("tessera_gpu_xid_errors_total", (("xid", "79"),))] == 1.0
            health = {labels["device"]: (value, labels["reason"]) for (name, label_items), value in samples.items()
                      if name == "tessera_device_healthy" for labels in [dict(label_items)]}
            assert health == {"gpu-0": (1.0, ""), **dict.fromkeys(MIG, (1.0, "")),
                              **dict.fromkeys(SHARES, (0.0, "xid-48"))}
            gpus = {gpu_uuid(sim_node, minor) for minor in (0, 1, 2)}
            for reading in ("temperature_celsius", "power_watts", "memory_used_bytes"):
                named = f"tessera_gpu_{reading}"
                assert {dict(labels)["gpu_uuid"] for name, labels in samples if name == named} == gpus
        finally:
            watch.close()
    finally:
        sim_node.close()


def test_lost_gpu_refuses_new_claims_keeps_prepared_ones_and_streams_v1alpha1() -> None:
    sim_node = new_node()
    try:
        start(sim_node, "--health-taint-effect", "NoExecute")
        prepared = sim_node.claim("before", [("gpu", "gpu-0")])
        sim_node.prepare_ok(prepared)
        watch = sim_node.kubelet.watch_health("v1alpha1.DRAResourceHealth")
        try:
            wait_until(lambda: stream_health(watch)["gpu-0"] == "Healthy", 5, "gpu-0 healthy at connect")
            inject(sim_node, uuid=gpu_uuid(sim_node, 0), lost=True)
            wait_until(lambda: tainted(sim_node) == {"gpu-0": "gpu-lost"}, 2, "gpu-0 tainted as lost")
            assert taints(sim_node)["gpu-0"][0]["effect"] == "NoExecute"
            wait_until(lambda: stream_health(watch)["gpu-0"] == "Unhealthy", 5, "stream says gpu-0 unhealthy")
            reported = watch.device(NODE, "gpu-0")
            assert reported is not None and "gpu-lost" in reported.message

            refused = sim_node.claim("after", [("gpu", "gpu-0")])
            answer = sim_node.prepare(refused)[refused.uid]
            assert answer.error is not None and "gpu-0 (gpu-lost" in answer.error and "unhealthy" in answer.error
            assert not sim_node.cdi_spec(refused.uid).exists()
            # The claim prepared before the failure stays prepared; a repeated prepare returns it.
            assert sim_node.checkpoint()["claims"][prepared.uid]["phase"] == "PrepareCompleted"
            sim_node.prepare_ok(prepared)
            done = subprocess.run([sys.executable, "-m", "driver", "inspect", "--json", "--plugins-dir",
                                   str(sim_node.work / "plugins"), "--cdi-root", str(sim_node.cdi_dir)],
                                  capture_output=True, text=True, timeout=30)
            report = json.loads(done.stdout)
            assert report["device_health"]["gpu-0"]["health"] == "Unhealthy"
            assert report["device_health"]["gpu-2-mps-0"]["health"] == "Healthy"
            [claim] = report["claims"]
            assert claim["devices"][0]["health"] == "Unhealthy"
            assert done.returncode == 1 and any("device gpu-0 is unhealthy" in p for p in report["problems"])
        finally:
            watch.close()
    finally:
        sim_node.close()


def test_taints_are_not_sent_to_a_server_without_device_taints() -> None:
    sim_node = new_node(minor_version=35)
    try:
        start(sim_node)
        watch = sim_node.kubelet.watch_health()
        try:
            inject(sim_node, uuid=gpu_uuid(sim_node, 0), xid=94)
            wait_until(lambda: stream_health(watch)["gpu-0"] == "Unhealthy", 5, "stream says gpu-0 unhealthy")
            # The publish that carries a health change happens before the stream hears of it, and the
            # API double stores taints whatever its version: none there means none were sent.
            assert tainted(sim_node) == {}
            assert any("device taints are NOT published" in str(e.get("msg")) for e in sim_node.log())
        finally:
            watch.close()
    finally:
        sim_node.close()


def test_a_recovery_action_clears_only_itself_and_a_pending_row_remap_leaves_the_gpu_schedulable() -> None:
    # nvml.h: a recovery-action event carries no action (eventData is 0), so the action is read from
    # the field; NVIDIA's memory-error guide: a pending remap lets work go on until the next reset.
    sim_node = new_node()
    try:
        start(sim_node)
        l4 = gpu_uuid(sim_node, 2)
        inject(sim_node, uuid=l4, xid=79)
        inject(sim_node, uuid=l4, recovery_action=1)  # NVML asks for a GPU reset
        wait_until(lambda: tainted(sim_node) == dict.fromkeys(SHARES, "xid-79"), 5,
                   f"xid-79 taints (have {tainted(sim_node)})")
        inject(sim_node, uuid=l4, recovery_action=0)  # the action goes away: its reason goes, the XID's stays
        inject(sim_node, uuid=gpu_uuid(sim_node, 0), row_remap={"pending": True})  # the whole GPU: a reset is due
        wait_until(lambda: any("row remap is pending" in str(e.get("msg")) for e in sim_node.log()), 5,
                   "the pending remap logged")
        assert tainted(sim_node) == dict.fromkeys(SHARES, "xid-79"), "the recovery action cleared the XID 79"
        claim = sim_node.claim("on-remap-pending", [("gpu", "gpu-0")])
        sim_node.prepare_ok(claim)  # still schedulable and preparable
        inject(sim_node, uuid=gpu_uuid(sim_node, 0), row_remap={"pending": False, "failed": True})
        wait_until(lambda: tainted(sim_node).get("gpu-0") == "row-remapping", 5, "a failed remap taints the GPU")
    finally:
        sim_node.close()


def test_a_gpu_asking_for_a_reset_is_healthy_after_the_reset_and_a_recorded_row_remap_is_no_fault() -> None:
    # What a real GPU reports (NVIDIA's XID catalog, nvml.h): XID 154 as field 230 turns to "GPU reset", and
    # XID 154 again as it goes back to none after the reset. XID 63 says a row remap was recorded: pending
    # until the next reset, which NVIDIA's memory-error guide says is no fault.
    sim_node = new_node()
    try:
        start(sim_node)
        l4 = gpu_uuid(sim_node, 2)
        inject(sim_node, uuid=l4, xid=154)
        inject(sim_node, uuid=l4, recovery_action=1)
        wait_until(lambda: tainted(sim_node) == dict.fromkeys(SHARES, "recovery-action"), 5,
                   f"the reset asked for taints the GPU's shares (have {tainted(sim_node)})")
        inject(sim_node, uuid=l4, recovery_action=0)  # the operator reset the GPU
        inject(sim_node, uuid=l4, xid=154)
        wait_until(lambda: tainted(sim_node) == {}, 5, f"no taint after the reset (have {tainted(sim_node)})")

        inject(sim_node, uuid=gpu_uuid(sim_node, 0), xid=63)
        inject(sim_node, uuid=gpu_uuid(sim_node, 1), xid=48)  # a fault after it: once it shows, XID 63 was handled
        wait_until(lambda: tainted(sim_node) == dict.fromkeys(MIG, "xid-48"), 5,
                   f"xid-48 alone (have {tainted(sim_node)})")
        sim_node.prepare_ok(sim_node.claim("after-remap-recorded", [("gpu", "gpu-0")]))
        said = [e for e in sim_node.log() if e.get("msg") == "XID reported; device health unchanged"]
        assert sorted(e["xid"] for e in said) == [63, 154, 154]
        assert metrics(sim_node)[("tessera_gpu_xid_errors_total", (("xid", "154"),))] == 2.0
    finally:
        sim_node.close()


def test_remapped_rows_nvml_cannot_report_on_a_mig_gpu_with_instances_are_said_once_and_shown_by_inspect() -> None:
    # nvml.h: "On MIG-enabled GPUs with active instances, querying the number of remapped rows is not supported".
    sim_node = new_node()
    try:
        start(sim_node)
        migged = gpu_uuid(sim_node, 1)
        inject(sim_node, uuid=migged, row_remap={"pending": False, "failed": True})  # NVML cannot report this reading
        inject(sim_node, uuid=gpu_uuid(sim_node, 0), lost=True)  # a change after it: the health file is written again
        wait_until(lambda: tainted(sim_node) == {"gpu-0": "gpu-lost"}, 5,
                   f"gpu-0 lost alone (have {tainted(sim_node)})")
        said = [e for e in sim_node.log()
                if str(e.get("msg")).startswith("memory row remapping of a GPU cannot be read")]
        assert [e["uuid"] for e in said] == [migged], "said once, for the MIG GPU with instances only"
        done = subprocess.run([sys.executable, "-m", "driver", "inspect", "--plugins-dir",
                               str(sim_node.work / "plugins"),
                               "--cdi-root", str(sim_node.cdi_dir)], capture_output=True, text=True, timeout=30)
        assert (f"- not watched on {migged}: memory row remapping: NVML does not report remapped rows on a GPU in MIG "
                "mode with instances (nvml.h)") in done.stdout, done.stdout
    finally:
        sim_node.close()
