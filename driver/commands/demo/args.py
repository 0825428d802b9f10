"""``python -m driver demo``'s command line, and the sharing plan its simulated node gets (SIMULATION).

Pure functions over the arguments, the example files and the simulated inventory, so that every
choice the demo makes can be checked without starting it. Errors are :class:`DemoArgsError`, whose
message is one line naming the flag and what it accepts.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from cdi.yamlload import load_yaml_documents
from driver.cliparser import CliParser
from driver.gpu.discovery.inventory import NodeInventory

EXAMPLES_DIR = Path(__file__).resolve().parents[3] / "examples" / "resourceclaims"
DEFAULT_EXAMPLES = ("gpu-mps-per-claim.yaml", "mig-by-profile.yaml", "mps-share-from-plan.yaml")
DYNAMIC_MIG_EXAMPLE = "mig-dynamic.yaml"  # --dynamic-mig: its template, at several sizes (driver/commands/demo/mig.py)
DYNAMIC_MIG_LAYOUT = "dynamic-mig"
# Examples that only a particular simulated node can serve, and that node: the hint when one is not allocated.
EXAMPLE_LAYOUTS = {"consumable-share-kernel-memory.yaml": "kernel-memory"}
PLAN_NAME = "demo"
SHARES = 4
ShareMode = Literal["mps", "timeSlicing", "consumable"]


# Everything a demo run writes in its working directory (driver/commands/demo/scenario.py): what a rerun may remove.
WORKDIR_ENTRIES = frozenset({".demo.lock", "cdi", "driver.log", "health-events.jsonl", "host", "kubeconfig",
                             "nvidia-smi-calls.jsonl", "nvml-calls.jsonl", "plugins", "plugins_registry",
                             "sharing-plans.yaml", "tmp"})


class DemoArgsError(ValueError):
    """A demo argument that cannot be used; the message is one line."""


@dataclass(frozen=True)
class DemoOptions:
    layout: str
    workdir: Path | None
    keep_prepared: bool
    examples: tuple[Path, ...]
    health: bool = False
    dynamic_mig: bool = False


def build_parser(layouts: Sequence[str]) -> argparse.ArgumentParser:
    parser = CliParser(
        prog="python -m driver demo",
        description="SIMULATION: one simulated GPU node end to end (the real driver process, simulated GPUs, "
                    "stand-in NVIDIA tools, an API server double, a kubelet stand-in). No cluster, GPU or root needed.")
    parser.add_argument("--layout", default=None, metavar="LAYOUT",
                        help=f"simulated node: one of {', '.join(layouts)}, or a YAML file holding one layout "
                             f"(default: demo; {DYNAMIC_MIG_LAYOUT} with --dynamic-mig)")
    parser.add_argument("--workdir", default=None, metavar="DIR",
                        help="keep the demo's files (driver.log, CDI specs, checkpoint) in DIR instead of a "
                             "temporary directory that is removed at the end; a rerun on the same DIR first removes "
                             "the previous run's files (a DIR holding other files is refused)")
    parser.add_argument("--keep-prepared", action="store_true",
                        help="leave the claims prepared (needs --workdir) so that `python -m driver inspect` and the "
                             "CDI specs can be read afterwards; the closing message prints the commands")
    parser.add_argument("--example", action="append", default=None, metavar="PATH",
                        help="a YAML file with ResourceClaims or ResourceClaimTemplates to prepare; repeatable. A "
                             "bare name is looked up in examples/resourceclaims/ "
                             f"(default: {', '.join(DEFAULT_EXAMPLES)})")
    parser.add_argument("--dynamic-mig", action="store_true",
                        help=f"dynamic MIG: the node's MIG-mode GPUs without instances publish their placements, and "
                             f"MIG instances are created for claims (from {DYNAMIC_MIG_EXAMPLE}): a 3g.40gb and two "
                             "2g.20gb on one H100, a 7g.80gb refused until they are gone (plus any --example)")
    parser.add_argument("--health", action="store_true",
                        help="also fail a GPU and recover it while the claims are prepared: the taints appearing and "
                             "going, the kubelet's health stream and the health metrics")
    return parser


def parse_options(argv: Sequence[str], layouts: Sequence[str]) -> DemoOptions:
    """Parse and check ``argv``; argparse exits for --help and unknown flags, anything else is DemoArgsError."""
    args = build_parser(layouts).parse_args(argv)
    layout: str = args.layout or (DYNAMIC_MIG_LAYOUT if args.dynamic_mig else "demo")
    if layout not in layouts:
        if not Path(layout).is_file():
            raise DemoArgsError(f"unknown --layout {layout!r}: choose one of {', '.join(layouts)} "
                                "(or give a YAML file holding one layout)")
        layout = str(Path(layout).resolve())  # the driver process reads it too
    if args.keep_prepared and args.workdir is None:
        raise DemoArgsError("--keep-prepared needs --workdir DIR: the prepared claims' files are left there")
    examples = tuple(resolve_example(text) for text in args.example or (() if args.dynamic_mig else default_examples()))
    workdir = Path(args.workdir).resolve() if args.workdir is not None else None
    if workdir is not None and workdir.exists() and not workdir.is_dir():
        raise DemoArgsError(f"--workdir {args.workdir}: exists and is not a directory")
    return DemoOptions(layout=layout, workdir=workdir, keep_prepared=args.keep_prepared, examples=examples,
                       health=args.health, dynamic_mig=args.dynamic_mig)


def layout_hint(example: str) -> str:
    """What to try when a claim of ``example`` (a file name) found no device on the demo's node."""
    if example in EXAMPLE_LAYOUTS:
        return f"this example needs the simulated node --layout {EXAMPLE_LAYOUTS[example]}"
    return "another simulated node may have such a device (python -m driver demo --help lists the layouts)"


