"""The layers import one way: the GPU code never reaches for the simulation or the app wiring.

The choice between real hardware and the simulated node is made where the app is wired
(``driver/nodelayout.py``); code under ``driver/gpu`` sees only the ``Discovery`` it is given.
The kubelet-plugin layer's own rule is checked in ``test_kubeletplugin_helper.py``. Every module
also has its line in the map of docs/design.md.
"""

from __future__ import annotations

import ast
import re
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
    assert package / "devices.py" in files
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
