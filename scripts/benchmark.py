"""Benchmark the driver over its real socket on a simulated node, against the I/O floor of this machine.

    .venv/bin/python scripts/benchmark.py [--claims 300] [--streams 4] [--rounds 6] [--registration-runs 5]

Runs the real driver process (``python -m driver run --simulate``, 8 simulated GPUs) with the kubelet
stand-in calling its Unix socket and the API server double answering its claim GETs, and in the same
run a bare loop doing only the I/O a prepare needs (the floor):
  * the claim GET from the same API server double (one kept-alive HTTP connection, JSON decoded);
  * one CDI spec file and one checkpoint record, each written atomically (temporary file, fsync,
    rename, directory fsync), as crash safety requires;
  * per unprepare: the spec removed and the checkpoint record written again.
Tessera's figures are reported as ratios to the floor measured in the same run (the two alternate in
rounds, so a change of load during the run touches both), so runs on noisy machines compare, next to
the goals in docs/benchmarks.md:
  * sequential prepare p50 within 1.5x the floor's;
  * prepare+unprepare throughput at 4 streams at least 1.5x the sequential (1 stream) throughput;
  * prepare p99 at 4 streams at most 3x the sequential p99;
  * driver CPU per prepare+unprepare cycle under 4 ms;
  * process start -> registered with the kubelet under 0.25 s (median; a bare `python -c pass` beside it);
  * peak resident memory of the driver process under 64 MiB.
With --profile FILE, py-spy (if on PATH: `pip install py-spy`) samples the driver while it holds the GIL
during the measured cycles and writes FILE in its raw (collapsed stacks) format.
Also measured: driver CPU per cycle, MPS share prepares and consumable share prepares (SIMULATION: the
daemon is the stand-in; every consumable claim starts a daemon of its own), and the cold plan MPS share
prepare with NVIDIA's own nvidia-cuda-mps-control 550 (goal: under 30 ms p50) where
scripts/fetch-nvidia-mps.sh put it into .cache/nvidia-mps; compute modes go through the simulated NVML in the
driver's process, and the nvidia-smi runs that read or set one are counted (0).
Also: the API requests per node at idle (over --idle-seconds, and the steady rate the watches' timeouts give,
scaled to 5,000 nodes) and per prepare+unprepare cycle, and the sequential prepare latency with claim status
writes and without them (scripts/apiload.py).
Also: other tenants' plan MPS share prepares while three UID-65534 tenants flood the shared daemon's
control socket (p50/p99, goal: each under 3 s), and a prepare and the last unprepare while one holds it
silent (scripts/benchflood.py; stand-in and NVIDIA's 550/535 where fetched; --flood-prepares 0 skips).
This is not a test: it asserts nothing and is never run by CI.
"""

from __future__ import annotations

import argparse
import compileall
import http.client
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import apiload

from driver.kubeletplugin.types import ClaimRef
from scripts.benchflood import flood_rows
from tests.support.mpsdaemons import STANDIN, MpsDaemonKind, daemon_params
from tests.support.node import DRIVER, NODE, SimulatedNode, wait_until

# The test harness rescans every 0.5 s to notice changes quickly; measure with the default.
PRODUCTION_RESCAN = ("--rescan-interval", "30")
GPUS = 8


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def proc_status_mib(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@dataclass
class Run:
    """Prepare latencies and the wall time of one batch of prepare+unprepare cycles."""

    prepare: list[float] = field(default_factory=list)
    cycles: int = 0
    wall: float = 0.0

    @property
    def per_second(self) -> float:
        return self.cycles / self.wall

    def add(self, other: Run) -> None:
        self.prepare += other.prepare
        self.cycles += other.cycles
        self.wall += other.wall


def in_streams(streams: int, cycle: Callable[[int], float], per_stream: int) -> Run:
    """Run ``per_stream`` cycles in each of ``streams`` threads; ``cycle(stream)`` returns the prepare time."""
    run = Run(cycles=streams * per_stream)
    lock = threading.Lock()
    errors: list[BaseException] = []

    def work(stream: int) -> None:
        try:
            times = [cycle(stream) for _ in range(per_stream)]
        except BaseException as exc:
            errors.append(exc)
            return
        with lock:
            run.prepare.extend(times)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(streams)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    run.wall = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} stream(s) failed") from errors[0]
    return run


# ----------------------------------------------------------------------------- the floor


