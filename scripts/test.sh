#!/usr/bin/env bash
# Run every check the project's CI runs: lint, types, the test suite.
# Creates .venv (if missing) and installs the project with its test extras into it.
set -euo pipefail
cd "$(dirname "$0")/.."
# One line per step: a first run spends minutes in pip, which must not look like a hang (here or in .ci/run's log).
if [ ! -x .venv/bin/python ]; then
  echo "== creating the virtual environment .venv (first run)"
  python3 -m venv .venv
fi
echo "== upgrading pip in .venv"
.venv/bin/python -m pip install -q --upgrade pip
echo "== installing Tessera with its test extras into .venv (pip; minutes the first time)"
.venv/bin/python -m pip install -q -e '.[test]'
echo "== ruff"
.venv/bin/ruff check .
echo "== mypy"
.venv/bin/mypy
echo "== import contracts (lint-imports; pyproject.toml [tool.importlinter])"
.venv/bin/lint-imports
echo "== NVIDIA's MPS daemon for the MPS tests (never fails the run)"
bash scripts/fetch-nvidia-mps.sh
echo "== pytest"
# Two workers on CI's two cores: the suite is mostly subprocess and socket waits.
.venv/bin/python -m pytest -n auto "$@"
