"""``python -m driver convert-plan FILE [--default KEY]``: an NVIDIA device plugin sharing config, or the GPU
Operator's ConfigMap of them, printed as a Tessera sharing plans file (``driver.gpu.published.planconvert``).

The plans go to stdout, what the plans cannot carry or carry differently to stderr, one line each.
Exit status: 0 converted as the device plugin had it, 1 converted but nodes on some plan would
publish something else (the lines say what), 2 unreadable input or a usage error.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import yaml

from driver.cliparser import USAGE_ERROR
from driver.config import DEFAULT_PLAN_LABEL
from driver.gpu.published.deviceplugincfg import DevicePluginConfig, DevicePluginConfigError, parse_configs
from driver.gpu.published.planconvert import convert

PROG = "python -m driver convert-plan"
DESCRIPTION = ("Print an NVIDIA device plugin sharing config (version v1), or a ConfigMap of them as the GPU Operator "
               "keeps them (data: {key: config}), as a sharing plans file: one plan per key. What a plan cannot "
               "carry, or carries differently, is listed on stderr, one line each. Exit status 0 converted, 1 "
               "converted but some nodes would publish something else than with the device plugin, 2 unreadable "
               "input or a usage error. docs/migration.md.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", metavar="FILE", help="the device plugin config file, or a ConfigMap of configs (YAML)")
    parser.add_argument("--default", metavar="KEY", default=None,
                        help="the plan for nodes without the plan label (defaultPlan), as the ClusterPolicy's "
                             "devicePlugin.config.default; default: none for a ConfigMap (such nodes publish every "
                             "GPU whole), the one config of a single file")


def main(args: argparse.Namespace) -> int:
    path = Path(args.file)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        print(f"{PROG}: {path}: cannot read the file: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return USAGE_ERROR
    try:
        configs, from_configmap = parse_configs(text, str(path))
    except DevicePluginConfigError as exc:
        for line in str(exc).splitlines():
            print(f"{PROG}: {line}", file=sys.stderr)
        return USAGE_ERROR
    if not from_configmap:
        # One config served every node the plugin ran on: it becomes the plan of nodes without the label.
        configs = {_plan_name(path): next(iter(configs.values()))}
    default = args.default if args.default is not None or from_configmap else next(iter(configs))
    if default is not None and default not in configs:
        print(f"{PROG}: --default {default!r}: no such config in {path}; keys: {', '.join(configs)} "
              f"({PROG} --help lists the flags)", file=sys.stderr)
        return USAGE_ERROR
    conversion = convert(configs, default)
    print(_header(path, configs, from_configmap) + _dump(conversion.plans), end="")
    for finding in conversion.findings:
        print(f"{PROG}: {finding.line()}", file=sys.stderr)
    return 1 if conversion.differs else 0


class _FlowDumper(yaml.SafeDumper):
    """Writes each entry's ``match`` on one line, as the docs and examples do."""


class _Match(dict[str, object]):
    pass


_FlowDumper.add_representer(
    _Match, lambda dumper, data: dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=True))


def _dump(plans: dict[str, Any]) -> str:
    shown = {**plans, "plans": {name: {**plan, "gpus": [{**entry, "match": _Match(entry["match"])}
                                                        for entry in plan["gpus"]]} if plan else plan
                                for name, plan in plans["plans"].items()}}
    return yaml.dump(shown, Dumper=_FlowDumper, sort_keys=False)


def _plan_name(path: Path) -> str:
    """A label value from the file's name, for the plan of a single config."""
    name = re.sub(r"[^-A-Za-z0-9_.]+", "-", path.stem)[:63].strip("-_.")
    return name or "converted"


def _header(path: Path, configs: dict[str, DevicePluginConfig], from_configmap: bool) -> str:
    selected = (f"# Nodes select a plan by the label the chart's sharing.planLabel names: set it to\n"
                f"# nvidia.com/device-plugin.config to keep the GPU Operator's labels (default {DEFAULT_PLAN_LABEL}).\n"
                if from_configmap else "")
    return (f"# Sharing plans converted from the NVIDIA device plugin config{'s' if len(configs) > 1 else ''} in "
            f"{path.name} by {PROG}.\n{selected}# Check with: python -m driver check-plan FILE --simulate LAYOUT\n")
