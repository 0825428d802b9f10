#!/usr/bin/env python3
"""The real driver on this machine's real GPUs, end to end, without a cluster.

For a GPU machine with no Kubernetes (a lent test machine, a node before it joins): runs
``python -m driver run`` with NVML discovery on the real GPUs and the real driver root, against
the two stand-ins the repository has for the cluster side: the in-process API server double
(real HTTP, the real ``kubernetes`` client) and the kubelet stand-in (real gRPC over the Unix
sockets). Only the cluster is simulated; GPUs, NVML, device nodes and libraries are real.

It changes nothing on the GPUs: it prepares and unprepares one whole-GPU claim per GPU (no
compute mode, MIG mode or time-slice change; MPS is checked by ``check-node``, which needs no
compute-mode change either), and prints what the driver published, the CDI spec it wrote, the
health stream's first report and what ``inspect`` shows. Exit status 0 when every step worked.

    python scripts/real-node-e2e.py [--driver-root /] [--workdir DIR] [--driver-libraries-required false]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from driver.commands.demo.table import print_slices
from driver.config import DEFAULT_DRIVER_NAME
from driver.gpu.claimcdi.edits import CdiNames
from driver.kubeletplugin.types import ClaimRef
from driver.simulation.allocator import allocate, claim_from_template
from driver.simulation.apiserver import FakeApiServer
from driver.simulation.discovery import SimulatedDiscovery
from driver.simulation.hostroot import build_host_root
from driver.simulation.kubelet import KubeletEmulator

NODE = "real-node"
WHOLE_GPU_CLAIM = {"spec": {"spec": {"devices": {"requests": [
    {"name": "gpu", "exactly": {"deviceClassName": DEFAULT_DRIVER_NAME}}]}}}}


def say(text: str = "") -> None:
    print(text, flush=True)


def wait_for(what: str, check: Any, timeout: float, log: Path) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if log.exists() else ""
    raise RuntimeError(f"{what}: not seen within {timeout:.0f} s\n--- driver log tail\n{tail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--driver-root", default="/")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--driver-libraries-required", default="true")
    parser.add_argument("--nvidia-cdi-spec", default=None, help="the toolkit's CDI spec, where not auto-detected")
    parser.add_argument("--sharing-plans", default=None, help="sharing plans for the driver (its defaultPlan)")
    parser.add_argument("--server-minor", type=int, default=36)
    parser.add_argument("--simulate", default=None,
                        help="SIMULATION: a simulated layout instead of the real GPUs (to try this script without one)")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="tessera-real-"))
    work.mkdir(parents=True, exist_ok=True)
    gpus_are = f"SIMULATED layout {args.simulate}" if args.simulate else "REAL GPUs and NVML"
    say(f"work directory {work}; API server double v1.{args.server_minor}; kubelet stand-in; {gpus_are}")
    api = FakeApiServer(minor_version=args.server_minor)
    api.start()
    api.add_node(NODE)
    kubeconfig = api.kube_config(work / "kubeconfig")
    kubelet = KubeletEmulator(work / "registry")
    log = work / "driver.log"
    node_args = ["--node-name", NODE, "--plugins-dir", str(work / "plugins"), "--cdi-root", str(work / "cdi"),
                 "--driver-root", args.driver_root, "--driver-libraries-required", args.driver_libraries_required]
    if args.nvidia_cdi_spec:
        node_args += ["--nvidia-cdi-spec", args.nvidia_cdi_spec]
    if args.sharing_plans:
        node_args += ["--sharing-plans", str(Path(args.sharing_plans).resolve())]
    if args.simulate:
        discovery = SimulatedDiscovery(args.simulate, NODE)
        host = build_host_root(work / "host", discovery.discover(), discovery.driver_layout)
        real_roots = {"--driver-root": args.driver_root}
        node_args = [a for i, a in enumerate(node_args) if a not in real_roots and node_args[i - 1] not in real_roots]
        node_args += ["--simulate", args.simulate, *host.driver_args()]
    cmd = [sys.executable, "-m", "driver", "run", *node_args, "--kubeconfig", str(kubeconfig),
           "--registrar-dir", str(work / "registry"), "--http-port", "0", "--log-format", "text"]
    failures: list[str] = []
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for("the driver's registration socket", lambda: proc.poll() is not None or kubelet.registration_sockets(),
                 60, log)
        if proc.poll() is not None:
            raise RuntimeError(f"the driver exited with status {proc.returncode} before registering; see {log}")
        plugin = kubelet.wait_for_plugin(DEFAULT_DRIVER_NAME, timeout=30)
        say(f"registered after {time.monotonic() - started:.2f} s: {plugin.endpoint} ({plugin.api_version})")
        slices = wait_for("ResourceSlices", lambda: [s for s in api.slices(DEFAULT_DRIVER_NAME, NODE)
                                                      if s["spec"].get("devices")], 60, log)
        say(f"published after {time.monotonic() - started:.2f} s:")
        print_slices(slices, say)
        say(json.dumps(slices, indent=1)[:6000])
        watch = kubelet.watch_health()
        cdi = CdiNames(DEFAULT_DRIVER_NAME)
        taken: set[str] = set()
        refs: list[ClaimRef] = []
        gpus = sum(1 for s in slices for d in s["spec"]["devices"]
                   if (d.get("attributes", {}).get("type", {}) or {}).get("string") == "gpu")
        for i in range(gpus):
            claim = claim_from_template(WHOLE_GPU_CLAIM, f"whole-{i}")
            allocated = allocate(claim, api.slices(DEFAULT_DRIVER_NAME, NODE), DEFAULT_DRIVER_NAME, taken, {})
            api.put_claim(allocated)
            ref = ClaimRef(namespace="default", name=f"whole-{i}", uid=claim["metadata"]["uid"])
            t0 = time.perf_counter()
            answer = kubelet.prepare([ref])[ref.uid]
            ms = (time.perf_counter() - t0) * 1000
            if answer.error:
                failures.append(f"prepare whole-{i}: {answer.error}")
                say(f"prepare whole-{i} FAILED in {ms:.1f} ms: {answer.error}")
                continue
            refs.append(ref)
            say(f"prepare whole-{i} ok in {ms:.1f} ms: " + ", ".join(
                f"{d.device_name} -> {list(d.cdi_device_ids)}" for d in answer.devices))
            spec = work / "cdi" / cdi.spec_file_name(ref.uid)
            say(f"--- CDI spec {spec.name}")
            say(spec.read_text()[:8000])
        if watch.wait_messages(1, timeout=30):
            say("health stream: first report received")
        else:
            failures.append("health stream: no report in 30 s")
        inspect = subprocess.run([sys.executable, "-m", "driver", "inspect", *node_args],
                                 capture_output=True, text=True, timeout=60, check=False)
        say("--- inspect")
        say(inspect.stdout + inspect.stderr)
        for ref in refs:
            t0 = time.perf_counter()
            error = kubelet.unprepare([ref])[ref.uid]
            ms = (time.perf_counter() - t0) * 1000
            say(f"unprepare {ref.name}: {error or 'ok'} in {ms:.1f} ms")
            if error:
                failures.append(f"unprepare {ref.name}: {error}")
        left = sorted(p.name for p in (work / "cdi").glob(cdi.spec_prefix + "*"))
        if left:
            failures.append(f"CDI specs left after unprepare: {left}")
        watch.close()
    except Exception as exc:  # a check script reports every failure, then still cleans up
        failures.append(f"{type(exc).__name__}: {exc}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            failures.append("the driver did not stop within 20 s of SIGTERM")
        kubelet.close()
        api.stop()
    say("--- driver log (last 60 lines)")
    say("\n".join(log.read_text(errors="replace").splitlines()[-60:]))
    say("RESULT: " + ("ok" if not failures else "FAILED\n  " + "\n  ".join(failures)))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
