"""The MPS host: the command lines it builds, what it refuses, its socket and the plugin's client.

Real launches are in test_mpshost_launch.py.
"""

from __future__ import annotations

import json
import socket
import stat
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from driver.gpu.mps.hostcheck import HostConfig, HostError, LaunchRefused, check_config, check_launch, default_tools
from driver.gpu.mps.hostclient import HostReply, MpsHostLauncher, read_line
from driver.gpu.mps.hostcmd import ROOT_PATH, WRAP_SCRIPT, HostMode, Tools, daemon_argv, daemon_env, shm_source
from driver.gpu.mps.hostserver import open_listener
from driver.gpu.mps.launch import DaemonLaunch, MpsLaunchError
from tests.support.mpshost import GPU, host_for, launch_request, make_dirs

TOOLS = Tools(unshare="/u/unshare", sh="/u/sh", mount="/u/mount", chroot="/u/chroot")


# -- command lines (pure) -------------------------------------------------------------------------


def test_plain_mode_runs_the_binary_in_the_foreground_with_the_driver_env() -> None:
    request = launch_request(Path("/m"))
    mode = HostMode(driver_root=Path("/dr"))
    assert daemon_argv(request, Path("/dr/usr/bin/nvidia-cuda-mps-control"), Path("/m"), mode, TOOLS) == [
        "/dr/usr/bin/nvidia-cuda-mps-control", "-f"]
    env = daemon_env(request, mode, {"PATH": "/dr/usr/bin:/usr/bin", "LD_LIBRARY_PATH": "/links"})
    assert env == {"PATH": "/dr/usr/bin:/usr/bin", "LD_LIBRARY_PATH": "/links",
                   "CUDA_MPS_PIPE_DIRECTORY": "/m/plan-0123456789ab/pipe",
                   "CUDA_MPS_LOG_DIRECTORY": "/m/plan-0123456789ab/log", "CUDA_VISIBLE_DEVICES": GPU}


def test_multi_user_daemons_get_the_flag_in_every_mode() -> None:
    request = launch_request(Path("/m"), multi_user=True)
    argv = daemon_argv(request, Path("/dr/usr/bin/nvidia-cuda-mps-control"), Path("/m"),
                       HostMode(driver_root=Path("/dr"), chroot=True), TOOLS)
    assert argv[-3:] == ["/usr/bin/nvidia-cuda-mps-control", "-f", "-M"]


def test_chroot_binds_the_mps_dir_and_the_hosts_shm_into_the_root_and_runs_the_binary_inside() -> None:
    request = launch_request(Path("/m"), visible_devices=[GPU, "MIG-aaaa"])
    mode = HostMode(driver_root=Path("/driver-root"), chroot=True)
    argv = daemon_argv(request, Path("/driver-root/usr/bin/nvidia-cuda-mps-control"), Path("/m"), mode, TOOLS)
    # Inside the root the pipe dir has the path the plugin knows; the root's own /dev/shm is not the
    # one clients mount, so the host's (the shared MPS tmpfs) goes over it.
    assert argv == ["/u/unshare", "--mount", "--propagation", "slave", "--", "/u/sh", "-euc", WRAP_SCRIPT,
                    "tessera-mps-wrap", "/u/mount", "/m", "/driver-root/m", "/dev/shm", "/driver-root/dev/shm", "--",
                    "/u/chroot", "/driver-root", "/usr/bin/nvidia-cuda-mps-control", "-f"]
    env = daemon_env(request, mode, {"PATH": "/driver-root/usr/bin", "LD_LIBRARY_PATH": "/container/links"})
    assert env["PATH"] == ROOT_PATH and "LD_LIBRARY_PATH" not in env, "container paths mean nothing in the root"
    assert env["CUDA_VISIBLE_DEVICES"] == f"{GPU},MIG-aaaa"


