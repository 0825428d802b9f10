"""Regenerate the Python gRPC stubs for the kubelet protos in ``proto/dra/``.

Usage: ``python proto/generate.py [--out DIR]`` (default: ``driver/kubeletplugin/api``).

The protos are copied into a temporary tree that mirrors the package path
(``driver/kubeletplugin/api/*.proto``) and compiled with ``-I`` at its root. protoc then names
every module by its package path, so the generated ``*_pb2_grpc.py`` files import
``driver.kubeletplugin.api.<name>_pb2`` and need no rewriting afterwards. The same trick keeps
the descriptor-pool file names distinct (the upstream files are all called ``api.proto``).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = REPO_ROOT / "proto" / "dra"
PACKAGE_PATH = Path("driver", "kubeletplugin", "api")
DEFAULT_OUT = REPO_ROOT / PACKAGE_PATH

INIT_TEXT = '''"""Generated gRPC stubs for the kubelet plugin APIs. Do not edit.

Regenerate with ``python proto/generate.py`` after changing ``proto/dra/*.proto``.
"""
'''


def generate(out_dir: Path, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Compile every ``*.proto`` in ``proto_dir`` into ``out_dir``; return the files written."""
    protos = sorted(proto_dir.glob("*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files in {proto_dir}")
    with tempfile.TemporaryDirectory(prefix="tessera-protoc-") as tmp:
        src_root = Path(tmp, "src")
        gen_root = Path(tmp, "gen")
        (src_root / PACKAGE_PATH).mkdir(parents=True)
        gen_root.mkdir()
        for proto in protos:
            shutil.copyfile(proto, src_root / PACKAGE_PATH / proto.name)
        args = [
            "grpc_tools.protoc",
            f"-I{src_root}",
            f"--python_out={gen_root}",
            f"--pyi_out={gen_root}",
            f"--grpc_python_out={gen_root}",
            *(str(src_root / PACKAGE_PATH / proto.name) for proto in protos),
        ]
        rc = int(protoc.main(args))
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc} (arguments: {args[1:]})")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for generated in sorted((gen_root / PACKAGE_PATH).iterdir()):
            target = out_dir / generated.name
            shutil.copyfile(generated, target)
            written.append(target)
    init = out_dir / "__init__.py"
    init.write_text(INIT_TEXT)
    written.append(init)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"directory for the generated modules (default: {DEFAULT_OUT})")
    options = parser.parse_args(argv)
    for path in generate(options.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
