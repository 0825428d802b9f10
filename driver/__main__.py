"""``python -m driver``: the command line, with the two ways a terminal ends a command handled as one line.

Ctrl-C before a command has set up its own handling (the imports alone take a few hundred ms) and a
reader that goes away (``inspect | head``) would otherwise end in a traceback that says nothing useful.
"""

import os
import signal
import sys
from types import FrameType


def _hold(signum: int, frame: FrameType | None) -> None:
    held.append(signum)


held: list[int] = []
try:
    # A Ctrl-C that lands inside pydantic-core's import makes it panic (a PanicException, not a KeyboardInterrupt)
    # and print a Rust backtrace: Ctrl-C waits until the imports are done.
    signal.signal(signal.SIGINT, _hold)
    from driver.cli import main

    signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise KeyboardInterrupt
    status = main()
except KeyboardInterrupt:
    # Nothing was started yet: every command that starts processes stops them itself (driver/reaper.py).
    print("\npython -m driver: interrupted", file=sys.stderr)
    status = 128 + signal.SIGINT
except BrokenPipeError:
    # Python's documented handling: point stdout at /dev/null, so the flush at exit does not raise again.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    status = 128 + signal.SIGPIPE
raise SystemExit(status)
