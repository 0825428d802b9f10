"""scripts/benchmark.py's output: a table whose columns line up, and text that stands on its own."""

from __future__ import annotations

import importlib.util
import re
import sys
import venv
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "benchmark.py"


def test_the_script_cites_no_issue_numbers() -> None:
    # A reader of the output or the script has no issue tracker; the goals are in docs/benchmarks.md.
    assert re.findall(r"issue[' ]*s? *\d+|the issue'?s", SCRIPT.read_text()) == []


def load_script(monkeypatch: pytest.MonkeyPatch) -> Any:
    spec = importlib.util.spec_from_file_location("benchmark_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "benchmark_script", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_table_columns_line_up_however_long_a_name(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_script(monkeypatch)
    module.print_table([("sequential prepare p50", "1.00 ms", "0.50 ms", "2.00x", "<= 1.5x floor"),
                        ("MPS share prepare, cold, NVIDIA's daemon (p50 of 20)", "12.0 ms", "", "", "< 30 ms")])
    lines = capsys.readouterr().out.splitlines()
    header, _rule, first, second = lines
    assert header.index("Tessera") + len("Tessera") == first.index("1.00 ms") + len("1.00 ms") \
        == second.index("12.0 ms") + len("12.0 ms")
    assert header.index("goal") == first.index("<= 1.5x") == second.index("< 30 ms")


def test_it_says_when_the_driver_carries_test_only_packages_the_image_lacks(monkeypatch: pytest.MonkeyPatch,
                                                                            tmp_path: Path) -> None:
    # The test environment has kubernetes-validate, which `import kubernetes` loads when installed; an
    # environment without it (as the image's, deploy/build-venv.sh) is reported clean.
    module = load_script(monkeypatch)
    assert "test-only kubernetes_validate" in module.driver_environment(sys.executable)
    venv.create(tmp_path / "bare", with_pip=False)
    bare = str(tmp_path / "bare" / "bin" / "python")
    assert module.driver_environment(bare) == f"driver run by {bare}: no test-only package it would import"
