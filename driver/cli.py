"""Entry point: ``python -m driver {run,demo,inspect,check-node,check-plan,convert-plan,mps-host}``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from driver.cliparser import USAGE_ERROR, CliParser
from driver.commands.mpshost import add_host_arguments, main_host
from driver.config import (
    CHECK_NODE_FIELDS,
    INSPECT_FIELDS,
    SettingsError,
    add_settings_arguments,
    settings_from_args,
    settings_problems,
)
from driver.kubeletplugin.logfmt import configure_logging

INSPECT_DESCRIPTION = ("Show what is prepared on this node: claims, their devices and CDI specs, MPS daemons, "
                       "compute modes, the sharing plan in use, device health. Read-only and lock-free: safe next to "
                       "a running driver (kubectl exec into the plugin pod). Exit status 1 if it found problems.")
CHECK_NODE_DESCRIPTION = ("Check that this node can serve GPU claims: one line per check (NVML and every GPU, device "
                          "nodes, the toolkit CDI spec, libcuda, nvidia-smi, compute modes, MPS end to end with a "
                          "throwaway daemon). Exit status 1 on any failure. Changes nothing on the GPUs. "
                          "docs/operations.md, 'Checking a new node'.")

_COMMANDS = ("run", "inspect", "demo", "check-node", "check-plan", "convert-plan", "mps-host")

CHECK_PLAN_DESCRIPTION = ("Check a sharing plans file without a cluster: the same validation and one-line errors as "
                          "the driver at start. With --simulate LAYOUT, resolve the plan a node would use against "
                          "that simulated node and print what each GPU would publish. Exit status 0 valid, 1 the plan "
                          "has problems, 2 a usage error.")


def _parser(command: str | None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser, and each subcommand's (whose name a usage error must carry).

    ``command``: the subcommand asked for, if known. check-plan's flags are defined by its own module,
    which imports the sharing-plan code: only for check-plan itself or the top-level help, so that
    ``run`` does not pay for it before registering.
    """
    parser = CliParser(prog="python -m driver", description="Tessera: a Kubernetes DRA kubelet driver for NVIDIA GPUs")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the kubelet plugin on this node")
    add_settings_arguments(run)
    inspect = sub.add_parser("inspect", help="show what is prepared on this node (claims, devices, CDI, MPS)",
                             description=INSPECT_DESCRIPTION)
    add_settings_arguments(inspect, INSPECT_FIELDS)
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    # Listed for --help only: main() hands `demo ...` to driver.commands.demo.scenario, whose parser lists the layouts.
    sub.add_parser("demo", help="SIMULATION: run a simulated node end to end, no cluster or GPU needed "
                                "(python -m driver demo --help)", add_help=False)
    check = sub.add_parser("check-node", help="check that this node can serve GPU claims: a table, exit status 1 on "
                                              "any failure (docs/operations.md, 'Checking a new node')",
                           description=CHECK_NODE_DESCRIPTION)
    add_settings_arguments(check, CHECK_NODE_FIELDS)
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.add_argument("--mps-device", default=None, metavar="UUID",
                       help="GPU or MIG UUID of this node for the MPS checks (default: the first whole GPU in "
                            "compute mode DEFAULT, else the first MIG device)")
    check.add_argument("--verbose", action="store_true", help="log what the checks do to stderr")
    plan = sub.add_parser("check-plan", description=CHECK_PLAN_DESCRIPTION,
                          help="check a sharing plans file offline; with --simulate, show what each GPU of a simulated "
                               "node would publish")
    if command in ("check-plan", None):
        from driver.commands.checkplan import add_arguments as add_plan_arguments

        add_plan_arguments(plan)
    convert = sub.add_parser("convert-plan", help="print an NVIDIA device plugin sharing config (or the GPU Operator's "
                                                  "ConfigMap of them) as a sharing plans file (docs/migration.md)")
    if command in ("convert-plan", None):
        from driver.commands.convertplan import DESCRIPTION as CONVERT_DESCRIPTION
        from driver.commands.convertplan import add_arguments as add_convert_arguments

        convert.description = CONVERT_DESCRIPTION
        add_convert_arguments(convert)
    host = sub.add_parser("mps-host", help="run the MPS host: owns the node's MPS daemons so they outlive the plugin")
    add_host_arguments(host)
    return parser, {"run": run, "inspect": inspect, "check-node": check, "check-plan": plan,
                    "convert-plan": convert, "mps-host": host}


