"""``python -m driver run``: wire the GPU side (discovery, state, devices) to the kubelet-plugin helper.

Start-up order matters: recover local state first (so the kubelet never talks to a driver
with half-finished work), then start the helper (sockets, registration) and publish the devices.
A bad sharing plan stops the process before anything is served, with a message naming the entry.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType

import kubernetes.client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from driver import nodelayout
from driver.config import Settings
from driver.gpu.claimcdi.toolkit import toolkit_spec_changed
from driver.gpu.devices import build_devices
from driver.gpu.discovery.inventory import Discovery, NodeInventory
from driver.gpu.discovery.source import open_discovery
from driver.gpu.driver import GpuDriver
from driver.gpu.mps.hostclient import MpsHostLauncher
from driver.gpu.mps.launch import DaemonLauncher, LocalLauncher
from driver.gpu.mps.manager import MpsManager
from driver.gpu.runtime.timeslice import TimeSlicer
from driver.gpu.sharing import SharingLayout
from driver.gpu.sharingplan import PlanError, load_plans, resolve_layout, select_plan
from driver.gpu.state import DeviceState, StatePaths
from driver.gpu.targets import make_view
from driver.kubeletplugin.helper import Helper, HttpEndpoint, TelemetryNames
from driver.kubeletplugin.helper import start as start_plugin
from driver.kubeletplugin.kubeclient import KubeConfigError, load_api_client

log = logging.getLogger(__name__)


class StartupError(Exception):
    """Configuration or environment problem that must stop the driver with a clear message."""


@dataclass
class PlanSource:
    """Where the node's sharing plan comes from: the plans file and this node's label."""

    settings: Settings
    api: kubernetes.client.ApiClient

    def desired_layout(self, inventory: NodeInventory) -> SharingLayout:
        path = self.settings.sharing_plans
        if path is None:
            return {}
        plans = load_plans(path)
        node = kubernetes.client.CoreV1Api(self.api).read_node(self.settings.node_name, _request_timeout=20)
        labels = dict(node.metadata.labels or {}) if node.metadata else {}
        name, plan = select_plan(plans, labels, self.settings.sharing_plan_label)
        return resolve_layout(plan, inventory, name)


def state_paths(settings: Settings) -> StatePaths:
    device_root = nodelayout.device_root(settings)
    log.info("NVIDIA device nodes are read from %s", device_root.describe())
    return StatePaths(state_dir=settings.state_dir, cdi_root=settings.cdi_root, host_root=settings.host_root,
                      mps_shm_dir=settings.mps_shm_dir, driver_root=settings.driver_root,
                      driver_root_on_host=nodelayout.driver_root_on_host(settings))


def choose_launcher(settings: Settings) -> DaemonLauncher:
    """The MPS host when one is configured (daemons outlive this process), else children of this process."""
    if settings.mps_host_socket is not None:
        return MpsHostLauncher(settings.mps_host_socket)
    return LocalLauncher(settings.driver_root)


class DriverApp:
    def __init__(self, settings: Settings):
        if not settings.node_name:
            raise StartupError("the node name is required: set --node-name or NODE_NAME (downward API spec.nodeName)")
        self.settings = settings
        try:
            self.api = load_api_client(settings.kubeconfig)
        except KubeConfigError as exc:
            raise StartupError(str(exc)) from exc
        try:
            self.discovery: Discovery = open_discovery(settings.simulate, settings.node_name, settings.driver_root)
            inventory = self.discovery.discover()
        except (RuntimeError, ValueError, ImportError, OSError) as exc:  # no NVML/driver, or a bad simulated layout
            raise StartupError(f"GPU discovery failed: {exc}") from exc
        self.plans = PlanSource(settings, self.api)
        try:
            desired = self.plans.desired_layout(inventory)
        except PlanError as exc:
            raise StartupError(f"invalid sharing plan: {exc}") from exc
        except (ApiException, HTTPError) as exc:
            raise StartupError(f"cannot read Node {settings.node_name!r} to choose its sharing plan "
                               f"(label {settings.sharing_plan_label}): {exc}") from exc
        self._helper: Helper | None = None
        self._stop = threading.Event()
        self._exit_code = 0
        paths = state_paths(settings)
        self.mps_launcher = choose_launcher(settings)
        self.state = DeviceState(
            driver_name=settings.driver_name, pool_name=settings.node_name, paths=paths,
            toolkit=nodelayout.load_toolkit(settings),
            mps=MpsManager(settings.driver_root, settings.state_dir / "mps", self.mps_launcher,
                           shm_dir=settings.mps_shm_dir),
            timeslicer=TimeSlicer(settings.driver_root), view=make_view(inventory, {}))
        self.state.recover()
        view, _deferred = self.state.apply_layout(make_view(inventory, {}), desired)

        self.devices = build_devices(view.inventory, view.layout)

    def _registration_failed(self, error: str) -> None:
        log.error("the kubelet refused the plugin registration; exiting", extra={"kubelet_error": error})
        self._exit_code = 1
        self._stop.set()

    @property
    def helper(self) -> Helper:
        if self._helper is None:
            raise RuntimeError("the kubelet plugin is not started yet")
        return self._helper

    def readyz(self) -> tuple[int, str]:
        registered, detail = self.helper.readiness()
        if not registered:
            return 503, detail + "\n"
        if self.state.toolkit.readiness_problem is not None:
            # The full reason names host files: it is in the log and in 'inspect', not on the HTTP port.
            return 503, ("no usable NVIDIA driver libraries for containers (toolkit CDI spec missing, invalid or "
                         "without libcuda); see the plugin log or 'python -m driver inspect'\n")
        return 200, "ok\n"

    def rescan(self) -> None:
        """Pick up toolkit-spec, GPU and sharing-plan changes; a GPU with prepared claims keeps its form."""
        candidates = nodelayout.toolkit_candidates(self.settings)
        if toolkit_spec_changed(self.state.toolkit, self.settings.nvidia_cdi_spec, candidates):
            log.info("the NVIDIA Container Toolkit CDI spec changed; claims prepared from now on use it")
            self.state.set_toolkit(nodelayout.load_toolkit(self.settings))
        inventory = self.discovery.discover()
        try:
            desired = self.plans.desired_layout(inventory)
        except PlanError as exc:
            log.error("the sharing plan became invalid; keeping the one in force", extra={"reason": str(exc)})
            desired = self.state.view.layout
        view, _deferred = self.state.apply_layout(make_view(inventory, {}), desired)
        self.helper.publish(build_devices(view.inventory, view.layout))
        # A daemon that died (with the MPS host, or with this container when daemons are our own
        # children) is restarted here with the same limits; live ones are only looked up in /proc.
        self.state.check_daemons()

    def run(self) -> int:
        settings = self.settings
        # The helper serves /metrics, /healthz (its sockets) and /readyz, which adds the GPU side's checks.
        self._helper = start_plugin(
            GpuDriver(self.state), driver_name=settings.driver_name, node_name=settings.node_name, api=self.api,
            names=TelemetryNames(service="tessera-kubelet-plugin", metric_prefix="tessera"),
            registrar_dir=settings.registrar_dir, plugin_dir=settings.state_dir, pod_uid=settings.pod_uid,
            on_registration_failed=self._registration_failed,
            http=HttpEndpoint(port=settings.http_port, routes={"/readyz": self.readyz}))
        self.helper.telemetry.observe_gauge("prepared_claims", "Claims prepared on this node",
                                            lambda: float(self.state.prepared_count()))
        self.helper.publish(self.devices)
        log.info("driver started", extra={"driver": self.settings.driver_name, "node": self.settings.node_name,
                                          "http_port": self.helper.http_port,
                                          "dra_socket": str(self.helper.dra_socket),
                                          "simulated": self.settings.simulate is not None,
                                          "mps_daemons": self.mps_launcher.describe()})
        next_scan = time.monotonic() + self.settings.rescan_interval
        while not self._stop.wait(timeout=1.0):
            if time.monotonic() >= next_scan:
                next_scan = time.monotonic() + self.settings.rescan_interval
                try:
                    self.rescan()
                except Exception:
                    log.exception("rescan failed; will retry")
        self.shutdown()
        return self._exit_code

    def stop(self) -> None:
        self._stop.set()

    def shutdown(self) -> None:
        # Slices stay published: during a rolling update the other pod keeps serving them, and
        # after a real removal the kubelet wipes them 30 s after the sockets are gone.
        if self._helper is not None:
            self._helper.stop()
        self.discovery.close()
        log.info("driver stopped")


def run(settings: Settings) -> int:
    app = DriverApp(settings)

    def _on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal received; shutting down", extra={"signal": signal.Signals(signum).name})
        app.stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return app.run()
