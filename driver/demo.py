"""``python -m driver demo``: SIMULATION of one GPU node, end to end, on any machine.

Runs the real driver process (``python -m driver run --simulate``) against simulated parts:
GPUs from ``driver/simulation``, a host tree with stand-in device nodes and executables, an
in-process Kubernetes API server double, and a kubelet stand-in calling the real Unix sockets.
Nothing here touches real GPUs, a real cluster or the host's /dev.

SIGTERM and Ctrl-C stop the demo cleanly: the driver gets SIGTERM, then every process it started
(the MPS daemon stand-ins detach from it) is found by a token in its environment and stopped.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

from driver.config import DEFAULT_DRIVER_NAME, DEFAULT_PLAN_LABEL
from driver.demoargs import (
    DemoArgsError,
    DemoOptions,
    ShareMode,
    claim_documents,
    demo_plan,
    parse_options,
    share_mode,
)
from driver.demohealth import show_failure_and_recovery
from driver.gpu.claimcdi.edits import CdiNames
from driver.gpu.discovery.inventory import NodeInventory
from driver.kubeletplugin.types import ClaimRef
from driver.simulation.allocator import AllocationError, allocate, claim_from_template
from driver.simulation.apiserver import FakeApiServer
from driver.simulation.discovery import SimulatedDiscovery, available_layouts
from driver.simulation.healthevents import EVENTS_ENV
from driver.simulation.hostroot import SimulatedHost, build_host_root
from driver.simulation.kubelet import KubeletEmulator
from driver.simulation.leftovers import processes_with_env, stop_processes

NODE = "demo-node"
CDI_NAMES = CdiNames(DEFAULT_DRIVER_NAME)
# Inherited by every process the demo's driver starts, daemons included: how the demo finds them to stop them.
RUN_TOKEN_ENV = "TESSERA_DEMO_RUN"


class DemoStopped(BaseException):
    """SIGTERM or SIGINT arrived; a BaseException so that no ``except Exception`` on the way swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _stop_on_signal(signum: int, frame: FrameType | None) -> None:
    # The first signal starts the shutdown; more of them (an impatient Ctrl-C) must not cut it short.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise DemoStopped(signum)