def _parse(argv: list[str]) -> argparse.Namespace:
    """The command line parsed. In a function of its own so that the parsers (all subcommands, their
    help) are garbage once it returns, rather than held for the life of ``run``."""
    parser, subcommands = _parser(argv[0] if argv[:1] and argv[0] in _COMMANDS else None)
    if argv[:1] and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        # argparse would only say that a command is missing, never naming the flag it did not know.
        parser.error(f"unrecognized argument {argv[0]!r} before the command: give a command first "
                     f"({', '.join(_COMMANDS)}), then its flags")
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # argparse would blame the top-level parser, whose --help does not list the subcommand's flags.
        subcommands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


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
        from driver.commands.demo.scenario import main as demo_main

        return demo_main(argv[1:])
    args = _parse(argv)
    if args.command == "mps-host":
        return main_host(args)
    if args.command == "check-plan":
        from driver.commands.checkplan import main as main_plan

        return main_plan(args)
    if args.command == "convert-plan":
        from driver.commands.convertplan import main as main_convert

        return main_convert(args)
    prog = f"python -m driver {args.command}"
    try:
        settings = settings_from_args(args)
    except SettingsError as exc:
        for line in settings_problems(exc, args):
            print(f"{prog}: {line}", file=sys.stderr)
        return USAGE_ERROR
    layout_problem = _simulated_layout_problem(settings.simulate)
    if layout_problem:
        # Checked here, not when discovery runs: the real host must never be examined in place of a layout.
        where = (f"--simulate {settings.simulate!r}" if args.simulate is not None
                 else f"TESSERA_SIMULATE={settings.simulate!r} (environment variable for --simulate)")
        print(f"{prog}: {where}: {layout_problem}", file=sys.stderr)
        return USAGE_ERROR
    if args.command == "run" and not settings.node_name:
        # A usage error like any other missing setting: status 2 and the command's prefix (docs/configuration.md).
        print(f"{prog}: the node name is required: set --node-name or NODE_NAME (downward API spec.nodeName)",
              file=sys.stderr)
        return USAGE_ERROR
    if args.command == "inspect":
        from driver.commands.inspect import inspect_status

        # Its report carries every problem it finds; a log line on stderr as well would only be noise
        # (with --json, text that no parser of the output sees).
        configure_logging("critical", "text")
        status, output = inspect_status(settings, args.json)
        print(output)
        return status
    if args.command == "check-node":
        from driver.commands.checknode.checks import UnknownMpsDevice, run_check_node
        from driver.reaper import Interrupted, Reaper

        configure_logging("debug" if args.verbose else "critical", "text")
        try:
            with Reaper() as reaper:
                status, output = run_check_node(settings, args.json, args.mps_device, reaper.remove_on_exit)
        except UnknownMpsDevice as exc:
            print(f"{prog}: {exc} ({prog} --help lists the flags)", file=sys.stderr)
            return USAGE_ERROR
        except Interrupted as stop:
            # One line, no traceback: the reaper has stopped the throwaway daemon and removed its files.
            print(f"{prog}: stopped by {stop}; everything it started is stopped and its files removed",
                  file=sys.stderr)
            return stop.status
        print(output)
        return status
    configure_logging(settings.log_level, settings.log_format)
    from driver.commands.run.startup import run

    return run(settings)


def _simulated_layout_problem(layout: str | None) -> str | None:
    """Why ``--simulate`` (or TESSERA_SIMULATE) names no usable layout; None when unset or usable."""
    if not layout:
        return None
    from driver.simulation.discovery import load_layout
    from driver.simulation.gpus import SimulationError

    try:
        load_layout(layout)
    except SimulationError as exc:
        return str(exc)
    return None


def _standins_installed() -> bool:
    # The production image leaves the stand-ins out (deploy/build-venv.sh): nothing there may run a fake nvidia-smi.
    # A path beside this file rather than importlib.resources, whose import every command would pay for.
    return (Path(__file__).parent / "simulation" / "bin" / "nvidia-smi").is_file()
