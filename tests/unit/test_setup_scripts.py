"""scripts/demo.sh and scripts/test.sh say what they are doing while they set up, one line per step.

Run in a copy of the repository's layout whose ``.venv`` tools are stubs that record their
arguments, so the scripts' own steps run for real and nothing is installed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$(dirname "$0")/../../calls.log"
"""


def _tree(tmp_path: Path, with_venv: bool) -> Path:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in ("demo.sh", "test.sh"):
        shutil.copy(REPO / "scripts" / name, root / "scripts" / name)
    (root / "scripts" / "fetch-nvidia-mps.sh").write_text("echo fetch-nvidia-mps.sh >> calls.log\n")
    (root / "pyproject.toml").write_text("")
    if with_venv:
        bin_dir = root / ".venv" / "bin"
        bin_dir.mkdir(parents=True)
        for tool in ("python", "ruff", "mypy", "lint-imports"):
            (bin_dir / tool).write_text(STUB)
            (bin_dir / tool).chmod(0o755)
    return root


def test_the_demo_script_says_each_setup_step_on_stderr_then_only_on_a_first_run(tmp_path: Path) -> None:
    root = _tree(tmp_path, with_venv=True)
    first = subprocess.run(["bash", "scripts/demo.sh", "--layout", "l4"], cwd=root, capture_output=True, text=True,
                           timeout=60, check=True)
    assert first.stdout == ""
    assert first.stderr.splitlines() == [
        "demo.sh: upgrading pip in .venv",
        "demo.sh: installing Tessera and its dependencies into .venv (pip; a minute or more the first time)",
        "demo.sh: installed; starting the demo"]
    again = subprocess.run(["bash", "scripts/demo.sh"], cwd=root, capture_output=True, text=True, timeout=60,
                           check=True)
    assert again.stderr == ""
    calls = (root / "calls.log").read_text().splitlines()
    assert calls[-2:] == ["python -m driver demo --layout l4", "python -m driver demo"]


def test_the_test_script_says_each_step(tmp_path: Path) -> None:
    root = _tree(tmp_path, with_venv=True)
    done = subprocess.run(["bash", "scripts/test.sh", "-q"], cwd=root, capture_output=True, text=True, timeout=60,
                          check=True)
    steps = [line for line in done.stdout.splitlines() if line.startswith("== ")]
    assert steps[:2] == ["== upgrading pip in .venv",
                         "== installing Tessera with its test extras into .venv (pip; minutes the first time)"]
    assert steps[2:] == ["== ruff", "== mypy", "== import contracts (lint-imports; pyproject.toml [tool.importlinter])",
                         "== NVIDIA's MPS daemon for the MPS tests (never fails the run)", "== pytest"]
    assert "lint-imports " in (root / "calls.log").read_text().splitlines()