def main(argv: Sequence[str]) -> int:
    """``python -m driver demo [options]``: exit status 0 done, 1 failed, 2 bad arguments, 128+N stopped by signal N."""
    try:
        options = parse_options(argv, available_layouts())
        mode = share_mode(options.examples, DEFAULT_DRIVER_NAME)
    except DemoArgsError as exc:
        print(f"python -m driver demo: {exc}", file=sys.stderr)
        return 2
    previous = {s: signal.signal(s, _stop_on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run_demo(options, mode)
    except DemoStopped as stop:
        _say(f"\ndemo stopped by {stop}: the driver and every stand-in it started are stopped")
        return 128 + stop.signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _say(text: str = "") -> None:
    print(text, flush=True)


def _heading(text: str) -> None:
    _say()
    _say(f"=== {text}")


def _node_args(work: Path, layout: str, host: SimulatedHost, cdi_dir: Path, plans: Path) -> list[str]:
    """The settings ``run`` and ``inspect`` share: the simulated node's host tree, state and CDI directories."""
    return ["--simulate", layout, "--node-name", NODE, "--plugins-dir", str(work / "plugins"),
            "--cdi-root", str(cdi_dir), *host.driver_args(), "--sharing-plans", str(plans)]


@contextmanager
def _driver_process(work: Path, kubeconfig: Path, node_args: list[str],
                    extra_env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    args = [sys.executable, "-m", "driver", "run", *node_args,
            "--kubeconfig", str(kubeconfig), "--registrar-dir", str(work / "plugins_registry"),
            "--http-port", "0", "--log-format", "text"]
    (work / "tmp").mkdir(exist_ok=True)
    token = uuid.uuid4().hex
    env = dict(os.environ, TMPDIR=str(work / "tmp"), TESSERA_SIM_NVIDIA_SMI_LOG=str(work / "nvidia-smi-calls.jsonl"),
               TESSERA_SIM_NVML_LOG=str(work / NVML_CALLS),
               **{RUN_TOKEN_ENV: token}, **extra_env)
    with open(work / "driver.log", "wb") as log:
        # A session of its own: a terminal's Ctrl-C reaches only the demo, which then stops the driver
        # with SIGTERM (its clean shutdown) and in order, instead of both dying at once.
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            yield proc
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            stop_processes(processes_with_env(RUN_TOKEN_ENV, token))


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


NVML_CALLS = "nvml-calls.jsonl"  # what the driver asked the simulated NVML (driver/simulation/nvmlcompute.py)


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
    nvml_log = work / NVML_CALLS
    if daemons and nvml_log.exists():
        # Compute modes go through NVML in the driver's process (SIMULATION: the NVML double records them).
        calls = [json.loads(line) for line in nvml_log.read_text().splitlines() if line.strip()]
        _say("  compute-mode calls the driver made through NVML so far (SIMULATION double):")
        for call in calls:
            _say(f"    {call['call']} {call['uuid']}{' ' + call['mode'] if 'mode' in call else ''}")


def _prepare_example(path: Path, api: FakeApiServer, kubelet: KubeletEmulator, work: Path, cdi_dir: Path,
                     taken: set[str], consumed: dict[str, dict[str, int]]) -> list[ClaimRef]:
    refs: list[ClaimRef] = []
    for doc in claim_documents(path):
        name = f"demo-{doc['metadata']['name']}"
        claim = claim_from_template(doc, name) if doc["kind"] == "ResourceClaimTemplate" else {
            **doc, "metadata": {**doc["metadata"], "name": name, "namespace": "default",
                                "uid": claim_from_template({"spec": {"spec": doc["spec"]}}, name)["metadata"]["uid"]}}
        try:
            allocated = allocate(claim, api.slices(DEFAULT_DRIVER_NAME, NODE), DEFAULT_DRIVER_NAME, taken, consumed)
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
        spec_path = cdi_dir / CDI_NAMES.spec_file_name(ref.uid)
        spec_json = json.loads(spec_path.read_text())
        _say(f"  CDI spec written: {spec_path} (cdiVersion {spec_json['cdiVersion']})")
        for dev in spec_json["devices"]:
            edits = dev["containerEdits"]
            _say(f"    {dev['name']}")
            for node in edits.get("deviceNodes", []):
                extra = f" (char {node['major']}:{node['minor']})" if "major" in node else ""
                extra += f" from host {node['hostPath']}" if "hostPath" in node else ""
                _say(f"      device node {node['path']}{extra}")
            for env in edits.get("env", []):
                _say(f"      env {env}")
            for mount in edits.get("mounts", []):
                _say(f"      mount {mount['hostPath']} -> {mount['containerPath']}")
            for hook in edits.get("hooks", []):
                _say(f"      {hook['hookName']} hook {' '.join(hook['args'])}")
        common = spec_json.get("containerEdits", {})
        _say(f"    common to the claim: {len(common.get('mounts', []))} driver library/binary mounts, "
             f"{len(common.get('hooks', []))} hooks, control nodes "
             + ", ".join(n["path"] for n in common.get("deviceNodes", [])))
        _show_mps_commands(work, spec_json)
    return refs


def run_demo(options: DemoOptions, mode: ShareMode = "mps") -> int:
    keep = options.workdir is not None
    work = options.workdir or Path(tempfile.mkdtemp(prefix="tessera-demo-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    _say("Tessera demo: SIMULATION of one GPU node (simulated GPUs, stand-in nvidia-smi and")
    _say("nvidia-cuda-mps-control, an in-process API server double, a kubelet stand-in).")
    _say("The driver itself is the real one, running as `python -m driver run --simulate`.")
    _say(f"Working directory: {work}")
    api = FakeApiServer(minor_version=36)
    kubelet = KubeletEmulator(work / "plugins_registry")
    try:
        discovery = SimulatedDiscovery(options.layout, NODE)
        inventory = discovery.discover()
        host = build_host_root(work / "host", inventory, discovery.driver_layout)
        # On a GPU Operator node the driver writes its specs next to the operator's toolkit spec and finds it there.
        cdi_dir = host.toolkit_spec.parent if host.layout == "gpu-operator" else work / "cdi"
        if host.layout == "gpu-operator":
            _say(f"Driver layout: NVIDIA GPU Operator (driver root {host.driver_root}, device nodes in its dev/, "
                 f"toolkit spec {host.toolkit_spec.name})")
        plan, plan_text = demo_plan(inventory, mode)
        plans = work / "sharing-plans.yaml"
        plans.write_text("# SIMULATION: the sharing plan of the demo's node, chosen for its layout and examples.\n"
                         + yaml.safe_dump(plan, sort_keys=False))
        api.start()
        api.add_node(NODE, labels={DEFAULT_PLAN_LABEL: "demo"})
        kubeconfig = api.kube_config(work / "kubeconfig")
        layout_name = Path(options.layout).name if "/" in options.layout else options.layout
        node_args = _node_args(work, options.layout, host, cdi_dir, plans)
        events = work / "health-events.jsonl"  # SIMULATION: GPU health events (--health)
        extra_env = {EVENTS_ENV: str(events)} if options.health else {}
        with _driver_process(work, kubeconfig, node_args, extra_env) as proc:
            _heading(f"1. The driver registers with the kubelet (simulated node '{layout_name}': "
                     f"{discovery.description or f'{len(inventory.gpus)} GPUs'})")
            registered = kubelet.wait_for_plugin(DEFAULT_DRIVER_NAME, timeout=30)
            _say(f"Registered {registered.name} (pid {proc.pid}); DRA endpoint {registered.endpoint}; "
                 f"API {registered.api_version}")

            _heading(f"2. ResourceSlices it published (node sharing plan 'demo': {plan_text})")
            _print_slices(_wait_for_slices(api, _expected_devices(plans, inventory)))

            sources = sorted({str(p.parent) for p in options.examples})
            _heading(f"3. The kubelet prepares claims from {', '.join(_short(s) for s in sources)}")
            _say("(the simulated allocator picks the first free device that the request's DeviceClass and its")
            _say(" equality, prefix and capacity selectors allow; a real scheduler evaluates the full CEL)")
            taken: set[str] = set()
            consumed: dict[str, dict[str, int]] = {}  # what consumable shares took, per device
            prepared: list[ClaimRef] = []
            for path in options.examples:
                _say()
                prepared += _prepare_example(path, api, kubelet, work, cdi_dir, taken, consumed)

            _heading("4. `python -m driver inspect` on the node")
            _say(_run_inspect(node_args))

            if options.health:
                _heading("4b. A GPU fails and recovers (--health)")
                show_failure_and_recovery(api=api, kubelet=kubelet, driver=DEFAULT_DRIVER_NAME, node=NODE,
                                          inventory=inventory, events=events, log=work / "driver.log", say=_say)

            if options.keep_prepared:
                _heading("5. The claims stay prepared (--keep-prepared)")
                _say(f"{len(prepared)} claim(s) left prepared; stopping the driver (SIGTERM) and the MPS daemon "
                     "stand-ins it started.")
            else:
                _heading("5. The kubelet unprepares them")
                answers = kubelet.unprepare(prepared)
                for ref in prepared:
                    _say(f"NodeUnprepareResources {ref.namespace}/{ref.name}: {answers[ref.uid] or 'ok'}")
                left = sorted(p.name for p in cdi_dir.glob(CDI_NAMES.spec_prefix + "*"))
                mps_dirs = sorted(p.name for p in (work / "plugins" / DEFAULT_DRIVER_NAME / "mps").glob("*-*"))
                _say(f"CDI specs left: {left or 'none'}; MPS daemons left: {mps_dirs or 'none'}")
        _heading("Done")
        _say(_closing(work, cdi_dir, node_args, keep, options.keep_prepared))
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


def _short(directory: str) -> str:
    try:
        return f"{Path(directory).relative_to(Path.cwd())}/"
    except ValueError:
        return f"{directory}/"


def inspect_command(node_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "driver", "inspect", *node_args]


def _run_inspect(node_args: list[str]) -> str:
    done = subprocess.run(inspect_command(node_args), capture_output=True, text=True, check=False)
    return (done.stdout.rstrip() + "\n" + done.stderr.rstrip()).strip()


def _closing(work: Path, cdi_dir: Path, node_args: list[str], keep: bool, kept_prepared: bool) -> str:
    if not keep:
        return ("The simulated node's files were removed. To read them afterwards: --workdir DIR keeps them, and "
                "--workdir DIR --keep-prepared also leaves the claims prepared for `inspect`.")
    cdi_text = f"{cdi_dir.relative_to(work)}/" if cdi_dir.is_relative_to(work) else str(cdi_dir)
    lines = [f"Files kept in {work}: driver.log, {cdi_text} (CDI specs), plugins/ (checkpoint, MPS dirs), "
             "host/ (the simulated host)."]
    if kept_prepared:
        lines += ["The claims are still prepared (the driver and the daemon stand-ins are stopped, so inspect shows "
                  "the MPS daemons as not running). Read them with:",
                  f"  {shlex.join(inspect_command(node_args))}",
                  f"  ls {shlex.quote(str(cdi_dir))}",
                  f"  cat {shlex.quote(str(cdi_dir))}/{CDI_NAMES.spec_prefix}*.json"]
    else:
        lines += ["Pass --keep-prepared too to leave the claims prepared for `python -m driver inspect`."]
    lines.append(f"Remove them with: rm -rf {shlex.quote(str(work))}")
    return "\n".join(lines)


def _expected_devices(plans_file: Path, inventory: NodeInventory) -> int:
    from driver.gpu.devices import make_view
    from driver.gpu.sharingplan import load_plans, resolve_layout

    plan = load_plans(plans_file).plans["demo"]
    return len(make_view(inventory, resolve_layout(plan, inventory, "demo")).devices)
