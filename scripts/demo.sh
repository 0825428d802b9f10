#!/usr/bin/env bash
# SIMULATION demo: a simulated GPU node end to end (ResourceSlices, prepare over the real
# kubelet gRPC socket, CDI specs, an MPS daemon stand-in). No cluster, GPU or root needed.
# Options go to `python -m driver demo` (see --help); paths in them are relative to where you run this.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="$root/.venv/bin/python"
if [ ! -x "$python" ]; then
  python3 -m venv "$root/.venv"
fi
# Install on the first run and whenever pyproject.toml changes; later runs start the demo at once.
stamp="$root/.venv/.demo-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  "$python" -m pip install -q --upgrade pip
  "$python" -m pip install -q -e "$root"
  touch "$stamp"
fi
exec "$python" -m driver demo "$@"
