"""Entry point: ``python -m driver {run,demo,inspect,check-node,mps-host}``."""

from __future__ import annotations

import argparse
import importlib.resources
import os
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from driver.cliparser import USAGE_ERROR, CliParser
from driver.config import add_settings_arguments, settings_from_args, settings_problems
from driver.kubeletplugin.logfmt import configure_logging
from driver.mpshostcli import add_host_arguments, main_host


def _parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="python -m driver", description="Tessera: a Kubernetes DRA kubelet driver for NVIDIA GPUs")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the kubelet plugin on this node")
    add_settings_arguments(run)
    inspect = sub.add_parser("inspect", help="show what is prepared on this node (claims, devices, CDI, MPS)")
    add_settings_arguments(inspect)
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    # Listed for --help only: main() hands `demo ...` to driver.demo, whose parser lists the layouts.
    sub.add_parser("demo", help="SIMULATION: run a simulated node end to end, no cluster or GPU needed "
                                "(python -m driver demo --help)", add_help=False)
    check = sub.add_parser("check-node", help="check that this node can serve GPU claims: a table, exit status 1 on "
                                              "any failure (docs/operations.md, 'Checking a new node')")
    add_settings_arguments(check)
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.add_argument("--mps-device", default=None, help="GPU or MIG UUID for the MPS checks (default: chosen)")
    check.add_argument("--verbose", action="store_true", help="log what the checks do to stderr")
    host = sub.add_parser("mps-host", help="run the MPS host: owns the node's MPS daemons so they outlive the plugin")
    add_host_arguments(host)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Everything the driver creates (state dir, sockets, lock, checkpoint) is root's alone unless
    # created with an explicit mode: CDI specs (0644, runtimes read them) and the MPS pipe dir
    # (0755, client UIDs traverse it) set theirs; MPS daemons are started with their own umask.
    os.umask(0o077)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        if not _standins_installed():
            print("python -m driver demo: the stand-in NVIDIA tools (driver/simulation/bin/) are not installed here; "
                  "the production image leaves them out. Run the demo from a source checkout: bash scripts/demo.sh",
                  file=sys.stderr)
            return USAGE_ERROR
        from driver.demo import main as demo_main

        return demo_main(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "mps-host":
        return main_host(args)
    prog = f"python -m driver {args.command}"
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        for line in settings_problems(exc, args):
            print(f"{prog}: {line}", file=sys.stderr)
        return USAGE_ERROR
    if args.command == "inspect":
        from driver.inspect_node import inspect_status

        status, output = inspect_status(settings, args.json)
        print(output)
        return status
    if args.command == "check-node":
        from driver.checknode import run_check_node

        configure_logging("debug" if args.verbose else "critical", "text")
        status, output = run_check_node(settings, args.json, args.mps_device)
        print(output)
        return status
    configure_logging(settings.log_level, settings.log_format)
    from driver.app import StartupError, run

    try:
        return run(settings)
    except StartupError as exc:
        print(f"tessera: {exc}", file=sys.stderr)
        return 1


def _standins_installed() -> bool:
    # The production image leaves the stand-ins out (deploy/build-venv.sh): nothing there may run a fake nvidia-smi.
    return importlib.resources.files("driver.simulation").joinpath("bin", "nvidia-smi").is_file()