def _atomic_write(directory: Path, name: str, payload: bytes) -> None:
    fd, temp = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, directory / name)
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class Floor:
    """The bare I/O of prepare and unprepare, one instance per stream (own connection, own files)."""

    def __init__(self, node: SimulatedNode, refs: list[ClaimRef], directory: Path):
        self.refs = iter(refs)
        self.cdi = directory / "cdi"
        self.state = directory / "state"
        self.cdi.mkdir(parents=True)
        self.state.mkdir(parents=True)
        self.spec = json.dumps({"cdiVersion": "0.5.0", "kind": "k8s.gpu.tessera.dev/claim", "devices": [
            {"name": "x-gpu-0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}]}).encode()
        url = node.api.url.removeprefix("http://")
        host, port = url.split(":")
        self.conn = http.client.HTTPConnection(host, int(port))

    def _get(self, ref: ClaimRef) -> object:
        self.conn.request("GET", f"/apis/resource.k8s.io/v1/namespaces/{ref.namespace}/resourceclaims/{ref.name}",
                          headers={"Authorization": "Bearer fake-token", "Accept": "application/json"})
        response = self.conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"floor GET: HTTP {response.status}")
        return json.loads(body)

    def cycle(self) -> float:
        ref = next(self.refs)
        started = time.perf_counter()
        self._get(ref)
        spec_name = f"k8s.gpu.tessera.dev-claim_{ref.uid}.json"
        _atomic_write(self.cdi, spec_name, self.spec)
        _atomic_write(self.state, "checkpoint.json", json.dumps({"claim": ref.uid, "phase": "prepared"}).encode())
        prepared = time.perf_counter() - started
        (self.cdi / spec_name).unlink()
        _atomic_write(self.state, "checkpoint.json", json.dumps({"claim": ref.uid, "phase": "unprepared"}).encode())
        return prepared


class Tessera:
    """Prepare+unprepare cycles through the driver's socket, one instance per stream (own GPU, own claims)."""

    def __init__(self, node: SimulatedNode, refs: list[ClaimRef]):
        self.node = node
        self.refs = iter(refs)

    def cycle(self) -> float:
        ref = next(self.refs)
        started = time.perf_counter()
        # The kubelet stand-in directly: SimulatedNode.prepare first scans every claim in the API
        # server double for share IDs, which with the ~1,200 claims of a run added ~25 ms of harness
        # time to each timed prepare (none of these claims has a share ID to check).
        answer = self.node.kubelet.prepare([ref])[ref.uid]
        prepared = time.perf_counter() - started
        if answer.error:
            raise RuntimeError(f"prepare failed: {answer.error}")
        error = self.node.unprepare(ref)[ref.uid]
        if error is not None:
            raise RuntimeError(f"unprepare failed: {error}")
        return prepared


@dataclass
class Results:
    floor_seq: Run = field(default_factory=Run)
    floor_par: Run = field(default_factory=Run)
    seq: Run = field(default_factory=Run)
    par: Run = field(default_factory=Run)
    driver_cpu_s: float = 0.0


def profiled(pid: int, output: Path | None) -> subprocess.Popen[bytes] | None:
    """py-spy recording ``pid`` while it holds the GIL (CPU, not waits) into ``output``, or None without one."""
    if output is None:
        return None
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("--profile needs py-spy on PATH (.venv/bin/pip install py-spy)")
    return subprocess.Popen([spy, "record", "--gil", "--rate", "500", "--format", "raw", "-o", str(output),
                             "--pid", str(pid)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(node: SimulatedNode, claims: int, streams: int, rounds: int, scratch: Path) -> Results:
    """Floor and Tessera, sequential and in ``streams`` streams, interleaved in ``rounds`` so that a change
    of load on the machine during the run touches both alike."""
    per_round = claims // rounds
    per_stream = per_round // streams

    def claim_set(prefix: str, gpu: int, count: int) -> list[ClaimRef]:
        return [node.claim(f"{prefix}-{i}", [("gpu", f"gpu-{gpu}")]) for i in range(count)]

    # One GPU per stream: a whole GPU is prepared for one claim at a time.
    floor_seq = Floor(node, claim_set("fs", 0, per_round * rounds + 10), scratch / "seq")
    floor_par = [Floor(node, claim_set(f"fp{s}", s, per_stream * rounds), scratch / f"s{s}") for s in range(streams)]
    seq = Tessera(node, claim_set("ts", 0, per_round * rounds + 10))
    par = [Tessera(node, claim_set(f"tp{s}", s, per_stream * rounds)) for s in range(streams)]
    for _ in range(10):  # warm-up: connections, the page cache of the directories, the driver's first calls
        floor_seq.cycle()
        seq.cycle()
    assert node.proc is not None
    results = Results()
    for _ in range(rounds):
        results.floor_seq.add(in_streams(1, lambda _s: floor_seq.cycle(), per_round))
        cpu = cpu_seconds(node.proc.pid)
        results.seq.add(in_streams(1, lambda _s: seq.cycle(), per_round))
        results.driver_cpu_s += cpu_seconds(node.proc.pid) - cpu
        results.floor_par.add(in_streams(streams, lambda s: floor_par[s].cycle(), per_stream))
        cpu = cpu_seconds(node.proc.pid)
        results.par.add(in_streams(streams, lambda s: par[s].cycle(), per_stream))
        results.driver_cpu_s += cpu_seconds(node.proc.pid) - cpu
    return results


def time_to_registration(runs: int, python: str) -> tuple[list[float], list[float]]:
    """Wall time from Popen to registration, and the driver's CPU time by then (what load skews less)."""
    times, cpu = [], []
    for _ in range(runs):
        node = SimulatedNode("dgx-h100", python=python)
        try:
            started = time.perf_counter()
            node.start(register=False)
            node.kubelet.wait_for_plugin(DRIVER, timeout=60)
            times.append(time.perf_counter() - started)
            assert node.proc is not None
            cpu.append(cpu_seconds(node.proc.pid))
        finally:
            node.close()
    return times, cpu


def compile_bytecode() -> None:
    """Byte-compile the driver as the image does (deploy/build-venv.sh): with PYTHONDONTWRITEBYTECODE (set on
    CI and in the image) every start would otherwise compile the driver's modules again, which no node does."""
    root = Path(__file__).resolve().parent.parent
    for package in ("driver", "cdi"):
        compileall.compile_dir(root / package, quiet=1)


def interpreter_start(runs: int, python: str) -> float:
    """The floor of any start-up: a bare interpreter with site-packages, doing nothing."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([python, "-c", "pass"], check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def mps_share_latency(repeats: int, python: str, daemon: MpsDaemonKind = STANDIN,
                      cycles: int = 5) -> tuple[list[float], list[float], int]:
    """Plan MPS share prepares on a GPU of 8 shares: the cold one (starts the GPU's daemon, reads the compute
    mode and sets EXCLUSIVE_PROCESS through NVML) and the following ones (daemon running). ``cycles`` times
    per driver process: unpreparing every share stops the daemon and restores the mode, so the next first
    prepare is cold again. ``daemon``: the stand-in (a Python script) or NVIDIA's nvidia-cuda-mps-control,
    installed in the simulated driver root (it starts and answers without a GPU). Also returns the
    nvidia-smi runs that read or set a compute mode during all of it (0 since compute modes go through NVML).
    """
    plans = {"plans": {"mps": {"gpus": [{"match": {"all": True}, "mps": {"shares": 8}}]}}}
    first: list[float] = []
    following: list[float] = []
    smi_compute_mode_runs = 0
    for _ in range(repeats):
        node = SimulatedNode("l4", plans=plans, plan="mps", python=python)
        try:
            daemon.install(node.sim_host.driver_root / "usr" / "bin")
            node.start(*PRODUCTION_RESCAN)
            node.wait_for_devices([f"gpu-0-mps-{k}" for k in range(8)])
            probe = node.state_dir / "mps" / "probe-multi-user"  # the throwaway daemon of the multi-user probe
            wait_until(_gone(probe), timeout=60, what="the MPS multi-user probe to finish")
            for cycle in range(cycles + 1):
                refs = [node.claim(f"share-{cycle}-{k}", [("share", f"gpu-0-mps-{k}")]) for k in range(8)]
                if cycle == 0:  # warm-up: the driver's first use of each code path
                    _time_prepares(node, refs, [], [])
                else:
                    _time_prepares(node, refs, first, following)
            smi_compute_mode_runs += sum(1 for c in node.nvidia_smi_calls()
                                         if "-c" in c or any(a.startswith("--query-gpu") for a in c))
        finally:
            node.close()
    return first, following, smi_compute_mode_runs


def _gone(path: Path) -> Callable[[], bool]:
    return lambda: not path.exists()


def nvidia_daemon() -> MpsDaemonKind | None:
    """NVIDIA's 550 ``nvidia-cuda-mps-control`` if scripts/fetch-nvidia-mps.sh put it into .cache/nvidia-mps."""
    for param in daemon_params():
        kind = param.values[0] if hasattr(param, "values") else None
        if isinstance(kind, MpsDaemonKind) and kind.name == "nvidia-550" and kind.binary is not None:
            return kind
    return None


def _time_prepares(node: SimulatedNode, refs: list[ClaimRef], first: list[float], following: list[float]) -> None:
    """Prepare ``refs`` one after another, timing the first apart from the rest, then unprepare them."""
    for k, ref in enumerate(refs):
        started = time.perf_counter()
        node.prepare_ok(ref)
        (first if k == 0 else following).append(time.perf_counter() - started)
    node.unprepare(*refs)


def consumable_share_latency(repeats: int, python: str, claims: int = 4) -> tuple[list[float], list[float]]:
    """Prepare of consumable shares of one GPU: the first claim, then the GPU's following claims.

    Each consumable claim gets an MPS daemon of its own (docs/sharing.md, C.), so every prepare
    starts one (SIMULATION: the stand-in) and sets and reads back its limits; there is no "daemon
    already running" case to measure. The plan MPS share rows are that case.
    """
    plans = {"plans": {"c": {"gpus": [{"match": {"minor": 0}, "consumable": {}}]}}}
    first: list[float] = []
    following: list[float] = []
    for _ in range(repeats):
        node = SimulatedNode("l4", plans=plans, plan="c", python=python)
        try:
            node.start(*PRODUCTION_RESCAN)
            node.wait_for_devices(["gpu-0-shared"])
            refs = []
            for k in range(claims):  # as the scheduler allocates them: a share ID and what each consumed
                ref = ClaimRef(namespace="default", name=f"share-{k}", uid=str(uuid.uuid4()))
                node.api.put_claim({
                    "metadata": {"name": ref.name, "namespace": "default", "uid": ref.uid},
                    "spec": {"devices": {"requests": []}},
                    "status": {"allocation": {"devices": {"config": [], "results": [{
                        "request": "share", "driver": DRIVER, "pool": NODE, "device": "gpu-0-shared",
                        "shareID": str(uuid.uuid4()),
                        "consumedCapacity": {"memory": "2Gi", "multiprocessors": "8"}}]}}}})
                refs.append(ref)
            _time_prepares(node, refs, first, following)
        finally:
            node.close()
    return first, following


# ----------------------------------------------------------------------------- report

# Test-side packages that a runtime package imports whenever they are installed, so a driver run from the
# development environment carries them and the image's does not: `kubernetes.dynamic` (which
# `import kubernetes` loads) imports kubernetes-validate, and with it jsonschema, referencing and rpds.
TEST_ONLY_IMPORTED = ("kubernetes_validate",)


def driver_environment(python: str) -> str:
    """Which interpreter runs the driver, and whether its environment differs from the image's."""
    found = subprocess.run(
        [python, "-c", "import importlib.util as u, sys; print(*[m for m in sys.argv[1:] if u.find_spec(m)])",
         *TEST_ONLY_IMPORTED], check=True, capture_output=True, text=True).stdout.split()
    if not found:
        return f"driver run by {python}: no test-only package it would import"
    return (f"driver run by {python}, which also imports the test-only {', '.join(found)} (~3 MiB, ~35 ms on the "
            "initialisation thread); for the image's figures build its environment with "
            "`sh deploy/build-venv.sh DIR` and pass --driver-python DIR/bin/python")



def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown CPU")
    return (f"{os.cpu_count()} CPUs ({model}), {platform.machine()}, Python {platform.python_version()}, "
            f"{platform.platform()}; load average {os.getloadavg()[0]:.1f}")


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--claims", type=int, default=300, help="prepare+unprepare cycles per run (default 300)")
    parser.add_argument("--streams", type=int, default=4, help="concurrent kubelet streams (default 4)")
    parser.add_argument("--rounds", type=int, default=6,
                        help="floor and Tessera runs alternate in this many rounds (default 6)")
    parser.add_argument("--registration-runs", type=int, default=5)
    parser.add_argument("--mps-runs", type=int, default=3, help="0 skips the MPS share rows")
    parser.add_argument("--idle-seconds", type=float, default=60.0,
                        help="window for counting API requests at idle; 0 skips the API rows (default 60)")
    parser.add_argument("--status-claims", type=int, default=200,
                        help="prepares timed with and without claim status writes; 0 skips them (default 200)")
    parser.add_argument("--flood-prepares", type=int, default=24,
                        help="other tenants' prepares under a flooded control socket, per daemon (0 skips)")
    parser.add_argument("--profile", type=Path, default=None, metavar="FILE",
                        help="py-spy's raw profile of the driver during the measured cycles (needs py-spy)")
    parser.add_argument("--driver-python", default=sys.executable, metavar="PYTHON",
                        help="the interpreter the driver runs with (default: this one); give the image's "
                             "environment, built by deploy/build-venv.sh, for the image's memory and start figures")
    args = parser.parse_args()
    if not 1 <= args.streams < GPUS:
        parser.error(f"--streams must be between 1 and {GPUS - 1} (one simulated GPU per stream, one for warm-up)")

    load_before = os.getloadavg()[0]
    compile_bytecode()
    python = args.driver_python
    bare_start = interpreter_start(args.registration_runs, python)
    registration_times, registration_cpu = time_to_registration(args.registration_runs, python)
    registration = statistics.median(registration_times)
    node = SimulatedNode("dgx-h100", python=python)
    try:
        node.start(*PRODUCTION_RESCAN)
        node.wait_for_devices([f"gpu-{i}" for i in range(GPUS)])
        assert node.proc is not None
        spy = profiled(node.proc.pid, args.profile)
        with tempfile.TemporaryDirectory(dir=node.work) as scratch:  # the floor's files, on the driver's disk
            results = measure(node, args.claims, args.streams, args.rounds, Path(scratch))
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file when interrupted
            spy.wait(timeout=60)
        peak_rss = proc_status_mib(node.proc.pid, "VmHWM")
    finally:
        node.close()
    mps_first, mps_following, smi_runs = mps_share_latency(args.mps_runs, python) if args.mps_runs else ([], [], 0)
    nvidia = nvidia_daemon()
    nv_first, nv_following, nv_smi_runs = (mps_share_latency(args.mps_runs, python, nvidia)
                                           if args.mps_runs and nvidia else ([], [], 0))
    shares_first, shares_following = (consumable_share_latency(args.mps_runs, python) if args.mps_runs
                                      else ([], []))
    load = apiload.api_load(python, args.idle_seconds, PRODUCTION_RESCAN) if args.idle_seconds else None
    writes_on, writes_off = (apiload.alternating(python, args.status_claims, PRODUCTION_RESCAN)
                             if args.status_claims else (None, None))

    floor_seq, floor_par, seq, par = results.floor_seq, results.floor_par, results.seq, results.par
    cpu_per_cycle = results.driver_cpu_s / (seq.cycles + par.cycles)
    ms = 1000.0
    n = args.streams
    p50, p99 = percentile(seq.prepare, 50), percentile(seq.prepare, 99)
    f50, f99 = percentile(floor_seq.prepare, 50), percentile(floor_seq.prepare, 99)
    par99, fpar99 = percentile(par.prepare, 99), percentile(floor_par.prepare, 99)
    scaling = par.per_second / seq.per_second
    print(f"machine: {machine()} at the end, {load_before:.1f} at the start (a busy machine skews the figures)")
    print(driver_environment(python))
    print(f"{seq.cycles} sequential and {par.cycles} concurrent cycles ({n} streams) each, 8 simulated GPUs, "
          f"floor = bare loop of the same I/O, interleaved with Tessera in {args.rounds} rounds; the driver's "
          "bytecode compiled first, as in the image\n")
    rows = [
        ("sequential prepare p50", f"{p50 * ms:.2f} ms", f"{f50 * ms:.2f} ms", f"{p50 / f50:.2f}x",
         f"<= 1.5x floor: {verdict(p50 / f50 <= 1.5)}"),
        ("sequential prepare p99", f"{p99 * ms:.2f} ms", f"{f99 * ms:.2f} ms", f"{p99 / f99:.2f}x", ""),
        ("prepare+unprepare cycles/s, 1 stream", f"{seq.per_second:.0f}", f"{floor_seq.per_second:.0f}",
         f"{seq.per_second / floor_seq.per_second:.2f}x", ""),
        (f"prepare+unprepare cycles/s, {n} streams", f"{par.per_second:.0f}", f"{floor_par.per_second:.0f}",
         f"{par.per_second / floor_par.per_second:.2f}x",
         f"{n} streams / 1 stream = {scaling:.2f}x (floor {floor_par.per_second / floor_seq.per_second:.2f}x), "
         f">= 1.5x: {verdict(scaling >= 1.5)}"),
        (f"prepare p99 at {n} streams", f"{par99 * ms:.2f} ms", f"{fpar99 * ms:.2f} ms", f"{par99 / fpar99:.2f}x",
         f"/ sequential p99 = {par99 / p99:.2f}x, <= 3x: {verdict(par99 / p99 <= 3)}"),
        ("driver CPU per cycle", f"{cpu_per_cycle * ms:.2f} ms", "", "", f"< 4 ms: {verdict(cpu_per_cycle < 0.004)}"),
        (f"process start -> registered (median {args.registration_runs})", f"{registration * ms:.0f} ms",
         f"{bare_start * ms:.0f} ms", f"{registration / bare_start:.1f}x",
         f"< 250 ms: {verdict(registration < 0.25)} (floor: python -c pass)"),
        ("driver CPU from start to registered", f"{statistics.median(registration_cpu) * ms:.0f} ms", "", "",
         "the rest of the start runs after registration"),
        ("peak RSS of the driver process", f"{peak_rss:.1f} MiB", "", "", f"< 64 MiB: {verdict(peak_rss < 64)}"),
    ]
    if mps_first:
        rows += [
            (f"MPS share prepare, cold (p50 of {len(mps_first)})", f"{percentile(mps_first, 50) * ms:.1f} ms",
             "", "", "starts the SIMULATION daemon stand-in (a Python script); compute mode through NVML"),
            ("MPS share prepare, following (median)", f"{statistics.median(mps_following) * ms:.2f} ms", "", "",
             "daemon already running"),
        ]
    if nv_first:
        nv50 = percentile(nv_first, 50)
        rows += [
            (f"MPS share prepare, cold, NVIDIA's daemon (p50 of {len(nv_first)})", f"{nv50 * ms:.1f} ms", "", "",
             f"< 30 ms: {verdict(nv50 < 0.030)} (p90 {percentile(nv_first, 90) * ms:.1f} ms)"),
            ("MPS share prepare, following, NVIDIA's daemon", f"{statistics.median(nv_following) * ms:.2f} ms", "",
             "", "daemon already running"),
        ]
    elif args.mps_runs:
        rows.append(("MPS share prepare, NVIDIA's daemon", "skipped", "", "",
                     "no build in .cache/nvidia-mps: run scripts/fetch-nvidia-mps.sh"))
    if mps_first or nv_first:
        rows.append(("nvidia-smi runs for compute modes", str(smi_runs + nv_smi_runs), "", "",
                     "in all MPS share prepares and unprepares above (NVML in the driver's process instead)"))
    if shares_first:
        rows += [
            (f"consumable share prepare, first (median {len(shares_first)})",
             f"{statistics.median(shares_first) * ms:.1f} ms", "", "", "starts the claim's own daemon (stand-in)"),
            ("consumable share prepare, following (median)", f"{statistics.median(shares_following) * ms:.1f} ms",
             "", "", "also starts one: a daemon per claim (a < 10 ms goal would need a shared daemon)"),
        ]
    if load is not None:
        rows += apiload.rows(load, writes_on, writes_off)
    rows += flood_rows(args.flood_prepares, python, PRODUCTION_RESCAN)
    print_table(rows)


def print_table(rows: list[tuple[str, str, str, str, str]]) -> None:
    """Columns as wide as their widest cell, so a long measurement name does not push its row out of line."""
    header = ("measurement", "Tessera", "floor", "ratio", "goal")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]

    def line(row: tuple[str, str, str, str, str]) -> str:
        name, value, floor, ratio, goal = row
        return (f"{name:<{widths[0]}} {value:>{widths[1]}} {floor:>{widths[2]}} {ratio:>{widths[3]}}  {goal}").rstrip()

    print(line(header))
    print("-" * (sum(widths) + 3 + 2 + max(len(row[4]) for row in rows)))
    for row in rows:
        print(line(row))


if __name__ == "__main__":
    main()
