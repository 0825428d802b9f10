"""scripts/benchmark.py's output: a table whose columns line up, and text that stands on its own."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "benchmark.py"


def test_the_script_cites_no_issue_numbers() -> None:
    # A reader of the output or the script has no issue tracker; the goals are in docs/benchmarks.md.
    assert re.findall(r"issue[' ]*s? *\d+|the issue'?s", SCRIPT.read_text()) == []


def test_the_table_columns_line_up_however_long_a_name(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location("benchmark_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "benchmark_script", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    module.print_table([("sequential prepare p50", "1.00 ms", "0.50 ms", "2.00x", "<= 1.5x floor"),
                        ("MPS share prepare, cold, NVIDIA's daemon (p50 of 20)", "12.0 ms", "", "", "< 30 ms")])
    lines = capsys.readouterr().out.splitlines()
    header, _rule, first, second = lines
    assert header.index("Tessera") + len("Tessera") == first.index("1.00 ms") + len("1.00 ms") \
        == second.index("12.0 ms") + len("12.0 ms")
    assert header.index("goal") == first.index("<= 1.5x") == second.index("< 30 ms")
