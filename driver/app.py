"""``python -m driver run``: wire discovery, state, the kubelet plugin and slice publishing together.

Start-up order matters: recover local state first (so the kubelet never talks to a driver
with half-finished work), then publish slices and serve the sockets. A bad sharing plan stops
the process before anything is served, with a message naming the entry.
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

from driver.config import Settings
from driver.gpu.devices import build_devices
from driver.gpu.discovery import open_discovery
from driver.gpu.driver import GpuDriver
from driver.gpu.inventory import Discovery, NodeInventory
from driver.gpu.mps import MpsManager
from driver.gpu.sharing import SharingLayout
from driver.gpu.sharingplan import PlanError, load_plans, resolve_layout, select_plan
from driver.gpu.state import DeviceState, StatePaths
from driver.gpu.targets import make_view
from driver.gpu.timeslice import TimeSlicer
from driver.gpu.toolkit import load_toolkit_edits, toolkit_spec_changed
from driver.kubeletplugin.claims import ClaimFetcher
from driver.kubeletplugin.kubeclient import KubeConfigError, load_api_client
from driver.kubeletplugin.liveness import check_plugin
from driver.kubeletplugin.plugin import KubeletPlugin
from driver.kubeletplugin.resourceslices import ResourceSlicePublisher
from driver.kubeletplugin.telemetry import Telemetry

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
        self.telemetry = Telemetry("tessera-kubelet-plugin", "tessera")
        self._stop = threading.Event()
        self._exit_code = 0
        paths = StatePaths(state_dir=settings.state_dir, cdi_root=settings.cdi_root,
                           host_root=settings.host_root, mps_shm_dir=settings.mps_shm_dir)
        self.state = DeviceState(
            driver_name=settings.driver_name, pool_name=settings.node_name, paths=paths,
            toolkit=load_toolkit_edits(settings.nvidia_cdi_spec),
            mps=MpsManager(settings.driver_root, settings.state_dir / "mps"),
            timeslicer=TimeSlicer(settings.driver_root), view=make_view(inventory, {}))
        self.state.recover()
        view, _deferred = self.state.apply_layout(make_view(inventory, {}), desired)

        self.publisher = ResourceSlicePublisher(self.api, settings.driver_name, settings.node_name, self.telemetry)
        self.publisher.update(build_devices(view.inventory, view.layout))
        self.plugin = KubeletPlugin(
            driver=GpuDriver(self.state), driver_name=settings.driver_name,
            claim_fetcher=ClaimFetcher(self.api), telemetry=self.telemetry,
            registrar_dir=settings.registrar_dir, plugin_dir=settings.state_dir, pod_uid=settings.pod_uid,
            on_registration_failed=self._registration_failed)
        self.telemetry.observe_gauge("prepared_claims", "Claims prepared on this node",
                                     lambda: float(self.state.prepared_count()))
        self.telemetry.observe_gauge("published_devices", "Devices published in ResourceSlices",
                                     lambda: float(self.publisher.published_device_count))

    def _registration_failed(self, error: str) -> None:
        log.error("the kubelet refused the plugin registration; exiting", extra={"kubelet_error": error})
        self._exit_code = 1
        self._stop.set()

    def healthz(self) -> tuple[int, str]:
        # Busy with slow prepares is healthy; only a socket that makes no progress is not.
        ok, detail = check_plugin(self.plugin)
        return (200 if ok else 503), detail + "\n"

    def readyz(self) -> tuple[int, str]:
        if not self.plugin.registered.is_set():
            return 503, "not yet registered with the kubelet\n"
        return 200, "ok\n"

    def rescan(self) -> None:
        """Pick up toolkit-spec, GPU and sharing-plan changes; a GPU with prepared claims keeps its form."""
        if toolkit_spec_changed(self.state.toolkit, self.settings.nvidia_cdi_spec):
            log.info("the NVIDIA Container Toolkit CDI spec changed; claims prepared from now on use it")
            self.state.set_toolkit(load_toolkit_edits(self.settings.nvidia_cdi_spec))
        inventory = self.discovery.discover()
        try:
            desired = self.plans.desired_layout(inventory)
        except PlanError as exc:
            log.error("the sharing plan became invalid; keeping the one in force", extra={"reason": str(exc)})
            desired = self.state.view.layout
        view, _deferred = self.state.apply_layout(make_view(inventory, {}), desired)
        self.publisher.update(build_devices(view.inventory, view.layout))
        # MPS daemons live in this container's cgroup: a replaced plugin pod takes the daemons it
        # started with it, and the surviving pod restarts them here with the same limits.
        self.state.check_daemons()

    def run(self) -> int:
        port = self.telemetry.serve_metrics("::", self.settings.http_port,
                                            {"/healthz": self.healthz, "/readyz": self.readyz})
        self.publisher.start()
        self.plugin.start()
        log.info("driver started", extra={"driver": self.settings.driver_name, "node": self.settings.node_name,
                                          "http_port": port, "dra_socket": str(self.plugin.dra_socket),
                                          "simulated": self.settings.simulate is not None})
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
        self.plugin.stop()
        self.publisher.stop()
        self.discovery.close()
        self.telemetry.shutdown()
        log.info("driver stopped")


def run(settings: Settings) -> int:
    app = DriverApp(settings)

    def _on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("signal received; shutting down", extra={"signal": signal.Signals(signum).name})
        app.stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return app.run()
