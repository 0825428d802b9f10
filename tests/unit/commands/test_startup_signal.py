"""The plugin process's SIGTERM/SIGINT handler takes no lock its main thread may hold.

A handler runs on the main thread between two of its bytecodes. The main loop waits on the stop Event, and
``Event.wait`` holds the Event's (non-reentrant) lock for a moment on the way in and out: a handler that set
the Event there waited for the very thread it interrupted, and the process hung until the kubelet's SIGKILL.
"""

from __future__ import annotations

import signal
import threading

from driver.commands.run.startup import Startup
from driver.config import Settings


def test_a_signal_while_the_stop_events_lock_is_held_records_it_without_waiting() -> None:
    startup = Startup(Settings())
    returned = threading.Event()

    def interrupted_main_thread() -> None:
        # The moment inside Event.wait: its lock held by the thread the handler interrupts (the same thread).
        with startup._stop._cond:  # the very lock the window is about
            startup.on_signal(signal.SIGTERM)
        returned.set()

    thread = threading.Thread(target=interrupted_main_thread, daemon=True)  # left blocked if the handler waits
    thread.start()
    assert returned.wait(5), "the handler waited for a lock its own thread holds"
    assert startup._signal == signal.SIGTERM  # what the main loop acts on
