"""Each MPS daemon's own /dev/shm tmpfs: its size (plan, claim, flag), the LocalLauncher's and the MPS
host's mount and unmount, and records written before it existed. Mounting tests skip where mount(2)
is not permitted; every one unmounts what it mounted, also when it fails."""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from driver.config import SettingsError, add_settings_arguments, parse_settings, settings_problems
from driver.gpu.claimconfig.api import ConfigError, parse_config
from driver.gpu.mps.hostcheck import HostConfig, HostError, check_config, default_tools
from driver.gpu.mps.hostclient import HostReply, HostRequest, MpsHostLauncher, encode
from driver.gpu.mps.hostcmd import HostMode
from driver.gpu.mps.launch import MpsLaunchError
from driver.gpu.mps.locallauncher import LocalLauncher
from driver.gpu.mps.manager import MpsManager
from driver.gpu.mps.model import MpsDaemonRecord, MpsDaemonSpec
from driver.gpu.mps.shmmount import ShmTmpfs, is_mount_point, mount_tmpfs, unmount_all
from driver.gpu.published.sharelayout import GpuForm
from driver.gpu.published.sharingplan import PlanError, load_plans
from driver.gpu.runtime.sharing import _same_limits
from driver.units import GIB, MIB
from tests.support.mpshost import GPU, launch_request, make_dirs, serving
from tests.support.processes import poll_until, standin_sandbox
from tests.support.shm import (
    fill_until_full,
    mounts_under,
    no_mounts_left,
    size_option,
    tmpfs_mount_problem,
    write_ok,
)

PROBLEM = tmpfs_mount_problem()
needs_mount = pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")
DAEMON = "plan-0123456789ab"


@pytest.fixture
def top() -> Iterator[Path]:
    with standin_sandbox("tsm", ["nvidia-cuda-mps-control"]) as directory, no_mounts_left(directory):
        yield directory


def local_manager(top: Path, default_size: int = 128 * MIB) -> MpsManager:
    launcher = LocalLauncher(top / "root", shm=ShmTmpfs(default_size, "--mps-shm-tmpfs", default_tools()))
    return MpsManager(top / "root", top / "mps", launcher, shm_dir=top / "mps-shm", ready_timeout=20.0)


