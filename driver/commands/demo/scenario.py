"""``python -m driver demo``: SIMULATION of one GPU node, end to end, on any machine.

Runs the real driver process (``python -m driver run --simulate``) against simulated parts:
GPUs from ``driver/simulation``, a host tree with stand-in device nodes and executables, an
in-process Kubernetes API server double, and a kubelet stand-in calling the real Unix sockets.
Nothing here touches real GPUs, a real cluster or the host's /dev.

SIGTERM, Ctrl-C and SIGHUP stop the demo cleanly: the driver gets SIGTERM, then every process it
started (the MPS daemon stand-ins detach from it) is found by a token in its environment and
stopped. If the demo is killed outright, its watchdog does the same (``driver/reaper.py``).
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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from driver.commands.demo.args import (
    EXAMPLES_DIR,
    DemoArgsError,
    DemoOptions,
    ShareMode,
    claim_documents,
    clear_previous_run,
    demo_plan,
    layout_hint,
    parse_options,
    pods_using,
    share_mode,
)
from driver.commands.demo.health import show_failure_and_recovery
from driver.commands.demo.lock import WorkdirBusy, workdir_lock
from driver.commands.demo.mig import FULL, dynamic_mig_plan, prepare_mix, show_full_gpu_fits
from driver.commands.demo.table import print_slices
from driver.config import DEFAULT_DRIVER_NAME, DEFAULT_PLAN_LABEL
from driver.gpu.claimcdi.edits import CdiNames
from driver.gpu.discovery.inventory import NodeInventory
from driver.kubeletplugin.types import ClaimRef
from driver.nodelayout import SIMULATED_NODE_NAME
from driver.reaper import TOKEN_ENV, Interrupted, Reaper, no_cleanup, processes_with_env, stop_processes
from driver.simulation.allocator import AllocationError, allocate, claim_from_template
from driver.simulation.apiserver import FakeApiServer
from driver.simulation.discovery import SimulatedDiscovery, available_layouts
from driver.simulation.healthevents import EVENTS_ENV
from driver.simulation.hostroot import SimulatedHost, build_host_root
from driver.simulation.kubelet import KubeletEmulator

NODE = SIMULATED_NODE_NAME  # the name check-node, inspect and check-plan simulate too: the same GPU UUIDs
CDI_NAMES = CdiNames(DEFAULT_DRIVER_NAME)


def main(argv: Sequence[str]) -> int:
    """``python -m driver demo [options]``: exit status 0 done, 1 failed, 2 bad arguments, 128+N stopped by signal N."""
    try:
        options = parse_options(argv, available_layouts())
        mode = share_mode(options.examples, DEFAULT_DRIVER_NAME)
    except DemoArgsError as exc:
        print(f"python -m driver demo: {exc}", file=sys.stderr)
        return 2
    if options.workdir is None:
        return _run(options, mode)
    try:
        with workdir_lock(options.workdir):
            return _run(options, mode, clear_previous_run(options.workdir))
    except (DemoArgsError, WorkdirBusy) as exc:
        print(f"python -m driver demo: {exc}", file=sys.stderr)
        return 2


def _run(options: DemoOptions, mode: ShareMode, cleared: Sequence[str] = ()) -> int:
    if cleared:
        _say(f"Removed the previous demo run's files from {options.workdir} ({', '.join(cleared)}).")
    try:
        # SIGTERM, Ctrl-C and a closed terminal (SIGHUP) stop the demo in order; kill -9 leaves it to the
        # reaper's watchdog. Either way the driver and every stand-in it started are stopped.
        with Reaper() as reaper:
            return run_demo(options, mode, reaper.remove_on_exit)
    except Interrupted as stop:
        _say(f"\ndemo stopped by {stop}: the driver and every stand-in it started are stopped")
        return stop.status


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
            "--device-plugins-dir", str(work / "device-plugins"), "--http-port", "0", "--log-format", "text"]
    (work / "tmp").mkdir(exist_ok=True)
    # The reaper's token is in os.environ, so the driver and every daemon it starts inherit it.
    env = dict(os.environ, TMPDIR=str(work / "tmp"), TESSERA_SIM_NVIDIA_SMI_LOG=str(work / "nvidia-smi-calls.jsonl"),
               TESSERA_SIM_NVML_LOG=str(work / NVML_CALLS), **extra_env)
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
            # The daemon stand-ins detach from the driver; they hold the reaper's token (main() runs the demo
            # under a reaper, whose own exit would stop them too, but only after the closing lines).
            token = os.environ.get(TOKEN_ENV)
            if token:
                stop_processes(processes_with_env(TOKEN_ENV, token))


def _wait_for_slices(api: FakeApiServer, expected: int, timeout: float = 20.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        slices = api.slices(DEFAULT_DRIVER_NAME, NODE)
        if sum(len(s["spec"].get("devices", [])) for s in slices) == expected:
            return slices
        time.sleep(0.1)
    raise RuntimeError("the driver did not publish its ResourceSlices in time; see driver.log")


FULL_GPU_CLAIM = f"the {FULL} after the others (--dynamic-mig)"
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


def _prepare_document(doc: dict[str, Any], source: str, api: FakeApiServer, kubelet: KubeletEmulator, work: Path,
                      cdi_dir: Path, taken: set[str], consumed: dict[str, dict[str, int]],
                      failed: list[str], pods: Sequence[dict[str, Any]] = ()) -> ClaimRef | None:
    """Allocate one ResourceClaim(Template) document, reserve it for ``pods`` (the example's Pods that use it,
    as the scheduler does), prepare it through the kubelet stand-in, show what the container would get; its
    ref if it is prepared."""
    name = f"demo-{doc['metadata']['name']}"
    claim = claim_from_template(doc, name) if doc["kind"] == "ResourceClaimTemplate" else {
        **doc, "metadata": {**doc["metadata"], "name": name, "namespace": "default",
                            "uid": claim_from_template({"spec": {"spec": doc["spec"]}}, name)["metadata"]["uid"]}}
    try:
        allocated = allocate(claim, api.slices(DEFAULT_DRIVER_NAME, NODE), DEFAULT_DRIVER_NAME, taken, consumed)
    except AllocationError as exc:
        _say(f"  NOT ALLOCATED: claim default/{name} (from {source}): {exc}; {layout_hint(source)}")
        failed.append(name)
        return None
    for pod in pods:
        stored = api.put_pod({**pod, "metadata": {"name": f"demo-{pod['metadata']['name']}", "namespace": "default",
                                                  "uid": str(uuid.uuid4())}})
        allocated.setdefault("status", {}).setdefault("reservedFor", []).append(
            {"resource": "pods", "name": stored["metadata"]["name"], "uid": stored["metadata"]["uid"]})
    api.put_claim(allocated)
    ref = ClaimRef(namespace="default", name=name, uid=claim["metadata"]["uid"])
    results = allocated["status"]["allocation"]["devices"]["results"]
    _say(f"Claim default/{name} (from {source}) allocated: "
         + ", ".join(f"{r['request']} -> {r['device']}" for r in results))
    started = time.perf_counter()
    answer = kubelet.prepare([ref])[ref.uid]
    elapsed_ms = (time.perf_counter() - started) * 1000
    if answer.error:
        _say(f"  NodePrepareResources FAILED: {answer.error}")
        failed.append(name)
        return None
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
    return ref


def run_demo(options: DemoOptions, mode: ShareMode = "mps", remove_on_exit: Callable[[Path], None] = no_cleanup) -> int:
    """``remove_on_exit``: the demo's :meth:`Reaper.remove_on_exit`, so a killed demo's files go too."""
    keep = options.workdir is not None
    work = options.workdir or Path(tempfile.mkdtemp(prefix="tessera-demo-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    if not keep:
        remove_on_exit(work)  # also if the demo is killed
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
        plan, plan_text = dynamic_mig_plan(inventory) if options.dynamic_mig else demo_plan(inventory, mode)
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
            print_slices(_wait_for_slices(api, _expected_devices(plans, inventory)), _say)

            sources = sorted({str(p.parent) for p in options.examples} | ({str(EXAMPLES_DIR)} if options.dynamic_mig
                                                                           else set()))
            _heading(f"3. The kubelet prepares claims from {', '.join(_short(s) for s in sources)}")
            _say("(the simulated allocator picks the first free device that the request's DeviceClass and its")
            _say(" equality, prefix and capacity selectors allow; a real scheduler evaluates the full CEL)")
            taken: set[str] = set()
            consumed: dict[str, dict[str, int]] = {}  # what consumable shares took, per device
            prepared: list[ClaimRef] = []
            failed: list[str] = []
            state_dir = work / "plugins" / DEFAULT_DRIVER_NAME

            def prepare(doc: dict[str, Any], source: str, pods: Sequence[dict[str, Any]] = ()) -> ClaimRef | None:
                return _prepare_document(doc, source, api, kubelet, work, cdi_dir, taken, consumed, failed, pods)

            if options.dynamic_mig:
                prepared += prepare_mix(prepare, lambda: api.slices(DEFAULT_DRIVER_NAME, NODE), taken,
                                        DEFAULT_DRIVER_NAME, state_dir, _say)
            for path in options.examples:
                _say()
                refs = [prepare(doc, path.name, pods_using(path, doc)) for doc in claim_documents(path)]
                prepared += [ref for ref in refs if ref is not None]

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
                if options.dynamic_mig:
                    uids = {r.uid for r in prepared}
                    released = [r["device"] for c in api.claims() if c["metadata"]["uid"] in uids
                                for r in c["status"]["allocation"]["devices"]["results"]]
                    if not show_full_gpu_fits(prepare, kubelet.unprepare, released, taken, state_dir, _say):
                        failed.append(FULL_GPU_CLAIM)
        failed = list(dict.fromkeys(failed))  # a claim the allocator refused is not counted again when its prepare is
        _heading("Done" if not failed else f"Done, but {len(failed)} claim(s) FAILED: {', '.join(failed)}")
        _say(_closing(work, cdi_dir, node_args, keep, options.keep_prepared))
        return 1 if failed else 0
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
    from driver.gpu.published.devices import make_view
    from driver.gpu.published.sharingplan import load_plans, resolve_layout

    plan = load_plans(plans_file).plans["demo"]
    return len(make_view(inventory, resolve_layout(plan, inventory, "demo")).devices)