def test_private_shm_binds_the_daemons_own_directory_over_dev_shm() -> None:
    request = launch_request(Path("/m"), shm_dir=Path("/m/plan-0123456789ab/shm"))
    plain = HostMode(driver_root=Path("/"), private_shm=True)
    argv = daemon_argv(request, Path("/usr/bin/nvidia-cuda-mps-control"), Path("/m"), plain, TOOLS)
    assert argv[argv.index("/u/mount") + 1:] == ["/m/plan-0123456789ab/shm", "/dev/shm", "--",
                                                 "/usr/bin/nvidia-cuda-mps-control", "-f"]
    rooted = HostMode(driver_root=Path("/dr"), chroot=True, private_shm=True)
    argv = daemon_argv(request, Path("/dr/usr/bin/nvidia-cuda-mps-control"), Path("/m"), rooted, TOOLS)
    assert argv[argv.index("/u/mount") + 1:argv.index("/u/chroot")] == [
        "/m", "/dr/m", "/m/plan-0123456789ab/shm", "/dr/dev/shm", "--"]


def test_without_private_shm_a_requested_shm_dir_is_not_used_and_not_replied() -> None:
    request = launch_request(Path("/m"), shm_dir=Path("/m/x/shm"))
    assert shm_source(request, HostMode(driver_root=Path("/"))) is None


# -- what the host refuses --------------------------------------------------------------------------


@pytest.fixture
def base(tmp_path: Path) -> Path:
    directory = tmp_path / "mps"
    directory.mkdir()
    return directory


def test_a_well_formed_request_with_existing_directories_passes(base: Path) -> None:
    request = launch_request(base, shm_dir=base / "plan-0123456789ab" / "shm")
    make_dirs(request)
    check_launch(request, base)


@pytest.mark.parametrize(("changes", "expected"), [
    ({"pipe_dir": Path("/etc")}, "pipe_dir /etc is not inside the MPS directory"),
    ({"log_dir": Path("LOGS")}, "log_dir 'LOGS' must be an absolute path"),
    ({"shm_dir": Path("/dev/shm")}, "shm_dir /dev/shm is not inside the MPS directory"),
    ({"daemon_id": "../x"}, "daemon_id '../x' must be 1-63 characters"),
    ({"visible_devices": [f"{GPU},GPU-2"]}, "is not a GPU-... or MIG-... UUID"),
    ({"visible_devices": [GPU, GPU]}, "lists a device more than once"),
])
def test_bad_fields_are_refused_naming_the_field(base: Path, changes: dict[str, object], expected: str) -> None:
    request = DaemonLaunch.model_validate({**launch_request(base).model_dump(), **changes})
    make_dirs(launch_request(base))
    with pytest.raises(LaunchRefused) as info:
        check_launch(request, base)
    assert expected in str(info.value)


def test_paths_that_climb_out_or_go_through_a_link_are_refused(base: Path, tmp_path: Path) -> None:
    make_dirs(launch_request(base))
    climbing = launch_request(base, pipe_dir=Path(f"{base}/plan-0123456789ab/../../elsewhere"))
    with pytest.raises(LaunchRefused, match=r"must be a normalised path \(no '..'\)"):
        check_launch(climbing, base)
    outside = tmp_path / "outside"
    outside.mkdir()
    (base / "linked").symlink_to(outside)
    linked = launch_request(base, pipe_dir=base / "linked")
    with pytest.raises(LaunchRefused, match=f"goes through a symbolic link \\(it leads to {outside}\\)"):
        check_launch(linked, base)
    with pytest.raises(LaunchRefused, match="is not inside"):
        check_launch(launch_request(base, pipe_dir=base), base)


def test_missing_directories_are_refused_not_created(base: Path) -> None:
    request = launch_request(base)
    with pytest.raises(LaunchRefused, match="is not an existing directory"):
        check_launch(request, base)
    assert not (base / "plan-0123456789ab").exists()


