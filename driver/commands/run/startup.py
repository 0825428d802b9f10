"""``python -m driver run``: register with the kubelet first, then initialise the driver behind the open sockets.

The kubelet sends nothing before a plugin is registered, and while a plugin restarts or is upgraded
no pod on the node that needs it can start, so registration comes first: the DRA and registration
sockets and the HTTP port need only grpc, the generated stubs and ``http.server``
(:mod:`driver.kubeletplugin.serving`). Everything prepare needs (the ``kubernetes`` API client, NVML or
the simulated node, the OpenTelemetry SDK, discovery, the sharing plan, recovery of interrupted prepares)
is imported and built on a thread behind them (:class:`driver.commands.run.app.DriverApp`). Until that finishes:

* a prepare or unprepare waits for it, bounded by its deadline (:mod:`driver.kubeletplugin.startgate`),
  and the kubelet's health stream waits for the first device list;
* ``/readyz`` answers 503 ("initialising"); ``/healthz`` checks the sockets as always.

Recovery runs inside the initialisation, so it finishes before any prepare is served, and the
devices are published after discovery. A failed initialisation (bad kubeconfig, no GPUs, a bad
sharing plan) answers the waiting calls with its reason and exits 1 with it on stderr.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING

from driver.config import Settings, StartupError
from driver.kubeletplugin.healthservice import HealthBoard
from driver.kubeletplugin.serving import HttpEndpoint, ServedPlugin, serve

if TYPE_CHECKING:  # imported on the initialisation thread (run_initialisation), never before registration
    from driver.commands.run.app import DriverApp

log = logging.getLogger(__name__)

# On SIGTERM during initialisation, how long to let it finish (so what it started is stopped in order)
# before exiting anyway; the kubelet's default grace period is 30 s.
INITIALISATION_STOP_WAIT_S = 10.0


# How soon the main loop sees a signal the handler recorded (the handler itself may take no lock).
SIGNAL_POLL_S = 0.1


class Startup:
    """One run of the plugin process: serve, initialise on a thread, then rescan until stopped."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._stop = threading.Event()
        self._lock = threading.Lock()  # orders "initialised" against "stopping"
        self._exit_code = 0
        self._failure: str | None = None
        self._served: ServedPlugin | None = None
        self._app: DriverApp | None = None
        self._signal: int | None = None  # set by the signal handler, acted on by the main loop

    def stop(self) -> None:
        self._stop.set()

    def on_signal(self, signum: int, _frame: FrameType | None = None) -> None:
        """The SIGTERM/SIGINT handler: records the signal and nothing else. It runs on the main thread between two
        of its bytecodes, possibly while that thread holds the stop Event's lock (inside ``Event.wait``): setting
        the Event (or logging) here could then wait for the thread it interrupted, forever."""
        self._signal = signum

    def run(self) -> int:
        settings = self.settings
        board = HealthBoard()
        try:
            served = serve(driver_name=settings.driver_name, node_name=settings.node_name,
                           on_registration_failed=self._registration_failed, registrar_dir=settings.registrar_dir,
                           plugin_dir=settings.state_dir, pod_uid=settings.pod_uid,
                           http=HttpEndpoint(port=settings.http_port, routes={"/readyz": self._readyz}),
                           prepare_deadline=settings.prepare_deadline, health=board)
        except (ValueError, OSError, RuntimeError) as exc:  # a path too long or in the way, a port taken
            print(f"tessera: cannot serve the plugin's sockets and HTTP port: {exc}", file=sys.stderr)
            return 1
        self._served = served
        log.info("plugin sockets served; initialising behind them", extra={
            "driver": settings.driver_name, "dra_socket": str(served.plugin.dra_socket),
            "registration_socket": str(served.plugin.registration_socket), "http_port": served.http_port})
        initialisation = threading.Thread(target=self._initialise, args=(served, board), name="initialise",
                                          daemon=True)
        initialisation.start()
        try:
            next_tick = time.monotonic() + 1.0
            while not self._stop.wait(timeout=SIGNAL_POLL_S):
                if self._signal is not None:
                    log.info("signal received; shutting down", extra={"signal": signal.Signals(self._signal).name})
                    self._stop.set()
                    break
                app = self._app
                if app is not None and time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + 1.0
                    app.tick()
        finally:
            self._shut_down(served, initialisation)
        if self._failure is not None:
            print(f"tessera: {self._failure}", file=sys.stderr)
            return 1
        return self._exit_code

    def _initialise(self, served: ServedPlugin, board: HealthBoard) -> None:
        try:
            # Imported here, on this thread: these modules are most of what a start costs, and nothing
            # before registration needs them (docs/benchmarks.md, "Start-up").
            from driver.commands.run.app import DriverApp
            from driver.kubeletplugin.helper import Helper

            app = DriverApp(self.settings, board)
        except StartupError as exc:
            self._fail(served, str(exc))
            return
        except Exception as exc:
            log.exception("initialisation failed")
            self._fail(served, f"initialisation failed: {type(exc).__name__}: {exc}")
            return
        with self._lock:
            if self._stop.is_set():
                app.shutdown()  # stopped while initialising: nothing was served with it
                return
            try:
                app.start_serving(Helper(served))
            except Exception as exc:
                log.exception("starting to serve claims failed")
                reason = f"starting to serve claims failed: {type(exc).__name__}: {exc}"
                # Answer the calls waiting in the gate first: shutdown stops the sockets, which waits out
                # its grace for them and then cuts them off without the reason.
                served.plugin.refuse_claims(reason)
                app.shutdown()
                self._fail(served, reason)
                return
            self._app = app

    def _fail(self, served: ServedPlugin, reason: str) -> None:
        log.error("the driver could not start; exiting", extra={"reason": reason})
        served.plugin.refuse_claims(reason)
        self._failure = reason
        self._stop.set()

    def _registration_failed(self, error: str) -> None:
        log.error("the kubelet refused the plugin registration; exiting", extra={"kubelet_error": error})
        self._exit_code = 1
        self._stop.set()

    def _readyz(self) -> tuple[int, str]:
        served, app = self._served, self._app
        if served is None:
            return 503, "starting\n"
        ok, detail = served.readiness()
        if not ok or app is None:
            return 503, (detail if not ok else "initialising") + "\n"
        problem = app.readiness_problem()
        return (503, problem + "\n") if problem is not None else (200, "ok\n")

    def _shut_down(self, served: ServedPlugin, initialisation: threading.Thread) -> None:
        # Let a running initialisation finish (or see the stop) so that what it started is stopped below.
        initialisation.join(INITIALISATION_STOP_WAIT_S)
        with self._lock:
            app = self._app
        if app is not None:
            app.shutdown()  # stops the plugin too, before NVML is closed
        elif self._failure is None:
            served.plugin.refuse_claims("the plugin is stopping before it finished initialising")
        # Slices stay published: during a rolling update the other pod keeps serving them, and
        # after a real removal the kubelet wipes them 30 s after the sockets are gone.
        served.stop()  # again does nothing
        log.info("driver stopped")


def run(settings: Settings) -> int:
    startup = Startup(settings)
    signal.signal(signal.SIGTERM, startup.on_signal)
    signal.signal(signal.SIGINT, startup.on_signal)
    return startup.run()
