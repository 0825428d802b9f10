"""Entry point: ``python -m driver {run,demo,inspect}``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from driver.config import add_settings_arguments, settings_from_args
from driver.kubeletplugin.logfmt import configure_logging


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m driver",
                                     description="Tessera: a Kubernetes DRA kubelet driver for NVIDIA GPUs")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the kubelet plugin on this node")
    add_settings_arguments(run)
    inspect = sub.add_parser("inspect", help="show what is prepared on this node (claims, devices, CDI, MPS)")
    add_settings_arguments(inspect)
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    demo = sub.add_parser("demo", help="SIMULATION: run a simulated node end to end, no cluster or GPU needed")
    demo.add_argument("--layout", default="demo", help="simulated node layout (default: demo)")
    demo.add_argument("--workdir", default=None, help="keep the demo's files here instead of a temporary dir")
    demo.add_argument("--example", action="append", default=None,
                      help="example file(s) from examples/resourceclaims to prepare (default: a representative set)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "demo":
        from driver.demo import run_demo

        return run_demo(layout=args.layout, workdir=args.workdir, examples=args.example)
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    if args.command == "inspect":
        from driver.inspect_node import inspect

        print(inspect(settings, args.json))
        return 0
    configure_logging(settings.log_level, settings.log_format)
    from driver.app import StartupError, run

    try:
        return run(settings)
    except StartupError as exc:
        print(f"tessera: {exc}", file=sys.stderr)
        return 1
