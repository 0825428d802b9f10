#!/usr/bin/env bash
# SIMULATION demo: a simulated GPU node end to end (ResourceSlices, prepare over the real
# kubelet gRPC socket, CDI specs, an MPS daemon stand-in). No cluster, GPU or root needed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e .
exec .venv/bin/python -m driver demo "$@"
