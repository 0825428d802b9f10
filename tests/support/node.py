"""A simulated GPU node for integration tests: the real driver process and simulated surroundings.

The driver runs as ``python -m driver run --simulate`` in its own process. Around it: the API
server double (real HTTP, the real kubernetes client on the driver side), the kubelet stand-in
(real gRPC over the real Unix sockets), a simulated host tree with stand-in device nodes, and
stand-in ``nvidia-smi`` / ``nvidia-cuda-mps-control`` executables.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import yaml

from driver.config import DEFAULT_PLAN_LABEL
from driver.kubeletplugin.types import ClaimRef
from driver.simulation.apiserver import FakeApiServer
from driver.simulation.discovery import SimulatedDiscovery
from driver.simulation.hostroot import build_host_root
from driver.simulation.kubelet import KubeletEmulator, PrepareAnswer
from tests.support.processes import kill_processes_mentioning

DRIVER = "gpu.tessera.dev"
NODE = "node-a"
PLAN_LABEL = DEFAULT_PLAN_LABEL


def wait_until(condition: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def kill_9_while_daemon_starts(sim_node: SimulatedNode, ref: ClaimRef) -> int:
    """Prepare ``ref`` and kill -9 the driver once its MPS daemon runs and the claim is PrepareStarted.

    The node must have been started with ``TESSERA_SIM_MPS_FAIL=hang``, so the prepare blocks in the
    daemon's readiness wait. Returns the daemon's pid, which must have outlived the driver.
    """
    def prepare_until_killed() -> None:
        with contextlib.suppress(grpc.RpcError):  # the driver dies under this call
            sim_node.prepare(ref)

    thread = threading.Thread(target=prepare_until_killed, daemon=True)
    thread.start()
    wait_until(lambda: any(e.get("event") == "start" for e in sim_node.journal()), what="the daemon to start")
    wait_until(lambda: sim_node.checkpoint()["claims"].get(ref.uid, {}).get("phase") == "PrepareStarted",
               what="PrepareStarted in the checkpoint")
    [daemon_pid] = {e["pid"] for e in sim_node.journal() if e.get("event") == "start"}
    sim_node.kill9()
    thread.join(timeout=30)
    assert pid_alive(daemon_pid), "the half-started daemon outlived the driver"
    return int(daemon_pid)


def copy_dev(source: Path, target: Path) -> None:
    """A /dev as a container runtime copies it: directories and files again, device nodes made again (never read)."""
    target.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.rglob("*")):
        made = target / path.relative_to(source)
        info = path.lstat()
        if path.is_dir():
            made.mkdir(parents=True, exist_ok=True)
        elif stat.S_ISCHR(info.st_mode):
            os.mknod(made, info.st_mode, info.st_rdev)
        elif stat.S_ISREG(info.st_mode):
            shutil.copyfile(path, made)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # the process may go between the two looks: reading a vanished /proc entry raises ESRCH
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


class SimulatedNode:
    def __init__(self, layout: str = "demo", plans: dict[str, Any] | None = None, plan: str | None = None,
                 minor_version: int = 36, python: str = sys.executable):
        # The interpreter the driver's processes run with: scripts/benchmark.py can give the image's environment
        # (deploy/build-venv.sh), which lacks the test-only packages that runtime packages import when present.
        self.python = python
        # Short paths: Unix socket paths must stay under 108 bytes.
        self.work = Path(tempfile.mkdtemp(prefix="tsn-", dir="/tmp"))
        self.layout = layout
        discovery = SimulatedDiscovery(layout, NODE)
        self.inventory = discovery.discover()
        self.host = self.work / "host"
        self.sim_host = build_host_root(self.host, self.inventory, discovery.driver_layout)
        self.plans_file: Path | None = None
        if plans is not None:
            self.plans_file = self.work / "plans.yaml"
            self.plans_file.write_text(yaml.safe_dump(plans))
        self.api = FakeApiServer(minor_version=minor_version)
        self.api.start()
        self.api.add_node(NODE, labels={PLAN_LABEL: plan} if plan else {})
        self.kubeconfig = self.api.kube_config(self.work / "kubeconfig")
        self.kubelet = KubeletEmulator(self.work / "reg")
        self.proc: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}
        self.log_path = self.work / "driver.log"
        self.mps_host: subprocess.Popen[bytes] | None = None
        # SIMULATION: GPU health events (TESSERA_SIM_EVENTS), appended by tests while the driver runs.
        self.events_file = self.work / "health-events.jsonl"

    # ----------------------------------------------------------------------------- paths

    @property
    def state_dir(self) -> Path:
        return self.work / "plugins" / DRIVER

    @property
    def device_plugins_dir(self) -> Path:
        """The simulated kubelet's device plugin directory (another GPU allocator's socket goes there)."""
        return self.work / "device-plugins"

    @property
    def cdi_dir(self) -> Path:
        # On a GPU Operator node the driver writes next to the operator's toolkit spec and finds it there.
        return self.sim_host.toolkit_spec.parent if self.sim_host.layout == "gpu-operator" else self.work / "cdi"

    @property
    def mps_journal(self) -> Path:
        return self.work / "mps-journal.jsonl"

    @property
    def nvidia_smi_log(self) -> Path:
        return self.work / "nvidia-smi.jsonl"

    @property
    def nvml_log(self) -> Path:
        """What the driver asked the simulated NVML (driver/simulation/nvmlcompute.py), one JSON object a line."""
        return self.work / "nvml-calls.jsonl"

    def nvml_calls(self) -> list[dict[str, Any]]:
        if not self.nvml_log.exists():
            return []
        return [json.loads(line) for line in self.nvml_log.read_text().splitlines() if line.strip()]

    def compute_mode(self, uuid: str) -> str:
        """The GPU's compute mode as the simulated NVML and the stand-ins hold it (DEFAULT until set)."""
        path = self.work / "nvidia-smi-state.json"
        state: dict[str, dict[str, str]] = json.loads(path.read_text()) if path.exists() else {}
        return state.get(uuid, {}).get("compute_mode", "DEFAULT")

    def cdi_spec(self, claim_uid: str) -> Path:
        return self.cdi_dir / f"k8s.gpu.tessera.dev-claim_{claim_uid}.json"

    def cdi_files(self) -> list[str]:
        return sorted(p.name for p in self.cdi_dir.glob("*.json")) if self.cdi_dir.exists() else []

    def checkpoint(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.state_dir / "checkpoint.json").read_text())["data"]
        return data

    def journal(self, probes: bool = False) -> list[dict[str, Any]]:
        """The MPS stand-ins' journal; without ``probes``, less the driver's multi-user probe daemon
        (a throwaway daemon the driver starts once after registration, driver/gpu/runtime/multiuser.py)."""
        if not self.mps_journal.exists():
            return []
        entries = [json.loads(line) for line in self.mps_journal.read_text().splitlines() if line.strip()]
        probe_dir = str(self.state_dir / "mps" / "probe-multi-user")
        return [e for e in entries if probes or not str(e.get("pipe_dir") or "").startswith(probe_dir)]

    def nvidia_smi_calls(self) -> list[list[str]]:
        if not self.nvidia_smi_log.exists():
            return []
        calls = []
        for line in self.nvidia_smi_log.read_text().splitlines():
            entry = json.loads(line)
            calls.append(entry["argv"] if isinstance(entry, dict) else entry)
        return calls

    # ----------------------------------------------------------------------------- process

    def args(self, *extra: str) -> list[str]:
        args = [self.python, "-m", "driver", "run", "--simulate", self.layout, "--node-name", NODE,
                "--kubeconfig", str(self.kubeconfig), "--registrar-dir", str(self.work / "reg"),
                "--device-plugins-dir", str(self.device_plugins_dir),
                "--plugins-dir", str(self.work / "plugins"), "--cdi-root", str(self.cdi_dir),
                *self.sim_host.driver_args(),
                "--http-port", "0", "--log-format", "json", "--rescan-interval", "0.5"]
        if self.plans_file is not None:
            args += ["--sharing-plans", str(self.plans_file)]
        return [*args, *extra]

    def inspect_args(self, *extra: str) -> list[str]:
        """``python -m driver inspect`` with the settings the driver runs with, as an operator would run it."""
        return [self.python, "-m", "driver", "inspect", "--simulate", self.layout,
                "--plugins-dir", str(self.work / "plugins"), "--cdi-root", str(self.cdi_dir),
                *self.sim_host.driver_args(), *extra]

    def _environment(self, env: dict[str, str] | None) -> dict[str, str]:
        tmp = self.work / "tmp"  # the driver's private temporary files go away with the node
        tmp.mkdir(exist_ok=True)
        return dict(os.environ, TMPDIR=str(tmp), TESSERA_SIM_MPS_JOURNAL=str(self.mps_journal),
                    TESSERA_SIM_NVIDIA_SMI_LOG=str(self.nvidia_smi_log),
                    TESSERA_SIM_NVIDIA_SMI_STATE=str(self.work / "nvidia-smi-state.json"),
                    TESSERA_SIM_NVML_LOG=str(self.nvml_log),
                    **(env or {}))

    @property
    def mps_host_socket(self) -> Path:
        return self.work / "mps-host" / "host.sock"

    @property
    def mps_host_dev_root(self) -> Path:
        """SIMULATION: the root whose dev/ is the MPS host container's own (``start_mps_host(own_dev=True)``)."""
        return self.work / "mps-host-root"

    def start_mps_host(self, *extra: str, own_dev: bool = False) -> int:
        """Run ``python -m driver mps-host`` for this node, as its DaemonSet would; returns its PID.

        Start the driver with ``"--mps-host-socket", str(node.mps_host_socket)`` to use it. With ``own_dev`` the
        host has a /dev of its own, as a privileged container does: a copy of the node's taken now
        (``mps_host_dev_root``), which its daemons use (the stand-in checks MIG capability nodes there).
        """
        assert self.mps_host is None or self.mps_host.poll() is not None, "MPS host already running"
        args = [self.python, "-m", "driver", "mps-host", "--socket", str(self.mps_host_socket),
                "--mps-dir", str(self.state_dir / "mps"), "--driver-root", str(self.host), *extra]
        env = None
        if own_dev:
            copy_dev(self.host / "dev", self.mps_host_dev_root / "dev")
            args += ["--host-root", str(self.host), "--dev-root", str(self.mps_host_dev_root)]
            env = {"TESSERA_SIM_DEV_ROOT": str(self.mps_host_dev_root)}
        log = open(self.work / "mps-host.log", "ab")  # noqa: SIM115 - handed to the child process
        host = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self._environment(env))
        log.close()
        self.mps_host = host
        wait_until(lambda: self.mps_host_socket.is_socket() or host.poll() is not None, what="the MPS host's socket")
        assert host.poll() is None, (self.work / "mps-host.log").read_text()
        return host.pid

    def stop_mps_host(self) -> int | None:
        if self.mps_host is None or self.mps_host.poll() is not None:
            return self.mps_host.returncode if self.mps_host else None
        self.mps_host.send_signal(signal.SIGTERM)
        try:
            return self.mps_host.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.mps_host.kill()
            return self.mps_host.wait()

    def start(self, *extra: str, env: dict[str, str] | None = None, register: bool = True) -> None:
        """Start the driver; with ``register``, return once the kubelet stand-in registered it and the
        driver finished initialising behind its sockets (recovery done, claims served:
        driver/commands/run/startup.py)."""
        assert self.proc is None or self.proc.poll() is not None, "driver already running"
        self.env = self._environment(env)
        started_before = self._initialised_count()
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child process
        self.proc = subprocess.Popen(self.args(*extra), stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        if register:
            self.kubelet.wait_for_plugin(DRIVER, timeout=30)
            self.wait_initialised(started_before)

    def _initialised_count(self) -> int:
        return sum(1 for line in self.log() if line.get("msg") == "driver started")

    def wait_initialised(self, before: int, timeout: float = 60.0) -> None:
        """Wait for the driver's "driver started" log line (its initialisation finished) beyond ``before`` of
        them; fail at once if the process exits instead."""
        proc = self.proc
        wait_until(lambda: self._initialised_count() > before or (proc is not None and proc.poll() is not None),
                   timeout, "the driver to finish initialising")
        assert self._initialised_count() > before, f"the driver exited while initialising: {self.log()[-3:]}"

    def run_to_exit(self, *extra: str, timeout: float = 30.0) -> tuple[int, str]:
        """Run the driver expecting it to exit by itself (e.g. bad configuration)."""
        done = subprocess.run(self.args(*extra), capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, **self.env))
        return done.returncode, done.stdout + done.stderr

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def restart(self, *extra: str, env: dict[str, str] | None = None) -> None:
        self.stop()
        self.kubelet.close()
        self.kubelet = KubeletEmulator(self.work / "reg")
        self.start(*extra, env=env)

    def log(self) -> list[dict[str, Any]]:
        lines = self.log_path.read_text().splitlines() if self.log_path.exists() else []
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                out.append({"msg": line})
        return out

    def close(self) -> None:
        self.stop()
        self.stop_mps_host()
        self.kubelet.close()
        self.api.stop()
        self._kill_leftover_daemons()
        shutil.rmtree(self.work, ignore_errors=True)

    def _kill_leftover_daemons(self) -> None:
        # MPS daemon stand-ins daemonise (setsid); kill any that a failing test left behind.
        kill_processes_mentioning(str(self.work), in_environment=True)

    # ----------------------------------------------------------------------------- cluster

    def devices(self) -> list[dict[str, Any]]:
        return [d for s in self.api.slices(DRIVER, NODE) for d in s["spec"].get("devices", [])]

    def device_names(self) -> list[str]:
        return [d["name"] for d in self.devices()]

    def wait_for_devices(self, expected: Sequence[str], timeout: float = 20.0) -> None:
        wait_until(lambda: sorted(self.device_names()) == sorted(expected), timeout,
                   f"published devices {sorted(expected)} (have {sorted(self.device_names())})")

    def claim(self, name: str, devices: Sequence[tuple[str, str]], *, configs: Sequence[dict[str, Any]] = (),
              namespace: str = "default", share_ids: dict[str, str] | None = None, pool: str = NODE,
              allocated: bool = True, pods: Sequence[dict[str, Any]] | None = None, admin_access: bool = False,
              tolerations: Sequence[dict[str, Any]] = (),
              consumed: dict[str, dict[str, str]] | None = None) -> ClaimRef:
        """Create a ResourceClaim allocated to ``devices`` (pairs of request, device name).

        ``pods`` (e.g. from :func:`pod`) are put on the API server and the claim is reserved for them;
        by default one pod that a ``clients: nonRoot`` share admits, as the kubelet prepares a claim only
        for a pod it is reserved for (``()``: reserved for none).
        ``admin_access`` and ``tolerations`` go into every result, as the scheduler copies them from the
        request; ``consumed``: device name -> its ``consumedCapacity``.
        """
        uid = str(uuid.uuid4())
        results = []
        for request, device in devices:
            result: dict[str, Any] = {"request": request, "driver": DRIVER, "pool": pool, "device": device}
            if share_ids and device in share_ids:
                result["shareID"] = share_ids[device]
            if consumed and device in consumed:
                result["consumedCapacity"] = consumed[device]
            if admin_access:
                result["adminAccess"] = True
            if tolerations:
                result["tolerations"] = list(tolerations)
            results.append(result)
        claim: dict[str, Any] = {"metadata": {"name": name, "namespace": namespace, "uid": uid},
                                 "spec": {"devices": {"requests": []}}}
        if allocated:
            claim["status"] = {"allocation": {"devices": {"results": results, "config": list(configs)}}}
        self.api.put_claim(claim)
        ref = ClaimRef(namespace=namespace, name=name, uid=uid)
        if pods is None:
            pods = [pod(f"{name}-pod", pod_security=NON_ROOT, containers=[("main", NO_ESCALATION)])]
        for p in pods:
            self.reserve(ref, p)
        return ref

    def reserve(self, ref: ClaimRef, pod_object: dict[str, Any]) -> None:
        """Put ``pod_object`` (in the claim's namespace) and add it to the claim's ``status.reservedFor``."""
        stored = self.api.put_pod({**pod_object, "metadata": {**pod_object["metadata"], "namespace": ref.namespace}})
        claim = next(c for c in self.api.claims() if c["metadata"]["uid"] == ref.uid)
        claim.setdefault("status", {}).setdefault("reservedFor", []).append(
            {"resource": "pods", "name": stored["metadata"]["name"], "uid": stored["metadata"]["uid"]})
        self.api.put_claim(claim)

    def prepare(self, *refs: ClaimRef) -> dict[str, PrepareAnswer]:
        """Prepare through the kubelet stand-in, which checks each answer's share IDs against the claim's."""
        share_ids: dict[str, dict[str, str]] = {}
        for claim in self.api.claims():
            for result in ((claim.get("status") or {}).get("allocation") or {}).get("devices", {}).get("results", []):
                if result.get("shareID"):
                    share_ids.setdefault(claim["metadata"]["uid"], {})[result["device"]] = result["shareID"]
        return self.kubelet.prepare(list(refs), share_ids)

    def prepare_ok(self, ref: ClaimRef) -> PrepareAnswer:
        answer = self.prepare(ref)[ref.uid]
        assert answer.error is None, f"prepare of {ref.name} failed: {answer.error}"
        return answer

    def unprepare(self, *refs: ClaimRef) -> dict[str, str | None]:
        return self.kubelet.unprepare(list(refs))


def pod(name: str, *, pod_security: dict[str, Any] | None = None,
        containers: Sequence[tuple[str, dict[str, Any] | None]] = (("main", None),),
        **spec: Any) -> dict[str, Any]:
    """A Pod object: its pod-level securityContext, containers as (name, securityContext), other spec fields."""
    body: dict[str, Any] = {**spec, "containers": [
        {"name": n, "image": "cuda", **({"securityContext": sc} if sc is not None else {})} for n, sc in containers]}
    if pod_security is not None:
        body["securityContext"] = pod_security
    return {"metadata": {"name": name, "uid": str(uuid.uuid4())}, "spec": body}


# A pod-level securityContext that runs as a non-root user and group, and a container's that cannot become root.
NON_ROOT = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000}
NO_ESCALATION = {"allowPrivilegeEscalation": False}


def gpu_config(**sharing: Any) -> dict[str, Any]:
    """An opaque GpuConfig entry as it appears in an allocation (source FromClaim, all requests)."""
    params: dict[str, Any] = {"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig"}
    if sharing:
        params["sharing"] = sharing
    return {"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": params}}
