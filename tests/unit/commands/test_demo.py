"""The demo's arguments, the sharing plan its node gets, every example allocating, and its signal handling.

Pure parts only (no driver process); tests/integration/test_demo.py runs the demo itself.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.commands.demo import scenario
from driver.commands.demo.args import (
    DEFAULT_EXAMPLES,
    EXAMPLES_DIR,
    DemoArgsError,
    build_parser,
    claim_documents,
    demo_plan,
    parse_options,
    share_mode,
)
from driver.config import DEFAULT_DRIVER_NAME
from driver.gpu.published.devices import make_view
from driver.gpu.published.sharingplan import load_plans, resolve_layout
from driver.reaper import processes_with_env, stop_processes
from driver.simulation.allocator import AllocationError, allocate, claim_from_template
from driver.simulation.discovery import SimulatedDiscovery, available_layouts

LAYOUTS = available_layouts()
EXAMPLES = sorted(EXAMPLES_DIR.glob("*.yaml"))
# Asks for kernel-enforced memory, which no node offers until its detection exists (docs/sharing.md).
NEVER_ALLOCATED = {"consumable-share-kernel-memory.yaml"}


# ----------------------------------------------------------------------------- arguments


def test_defaults() -> None:
    options = parse_options([], LAYOUTS)
    assert options.layout == "demo"
    assert options.workdir is None
    assert not options.keep_prepared
    assert options.examples == tuple(EXAMPLES_DIR / name for name in DEFAULT_EXAMPLES)


def test_unknown_layout_is_one_line_listing_the_layouts() -> None:
    with pytest.raises(DemoArgsError) as err:
        parse_options(["--layout", "dgx-h1000"], LAYOUTS)
    message = str(err.value)
    assert "\n" not in message
    assert "--layout 'dgx-h1000'" in message
    assert all(name in message for name in LAYOUTS)


def test_unknown_layout_exits_2_with_one_line_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    assert scenario.main(["--layout", "nope"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
    assert "gpu-operator" in captured.err


def test_help_lists_the_layouts(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at hyphens ("gpu-operator")
    with pytest.raises(SystemExit) as exited:
        build_parser(LAYOUTS).parse_args(["--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in LAYOUTS)
    assert "--keep-prepared" in text


def test_a_layout_file_is_accepted_as_an_absolute_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "node.yaml").write_text("gpus: [{model: L4}]\n")
    monkeypatch.chdir(tmp_path)
    assert parse_options(["--layout", "node.yaml"], LAYOUTS).layout == str(tmp_path / "node.yaml")


def test_keep_prepared_needs_a_workdir(tmp_path: Path) -> None:
    with pytest.raises(DemoArgsError, match="--keep-prepared needs --workdir"):
        parse_options(["--keep-prepared"], LAYOUTS)
    options = parse_options(["--keep-prepared", "--workdir", str(tmp_path / "w")], LAYOUTS)
    assert options.keep_prepared and options.workdir == tmp_path / "w"


def test_example_takes_a_path_relative_to_the_current_directory(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mine.yaml").write_text((EXAMPLES_DIR / "gpu-whole.yaml").read_text())
    monkeypatch.chdir(tmp_path)
    assert parse_options(["--example", "mine.yaml"], LAYOUTS).examples == (tmp_path / "mine.yaml",)


def test_example_bare_name_is_looked_up_in_the_examples() -> None:
    options = parse_options(["--example", "gpu-whole.yaml", "--example", "mig-by-profile.yaml"], LAYOUTS)
    assert options.examples == (EXAMPLES_DIR / "gpu-whole.yaml", EXAMPLES_DIR / "mig-by-profile.yaml")


def test_missing_example_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    with pytest.raises(DemoArgsError) as err:
        parse_options(["--example", str(tmp_path / "none.yaml")], LAYOUTS)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(f"--example '{tmp_path / 'none.yaml'}': no such file")
    assert "gpu-whole.yaml" in str(err.value)


@pytest.mark.parametrize(("content", "problem"), [
    ("kind: Pod\nmetadata: {name: p}\n", "holds no ResourceClaim"),
    ("kind: [unclosed\n", "cannot read it as YAML"),
])
def test_example_without_claims_is_refused(tmp_path: Path, content: str, problem: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(DemoArgsError, match=problem) as err:
        parse_options(["--example", str(path)], LAYOUTS)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------- the node's plan


def test_share_mode_follows_the_examples() -> None:
    assert share_mode([EXAMPLES_DIR / "mps-share-from-plan.yaml"], DEFAULT_DRIVER_NAME) == "mps"
    assert share_mode([EXAMPLES_DIR / "gpu-whole.yaml"], DEFAULT_DRIVER_NAME) == "mps"
    assert share_mode([EXAMPLES_DIR / "timeslice-share-from-plan.yaml"], DEFAULT_DRIVER_NAME) == "timeSlicing"
    assert share_mode([EXAMPLES_DIR / "consumable-share-small.yaml", EXAMPLES_DIR / "consumable-share-large.yaml"],
                      DEFAULT_DRIVER_NAME) == "consumable"
    with pytest.raises(DemoArgsError, match="separate runs"):
        share_mode([EXAMPLES_DIR / "mps-share-from-plan.yaml", EXAMPLES_DIR / "timeslice-share-from-plan.yaml"],
                   DEFAULT_DRIVER_NAME)


@pytest.mark.parametrize(("layout", "shared"), [("demo", "gpu-2 (NVIDIA L4)"), ("dgx-h100", "gpu-7"),
                                                ("h200-mig", None)])
def test_the_plan_shares_the_last_gpu_without_mig(layout: str, shared: str | None) -> None:
    inventory = SimulatedDiscovery(layout, "n").discover()
    plan, text = demo_plan(inventory, "mps")
    if shared is None:
        assert plan["plans"]["demo"] == {}
        assert text.startswith("none")
    else:
        assert text.startswith(shared)
        assert "4 MPS shares" in text


def _published(layout: str, mode: Any, tmp_path: Path) -> list[dict[str, Any]]:
    """The ResourceSlices the demo's driver publishes for ``layout`` with the demo's plan."""
    inventory = SimulatedDiscovery(layout, "demo-node").discover()
    plans_file = tmp_path / "plans.yaml"
    plans_file.write_text(yaml.safe_dump(demo_plan(inventory, mode)[0]))  # as the demo writes it
    plan = load_plans(plans_file).plans["demo"]
    devices = make_view(inventory, resolve_layout(plan, inventory, "demo")).devices
    return [{"spec": {"driver": DEFAULT_DRIVER_NAME, "pool": {"name": "demo-node"},
                      "devices": [d.to_wire() for d in devices]}}]


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_allocates_on_the_demo_node(example: Path, tmp_path: Path) -> None:
    slices = _published("demo", share_mode([example], DEFAULT_DRIVER_NAME), tmp_path)
    documents = claim_documents(example)
    assert documents
    for doc in documents:
        claim = claim_from_template(doc, "c") if doc["kind"] == "ResourceClaimTemplate" else doc
        if example.name in NEVER_ALLOCATED:
            with pytest.raises(AllocationError, match="no free"):
                allocate(claim, slices, DEFAULT_DRIVER_NAME, set())
            continue
        allocated = allocate(claim, slices, DEFAULT_DRIVER_NAME, set())  # raises if it cannot
        assert allocated["status"]["allocation"]["devices"]["results"]


# ----------------------------------------------------------------------------- stopping


def test_sigterm_and_ctrl_c_end_the_demo_with_the_signal_status(monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        cleaned: list[bool] = []

        def fake_run(options: object, mode: object, remove_on_exit: object, signum: int = signum,
                     cleaned: list[bool] = cleaned) -> int:
            try:
                os.kill(os.getpid(), signum)
                time.sleep(10)  # the handler interrupts this
                return 0
            finally:
                cleaned.append(True)

        monkeypatch.setattr(scenario, "run_demo", fake_run)
        before = signal.getsignal(signum)
        assert scenario.main([]) == 128 + signum
        assert cleaned == [True]
        assert signal.getsignal(signum) is before  # restored for the caller
        out = capsys.readouterr().out
        assert f"demo stopped by {signal.Signals(signum).name}" in out


def test_detached_processes_are_found_by_their_environment_and_stopped() -> None:
    token = uuid.uuid4().hex
    env = dict(os.environ, TESSERA_DEMO_RUN=token)
    # Detached like the MPS daemon stand-in: a session of its own, ignoring SIGTERM at first.
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); print('up', flush=True); time.sleep(60)"],
                             env=env, start_new_session=True, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        assert processes_with_env("TESSERA_DEMO_RUN", token) == [child.pid]
        assert processes_with_env("TESSERA_DEMO_RUN", "other") == []
        stop_processes([child.pid], grace_s=0.2)
        assert child.wait(timeout=5) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()


def test_a_rerun_clears_only_what_an_earlier_run_wrote(tmp_path: Path) -> None:
    from driver.commands.demo.args import WORKDIR_ENTRIES, DemoArgsError, clear_previous_run

    (tmp_path / "plugins" / "gpu.tessera.dev").mkdir(parents=True)
    (tmp_path / "driver.log").write_text("old run\n")
    assert clear_previous_run(tmp_path) == ["driver.log", "plugins"]
    assert list(tmp_path.iterdir()) == []
    assert clear_previous_run(tmp_path / "new") == []
    (tmp_path / "thesis.tex").write_text("")
    (tmp_path / "driver.log").write_text("")
    with pytest.raises(DemoArgsError, match=r"^--workdir .*: holds files the demo did not write \(thesis.tex\); "):
        clear_previous_run(tmp_path)
    assert (tmp_path / "driver.log").exists(), "nothing is removed from a directory that is refused"
    assert "driver.log" in WORKDIR_ENTRIES


def test_the_device_table_uses_one_memory_unit_and_says_what_each_row_is() -> None:
    from driver.commands.demo.table import details, mebibytes

    assert [mebibytes(q) for q in ("16Gi", "33024Mi", "81559Mi", "")] == ["16384Mi", "33024Mi", "81559Mi", ""]

    def device(kind: str, **attrs: str) -> dict[str, object]:
        return {"attributes": {"type": {"string": kind}, **{k: {"string": v} for k, v in attrs.items()}}}

    timeslice = device("timeslice", shareIndex="0", shareCount="4", memoryLimitEnforcement="none")
    assert details(timeslice) == "share 0/4 memory-enforcement=none", "no threads=-% for time slices"
    mps = device("mps", shareIndex="1", shareCount="4", activeThreadPercentage="25",
                 memoryLimitEnforcement="mps-per-process")
    assert details(mps) == "share 1/4 threads=25% memory-enforcement=mps-per-process"
    consumable = {**device("consumable", memoryLimitEnforcement="kernel"), "capacity": {
        "memory": {"value": "81559Mi", "requestPolicy": {"default": "1Gi",
                                                         "validRange": {"min": "1Gi", "max": "79Gi", "step": "1Gi"}}},
        "multiprocessors": {"value": "132", "requestPolicy": {"default": "2",
                                                              "validRange": {"min": "2", "step": "1"}}}}}
    assert details(consumable) == ("each claim takes memory 1024Mi-80896Mi step 1024Mi, SMs 2-132 step 1; "
                                   "memory-enforcement=kernel")


def test_a_slice_of_counter_sets_alone_says_what_it_holds_instead_of_an_empty_table() -> None:
    from driver.commands.demo.table import print_slices

    said: list[str] = []
    counters = {"name": "gpu-0-counter-set", "counters": {"multiprocessors": {"value": "132"},
                                                           "memory-slice-0": {"value": "1"}}}
    print_slices([{"metadata": {"name": "demo-node-gpu.tessera.dev-abcde"},
                   "spec": {"driver": "gpu.tessera.dev", "pool": {"name": "demo-node", "generation": 1},
                            "sharedCounters": [counters]}}], said.append)
    assert said[1:] == ["  counter set gpu-0-counter-set: 2 counters that the dynamic MIG devices of the other slices "
                        "consume"]
    assert not [line for line in said if "DEVICE" in line]
