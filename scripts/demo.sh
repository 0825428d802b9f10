#!/usr/bin/env bash
# SIMULATION demo: a simulated GPU node end to end (ResourceSlices, prepare over the real
# kubelet gRPC socket, CDI specs, an MPS daemon stand-in). No cluster, GPU or root needed.
# Options go to `python -m driver demo` (see --help); paths in them are relative to where you run this.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="$root/.venv/bin/python"
# One line per setup step, on stderr (the demo's own output is stdout): a first run spends a minute
# or more in pip, which must not look like a hang.
say() { echo "demo.sh: $*" >&2; }
if [ ! -x "$python" ]; then
  say "creating the virtual environment $root/.venv (first run)"
  python3 -m venv "$root/.venv"
fi
# Install on the first run and whenever pyproject.toml changes; later runs start the demo at once.
stamp="$root/.venv/.demo-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  say "upgrading pip in .venv"
  "$python" -m pip install -q --upgrade pip
  say "installing Tessera and its dependencies into .venv (pip; a minute or more the first time)"
  "$python" -m pip install -q -e "$root"
  touch "$stamp"
  say "installed; starting the demo"
fi
exec "$python" -m driver demo "$@"
