"""``python -m driver``: the command line, with the two ways a terminal ends a command handled as one line.

Ctrl-C before a command has set up its own handling (the imports alone take a few hundred ms) and a
reader that goes away (``inspect | head``) would otherwise end in a traceback that says nothing useful.
"""

import os
import signal
import sys

try:
    from driver.cli import main

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
