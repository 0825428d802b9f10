#!/bin/sh
# Builds the plugin image's Python environment at $1 from the source tree in the current directory.
# deploy/Dockerfile runs it in its build stage; `sh deploy/build-venv.sh /tmp/x` outside Docker builds
# the same tree, which is how docs/operations.md ("The image") measured the image's size.
#
# It installs the project (not editable), then removes what the plugin never runs and checks that
# it is gone, so an image built with another builder or a wider context cannot carry it either:
#   - pip, setuptools, wheel: build tools; the plugin installs nothing at run time.
#   - kubernetes/aio: the client's asyncio copy (about 40 MB of the 75 MB package), and aiohttp with
#     the packages only it needs (kubernetes 37 requires them for aio alone); the driver uses the
#     synchronous client. kubernetes/__init__.py imports client, config, dynamic, watch, stream,
#     utils, leaderelection and informer, so those stay although the driver calls only client and
#     config. (Import trace of `run`, docs/operations.md "The image".)
#   - driver/simulation/bin: the SIMULATION stand-ins for nvidia-smi and nvidia-cuda-mps-control.
#     Nothing in the image may run a fake NVIDIA tool. The rest of driver/simulation stays: the
#     chart's `simulate` value publishes simulated GPUs on clusters without NVIDIA hardware, and it
#     is imported only when --simulate is given (tests/unit/test_image.py checks `run` without it).
set -eu

venv=${1:?usage: build-venv.sh VENV_DIR}
python=${PYTHON:-python}
async_only="aiohttp aiohttp-retry aiosignal aiohappyeyeballs frozenlist multidict yarl propcache attrs"

# One line per step on stderr: pip's own output is kept to its errors, and a build must not look like a hang.
say() { echo "build-venv.sh: $*" >&2; }

say "creating the environment $venv"
"$python" -m venv "$venv"
say "installing Tessera and its dependencies (pip; a minute or more)"
"$venv/bin/pip" install -q --no-cache-dir --disable-pip-version-check .
say "removing the kubernetes client's asyncio packages, pip, setuptools and wheel"
"$venv/bin/pip" uninstall -q --yes --disable-pip-version-check $async_only
"$venv/bin/pip" uninstall -q --yes --disable-pip-version-check pip setuptools wheel
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
rm -rf "$site/kubernetes/aio" "$site/driver/simulation/bin"

for unwanted in kubernetes/aio driver/simulation/bin pip setuptools aiohttp yarl multidict; do
    if [ -e "$site/$unwanted" ]; then
        echo "build-venv.sh: $site/$unwanted is still there" >&2
        exit 1
    fi
done
say "checking that every entry point imports without them"
# Every entry point still imports without what was removed.
"$venv/bin/python" -c 'import driver.commands.run.app, driver.commands.checknode.checks, driver.cli, driver.commands.inspect, driver.gpu.mps.hostserver'
# Bytecode now: the plugin runs with a read-only root filesystem and PYTHONDONTWRITEBYTECODE.
say "compiling bytecode"
"$venv/bin/python" -m compileall -q "$venv/lib"
say "done: $(du -sm "$venv" | cut -f1) MiB in $venv"
