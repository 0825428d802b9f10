"""SIMULATION: ``python -m driver.simulation.apiserverrun``: the Kubernetes API server double as a process.

For trying the driver by hand against a cluster that is not there: it serves until interrupted.
"""

from __future__ import annotations

import argparse
import threading

from driver.simulation.apiserver import FakeApiServer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Kubernetes API server double (test support, in memory)")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--minor-version", type=int, default=36, help="Kubernetes 1.<minor> to pretend to be")
    parser.add_argument("--node", action="append", default=[], help="create a Node with this name (repeatable)")
    args = parser.parse_args(argv)
    server = FakeApiServer(minor_version=args.minor_version)
    url = server.start(port=args.port)
    for node in args.node:
        server.add_node(node)
    print(f"fake Kubernetes API server (test double) listening on {url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