def default_examples() -> tuple[str, ...]:
    if not EXAMPLES_DIR.is_dir():
        raise DemoArgsError(f"the default examples are in examples/resourceclaims/ of a source checkout "
                            f"({EXAMPLES_DIR} does not exist): pass --example PATH, or run from a clone: "
                            "bash scripts/demo.sh")
    return DEFAULT_EXAMPLES


def resolve_example(text: str) -> Path:
    """The example file ``text`` names: a path, else a file of that name in examples/resourceclaims/."""
    path = Path(text)
    if not path.is_file() and path.name == text and (EXAMPLES_DIR / text).is_file():
        path = EXAMPLES_DIR / text
    if not path.is_file():
        known = ", ".join(sorted(p.name for p in EXAMPLES_DIR.glob("*.yaml"))) if EXAMPLES_DIR.is_dir() else "none"
        raise DemoArgsError(f"--example {text!r}: no such file (files in examples/resourceclaims/: {known})")
    if not claim_documents(path):
        raise DemoArgsError(f"--example {text!r}: holds no ResourceClaim or ResourceClaimTemplate")
    return path.resolve()


def claim_documents(path: Path) -> list[dict[str, Any]]:
    """The ResourceClaim(Template) documents of a YAML file (other kinds, such as Pods, are skipped)."""
    try:
        docs = load_yaml_documents(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise DemoArgsError(f"--example {str(path)!r}: cannot read it as YAML ({' '.join(str(exc).split())})") from exc
    return [d for d in docs if isinstance(d, dict) and d.get("kind") in ("ResourceClaimTemplate", "ResourceClaim")]


def pods_using(path: Path, claim_doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The Pod documents of ``path`` that name ``claim_doc`` (a ResourceClaim or ResourceClaimTemplate)."""
    key = "resourceClaimTemplateName" if claim_doc.get("kind") == "ResourceClaimTemplate" else "resourceClaimName"
    name = claim_doc.get("metadata", {}).get("name")
    docs = load_yaml_documents(path.read_text())
    return [d for d in docs if isinstance(d, dict) and d.get("kind") == "Pod"
            and any(c.get(key) == name for c in (d.get("spec") or {}).get("resourceClaims") or [])]


def requested_classes(documents: Iterable[dict[str, Any]]) -> set[str]:
    """DeviceClass names the claims request (``exactly`` and each ``firstAvailable`` alternative)."""
    classes: set[str] = set()
    for doc in documents:
        spec = doc.get("spec", {})
        spec = spec.get("spec", spec) if doc.get("kind") == "ResourceClaimTemplate" else spec
        for request in spec.get("devices", {}).get("requests", []):
            for choice in [request.get("exactly") or {}, *(request.get("firstAvailable") or [])]:
                if "deviceClassName" in choice:
                    classes.add(choice["deviceClassName"])
    return classes


def share_mode(examples: Iterable[Path], driver_name: str) -> ShareMode:
    """How the demo node's shared GPU is split: time slicing only when the examples ask for it and not for MPS."""
    classes = requested_classes(doc for path in examples for doc in claim_documents(path))
    wants_mps, wants_ts = f"mps.{driver_name}" in classes, f"timeslice.{driver_name}" in classes
    wants_consumable = f"consumable.{driver_name}" in classes
    if wants_mps + wants_ts + wants_consumable > 1:
        raise DemoArgsError("--example: the MPS share, time-slice share and consumable share examples each need the "
                            "demo's shared GPU published their way; demo them in separate runs")
    return "consumable" if wants_consumable else "timeSlicing" if wants_ts else "mps"


def demo_plan(inventory: NodeInventory, mode: ShareMode) -> tuple[dict[str, Any], str]:
    """(sharing plans file content, one-line description): the last GPU without MIG split into shares."""
    candidates = [g for g in inventory.gpus if not g.mig_enabled]
    if not candidates:
        return {"defaultPlan": PLAN_NAME, "plans": {PLAN_NAME: {}}}, "none (no GPU without MIG to share)"
    if mode == "consumable":
        # The largest GPU, so the examples' differently sized claims fit on it together.
        gpu = max(candidates, key=lambda g: (g.memory_bytes or 0, g.minor))
        plan = {"gpus": [{"match": {"minor": gpu.minor}, "consumable": {}}]}
        return ({"defaultPlan": PLAN_NAME, "plans": {PLAN_NAME: plan}},
                f"gpu-{gpu.minor} ({gpu.product_name}) as one consumable device (claims take memory and SMs)")
    gpu = max(candidates, key=lambda g: g.minor)
    how: dict[str, Any] = {"shares": SHARES}
    if mode == "mps":
        how["activeThreadPercentage"] = 100 // SHARES
        what = f"{SHARES} MPS shares, {100 // SHARES}% of the SMs each"
    else:
        how["interval"] = "Short"
        what = f"{SHARES} time-sliced shares"
    plan = {"gpus": [{"match": {"minor": gpu.minor}, mode: how}]}
    return ({"defaultPlan": PLAN_NAME, "plans": {PLAN_NAME: plan}},
            f"gpu-{gpu.minor} ({gpu.product_name}) as {what}")


def clear_previous_run(workdir: Path) -> list[str]:
    """Remove what an earlier demo run left in ``workdir`` (its prepared claims would make every prepare of this
    run fail as stale) and return the names removed; refuse a directory holding anything else."""
    if not workdir.is_dir():
        return []
    found = sorted(entry.name for entry in workdir.iterdir())
    foreign = [name for name in found if name not in WORKDIR_ENTRIES]
    if foreign:
        raise DemoArgsError(f"--workdir {workdir}: holds files the demo did not write ({', '.join(foreign[:5])}"
                            f"{', ...' if len(foreign) > 5 else ''}); give an empty or new directory")
    # The lock is held by this run (driver/commands/demo/lock.py): removing it would let a second run in.
    found = [name for name in found if name != ".demo.lock"]
    for name in found:
        path = workdir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    return found
