"""The MPS host launching real daemons: the stand-in, NVIDIA's own when fetched, as children of a real
host served on a real Unix socket. The private /dev/shm and chroot paths run for real only as root.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.gpu.mps.hostclient import HostRequest, MpsHostLauncher
from driver.gpu.mps.launch import MpsLaunchError
from driver.gpu.mps.proc import read_proc_stat
from tests.support.mpsdaemons import MpsDaemonKind, daemon_params
from tests.support.mpshost import host_for, launch_request, make_dirs, serving
from tests.support.processes import poll_until, standin_sandbox


@pytest.fixture
def top() -> Iterator[Path]:
    with standin_sandbox("tsh", ["nvidia-cuda-mps-control"]) as directory:
        yield directory


def environ_of(pid: int) -> list[bytes]:
    return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")


def test_launch_over_the_socket_starts_the_daemon_as_the_hosts_child_and_reaps_it(top: Path) -> None:
    with serving(top) as served:
        request = launch_request(served.base)
        make_dirs(request)
        previous = os.umask(0o077)  # as `python -m driver` runs
        try:
            launched = served.launcher.launch(request)
        finally:
            os.umask(previous)
        stat = read_proc_stat(launched.pid)
        assert stat is not None and stat.pgrp == launched.pid, "its own process group, for its MPS servers"
        assert Path(f"/proc/{launched.pid}/comm").read_text().strip() == "nvidia-cuda-mps"
        assert f"CUDA_MPS_PIPE_DIRECTORY={request.pipe_dir}".encode() in environ_of(launched.pid)
        assert launched.shm_dir is None
        assert (request.pipe_dir / "control").is_socket(), "the host answers once the daemon serves"
        status = Path(f"/proc/{launched.pid}/status").read_text()
        assert "Umask:\t0022" in status, "the sockets it makes must be reachable by client UIDs"
        with pytest.raises(MpsLaunchError, match="already runs here"):
            served.launcher.launch(request)
        os.kill(launched.pid, 9)
        poll_until(lambda: read_proc_stat(launched.pid) is None, "the killed daemon to be reaped (no zombie)")
        # Reaped (gone from /proc) happens in waitpid, just before the reaper thread records the exit.
        poll_until(lambda: served.host.supervisor.running() == {}, "the host to record the daemon's exit")


def test_a_refused_request_comes_back_as_a_launch_error(top: Path) -> None:
    with serving(top) as served:
        request = launch_request(served.base, pipe_dir=Path("/etc"))
        make_dirs(launch_request(served.base))
        with pytest.raises(MpsLaunchError, match="the MPS host refused daemon plan-0123456789ab: pipe_dir /etc"):
            served.launcher.launch(request)
        assert served.host.supervisor.running() == {}


def test_a_daemon_that_exits_at_start_is_an_error_with_its_output(top: Path) -> None:
    binary = top / "root" / "usr" / "bin" / "nvidia-cuda-mps-control"
    binary.write_text("#!/bin/sh\necho 'no GPU here' >&2\nexit 3\n")
    with serving(top) as served:
        request = launch_request(served.base)
        make_dirs(request)
        with pytest.raises(MpsLaunchError, match=r"exited with status 3 at start; .*control.log ends with: no GPU"):
            served.launcher.launch(request)


def test_a_daemon_that_never_serves_is_killed_and_the_launch_fails(top: Path) -> None:
    binary = top / "root" / "usr" / "bin" / "nvidia-cuda-mps-control"
    binary.write_text("#!/bin/sh\necho 'waiting for a GPU'\nwhile :; do sleep 1; done\n")
    with serving(top, start_timeout=0.5) as served:
        request = launch_request(served.base)
        make_dirs(request)
        with pytest.raises(MpsLaunchError, match=r"created no .*/pipe/control within 0.5s; killed; .* waiting for"):
            served.launcher.launch(request)
        poll_until(lambda: served.host.supervisor.running() == {}, "the killed daemon to be reaped")


@pytest.mark.skipif(os.geteuid() != 0, reason="a private mount namespace and a bind mount need root")
def test_private_shm_is_the_daemons_dev_shm_for_real(top: Path) -> None:
    with serving(top, private_shm=True) as served:
        request = launch_request(served.base, shm_dir=served.base / "plan-0123456789ab" / "shm")
        make_dirs(request)
        (request.shm_dir / "marker").write_text("mine")  # type: ignore[operator]
        launched = served.launcher.launch(request)
        assert launched.shm_dir == request.shm_dir, "the plugin mounts the same directory into clients"
        # /proc/<pid>/root resolves paths in the daemon's own mount namespace.
        assert (Path(f"/proc/{launched.pid}/root/dev/shm") / "marker").read_text() == "mine"
        assert not Path("/dev/shm/marker").exists(), "the host's own /dev/shm is untouched"
        assert os.readlink(f"/proc/{launched.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")


def chroot_setup_script(root: Path) -> str:
    """Shell lines that make ``root`` a usable driver root in a private mount namespace: this machine's
    /usr, /etc, /proc, /dev and the interpreter's directories bound in (not /tmp, where the MPS
    directory is: the host must bind that in itself), and a bin/ of its own holding only the
    stand-in (where find_binary looks after usr/bin)."""
    interpreter_dirs = {f"/{Path(p).parts[1]}" for p in (sys.executable, os.path.realpath(sys.executable))}
    if "/tmp" in interpreter_dirs:
        # A virtual environment in /tmp (a fresh clone there, as CI may make): bind exactly it, since
        # all of /tmp would hide the MPS directory the host binds in itself.
        interpreter_dirs = {d for d in interpreter_dirs if d != "/tmp"} | {sys.prefix}
    lines = ["set -eu"]
    for source in sorted({"/usr", "/etc", "/proc", "/dev", *interpreter_dirs}):
        target = shlex.quote(str(root / source.lstrip("/")))
        lines += [f"mkdir -p {target}", f"mount --rbind {shlex.quote(source)} {target}"]
    return "\n".join(lines)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="chroot and mount namespaces need root and util-linux unshare")
def test_chroot_runs_the_daemon_inside_the_driver_root_for_real(top: Path) -> None:
    root = top / "driver-root"
    (root / "bin").mkdir(parents=True)
    shutil.copy2(top / "root" / "usr" / "bin" / "nvidia-cuda-mps-control", root / "bin")
    for name in ("lib", "lib64", "sbin"):
        if os.path.islink(f"/{name}"):
            (root / name).symlink_to(os.readlink(f"/{name}"))
    base = top / "mps"
    request = launch_request(base)
    make_dirs(request)
    socket_path = top / "run" / "host.sock"
    host_command = shlex.join([sys.executable, "-m", "driver", "mps-host", "--socket", str(socket_path),
                               "--mps-dir", str(base), "--driver-root", str(root), "--chroot"])
    # The host's own mount namespace stands in for its pod, where the chart mounts the driver root.
    host = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                             f"{chroot_setup_script(root)}\nexec {host_command}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[4])
    pid = None
    try:
        poll_until(lambda: socket_path.is_socket() or host.poll() is not None, "the chrooting host's socket")
        assert host.poll() is None, host.stdout.read().decode() if host.stdout else ""
        pid = MpsHostLauncher(socket_path).launch(request).pid
        assert (request.pipe_dir / "control").is_socket(), "the host answers once the daemon serves"
        # Chrooted: its / is the driver root, whose bin/ has the binary this machine's /bin lacks.
        assert (Path(f"/proc/{pid}/root/bin") / "nvidia-cuda-mps-control").is_file()
        assert not Path("/bin/nvidia-cuda-mps-control").exists()
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")  # the stand-in runs under its interpreter
        assert argv[argv.index(b"/bin/nvidia-cuda-mps-control") + 1] == b"-f", "the path inside the root"
        # It serves the pipe directory at the path the plugin and clients use, from inside the root.
        answer = subprocess.run([str(root / "bin" / "nvidia-cuda-mps-control")], capture_output=True, text=True,
                                input="get_default_active_thread_percentage\n", timeout=10, check=True,
                                env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(request.pipe_dir)})
        assert answer.stdout.strip() == "100.0"
        # The host made the mount point; the MPS directory is bound there only in the daemon's namespace.
        assert list((root / base.relative_to("/")).iterdir()) == []
        assert (Path(f"/proc/{pid}/root") / request.pipe_dir.relative_to("/") / "control").is_socket()
    finally:
        host.terminate()
        host.wait(timeout=20)
        if pid is not None:
            poll_until(lambda: read_proc_stat(pid) is None, "the host to stop and reap its chrooted daemon")


def test_stopping_the_host_ends_its_daemons_and_removes_its_socket(top: Path) -> None:
    base = top / "mps"
    request = launch_request(base)
    make_dirs(request)
    socket_path = top / "run" / "host.sock"
    host = subprocess.Popen([sys.executable, "-m", "driver", "mps-host", "--socket", str(socket_path),
                             "--mps-dir", str(base), "--driver-root", str(top / "root"), "--log-format", "text"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[4])
    poll_until(lambda: socket_path.is_socket() or host.poll() is not None, "the host's socket")
    pid = MpsHostLauncher(socket_path).launch(request).pid
    host.terminate()
    assert host.wait(timeout=20) == 0
    assert read_proc_stat(pid) is None, "the daemon ended with the host, and was reaped"
    assert not socket_path.exists()


def test_a_bad_flag_is_one_line_naming_it(top: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "driver", "mps-host", "--socket", str(top / "s"),
                           "--mps-dir", "relative/mps"], capture_output=True, text=True, timeout=30,
                          cwd=Path(__file__).parents[4])
    assert done.returncode == 1
    assert done.stderr.strip() == "tessera mps-host: --mps-dir relative/mps must be an absolute path"


@pytest.mark.parametrize("kind", daemon_params())
def test_the_host_runs_nvidias_daemon_as_well_as_the_stand_in(top: Path, kind: MpsDaemonKind) -> None:
    kind.install(top / "root" / "usr" / "bin")
    private = os.geteuid() == 0  # the private /dev/shm path too, where it can run
    with serving(top, private_shm=private) as served:
        request = launch_request(served.base, shm_dir=served.base / "plan-0123456789ab" / "shm")
        make_dirs(request)
        launched = served.launcher.launch(request)
        assert (request.pipe_dir / "control").is_socket()
        answer = subprocess.run([str(top / "root" / "usr" / "bin" / "nvidia-cuda-mps-control")],
                                input="get_default_active_thread_percentage\n", capture_output=True, text=True,
                                timeout=10, check=True,
                                env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(request.pipe_dir)})
        assert float(answer.stdout.strip()) == 100.0
        if private:
            assert os.path.samestat(os.stat(f"/proc/{launched.pid}/root/dev/shm"), os.stat(request.shm_dir))  # type: ignore[arg-type]


def test_a_host_that_is_stopping_starts_nothing_more(top: Path) -> None:
    base = top / "mps"
    base.mkdir()
    host = host_for(base, top / "root")
    host.supervisor.stop_all()
    request = launch_request(base)
    make_dirs(request)
    reply = host.answer(HostRequest(launch=request).model_dump_json().encode())
    assert reply.error is not None and "shutting down" in reply.error
    assert host.supervisor.running() == {} and not (request.log_dir / "control.log").exists()