# -- sizes: where they are written, and records from before --------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    ("1Mi", "GpuConfig.sharing.mpsConfig.shmSize: 1048576 bytes is out of range; expected a quantity from 64Mi to 1Ti"),
    ("2Ti", "GpuConfig.sharing.mpsConfig.shmSize: 2199023255552 bytes is out of range"),
    ("lots", 'GpuConfig.sharing.mpsConfig.shmSize: "lots" is not a valid quantity'),
])
def test_a_claims_shm_size_out_of_range_fails_naming_the_field(value: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse_config({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig",
                      "sharing": {"strategy": "MPS", "mpsConfig": {"shmSize": value}}})


def test_a_claims_shm_size_is_taken() -> None:
    config = parse_config({"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig",
                           "sharing": {"strategy": "MPS", "mpsConfig": {"shmSize": "256Mi"}}})
    assert config.sharing is not None and config.sharing.mpsConfig is not None
    assert config.sharing.mpsConfig.shmSize == 256 * MIB


@pytest.mark.parametrize("entry", [{"mps": {"shares": 2, "shmSize": "8Mi"}},
                                   {"consumable": {"shmSize": "8Mi"}}])
def test_a_plans_shm_size_out_of_range_stops_naming_the_entry(tmp_path: Path, entry: dict[str, object]) -> None:
    path = tmp_path / "plans.yaml"
    path.write_text(json.dumps({"plans": {"p": {"gpus": [{"match": {"all": True}, **entry}]}}}))
    form = next(iter(entry))
    with pytest.raises(PlanError, match=rf"plans\.p\.gpus\[0\]\.{form}\.shmSize: 8388608 bytes is out of range"):
        load_plans(path)


def test_the_node_default_is_a_flag_with_a_one_line_error() -> None:
    assert parse_settings([]).mps_shm_size == GIB
    assert parse_settings([], {"MPS_SHM_SIZE": "256Mi"}).mps_shm_size == 256 * MIB
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    args = parser.parse_args(["--mps-shm-size", "10Mi"])
    with pytest.raises(SettingsError) as caught:
        parse_settings(["--mps-shm-size", "10Mi"])
    assert settings_problems(caught.value, args) == [
        "--mps-shm-size '10Mi': 10485760 bytes is out of range; expected a quantity from 64Mi to 1Ti"]


def test_records_and_layouts_written_before_shm_sizes_load_and_keep_their_daemon() -> None:
    spec = MpsDaemonSpec(daemon_id=DAEMON, gpu_uuids=[GPU], active_thread_percentage=25)
    stored = {"spec": {"daemon_id": DAEMON, "gpu_uuids": [GPU], "active_thread_percentage": 25}, "pid": 7,
              "pipe_dir": "/m/p", "log_dir": "/m/l", "started_at": "2026-01-01T00:00:00+00:00",
              "process_start_time": 1}
    record = MpsDaemonRecord.model_validate(stored)
    assert record.spec.shm_size is None and record.shm_dir is None
    shares = GpuForm.model_validate({"strategy": "MPS", "count": 2, "memory_bytes_per_share": GIB})
    assert shares.shm_size_bytes is None
    # A plan that now names a size does not restart the running daemon under its clients.
    assert _same_limits(record.spec, spec.model_copy(update={"shm_size": 256 * MIB}))


def test_requests_leave_unset_fields_out_for_older_hosts() -> None:
    line = encode(HostRequest(launch=launch_request(Path("/m")))).decode()
    assert "shm_size" not in line and "shm_dir" not in line


# -- the LocalLauncher (--mps-shm-tmpfs) ---------------------------------------------------------------


@needs_mount
def test_the_local_launcher_gives_each_daemon_its_own_tmpfs_as_dev_shm(top: Path) -> None:
    manager = local_manager(top)
    record = manager.start(MpsDaemonSpec(daemon_id=DAEMON, gpu_uuids=[GPU], shm_size=80 * MIB))
    other = manager.start(MpsDaemonSpec(daemon_id="claim-0123456789ab-0", gpu_uuids=[GPU]))
    assert record.shm_dir == top / "mps" / DAEMON / "shm", "clients mount the tmpfs the daemon sees"
    mounts = {m.point: m for m in mounts_under(top)}
    own, default = mounts[record.shm_dir], mounts[top / "mps" / "claim-0123456789ab-0" / "shm"]
    assert own.fstype == "tmpfs" and {"nosuid", "nodev", "noexec"} <= own.options
    assert size_option(80 * MIB) in own.super_options and size_option(128 * MIB) in default.super_options
    assert stat.S_IMODE(os.stat(record.shm_dir).st_mode) == 0o1777
    # The daemon sees it as /dev/shm (its own mount namespace); the plugin's own /dev/shm is untouched.
    assert os.path.samestat(os.stat(f"/proc/{record.pid}/root/dev/shm"), os.stat(record.shm_dir))
    assert os.readlink(f"/proc/{record.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
    # Nothing of the driver's is on it: its pipe and log directories are on the MPS directory's file system.
    for own_dir in (record.pipe_dir, record.log_dir):
        assert os.stat(own_dir).st_dev == os.stat(top / "mps").st_dev != os.stat(record.shm_dir).st_dev
    # One daemon's tenant filling its /dev/shm leaves the other's, and the driver's directory, writable.
    fill_until_full(record.shm_dir)
    write_ok(other.shm_dir)  # type: ignore[arg-type]
    write_ok(top / "mps" / DAEMON)
    manager.stop(record)
    manager.stop(other)
    assert mounts_under(top) == [], "every tmpfs unmounted with its daemon"
    assert list((top / "mps").iterdir()) == []


@needs_mount
def test_a_daemon_restarted_in_its_directories_keeps_its_tmpfs_for_its_clients(top: Path) -> None:
    launcher = LocalLauncher(top / "root", shm=ShmTmpfs(64 * MIB, "--mps-shm-tmpfs", default_tools()))
    request = launch_request(top / "mps", shm_dir=top / "mps" / DAEMON / "shm")
    make_dirs(request)
    first = launcher.launch(request)
    assert first.shm_dir is not None
    (first.shm_dir / "client-file").write_text("kept")
    os.kill(first.pid, signal.SIGKILL)
    poll_until(lambda: not Path(f"/proc/{first.pid}").exists(), "the killed daemon to be reaped")
    second = launcher.launch(request)
    # Clients' bind mounts hold this tmpfs: the new daemon must see the same one, not a fresh one.
    # (The launcher returns before the daemon's wrapper has bound it over /dev/shm.)
    seen = Path(f"/proc/{second.pid}/root/dev/shm") / "client-file"
    poll_until(lambda: seen.exists(), "the restarted daemon to see its tmpfs as /dev/shm")
    assert seen.read_text() == "kept"
    assert len(mounts_under(top)) == 1, "not mounted twice"
    os.kill(second.pid, signal.SIGKILL)
    launcher.unmount_shm(DAEMON, request.shm_dir)  # type: ignore[arg-type]
    assert mounts_under(top) == []


def test_a_shm_dir_that_is_a_symlink_is_never_mounted_over_and_the_error_names_the_flag(top: Path) -> None:
    elsewhere = top / "elsewhere"
    elsewhere.mkdir()
    request = launch_request(top / "mps", shm_dir=top / "mps" / DAEMON / "shm")
    for directory in (request.pipe_dir, request.log_dir):
        directory.mkdir(parents=True)
    (top / "mps" / DAEMON / "shm").symlink_to(elsewhere)
    launcher = LocalLauncher(top / "root", shm=ShmTmpfs(64 * MIB, "--mps-shm-tmpfs", default_tools()))
    with pytest.raises(MpsLaunchError) as caught:
        launcher.launch(request)
    message = str(caught.value)
    assert message.startswith(f"--mps-shm-tmpfs: cannot mount a tmpfs of {64 * MIB} bytes at {request.shm_dir}")
    assert ("ENOTDIR" in message or "ELOOP" in message) and "\n" not in message  # O_NOFOLLOW refused the link
    assert mounts_under(top) == [] and not is_mount_point(elsewhere)


def test_without_the_setting_daemons_share_the_plugins_dev_shm(top: Path) -> None:
    request = launch_request(top / "mps", shm_dir=top / "mps" / DAEMON / "shm")
    make_dirs(request)
    launched = LocalLauncher(top / "root").launch(request)
    assert launched.shm_dir is None and mounts_under(top) == []
    os.kill(launched.pid, signal.SIGKILL)


# -- the MPS host (--shm-tmpfs) ------------------------------------------------------------------------


@needs_mount
def test_the_host_mounts_the_requested_size_in_its_namespace_and_unmounts_on_release(top: Path) -> None:
    with serving(top, private_shm=True, shm_tmpfs=True) as served:
        request = launch_request(served.base, shm_dir=served.base / DAEMON / "shm", shm_size=96 * MIB)
        make_dirs(request)
        launched = served.launcher.launch(request)
        assert launched.shm_dir == request.shm_dir
        [mount] = mounts_under(top)
        assert mount.point == request.shm_dir and size_option(96 * MIB) in mount.super_options
        assert os.path.samestat(os.stat(f"/proc/{launched.pid}/root/dev/shm"), os.stat(request.shm_dir))
        # Only the daemon's own shm directory may be released.
        refused = served.host.answer(encode_release("claim-0123456789ab-0", request.shm_dir))
        assert refused.error is not None and refused.error.startswith("invalid release: shm_dir")
        os.kill(launched.pid, signal.SIGKILL)
        poll_until(lambda: served.host.supervisor.running() == {}, "the daemon to be reaped")
        assert mounts_under(top) != [], "kept while the daemon may be restarted in its directories"
        served.launcher.unmount_shm(DAEMON, request.shm_dir)
        assert mounts_under(top) == []
        served.launcher.unmount_shm(DAEMON, request.shm_dir)  # nothing left: fine


def encode_release(daemon_id: str, shm_dir: Path) -> bytes:
    return json.dumps({"version": 1, "release": {"daemon_id": daemon_id, "shm_dir": str(shm_dir)}}).encode()


def test_shm_tmpfs_needs_private_shm(tmp_path: Path) -> None:
    config = HostConfig(socket_path=tmp_path / "s", mps_dir=tmp_path, tools=default_tools(),
                        mode=HostMode(driver_root=tmp_path, shm_tmpfs=True))
    with pytest.raises(HostError, match="--shm-tmpfs needs --private-shm"):
        check_config(config)


def test_a_bad_host_shm_size_is_one_line_naming_the_flag(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "driver", "mps-host", "--socket", str(tmp_path / "s"),
                           "--mps-dir", str(tmp_path), "--shm-tmpfs", "--shm-size", "1Mi"], capture_output=True,
                          text=True, timeout=30, cwd=Path(__file__).parents[4])
    assert done.returncode == 2
    assert done.stderr.strip() == ("tessera mps-host: --shm-size '1Mi': 1048576 bytes is out of range; "
                                   "expected a quantity from 64Mi to 1Ti")


def test_a_host_older_than_the_plugin_is_asked_again_without_a_size(tmp_path: Path) -> None:
    # An older host (updated OnDelete) refuses fields it does not know; the plugin must not fail every
    # MPS prepare until the host pod is replaced, and an older host has no release to answer.
    path = tmp_path / "old.sock"
    seen: list[dict[str, Any]] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen(4)

        def old_host() -> None:
            for _ in range(3):
                conn, _ = server.accept()
                with conn:
                    request = json.loads(conn.recv(65536))
                    seen.append(request)
                    launch = request.get("launch") or {}
                    if "release" in request:
                        reply = HostReply(error="invalid request: launch: Field required; release: Extra inputs are "
                                                "not permitted")
                    elif "shm_size" in launch:
                        reply = HostReply(error="invalid request: launch.shm_size: Extra inputs are not permitted")
                    else:
                        reply = HostReply.model_validate({"daemon": {"pid": os.getpid()}})
                    conn.sendall(encode(reply))

        thread = threading.Thread(target=old_host, daemon=True)
        thread.start()
        launcher = MpsHostLauncher(path, shm_size=256 * MIB)
        assert launcher.launch(launch_request(tmp_path)).pid == os.getpid()
        launcher.unmount_shm(DAEMON, tmp_path / DAEMON / "shm")
        thread.join(10)
    assert [("shm_size" in (r.get("launch") or {})) for r in seen] == [True, False, False]
    assert seen[0]["launch"]["shm_size"] == 256 * MIB


@needs_mount
def test_a_link_planted_at_the_daemon_directory_is_removed_and_nothing_behind_it_is_emptied_or_unmounted(
        top: Path) -> None:
    # Someone with write access to the MPS directory replaces <mps dir>/<id> with a link to a directory whose
    # shm/ is a mount with files: O_NOFOLLOW on the last component alone let the driver empty and unmount it.
    outside = top / "outside"
    (outside / "shm").mkdir(parents=True)
    mount_tmpfs(outside / "shm", 64 * MIB)
    (outside / "shm" / "precious").write_text("keep me")
    (top / "mps").mkdir()
    (top / "mps" / DAEMON).symlink_to(outside)
    manager = local_manager(top)
    with pytest.raises(OSError) as refused:
        unmount_all(top / "mps" / DAEMON / "shm")
    assert refused.value.errno in (errno.ELOOP, errno.ENOTDIR)
    assert not is_mount_point(top / "mps" / DAEMON / "shm"), "a link is no mount point"
    manager.stop_by_id(DAEMON)  # what a prepare does first, for a daemon left without a record
    assert (outside / "shm" / "precious").read_text() == "keep me"
    assert [m.point for m in mounts_under(top)] == [outside / "shm"], "the mount behind the link stays"
    assert not (top / "mps" / DAEMON).is_symlink(), "the link is gone: the next start makes a real directory"
    record = manager.start(MpsDaemonSpec(daemon_id=DAEMON, gpu_uuids=[GPU]))
    assert (top / "mps" / DAEMON).is_dir() and not (top / "mps" / DAEMON).is_symlink()
    manager.stop(record)
    assert (outside / "shm" / "precious").read_text() == "keep me"
