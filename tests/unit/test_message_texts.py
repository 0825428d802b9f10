"""Texts a tenant or operator reads (errors the kubelet shows, log lines) name no code of the driver.

Every ``raise SomeError(...)`` and every log call in the driver is read from its source: the literal parts
of its message must not name a function (``ensure_running()``), a module file (``manager.py``) or a module
path (``driver.gpu...``). Errors that only a programming mistake raises (RuntimeError, TypeError,
AssertionError, NotImplementedError) are left out: no tenant or operator meets them.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from driver.gpu.mps.manager import MpsManager
from driver.gpu.mps.model import MpsDaemonSpec, MpsError

DRIVER = Path(__file__).resolve().parents[2] / "driver"
PROGRAMMING_ERRORS = {"RuntimeError", "TypeError", "AssertionError", "NotImplementedError"}
LOG_METHODS = {"debug", "info", "warning", "error", "exception", "critical"}
INTERNAL = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\(\)|\b[a-z_][a-z0-9_]*\.py\b|\bdriver\.[a-z_]+")


def _literal_text(node: ast.AST) -> str:
    """The literal parts of every string in ``node`` (an f-string's placeholders dropped)."""
    parts: list[str] = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            parts.append(sub.value)
    return "\x00".join(parts)


def _message_calls(tree: ast.AST) -> list[tuple[int, ast.Call]]:
    found: list[tuple[int, ast.Call]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            func = node.exc.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name not in PROGRAMMING_ERRORS:
                found.append((node.lineno, node.exc))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in LOG_METHODS and isinstance(node.func.value, ast.Name)
              and node.func.value.id in ("log", "logger", "logging")):
            found.append((node.lineno, node))
    return found


def internal_names_in_messages(root: Path) -> list[str]:
    """``path:line: text`` for each message under ``root`` that names code."""
    hits: list[str] = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, call in _message_calls(tree):
            texts = [_literal_text(arg) for arg in call.args]
            texts += [_literal_text(k.value) for k in call.keywords if k.arg not in ("extra", "exc_info")]
            for text in texts:
                if match := INTERNAL.search(text):
                    hits.append(f"{path.relative_to(root.parent)}:{line}: {match.group(0)!r} in {text!r}")
    return hits


def test_no_error_or_log_message_of_the_driver_names_a_function_or_a_module() -> None:
    assert internal_names_in_messages(DRIVER) == []


def test_the_scan_finds_a_function_name_in_a_message(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        "def f(x):\n"
        "    raise ValueError(f'daemon {x} runs: adopt it with ensure_running()')\n"
        "def g(log):\n"
        "    log.warning('see %s in manager.py', 1)\n"
        "def h():\n"
        "    raise RuntimeError('call complete() first')\n")
    hits = internal_names_in_messages(tmp_path / "pkg")
    assert len(hits) == 2 and "ensure_running()" in hits[0] and "manager.py" in hits[1]


def test_a_second_daemon_in_the_same_directory_is_refused_in_the_operators_words(tmp_path: Path) -> None:
    # The refusal a tenant's prepare can meet when a daemon outlived its record: said without code names.
    from driver.gpu.mps.identity import DaemonIdentity

    class Running(DaemonIdentity):
        def __init__(self) -> None:
            pass

        def unrecorded(self, pipe_dir: Path) -> list[tuple[int, int]]:
            return [(4242, 1)]

    manager = MpsManager(tmp_path / "root", tmp_path / "mps", launcher=None)  # type: ignore[arg-type]
    manager.identity = Running()
    with pytest.raises(MpsError) as raised:
        manager.start(MpsDaemonSpec(daemon_id="plan-0123456789ab", gpu_uuids=["GPU-1"]))
    assert "pid 4242" in str(raised.value) and "already runs" in str(raised.value)
    assert INTERNAL.search(str(raised.value)) is None
