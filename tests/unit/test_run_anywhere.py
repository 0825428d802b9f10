"""``python -m driver`` works from any directory, including one holding ``cdi/`` or ``driver/`` folders.

A node's /var/run holds a ``cdi/`` folder. Python puts the current directory first on ``sys.path``, so
a folder without ``__init__.py`` there becomes a namespace package, and it used to win over the project's
``cdi`` package when the project was installed editable with setuptools' import hook (which is asked only
after the path). These tests run the installed CLI from such a directory.
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import cdi
import driver
from driver.gpu.record.checkpoint import Checkpoint, CheckpointStore


def _installed() -> bool:
    try:
        metadata.distribution("tessera")
    except metadata.PackageNotFoundError:
        return False
    return True


pytestmark = pytest.mark.skipif(not _installed(), reason="the project is not installed into this interpreter "
                                "(scripts/test.sh installs it); outside the source tree nothing finds it")


@pytest.fixture
def shadowing_cwd(tmp_path: Path) -> Path:
    cwd = tmp_path / "cwd"
    (cwd / "cdi").mkdir(parents=True)  # like /var/run/cdi on a node
    (cwd / "cdi" / "nvidia.yaml").write_text("cdiVersion: 0.5.0\n")
    (cwd / "driver").mkdir()
    return cwd


def _run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


def test_packages_resolve_to_the_project_not_the_current_directory(shadowing_cwd: Path) -> None:
    done = _run(shadowing_cwd, "-c", "import cdi, driver; print(cdi.__file__); print(driver.__file__)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(Path(cdi.__file__).resolve()), str(Path(driver.__file__).resolve())]


def test_inspect_runs_from_a_directory_with_a_cdi_folder(shadowing_cwd: Path, tmp_path: Path) -> None:
    plugins = tmp_path / "plugins"
    CheckpointStore(plugins / "gpu.tessera.dev" / "checkpoint.json").save(Checkpoint())
    cdi_root = tmp_path / "cdi-root"
    cdi_root.mkdir()
    # An orphan spec: listing it needs the real cdi package's functions, not an empty namespace package.
    (cdi_root / "k8s.gpu.tessera.dev-claim_orphan.json").write_text("{}")
    done = _run(shadowing_cwd, "-m", "driver", "inspect", "--plugins-dir", str(plugins),
                "--cdi-root", str(cdi_root), "--json")
    assert "Traceback" not in done.stderr, done.stderr
    assert '"orphan_cdi_specs"' in done.stdout
    assert "k8s.gpu.tessera.dev-claim_orphan.json" in done.stdout
