"""``python -m driver`` ended by its terminal: Ctrl-C while it is still importing, a reader that goes away.

Both end in one line (or none) and an exit status a shell understands, never a traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.support.processes import poll_until


def _mapped(pid: int, library: str) -> bool:
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return True  # it has exited: nothing left to wait for


def test_ctrl_c_while_the_demo_is_still_importing_is_one_line_and_status_130(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "driver", "demo", "--workdir", str(tmp_path / "work")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # pydantic's compiled core is loaded by the first of the driver's imports: the rest are still to come.
        poll_until(lambda: _mapped(proc.pid, "pydantic_core"), "the demo to start importing the driver")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, out + err
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    assert len(err.strip().splitlines()) <= 1, err


def test_a_reader_that_goes_away_ends_inspect_quietly_with_sigpipes_status(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # as `| head` does once it has its lines
    try:
        done = subprocess.run([sys.executable, "-m", "driver", "inspect", "--simulate", "demo",
                               "--plugins-dir", str(tmp_path / "plugins"), "--cdi-root", str(tmp_path / "cdi")],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, check=False)
    finally:
        os.close(write_end)
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 128 + signal.SIGPIPE
