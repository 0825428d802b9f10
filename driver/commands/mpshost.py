"""Flags of ``python -m driver mps-host`` (see driver/gpu/mps/hostserver.py for what the host does)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from driver.kubeletplugin.logfmt import configure_logging


def add_host_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", required=True, type=Path,
                        help="Unix socket to serve; the plugin's --mps-host-socket (its directory is made mode 0700)")
    parser.add_argument("--mps-dir", required=True, type=Path,
                        help="the plugin's MPS directory (<plugins-dir>/<driver-name>/mps): daemons' pipe, log and "
                             "shm directories must be inside it")
    parser.add_argument("--driver-root", default=Path("/"), type=Path,
                        help="where nvidia-cuda-mps-control and the driver's libraries are (default /)")
    parser.add_argument("--chroot", action="store_true",
                        help="run daemons chrooted into the driver root, so they see its /dev and libraries "
                             "(GPU Operator nodes); the MPS directory is bound in at the same path (the host "
                             "makes the mount point, so the root must be writable)")
    parser.add_argument("--private-shm", action="store_true",
                        help="give each daemon the per-daemon shm directory the plugin asks for as its /dev/shm, "
                             "in a private mount namespace (needs CAP_SYS_ADMIN)")
    parser.add_argument("--shm-tmpfs", action="store_true",
                        help="mount each daemon's shm directory as a tmpfs of its own, of the size the plugin "
                             "asks for, in this host's mount namespace (the MPS directory volume needs "
                             "Bidirectional propagation so the node, and the clients, see it); implies "
                             "--private-shm")
    parser.add_argument("--shm-size", default="1Gi",
                        help="with --shm-tmpfs: the tmpfs size for a request that names none (an older "
                             "plugin's); a quantity from 64Mi to 1Ti (default 1Gi)")
    parser.add_argument("--host-root", default=Path("/"), type=Path,
                        help="where the host's /proc is (default /): the MIG capability numbers are read there")
    parser.add_argument("--dev-root", default=Path("/"), type=Path,
                        help="the root whose dev/ this container's daemons open devices through (default /, its "
                             "own); MIG capability nodes a daemon needs are made there before it starts")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", default="json", choices=["json", "text"])


def main_host(args: argparse.Namespace) -> int:
    from driver.gpu.mps.hostcheck import HostConfig, HostError, default_tools
    from driver.gpu.mps.hostcmd import HostMode
    from driver.gpu.mps.hostserver import run_host
    from driver.gpu.mps.shmmount import parse_shm_size

    configure_logging(args.log_level, args.log_format)
    try:
        shm_size = parse_shm_size(args.shm_size)
    except ValueError as exc:
        print(f"tessera mps-host: --shm-size {args.shm_size!r}: {exc}", file=sys.stderr)
        return 2
    mode = HostMode(driver_root=args.driver_root, chroot=args.chroot, private_shm=args.private_shm or args.shm_tmpfs,
                    shm_tmpfs=args.shm_tmpfs, shm_size=shm_size, host_root=args.host_root.absolute(),
                    dev_root=args.dev_root.absolute())
    config = HostConfig(socket_path=args.socket.absolute(), mps_dir=args.mps_dir, mode=mode, tools=default_tools())
    try:
        return run_host(config)
    except HostError as exc:
        print(f"tessera mps-host: {exc}", file=sys.stderr)
        return 1