def test_pipe_dir_too_long_for_the_control_socket_is_refused(base: Path) -> None:
    request = launch_request(base, pipe_dir=base / ("p" * 100))
    request.pipe_dir.mkdir()
    request.log_dir.mkdir(parents=True)
    with pytest.raises(LaunchRefused, match="too long: its control socket needs"):
        check_launch(request, base)


@pytest.mark.parametrize(("raw", "expected"), [
    (b"{not json", "invalid request: not JSON"),
    (b'{"version": 2, "launch": {}}', "invalid request: version: Input should be 1"),
    (b'{"version": 1, "launch": {"daemon_id": "a", "pipe_dir": "/p", "log_dir": "/l", "visible_devices": [],'
     b' "sneaky": 1}}', "launch.visible_devices: List should have at least 1 item"),
    (b'{"version": 1, "launch": {"daemon_id": "a", "pipe_dir": "/p", "log_dir": "/l", "visible_devices": ["GPU-1"],'
     b' "sneaky": 1}}', "launch.sneaky: Extra inputs are not permitted"),
    (b"[" * 5000, "invalid request: not JSON"),
    (b'{"version": 1, "launch": {"daemon_id": "plan-0123456789ab", "pipe_dir": "/p\\u0000x", "log_dir": "/l",'
     b' "visible_devices": ["GPU-1"]}}', "pipe_dir '/p\\x00x' contains a NUL character"),
])
def test_malformed_requests_get_a_one_line_error(base: Path, raw: bytes, expected: str) -> None:
    reply = host_for(base, base).answer(raw)
    assert reply.daemon is None and reply.error is not None
    assert expected in reply.error and "\n" not in reply.error


def test_config_makes_the_mount_point_in_the_root_or_says_why_it_cannot(base: Path, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    config = HostConfig(socket_path=tmp_path / "s", mps_dir=base, mode=HostMode(driver_root=root, chroot=True),
                        tools=default_tools())
    check_config(config)
    assert (root / base.relative_to("/")).is_dir()
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / base.parts[1]).write_text("a file where the root's directory should be")
    with pytest.raises(HostError, match=f"--chroot: cannot create {blocked}{base}, .* needs the driver root mounted"):
        check_config(replace(config, mode=HostMode(driver_root=blocked, chroot=True)))
    with pytest.raises(HostError, match="--mps-dir relative must be an absolute path"):
        check_config(replace(config, mps_dir=Path("relative")))
    with pytest.raises(HostError, match="--private-shm needs /nonexistent/unshare"):
        check_config(replace(config, mode=HostMode(driver_root=root, private_shm=True),
                             tools=replace(default_tools(), unshare="/nonexistent/unshare")))


# -- the socket ---------------------------------------------------------------------------------------


def test_a_missing_host_is_a_launch_error_naming_the_socket_and_the_daemonset(tmp_path: Path) -> None:
    path = tmp_path / "absent.sock"
    with pytest.raises(MpsLaunchError) as info:
        MpsHostLauncher(path).launch(launch_request(tmp_path))
    assert str(path) in str(info.value)
    assert "is the tessera-mps-host DaemonSet running on this node?" in str(info.value)


def test_a_stale_socket_is_replaced_but_a_live_one_or_a_file_is_not(tmp_path: Path) -> None:
    path = tmp_path / "run" / "host.sock"
    stale = open_listener(path)
    stale.close()  # the file stays behind, nobody answers: a crashed host
    live = open_listener(path)
    try:
        assert oct(path.stat().st_mode & 0o777) == oct(0o600)
        assert oct(path.parent.stat().st_mode & 0o777) == oct(0o700)
        with pytest.raises(HostError, match=f"another MPS host is serving {path}"):
            open_listener(path)
    finally:
        live.close()
    path.unlink()
    path.write_text("not a socket")
    with pytest.raises(HostError, match="exists and is not a socket"):
        open_listener(path)
    assert path.read_text() == "not a socket"


