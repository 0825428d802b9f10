"""The layers import one way: the GPU code never reaches for the simulation or the app wiring.

The choice between real hardware and the simulated node is made where the app is wired
(``driver/nodelayout.py``); code under ``driver/gpu`` sees only the ``Discovery`` it is given.
The kubelet-plugin layer's own rule is checked in ``test_kubeletplugin_helper.py``; the import
contracts of pyproject.toml (``lint-imports``) check the layers. No two modules import each other,
even through others, in an annotation or inside a function. Every module also has its line in the
map of docs/design.md.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from pathlib import Path

import driver.gpu

# What driver/gpu may import from this project: itself, the generic plugin layer, the byte units,
# the CDI package, and the ``driver`` package itself (only to locate it on disk).
ALLOWED = ("driver.gpu", "driver.kubeletplugin", "driver.units", "cdi")


def _project_imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add(node.module or "")
    return {m for m in found if m in ("driver", "cdi") or m.startswith(("driver.", "cdi."))}


def _allowed(module: str) -> bool:
    return module == "driver" or any(module == a or module.startswith(a + ".") for a in ALLOWED)


def test_the_gpu_code_imports_neither_the_simulation_nor_the_app() -> None:
    package = Path(driver.gpu.__file__).parent
    files = sorted(package.rglob("*.py"))
    assert package / "published" / "devices.py" in files
    leaks = {str(p.relative_to(package)): sorted(m for m in _project_imports(p) if not _allowed(m)) for p in files}
    assert {f: m for f, m in leaks.items() if m} == {}


def test_the_check_sees_a_leak(tmp_path: Path) -> None:
    leaky = tmp_path / "leaky.py"
    leaky.write_text("import driver.simulation.discovery\n"
                     "def f() -> None:\n    from driver.commands.run.app import run\n"
                     "    from driver.gpu import devices\n")
    leaks = sorted(m for m in _project_imports(leaky) if not _allowed(m))
    assert leaks == ["driver.commands.run.app", "driver.simulation.discovery"]


def test_every_module_has_its_line_in_the_design_map() -> None:
    root = Path(driver.gpu.__file__).parents[2]
    design = (root / "docs" / "design.md").read_text()
    code_map = design[design.index("## Map of the code"):design.index("## The path of a prepare")]
    modules = [p for package in ("driver", "cdi") for p in sorted((root / package).rglob("*.py"))
               if "api" not in p.relative_to(root).parts and p.name not in ("__init__.py", "__main__.py")]
    assert len(modules) > 50
    missing = [str(p.relative_to(root)) for p in modules
               if not re.search(rf"(?<![\w.]){re.escape(p.name)}", code_map)]
    assert missing == [], "add a line for each to the map in docs/design.md"


def _module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the project's packages under ``root`` (generated stubs aside)."""
    names: dict[str, Path] = {}
    for package in ("driver", "cdi"):
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if "api" in parts:
                continue
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imported_modules(path: Path, name: str, modules: Mapping[str, Path]) -> set[str]:
    """The project modules ``path`` imports anywhere (module level, functions, TYPE_CHECKING blocks)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            targets.add(base)
            targets.update(f"{base}.{alias.name}" for alias in node.names)
    found = set()
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)
    return found


def _cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Every group of modules that import each other, directly or through others (Tarjan's components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in sorted(graph[module]):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = [stack.pop()]
            while group[-1] != module:
                group.append(stack.pop())
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(groups)


def _import_graph(root: Path) -> dict[str, set[str]]:
    modules = _module_names(root)
    return {name: _imported_modules(path, name, modules) for name, path in modules.items()}


def test_no_modules_import_each_other() -> None:
    graph = _import_graph(Path(driver.gpu.__file__).parents[2])
    assert len(graph) > 150 and "driver.gpu.state" in graph["driver.gpu.recovery"]
    assert _cycles(graph) == [], "move what both need into a module below them"


def test_the_cycle_check_sees_imports_in_annotations_and_functions(tmp_path: Path) -> None:
    package = tmp_path / "cdi"
    package.mkdir()
    (tmp_path / "driver").mkdir()
    (package / "__init__.py").write_text("")
    (package / "spec.py").write_text("from cdi.version import minimum\n")
    (package / "version.py").write_text("from typing import TYPE_CHECKING\n"
                                        "if TYPE_CHECKING:\n    from cdi.names import Name\n")
    (package / "names.py").write_text("def f() -> None:\n    from . import spec\n")
    (package / "store.py").write_text("import cdi.spec\n")
    assert _cycles(_import_graph(tmp_path)) == [["cdi.names", "cdi.spec", "cdi.version"]]


def test_no_code_or_test_names_an_issue_or_an_acceptance_letter() -> None:
    # An issue's number and its lettered points mean nothing to a reader of the code: say what the code is for.
    root = Path(__file__).resolve().parents[2]
    cited = re.compile(r"\b[Ii]ssues? #?\d+\b|^def test_[b-z]_", re.MULTILINE)
    found = [f"{path.relative_to(root)}: {match.group(0)}"
             for top in ("driver", "cdi", "tests", "scripts") for path in sorted((root / top).rglob("*.py"))
             for match in cited.finditer(path.read_text()) if path.name != "test_layering.py"]
    assert found == []
