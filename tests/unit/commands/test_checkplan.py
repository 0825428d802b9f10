"""Sharing plans checked without a cluster (``check-plan``), refused by ``inspect`` and ``check-node`` when
malformed, and the plan in use logged at start and shown by ``inspect``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import pytest

from driver.cli import main
from driver.commands.run.plansource import PlanSource
from driver.config import Settings
from driver.gpu.published.planuse import PLAN_USE_FILE, plan_use, write_plan_use
from driver.gpu.published.sharingplan import load_plans, resolve_layout
from driver.nodelayout import SIMULATED_NODE_NAME
from driver.simulation.discovery import SimulatedDiscovery

PLAN = """\
defaultPlan: l4-mps
plans:
  l4-mps:
    gpus:
    - match: {product: "NVIDIA L4"}
      mps: {shares: 4, activeThreadPercentage: 25}
  elsewhere:
    gpus:
    - match: {product: "NVIDIA A100*"}
      mps: {shares: 2}
"""


def run_cli(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        status = main(list(argv))
    except SystemExit as exc:  # argparse's own exits
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


@pytest.fixture(autouse=True)
def _keep_umask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("driver.cli.os.umask", lambda mask: 0o022)


@pytest.fixture
def plans(tmp_path: Path) -> Path:
    path = tmp_path / "plans.yaml"
    path.write_text(PLAN)
    return path


def test_a_valid_file_is_summarised_and_the_simulated_node_shows_each_gpu(
        plans: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(["check-plan", str(plans)], capsys)
    assert status == 0 and err == ""
    assert f"{plans}: valid; 2 plan(s), defaultPlan l4-mps" in out
    assert "plans.l4-mps.gpus[0]: match product: NVIDIA L4 -> mps" in out
    status, out, err = run_cli(["check-plan", str(plans), "--simulate", "demo"], capsys)
    assert status == 0 and err == ""
    inventory = SimulatedDiscovery("demo", SIMULATED_NODE_NAME).discover()
    l4 = next(g for g in inventory.gpus if g.product_name == "NVIDIA L4")
    assert (f"GPU {l4.minor} {l4.uuid} NVIDIA L4: plans.l4-mps.gpus[0] -> 4 MPS shares, each memory 5758Mi "
            "(pinned limit), 25% of the SMs, clients nonRoot") in out
    assert "NVIDIA H100 80GB HBM3: no entry matches -> whole (memory 81559Mi)" in out
    assert "no entry matches -> its 3 MIG device(s) (3g.40gb at 0; 2g.20gb at 4; 1g.10gb at 6)" in out
    assert "defaultPlan: the node has no label gpu.tessera.dev/sharing-plan" in out


def test_a_plan_matching_no_gpu_is_warned_about(plans: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(["check-plan", str(plans), "--simulate", "demo", "--node-label", "elsewhere"], capsys)
    assert status == 0
    assert "WARNING: plan 'elsewhere' matches no GPU of this node" in out
    assert "Entries matching no GPU of this node: plans.elsewhere.gpus[0] (match product: NVIDIA A100*)" in out


def test_malformed_yaml_is_one_line_naming_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("plans:\n  a:\n    gpus: [\n  - x\n")
    status, out, err = run_cli(["check-plan", str(bad)], capsys)
    assert status == 1 and out == ""
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(f"python -m driver check-plan: {bad}: not valid YAML: ")
    assert f'in "{bad}", line 4' in err and "<unicode string>" not in err


def test_a_bad_entry_is_one_line_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("plans:\n  p:\n    gpus:\n    - match: {all: true}\n      mps: {shares: 99}\n")
    status, _, err = run_cli(["check-plan", str(bad)], capsys)
    assert status == 1
    assert err.startswith(f"python -m driver check-plan: {bad}: plans.p.gpus[0].mps.shares")


def test_a_plan_that_cannot_apply_to_the_simulated_node_names_the_entry_and_gpu(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mig = tmp_path / "mig.yaml"
    mig.write_text("plans:\n  p:\n    gpus:\n    - match: {minor: 1}\n      mps: {shares: 4}\n")
    status, out, err = run_cli(["check-plan", str(mig), "--simulate", "demo", "--plan", "p"], capsys)
    assert status == 1 and out == ""
    assert err.startswith(f"python -m driver check-plan: {mig}: plans.p.gpus[0] (GPU minor 1, ")
    assert "MIG-enabled" in err


@pytest.mark.parametrize(("extra", "expected"), [
    (["--plan", "nope"], "python -m driver check-plan: --plan 'nope': no such plan in the file; known plans: "
                         "elsewhere, l4-mps (python -m driver check-plan --help lists the flags)"),
    (["--node-label", "nope"], "python -m driver check-plan: --node-label 'nope': names no sharing plan; known "
                               "plans: elsewhere, l4-mps (python -m driver check-plan --help lists the flags)"),
])
def test_usage_errors_exit_2_naming_the_flag(plans: Path, extra: list[str], expected: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(["check-plan", str(plans), *extra], capsys)
    assert status == 2
    assert err.strip() == expected


def test_plan_and_node_label_exclude_each_other_and_a_bad_layout_is_named(
        plans: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run_cli(["check-plan", str(plans), "--plan", "l4-mps", "--node-label", "l4-mps"], capsys)
    assert status == 2 and "not allowed with argument" in err
    status, _, err = run_cli(["check-plan", str(plans), "--simulate", "nope"], capsys)
    assert status == 2 and err.startswith("python -m driver check-plan: --simulate 'nope': ")


def test_inspect_and_check_node_refuse_a_malformed_plans_file(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("plans: [\n")
    status, out, _ = run_cli(["inspect", "--simulate", "demo", "--plugins-dir", str(tmp_path / "plugins"),
                              "--cdi-root", str(tmp_path / "cdi"), "--sharing-plans", str(bad)], capsys)
    assert status == 1
    assert f"PROBLEM: sharing plans: {bad}: not valid YAML" in out
    status, out, _ = run_cli(["check-node", "--simulate", "demo", "--cdi-root", str(tmp_path / "cdi"),
                              "--sharing-plans", str(bad)], capsys)
    assert status == 1
    line = next(line for line in out.splitlines() if line.startswith("sharing plans"))
    assert "FAIL" in line and str(bad) in line


def test_the_plan_in_use_is_logged_at_start_and_shown_by_inspect(
        plans: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    inventory = SimulatedDiscovery("demo", SIMULATED_NODE_NAME).discover()
    loaded = load_plans(plans)
    source = PlanSource(Settings(), api=None)  # type: ignore[arg-type]  # _record never calls the API
    for name, how in (("l4-mps", "node label gpu.tessera.dev/sharing-plan=l4-mps"),
                      ("elsewhere", "node label gpu.tessera.dev/sharing-plan=elsewhere")):
        plan = loaded.plans[name]
        use = plan_use(plan, name, plans, how, inventory, resolve_layout(plan, inventory, name))
        with caplog.at_level(logging.INFO, logger="driver.commands.run.plansource"):
            source._record(use)
    messages = [r.getMessage() for r in caplog.records]
    assert f"sharing plan in use: plan 'l4-mps' from {plans} (node label gpu.tessera.dev/sharing-plan=l4-mps)" \
        in messages
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and warnings[0].startswith("sharing plan 'elsewhere' matches no GPU of this node")
    state_dir = tmp_path / "plugins" / "gpu.tessera.dev"
    state_dir.mkdir(parents=True)
    plan = loaded.plans["l4-mps"]
    write_plan_use(state_dir / PLAN_USE_FILE, plan_use(plan, "l4-mps", plans, "node label x=l4-mps", inventory,
                                                       resolve_layout(plan, inventory, "l4-mps")))
    _, out, _ = run_cli(["inspect", "--simulate", "demo", "--plugins-dir", str(tmp_path / "plugins"),
                         "--cdi-root", str(tmp_path / "cdi")], capsys)
    assert f"sharing plan: plan 'l4-mps' from {plans} (node label x=l4-mps)" in out
    assert "plans.l4-mps.gpus[0] -> 4 MPS shares" in out
