"""Benchmark the driver over its real socket on a simulated node; prints a table of numbers.

    .venv/bin/python scripts/benchmark.py [--cycles 200] [--claims 100] [--concurrency 8]

Measures, with the real driver process (``python -m driver run --simulate``) and the kubelet
stand-in calling its Unix socket:
  * time from process start to registration with the kubelet;
  * NodePrepareResources + NodeUnprepareResources latency for a one-GPU claim (p50/p99);
  * total time for N claims prepared and unprepared at concurrency C;
  * prepare latency of an MPS share: the first on a GPU (starts the daemon) and the following ones
    (SIMULATION: the daemon is the stand-in executable, not NVIDIA's);
  * the driver's resident memory afterwards.
This is not a test: it asserts nothing and is never run by CI.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.node import DRIVER, SimulatedNode

# The test harness rescans every 0.5 s to notice changes quickly; measure with the default.
PRODUCTION_RESCAN = ("--rescan-interval", "30")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def time_to_registration(runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        node = SimulatedNode("dgx-h100")
        try:
            started = time.perf_counter()
            node.start(register=False)
            node.kubelet.wait_for_plugin(DRIVER, timeout=60)
            times.append(time.perf_counter() - started)
        finally:
            node.close()
    return times


def one_gpu_cycles(node: SimulatedNode, cycles: int) -> list[float]:
    refs = [node.claim(f"lat-{i}", [("gpu", "gpu-0")]) for i in range(cycles)]
    warmup = node.claim("warmup", [("gpu", "gpu-1")])
    node.prepare_ok(warmup)
    node.unprepare(warmup)
    latencies = []
    for ref in refs:
        started = time.perf_counter()
        node.prepare_ok(ref)
        error = node.unprepare(ref)[ref.uid]
        latencies.append(time.perf_counter() - started)
        assert error is None, error
    return latencies


def concurrent_claims(node: SimulatedNode, claims: int, concurrency: int) -> float:
    # One GPU per worker: a whole GPU can only be prepared for one claim at a time.
    per_worker = [[node.claim(f"par-{w}-{i}", [("gpu", f"gpu-{w}")]) for i in range(claims // concurrency)]
                  for w in range(concurrency)]
    for w in range(claims % concurrency):
        per_worker[w].append(node.claim(f"par-{w}-extra", [("gpu", f"gpu-{w}")]))
    errors: list[str] = []

    def work(refs: list) -> None:  # type: ignore[type-arg]
        for ref in refs:
            answer = node.prepare(ref)[ref.uid]
            if answer.error:
                errors.append(answer.error)
            if node.unprepare(ref)[ref.uid] is not None:
                errors.append("unprepare failed")

    threads = [threading.Thread(target=work, args=(refs,)) for refs in per_worker]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    if errors:
        raise RuntimeError(f"{len(errors)} errors, first: {errors[0]}")
    return elapsed


def mps_share_latency(repeats: int) -> tuple[list[float], list[float]]:
    plans = {"plans": {"mps": {"gpus": [{"match": {"all": True}, "mps": {"shares": 8}}]}}}
    first, following = [], []
    for _ in range(repeats):
        node = SimulatedNode("l4", plans=plans, plan="mps")
        try:
            node.start(*PRODUCTION_RESCAN)
            node.wait_for_devices([f"gpu-0-mps-{k}" for k in range(8)])
            refs = [node.claim(f"share-{k}", [("share", f"gpu-0-mps-{k}")]) for k in range(8)]
            for k, ref in enumerate(refs):
                started = time.perf_counter()
                node.prepare_ok(ref)
                (first if k == 0 else following).append(time.perf_counter() - started)
            node.unprepare(*refs)
        finally:
            node.close()
    return first, following


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--claims", type=int, default=100)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--registration-runs", type=int, default=5)
    parser.add_argument("--mps-runs", type=int, default=5)
    args = parser.parse_args()

    registration = time_to_registration(args.registration_runs)
    node = SimulatedNode("dgx-h100")
    try:
        node.start(*PRODUCTION_RESCAN)
        node.wait_for_devices([f"gpu-{i}" for i in range(8)])
        latencies = one_gpu_cycles(node, args.cycles)
        total = concurrent_claims(node, args.claims, args.concurrency)
        assert node.proc is not None
        rss = rss_mib(node.proc.pid)
    finally:
        node.close()
    mps_first, mps_following = mps_share_latency(args.mps_runs)

    ms = 1000.0
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"{platform.platform()}")
    print(f"{'measurement':<62} {'value':>14}")
    print(f"{'-' * 62} {'-' * 14}")
    rows = [
        (f"process start -> registered (median of {len(registration)})", f"{statistics.median(registration):.2f} s"),
        (f"prepare+unprepare, one GPU, p50 ({args.cycles} cycles)", f"{percentile(latencies, 50) * ms:.2f} ms"),
        (f"prepare+unprepare, one GPU, p99 ({args.cycles} cycles)", f"{percentile(latencies, 99) * ms:.2f} ms"),
        (f"{args.claims} claims prepare+unprepare at concurrency {args.concurrency}", f"{total:.2f} s"),
        (f"MPS share prepare, first on the GPU (daemon start), median of {len(mps_first)}",
         f"{statistics.median(mps_first) * ms:.1f} ms"),
        ("MPS share prepare, following shares (daemon running), median",
         f"{statistics.median(mps_following) * ms:.2f} ms"),
        ("driver resident memory after the runs", f"{rss:.1f} MiB"),
    ]
    for name, value in rows:
        print(f"{name:<62} {value:>14}")


if __name__ == "__main__":
    main()
