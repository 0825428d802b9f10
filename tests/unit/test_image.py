"""The plugin image's rules, checked without Docker: base pinned by digest, unused code removed, no stand-ins.

The build context is reproduced from deploy/Dockerfile.dockerignore (last matching rule wins, a
matching directory takes its contents along), and the driver is run from a copy of that context,
as the image's environment holds it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"
BUILD_VENV = ROOT / "deploy" / "build-venv.sh"
DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                          if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in (raw.strip() for raw in text.splitlines()) if line]


def ignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    """(excludes, pattern) per dockerignore line, in order."""
    rules = []
    for raw in DOCKERIGNORE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        rules.append((not include, re.compile(regex)))
    return rules


def in_context(relative: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    parts = relative.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    sent = True
    for excludes, pattern in rules:
        if any(pattern.fullmatch(candidate) for candidate in candidates):
            sent = not excludes
    return sent


def repository_files() -> Iterator[str]:
    for directory, subdirs, files in os.walk(ROOT):
        here = Path(directory).relative_to(ROOT)
        # Dot directories (.git, .venv, caches) hold nothing an image could want; skip walking them.
        subdirs[:] = [d for d in subdirs if not d.startswith(".")]
        for name in files:
            yield (here / name).as_posix()


@pytest.fixture(scope="module")
def context() -> set[str]:
    rules = ignore_rules()
    return {f for f in repository_files() if in_context(f, rules)}


def test_every_base_image_is_pinned_by_digest() -> None:
    steps = instructions(DOCKERFILE)
    args = dict(arg.split("=", 1) for kind, arg in steps if kind == "ARG" and "=" in arg)
    bases = [arg.split()[0] for kind, arg in steps if kind == "FROM"]
    assert len(bases) == 2, bases
    for base in bases:
        image = args.get(base.strip("${}"), "") if base.startswith("$") else base
        assert DIGEST.search(image), f"FROM {base} ({image}) is not pinned by digest"
    assert "docker buildx imagetools inspect" in DOCKERFILE.read_text(), "the refresh command is documented"


def test_the_build_stage_runs_the_pruning_script_and_the_final_stage_copies_only_its_result() -> None:
    steps = instructions(DOCKERFILE)
    runs = [arg for kind, arg in steps if kind == "RUN"]
    assert "sh deploy/build-venv.sh /opt/tessera" in runs
    final = steps[max(i for i, (kind, _) in enumerate(steps) if kind == "FROM"):]
    assert [arg for kind, arg in final if kind == "COPY"] == ["--from=build /opt/tessera /opt/tessera"]
    script = BUILD_VENV.read_text()
    removed = re.search(r'^rm -rf (.*)$', script, re.MULTILINE)
    assert removed is not None
    assert '"$site/kubernetes/aio"' in removed.group(1) and '"$site/driver/simulation/bin"' in removed.group(1)
    # ... and a check that fails the build if they came back.
    checked = re.search(r"^for unwanted in (.*); do$", script, re.MULTILINE)
    assert checked is not None
    assert {"kubernetes/aio", "driver/simulation/bin", "aiohttp"} <= set(checked.group(1).split())


def test_the_context_holds_what_the_build_copies_and_no_stand_ins(context: set[str]) -> None:
    copied = [source for kind, arg in instructions(DOCKERFILE) if kind == "COPY" and "--from" not in arg
              for source in arg.split()[:-1]]
    assert {"pyproject.toml", "README.md", "driver", "cdi", "deploy/build-venv.sh"} <= set(copied)
    for source in copied:
        assert any(f == source or f.startswith(source.rstrip("/") + "/") for f in context), f"{source} not sent"
    assert "driver/commands/run/app.py" in context and "cdi/__init__.py" in context
    assert "driver/simulation/discovery.py" in context  # the chart's `simulate` value needs the simulated GPUs
    assert not [f for f in context if f.startswith("driver/simulation/bin/")], "stand-ins must stay out"
    assert not [f for f in context if f.split("/")[0] in ("tests", "scripts", "examples", "docs")]
    assert not [f for f in context if "__pycache__" in f or f.endswith(".pyc")]


@pytest.fixture(scope="module")
def image_tree(context: set[str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    tree = tmp_path_factory.mktemp("image-context")
    for relative in context:
        (tree / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / relative, tree / relative)
    return tree


def run_from(tree: Path, *args: str, env: dict[str, str] | None = None,
             timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run Python with only ``tree``'s driver and cdi packages importable (the editable install's path is hidden)."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "TESSERA"))}
    # The copied tree has no bytecode: compile it once, outside the tree, for every run of this module.
    environment |= {"PYTHONPATH": str(tree), "PYTHONPYCACHEPREFIX": str(tree.parent / "pycache"), **(env or {})}
    code = (f"import sys; sys.path[:] = [p for p in sys.path if p != {str(ROOT)!r}]; "
            "import runpy; sys.argv = ['python -m driver', *sys.argv[1:]]; "
            "runpy.run_module('driver', run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code, *args], cwd=tree, env=environment, capture_output=True,
                          text=True, timeout=timeout, check=False)


def test_the_demo_refuses_in_one_line_where_the_stand_ins_are_left_out(image_tree: Path) -> None:
    done = run_from(image_tree, "demo")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "stand-in NVIDIA tools" in done.stderr and "bash scripts/demo.sh" in done.stderr


def test_run_without_simulate_imports_no_simulation_code(image_tree: Path) -> None:
    """The production start-up path: everything `run` imports before and at GPU discovery (no NVIDIA driver here)."""
    # Short paths: the socket paths must stay within gRPC's 105 bytes, which pytest's tmp_path can pass.
    tmp_path = Path(tempfile.mkdtemp(prefix="img-", dir="/tmp"))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nkind: Config\ncurrent-context: x\n"
                          "clusters: [{name: c, cluster: {server: 'http://127.0.0.1:9'}}]\n"
                          "users: [{name: u, user: {}}]\ncontexts: [{name: x, context: {cluster: c, user: u}}]\n")
    args = ("run", "--node-name", "n1", "--kubeconfig", str(kubeconfig), "--plugins-dir", str(tmp_path / "plugins"),
            "--registrar-dir", str(tmp_path / "registry"), "--cdi-root", str(tmp_path / "cdi"), "--http-port", "0",
            "--log-format", "text")
    try:
        stderr = run_from(image_tree, *args, env={"PYTHONPROFILEIMPORTTIME": "1"}, timeout=30).stderr
    except subprocess.TimeoutExpired as exc:  # on a machine with a GPU it gets further and keeps retrying the API
        stderr = exc.stderr if isinstance(exc.stderr, str) else (exc.stderr or b"").decode()
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
    imported = {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}
    assert "driver.commands.run.app" in imported and "driver.gpu.state" in imported, "the run path was imported"
    assert not [m for m in imported if m.startswith("driver.simulation") or m.startswith("driver.commands.demo")]
    assert not [m for m in imported if m.startswith(("kubernetes.aio", "aiohttp"))]
