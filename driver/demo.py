"""``python -m driver demo``: SIMULATION of one GPU node, end to end, on any machine.

Runs the real driver process (``python -m driver run --simulate``) against simulated parts:
GPUs from ``driver/simulation``, a host tree with stand-in device nodes and executables, an
in-process Kubernetes API server double, and a kubelet stand-in calling the real Unix sockets.
Nothing here touches real GPUs, a real cluster or the host's /dev.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from driver.config import DEFAULT_DRIVER_NAME
from driver.kubeletplugin.types import ClaimRef
from driver.simulation.allocator import AllocationError, allocate, claim_from_template
from driver.simulation.apiserver import FakeApiServer
from driver.simulation.discovery import SimulatedDiscovery
from driver.simulation.hostroot import build_host_root
from driver.simulation.kubelet import KubeletEmulator

NODE = "demo-node"
PLAN_LABEL = "gpu.tessera.dev/sharing-plan"
EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples" / "resourceclaims"
DEFAULT_EXAMPLES = ("gpu-mps-per-claim.yaml", "mig-by-profile.yaml", "mps-share-from-plan.yaml")


def _say(text: str = "") -> None:
    print(text, flush=True)


def _heading(text: str) -> None:
    _say()
    _say(f"=== {text}")


@contextmanager
def _driver_process(work: Path, kubeconfig: Path, layout: str, plans: Path) -> Iterator[subprocess.Popen[bytes]]:
    host = work / "host"
    args = [sys.executable, "-m", "driver", "run", "--simulate", layout, "--node-name", NODE,
            "--kubeconfig", str(kubeconfig), "--registrar-dir", str(work / "plugins_registry"),
            "--plugins-dir", str(work / "plugins"), "--cdi-root", str(work / "cdi"),
            "--host-root", str(host), "--driver-root", str(host),
            "--nvidia-cdi-spec", str(host / "etc" / "cdi" / "nvidia.yaml"), "--sharing-plans", str(plans),
            "--http-port", "0", "--log-format", "text"]
    (work / "tmp").mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(work / "tmp"), TESSERA_SIM_NVIDIA_SMI_LOG=str(work / "nvidia-smi-calls.jsonl"))
    with open(work / "driver.log", "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            yield proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_for_slices(api: FakeApiServer, expected: int, timeout: float = 20.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        slices = api.slices(DEFAULT_DRIVER_NAME, NODE)
        if sum(len(s["spec"].get("devices", [])) for s in slices) == expected:
            return slices
        time.sleep(0.1)
    raise RuntimeError("the driver did not publish its ResourceSlices in time; see driver.log")


def _attr(device: dict[str, Any], key: str) -> str:
    value = device.get("attributes", {}).get(key)
    return str(next(iter(value.values()))) if value else ""


def _print_slices(slices: list[dict[str, Any]]) -> None:
    for s in slices:
        spec = s["spec"]
        _say(f"ResourceSlice {s['metadata']['name']}  driver={spec['driver']}  pool={spec['pool']['name']} "
             f"generation={spec['pool']['generation']}  devices={len(spec.get('devices', []))}")
        _say(f"  {'DEVICE':<24} {'TYPE':<10} {'PRODUCT / PROFILE':<28} {'MEMORY':<10} DETAILS")
        for d in spec.get("devices", []):
            kind = _attr(d, "type")
            what = _attr(d, "profile") if kind == "mig" else _attr(d, "productName")
            memory = d.get("capacity", {}).get("memory", {}).get("value", "")
            details = ""
            if kind in ("mps", "timeslice"):
                details = (f"share {_attr(d, 'shareIndex')}/{_attr(d, 'shareCount')} "
                           f"threads={_attr(d, 'activeThreadPercentage') or '-'}% "
                           f"memory-enforcement={_attr(d, 'memoryLimitEnforcement')}")
            elif kind == "gpu":
                details = f"uuid={_attr(d, 'uuid')}"
            elif kind == "mig":
                details = f"parent={_attr(d, 'parentUUID')}"
            _say(f"  {d['name']:<24} {kind:<10} {what:<28} {memory:<10} {details}")


def _claim_documents(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return [d for d in docs if d.get("kind") in ("ResourceClaimTemplate", "ResourceClaim")]


def _show_mps_commands(work: Path, spec_json: dict[str, Any]) -> None:
    daemons = {ann for dev in spec_json.get("devices", [])
               for key, ann in (dev.get("annotations") or {}).items() if key.endswith("/mps-daemon")}
    for daemon_id in sorted(daemons):
        log = work / "plugins" / DEFAULT_DRIVER_NAME / "mps" / daemon_id / "log" / "commands.jsonl"
        if not log.exists():
            continue
        _say(f"  MPS control daemon {daemon_id} (SIMULATION stand-in) received, in order:")
        for line in log.read_text().splitlines():
            entry = json.loads(line)
            _say(f"    {' '.join([entry['cmd'], *entry.get('args', [])])}")


def _prepare_example(path: Path, api: FakeApiServer, kubelet: KubeletEmulator, work: Path,
                     taken: set[str]) -> list[ClaimRef]:
    refs: list[ClaimRef] = []
    for doc in _claim_documents(path):
        name = f"demo-{doc['metadata']['name']}"
        claim = claim_from_template(doc, name) if doc["kind"] == "ResourceClaimTemplate" else {
            **doc, "metadata": {**doc["metadata"], "name": name, "namespace": "default",
                                "uid": claim_from_template({"spec": {"spec": doc["spec"]}}, name)["metadata"]["uid"]}}
        try:
            allocated = allocate(claim, api.slices(DEFAULT_DRIVER_NAME, NODE), DEFAULT_DRIVER_NAME, taken)
        except AllocationError as exc:
            _say(f"  (skipped: {exc})")
            continue
        api.put_claim(allocated)
        ref = ClaimRef(namespace="default", name=name, uid=claim["metadata"]["uid"])
        results = allocated["status"]["allocation"]["devices"]["results"]
        _say(f"Claim default/{name} (from {path.name}) allocated: "
             + ", ".join(f"{r['request']} -> {r['device']}" for r in results))
        started = time.perf_counter()
        answer = kubelet.prepare([ref])[ref.uid]
        elapsed_ms = (time.perf_counter() - started) * 1000
        if answer.error:
            _say(f"  NodePrepareResources FAILED: {answer.error}")
            continue
        refs.append(ref)
        _say(f"  NodePrepareResources over the real gRPC socket: ok in {elapsed_ms:.1f} ms")
        for dev in answer.devices:
            ids = ", ".join(dev.cdi_device_ids)
            _say(f"    device {dev.device_name} for request(s) {list(dev.request_names)}: CDI {ids}")
        spec_path = work / "cdi" / f"k8s.gpu.tessera.dev-claim_{ref.uid}.json"
        spec_json = json.loads(spec_path.read_text())
        _say(f"  CDI spec written: {spec_path} (cdiVersion {spec_json['cdiVersion']})")
        for dev in spec_json["devices"]:
            edits = dev["containerEdits"]
            _say(f"    {dev['name']}")
            for node in edits.get("deviceNodes", []):
                extra = f" (char {node['major']}:{node['minor']})" if "major" in node else ""
                _say(f"      device node {node['path']}{extra}")
            for env in edits.get("env", []):
                _say(f"      env {env}")
            for mount in edits.get("mounts", []):
                _say(f"      mount {mount['hostPath']} -> {mount['containerPath']}")
        common = spec_json.get("containerEdits", {})
        _say(f"    common to the claim: {len(common.get('mounts', []))} driver library/binary mounts, "
             f"{len(common.get('hooks', []))} hooks, control nodes "
             + ", ".join(n["path"] for n in common.get("deviceNodes", [])))
        _show_mps_commands(work, spec_json)
    return refs


def run_demo(layout: str = "demo", workdir: str | None = None, examples: list[str] | None = None) -> int:
    if not EXAMPLES_DIR.is_dir():
        _say(f"The demo prepares the claims in examples/resourceclaims/ of a source checkout ({EXAMPLES_DIR} "
             "does not exist); run it from a clone of the repository: bash scripts/demo.sh")
        return 2
    keep = workdir is not None
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="tessera-demo-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    _say("Tessera demo: SIMULATION of one GPU node (simulated GPUs, stand-in nvidia-smi and")
    _say("nvidia-cuda-mps-control, an in-process API server double, a kubelet stand-in).")
    _say("The driver itself is the real one, running as `python -m driver run --simulate`.")
    _say(f"Working directory: {work}")

    inventory = SimulatedDiscovery(layout, NODE).discover()
    build_host_root(work / "host", inventory)
    plans = work / "sharing-plans.yaml"
    plans.write_text(resources.files("driver.simulation").joinpath("demo-sharing-plans.yaml").read_text())
    api = FakeApiServer(minor_version=36)
    api.start()
    api.add_node(NODE, labels={PLAN_LABEL: "demo"})
    kubeconfig = api.kube_config(work / "kubeconfig")
    kubelet = KubeletEmulator(work / "plugins_registry")
    try:
        with _driver_process(work, kubeconfig, layout, plans) as proc:
            _heading("1. The driver registers with the kubelet")
            registered = kubelet.wait_for_plugin(DEFAULT_DRIVER_NAME, timeout=30)
            _say(f"Registered {registered.name} (pid {proc.pid}); DRA endpoint {registered.endpoint}; "
                 f"API {registered.api_version}")

            _heading("2. ResourceSlices it published (node sharing plan 'demo': the L4 as 4 MPS shares)")
            expected = _expected_devices(work, layout)
            _print_slices(_wait_for_slices(api, expected))

            _heading("3. The kubelet prepares claims from examples/resourceclaims/")
            _say("(the simulated allocator picks the first free device that the request's DeviceClass and simple")
            _say(" equality selectors allow; a real scheduler evaluates the full CEL)")
            taken: set[str] = set()
            prepared: list[ClaimRef] = []
            for name in examples or DEFAULT_EXAMPLES:
                _say()
                prepared += _prepare_example(EXAMPLES_DIR / name, api, kubelet, work, taken)

            _heading("4. `python -m driver inspect` on the node")
            inspect = subprocess.run(
                [sys.executable, "-m", "driver", "inspect", "--plugins-dir", str(work / "plugins"),
                 "--cdi-root", str(work / "cdi")], capture_output=True, text=True, check=False)
            _say(inspect.stdout.rstrip() or inspect.stderr.rstrip())

            _heading("5. The kubelet unprepares them")
            answers = kubelet.unprepare(prepared)
            for ref in prepared:
                _say(f"NodeUnprepareResources {ref.namespace}/{ref.name}: {answers[ref.uid] or 'ok'}")
            left = sorted(p.name for p in (work / "cdi").glob("k8s.gpu.tessera.dev-claim_*"))
            _say(f"CDI specs left: {left or 'none'}; MPS daemons left: "
                 f"{sorted(p.name for p in (work / 'plugins' / DEFAULT_DRIVER_NAME / 'mps').glob('*-*')) or 'none'}")
        _heading("Done")
        if keep:
            _say(f"Files kept in {work}: driver.log, cdi/, plugins/ (checkpoint, MPS dirs), host/ (simulated host)")
        else:
            _say("The simulated node's files were removed; pass --workdir DIR to keep them (driver.log, cdi/, ...).")
        return 0
    except Exception as exc:
        _say(f"demo failed: {exc}")
        log = work / "driver.log"
        if log.exists():
            _say("--- last lines of driver.log")
            _say("\n".join(log.read_text().splitlines()[-30:]))
        return 1
    finally:
        kubelet.close()
        api.stop()
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def _expected_devices(work: Path, layout: str) -> int:
    from driver.gpu.devices import build_devices
    from driver.gpu.sharingplan import load_plans, resolve_layout

    inventory = SimulatedDiscovery(layout, NODE).discover()
    plans = load_plans(work / "sharing-plans.yaml")
    plan = plans.plans["demo"]
    return len(build_devices(inventory, resolve_layout(plan, inventory, "demo")))