def test_a_reply_the_client_cannot_read_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "odd.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))
        server.listen(1)

        def answer() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(json.dumps({"daemon": {"pid": 5}, "error": "both"}).encode() + b"\n")

        threading.Thread(target=answer, daemon=True).start()
        with pytest.raises(MpsLaunchError, match="sent an unreadable reply"):
            MpsHostLauncher(path).launch(launch_request(tmp_path))
    with pytest.raises(ValueError, match="exactly one"):
        HostReply()


def test_the_plugin_uses_the_host_only_when_its_socket_is_configured() -> None:
    from driver.commands.run.app import choose_launcher
    from driver.config import parse_settings
    from driver.gpu.mps.locallauncher import LocalLauncher

    chosen = choose_launcher(parse_settings([], {"MPS_HOST_SOCKET": "/run/h.sock"}))
    assert isinstance(chosen, MpsHostLauncher) and chosen.socket_path == Path("/run/h.sock")
    assert isinstance(choose_launcher(parse_settings([])), LocalLauncher)




def test_a_socket_in_a_shared_sticky_directory_is_refused_and_the_directory_keeps_its_mode(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    with pytest.raises(HostError, match="shared"):
        open_listener(shared / "host.sock")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777


def test_a_failing_accept_does_not_end_the_host(base: Path) -> None:
    host = host_for(base, base)

    class _Listener:
        calls = 0

        def settimeout(self, _timeout: float) -> None:
            pass

        def accept(self) -> tuple[socket.socket, object]:
            self.calls += 1
            if self.calls == 2:
                host.stop()
            raise OSError(24, "Too many open files")

    listener = _Listener()
    host.serve(listener)  # type: ignore[arg-type]
    assert listener.calls == 2  # the first failure was survived; only stop() ended the loop


def _host_answering(path: Path, answers: list[bytes | None]) -> threading.Thread:
    """A host on ``path`` giving each connection the next answer (None: close without one); then a daemon."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)

    def serve() -> None:
        with server:
            for answer in answers:
                conn, _ = server.accept()
                with conn:
                    if answer is not None:
                        conn.sendall(answer)
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(json.dumps({"daemon": {"pid": 5}}).encode() + b"\n")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


BUSY_LINE = json.dumps({"error": "the MPS host is busy: it already serves 16 connections; retry"}).encode() + b"\n"


def test_a_busy_or_broken_host_connection_is_asked_again_within_the_deadline(tmp_path: Path) -> None:
    # Two busy answers (the host reads nothing), then a connection cut before any answer: then it launches.
    path = tmp_path / "h.sock"
    server = _host_answering(path, [BUSY_LINE, BUSY_LINE, None])
    assert MpsHostLauncher(path).launch(launch_request(tmp_path), timeout=30).pid == 5
    server.join(5)


def test_a_host_busy_for_the_whole_deadline_is_named_busy_not_a_broken_pipe(tmp_path: Path) -> None:
    path = tmp_path / "h.sock"
    server = _host_answering(path, [BUSY_LINE] * 1000)
    with pytest.raises(MpsLaunchError) as info:
        MpsHostLauncher(path).launch(launch_request(tmp_path), timeout=0.5)
    assert str(info.value).startswith("the MPS host is busy or cut the connection: daemon plan-0123456789ab was "
                                      "not started after "), str(info.value)
    assert "Broken pipe" not in str(info.value)
    del server  # a daemon thread, blocked in accept, ends with the process


def test_a_message_sent_a_byte_at_a_time_is_bounded_as_a_whole_not_per_recv() -> None:
    ours, theirs = socket.socketpair()
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.02):
            theirs.sendall(b"{")

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    try:
        with pytest.raises(TimeoutError, match="no complete message"):
            read_line(ours, time.monotonic() + 0.3)
    finally:
        stop.set()
        sender.join(5)
        ours.close()
        theirs.close()
