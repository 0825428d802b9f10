"""The driver's initialisation and running: wire the GPU side (discovery, state, devices) to the plugin helper.

``driver/start.py`` serves the sockets and registers first, then builds :class:`DriverApp` on a
thread: its construction is the initialisation (API client, discovery, the sharing plan, recovery of
interrupted work), :meth:`DriverApp.start_serving` hands the claims to it and publishes the devices.
Recovery therefore finishes before any prepare is served (prepares that arrived earlier wait), and
the devices are published after discovery. A bad sharing plan stops the process before any claim is
served, with a message naming the entry. This module's imports are the heavy part of a start.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from urllib.parse import quote

from driver import nodelayout
from driver.config import Settings
from driver.gpu import kernelmemory
from driver.gpu.claimcdi.toolkit import toolkit_spec_changed
from driver.gpu.consumable import KernelMemoryLimits, consumable_supported
from driver.gpu.daemonwatch import DaemonWatcher, MpsReports
from driver.gpu.devices import make_view
from driver.gpu.discovery.inventory import Discovery, NodeInventory
from driver.gpu.driver import GpuDriver
from driver.gpu.health.monitor import HealthMonitor
from driver.gpu.health.node import NodeHealth
from driver.gpu.health.published import taints_decision
from driver.gpu.health.report import HEALTH_FILE
from driver.gpu.health.usagereport import USAGE_FILE
from driver.gpu.health.usagewatch import ClaimUsageWatch
from driver.gpu.health.xids import parse_ignored_xids
from driver.gpu.limitstatement import unconfirmed_gpus, with_unconfirmed_limits
from driver.gpu.migclaims import own_instances
from driver.gpu.migplacement import OwnInstances, partitionable_supported
from driver.gpu.mps.hostcheck import default_tools
from driver.gpu.mps.hostclient import MpsHostLauncher
from driver.gpu.mps.launch import DaemonLauncher, LocalLauncher
from driver.gpu.mps.manager import MpsManager
from driver.gpu.mps.multiuser import MultiUserProbe, probe_gpu, single_user_gpus
from driver.gpu.mps.shmmount import ShmTmpfs
from driver.gpu.planuse import PLAN_USE_FILE, PlanUse, chosen_how, gpu_lines, plan_use, write_plan_use
from driver.gpu.runtime.sharing import WATCH_CHECK_S
from driver.gpu.runtime.timeslice import TimeSlicer
from driver.gpu.sharelayout import SharingLayout
from driver.gpu.sharingplan import PlanError, SharingPlan, load_plans, resolve_plan, select_plan
from driver.gpu.state import DeviceState, StatePaths
from driver.gpu.targets import NodeView
from driver.healthsource import open_health_source, open_process_source
from driver.kubeletplugin.events import EventRecorder
from driver.kubeletplugin.healthservice import HealthBoard
from driver.kubeletplugin.helper import Helper, TelemetryNames
from driver.kubeletplugin.kubeclient import (
    KubeApiError,
    KubeClient,
    KubeConfigError,
    load_api_client,
    request_json,
    server_minor_version,
)
from driver.startup import StartupError

log = logging.getLogger(__name__)

# The API server's feature gates whose fields the sharing plan's devices need (1.34/1.35 alpha, on from 1.36).
PARTITIONABLE_GATE = "DRAPartitionableDevices"
CONSUMABLE_GATE = "DRAConsumableCapacity"


@dataclass
class PlanSource:
    """Where the node's sharing plan comes from: the plans file and this node's label."""

    settings: Settings
    api: KubeClient
    minor_version: int | None = None  # the API server's, read once when a plan first needs it
    kernel: KernelMemoryLimits | None = None  # kernel memory limits, detected at start and every rescan
    use: PlanUse | None = None  # the plan in use and each GPU's entry, as last logged
    # Feature gates the API server showed to be off (it dropped our fields that need them), whatever its release
    # or the plans file says: what needs them is not published again.
    gates_off: frozenset[str] = frozenset()

    def desired_layout(self, inventory: NodeInventory, own: OwnInstances = ()) -> SharingLayout:
        """``own``: MIG instances Tessera created for claims, which keep their GPU dynamic MIG."""
        path = self.settings.sharing_plans
        if path is None:
            self._record(plan_use(SharingPlan(), None, None, "no --sharing-plans", inventory, {}))
            return {}
        plans = load_plans(path)
        # A raw GET: the generated CoreV1Api costs a few hundred ms of imports at its first use.
        node = request_json(self.api, "GET", f"/api/v1/nodes/{quote(self.settings.node_name, safe='')}",
                            timeout=20)
        labels = {str(k): str(v) for k, v in ((node.get("metadata") or {}).get("labels") or {}).items()}
        key = self.settings.sharing_plan_label
        name, plan = select_plan(plans, labels, key)
        if self.minor_version is None and any(e.consumable is not None or e.dynamicMig is not None for e in plan.gpus):
            self.minor_version = server_minor_version(self.api)
        supported = (consumable_supported(self.minor_version or 0, plans.consumableCapacityGate)
                     and CONSUMABLE_GATE not in self.gates_off)
        partitionable = (partitionable_supported(self.minor_version or 0, plans.partitionableDevicesGate)
                         and PARTITIONABLE_GATE not in self.gates_off)
        resolved = resolve_plan(plan, inventory, name, consumable_supported=supported,
                                kernel=self.detect_kernel_memory(inventory), partitionable_supported=partitionable,
                                own_instances=own)
        self._record(plan_use(plan, name, path, chosen_how(key, labels.get(key), name), inventory, resolved.layout,
                              resolved.notes))
        return resolved.layout

    def _record(self, use: PlanUse) -> None:
        """Log the plan in use when it (or what it makes of a GPU) changes: at start, and after an edit."""
        if use == self.use:
            return
        self.use = use
        log.info("sharing plan in use: %s", use.summary(), extra={"gpus": gpu_lines(use)})
        for line in use.note_lines():  # e.g. a dynamicMig entry on a GPU without MIG: published as before
            log.warning(line)
        if use.plan is not None and all(g.entry is None for g in use.gpus):
            # Plans are shared by nodes, so one entry matching nothing is normal; a whole plan is a mistake.
            log.warning("sharing plan %r matches no GPU of this node: every GPU is published whole (or as its MIG "
                        "devices); check its match selectors with `python -m driver check-plan`", use.plan,
                        extra={"entries": use.unmatched_entries})

    def save(self, state_dir: Path) -> None:
        """Leave the plan in use where ``inspect`` reads it."""
        if self.use is None:
            return
        try:
            write_plan_use(state_dir / PLAN_USE_FILE, self.use)
        except OSError as exc:  # only inspect's view is missing; serving claims does not depend on it
            log.warning("cannot write %s for inspect: %s", state_dir / PLAN_USE_FILE, exc)

    def detect_kernel_memory(self, inventory: NodeInventory) -> KernelMemoryLimits:
        """Re-read at every call (a driver upgrade or a new toolkit can add it); logged when it changes."""
        s = self.settings
        candidates = (s.nvidia_cdi_spec,) if s.nvidia_cdi_spec else nodelayout.toolkit_candidates(s)
        spec = next((p for p in candidates if p.is_file()), None)
        kernel = kernelmemory.detect(s.host_root, inventory.driver_version, spec)
        if kernel != self.kernel:
            log.info("kernel-enforced GPU memory limits for consumable shares: %s",
                     "available" if kernel.available else "not available", extra={"reason": kernel.reason})
        self.kernel = kernel
        return kernel


def state_paths(settings: Settings) -> StatePaths:
    device_root = nodelayout.device_root(settings)
    log.info("NVIDIA device nodes are read from %s", device_root.describe())
    return StatePaths(state_dir=settings.state_dir, cdi_root=settings.cdi_root, host_root=settings.host_root,
                      mps_shm_dir=settings.mps_shm_dir, driver_root=settings.driver_root,
                      driver_root_on_host=nodelayout.driver_root_on_host(settings))


def choose_launcher(settings: Settings) -> DaemonLauncher:
    """The MPS host when one is configured (daemons outlive this process), else children of this process."""
    if settings.mps_host_socket is not None:
        return MpsHostLauncher(settings.mps_host_socket, shm_size=settings.mps_shm_size)
    shm = ShmTmpfs(settings.mps_shm_size, "--mps-shm-tmpfs", default_tools()) if settings.mps_shm_tmpfs else None
    return LocalLauncher(settings.driver_root, shm=shm)


class DriverApp:
    """The initialised driver: constructing it is the initialisation; the plugin's sockets are already served."""

    def __init__(self, settings: Settings, health_board: HealthBoard):
        """``health_board``: the board the plugin already serves the kubelet's health stream from."""
        if not settings.node_name:
            raise StartupError("the node name is required: set --node-name or NODE_NAME (downward API spec.nodeName)")
        self.settings = settings
        try:
            self.api = load_api_client(settings.kubeconfig)
        except KubeConfigError as exc:
            raise StartupError(str(exc)) from exc
        try:
            self.discovery: Discovery = nodelayout.open_discovery(settings, settings.node_name)
            inventory = self.discovery.discover()
        except (RuntimeError, ValueError, ImportError, OSError) as exc:  # no NVML/driver, or a bad simulated layout
            raise StartupError(f"GPU discovery failed: {exc}") from exc
        self.plans = PlanSource(settings, self.api)
        try:
            desired = self.plans.desired_layout(inventory)
        except PlanError as exc:
            raise StartupError(f"invalid sharing plan: {exc}") from exc
        except KubeApiError as exc:
            raise StartupError(f"cannot read Node {settings.node_name!r} to choose its sharing plan "
                               f"(label {settings.sharing_plan_label}): {exc}") from exc
        self._helper: Helper | None = None
        self._next_scan = 0.0
        self._mig_changes_seen = 0
        paths = state_paths(settings)
        self.mps_launcher = choose_launcher(settings)
        self.mps = MpsManager(settings.driver_root, settings.state_dir / "mps", self.mps_launcher,
                              shm_dir=settings.mps_shm_dir)
        # Multi-user MPS is probed after registration (a daemon start); until then plan daemons and
        # the published mpsMultiUser attribute say single-user, the answer that hides nothing.
        self.multi_user = MultiUserProbe(self.mps.supports_multi_user)
        self._single_user_gpus: tuple[str, ...] = ()
        compute_modes = nodelayout.open_compute_modes(settings)  # NVML (or its simulation double), once
        self.state = DeviceState(
            driver_name=settings.driver_name, pool_name=settings.node_name, paths=paths,
            toolkit=nodelayout.load_toolkit(settings), mps=self.mps,
            timeslicer=TimeSlicer(settings.driver_root, compute_modes), compute_modes=compute_modes,
            view=make_view(inventory, {}), mps_multi_user=False,
            mig=partial(nodelayout.open_mig_partitioner, settings))  # opened at the first dynamic MIG claim
        # Tenants that change or stop a shared MPS daemon: counted, logged and told to each claim's owner
        # as an Event (posted from the recorder's thread, never inside a prepare).
        self.events = EventRecorder(self.api, controller=f"{settings.driver_name}/kubelet-plugin",
                                    instance=settings.node_name)
        self.mps_reports = MpsReports(self.events)
        self.state.sharing.reports = self.mps_reports
        self.daemon_watch = DaemonWatcher(self.state, settings.mps_limit_check_interval)
        # A prepare joins a daemon whose limits the watcher confirmed this recently without a control command.
        self.state.sharing.confirmations.fresh_for = settings.mps_limit_check_interval
        self.state.sharing.confirmations.round_s = WATCH_CHECK_S
        # The shares' published limit statement follows (off the watcher's thread: it holds GPU locks).
        self.mps_reports.on_change = lambda: threading.Thread(
            target=self._publish_on_health_change, name="publish-limit-statement", daemon=True).start()
        self.state.recover()
        own = own_instances(self.state.ledger.read())
        if own or self.state.mig.changes:
            # Dynamic MIG: instances of claims keep their GPU dynamic, and what recovery destroyed or re-created
            # (an interrupted prepare's, a reboot's) is seen again before anything is published or prepared.
            inventory = self.discovery.discover()
            desired = self.plans.desired_layout(inventory, own)
        view, _deferred = self.state.apply_layout(make_view(inventory, {}), desired)
        self.plans.save(settings.state_dir)

        self.devices = view.devices
        self.health = NodeHealth(HealthMonitor(parse_ignored_xids(settings.ignored_xids)), health_board,
                                 driver_name=settings.driver_name, pool_name=settings.node_name,
                                 taint_effect=settings.health_taint_effect,
                                 report_path=settings.state_dir / HEALTH_FILE)
        self.health_source = open_health_source(settings, lambda: self.state.view.inventory, os.environ)
        self.state.device_problems = lambda: self.health.problems(self.state.view)
        self.state.device_taints = lambda: self.health.taints(self.state.view)
        self.usage = ClaimUsageWatch(open_process_source(settings, lambda: self.state.view.inventory, os.environ),
                                     self.state.ledger.read, lambda: self.state.view,
                                     report_path=settings.state_dir / USAGE_FILE)
        self._publish_lock = threading.Lock()

    @property
    def helper(self) -> Helper:
        if self._helper is None:
            raise RuntimeError("the kubelet plugin is not started yet")
        return self._helper

    def readiness_problem(self) -> str | None:
        """Why the node cannot serve GPU containers although the plugin is registered, None when it can."""
        if self.state.toolkit.readiness_problem is not None:
            # The full reason names host files: it is in the log and in 'inspect', not on the HTTP port.
            return ("no usable NVIDIA driver libraries for containers (toolkit CDI spec missing, invalid or "
                    "without libcuda); see the plugin log or 'python -m driver inspect'")
        return None

    def rescan(self) -> None:
        """Pick up toolkit-spec, GPU and sharing-plan changes; a GPU with prepared claims keeps its form."""
        candidates = nodelayout.toolkit_candidates(self.settings)
        if toolkit_spec_changed(self.state.toolkit, self.settings.nvidia_cdi_spec, candidates):
            log.info("the NVIDIA Container Toolkit CDI spec changed; claims prepared from now on use it")
            self.state.set_toolkit(nodelayout.load_toolkit(self.settings))
        inventory = self.discovery.discover()
        try:
            desired = self.plans.desired_layout(inventory, own_instances(self.state.ledger.read(), inventory))
        except PlanError as exc:
            log.error("the sharing plan became invalid; keeping the one in force", extra={"reason": str(exc)})
            desired = self.state.view.layout
        view, _deferred = self.state.apply_layout(make_view(inventory, {}), desired)
        self.plans.save(self.settings.state_dir)
        self.publish(view)
        # A daemon that died (with the MPS host, or with this container when daemons are our own
        # children) is restarted here with the same limits; live ones are only looked up in /proc.
        self.state.check_daemons()

    def follow_multi_user(self) -> None:
        """Start the multi-user probe once plan MPS shares could use it; once it answers yes, plan
        daemons started from then on use it and the devices are republished with mpsMultiUser.
        Logs the GPUs whose plan MPS shares serve one Linux UID at a time whenever that set changes."""
        view = self.state.view
        available = self.multi_user.result
        if available is None:
            gpu = probe_gpu(view.inventory, view.layout)
            if gpu is not None:
                self.multi_user.start(gpu)  # once; its answer is picked up at a later call
                return
            available = False  # nothing to probe: no plan MPS shares on a GPU that could be multi-user
        if available and not self.state.mps_multi_user:
            self.state.mps_multi_user = True
            view, _deferred = self.state.apply_layout(view, view.layout)
            self.publish(view)
            log.info("MPS multi-user mode is available: plan MPS daemons serve clients of any Linux UID at once")
        single = tuple(single_user_gpus(view.inventory, view.layout, available))
        if single != self._single_user_gpus:
            self._single_user_gpus = single
            if single:
                log.warning(
                    "plan MPS shares on these GPUs serve one Linux UID at a time (no MPS multi-user mode: the "
                    "driver's nvidia-cuda-mps-control lacks it, or compute capability < 7.0); a client running as "
                    "another UID waits until the first UID's clients finish. Published as mpsMultiUser=false; "
                    "see docs/sharing.md", extra={"gpu_uuids": list(single)})

    def _follow_multi_user_safely(self) -> None:
        try:
            self.follow_multi_user()
        except Exception:
            log.exception("applying the MPS multi-user probe failed; will retry")

    def publish(self, view: NodeView) -> None:
        """Publish ``view``'s devices (tainted where unhealthy) and tell the kubelet their health."""
        with self._publish_lock:
            devices = with_unconfirmed_limits(self.health.devices(view), unconfirmed_gpus(self.state.ledger.read()))
            self.helper.publish(devices, view.counter_sets)
            self.health.update_board(view)

    def _publish_on_health_change(self) -> None:
        try:
            self.publish(self.state.view)
        except Exception:
            log.exception("publishing a device health change failed; the next rescan retries")

    def _start_health(self) -> None:
        taints, why = taints_decision(self.settings.device_taints, self.helper.kubernetes_minor_version)
        self.health.taints_enabled = taints
        (log.info if taints else log.warning)(why)
        self.health.register_metrics(self.helper.telemetry, lambda: self.state.view, self.health_source)
        self.health.monitor.add_listener(lambda _health: self._publish_on_health_change())
        self.publish(self.state.view)
        self.health.monitor.start(self.health_source)
        self.usage.register_metrics(self.helper.telemetry)
        self.usage.start()

    def start_serving(self, helper: Helper) -> None:
        """Serve claims (prepares that waited included), publish the devices, start the watchers."""
        settings = self.settings
        self._helper = helper
        helper.complete(GpuDriver(self.state), api=self.api,
                        names=TelemetryNames(service="tessera-kubelet-plugin", metric_prefix="tessera"))
        self.helper.telemetry.observe_gauge("prepared_claims", "Claims prepared on this node",
                                            lambda: float(self.state.prepared_count()))
        self._start_health()
        self.mps_reports.register_metrics(self.helper.telemetry)
        self.events.start()
        self.daemon_watch.start()
        log.info("driver started", extra={"driver": settings.driver_name, "node": settings.node_name,
                                          "http_port": self.helper.http_port,
                                          "dra_socket": str(self.helper.dra_socket),
                                          "simulated": settings.simulate is not None,
                                          "mps_daemons": self.mps_launcher.describe()})
        self._follow_multi_user_safely()
        self._next_scan = time.monotonic() + settings.rescan_interval
        self._mig_changes_seen = self.state.mig.changes

    def tick(self) -> None:
        """Once a second on the main thread: the multi-user probe's answer, and a rescan when one is due, or
        at once after a MIG instance was created or destroyed: until discovery lists it, NVML's health events
        in it would name its whole GPU and taint every device of the GPU, other claims' instances too."""
        self._follow_multi_user_safely()
        mig_changes = self.state.mig.changes
        gates_off = self.helper.server_gates_off & {PARTITIONABLE_GATE, CONSUMABLE_GATE}
        if gates_off != self.plans.gates_off:
            log.error("the API server runs without %s: it dropped the fields of our ResourceSlices that need it, so "
                      "what needs it is withdrawn (dynamic MIG placements need %s, consumable GPUs %s); restart the "
                      "plugin once the gate is on", ", ".join(sorted(gates_off - self.plans.gates_off)),
                      PARTITIONABLE_GATE, CONSUMABLE_GATE, extra={"feature_gates": sorted(gates_off)})
            self.plans.gates_off = gates_off
            self._next_scan = 0.0  # at once: the scheduler may be allocating from what the server kept
        if time.monotonic() >= self._next_scan or mig_changes != self._mig_changes_seen:
            self._mig_changes_seen = mig_changes
            self._next_scan = time.monotonic() + self.settings.rescan_interval
            try:
                self.rescan()
            except Exception:
                log.exception("rescan failed; will retry")

    def shutdown(self) -> None:
        # Slices stay published: during a rolling update the other pod keeps serving them, and
        # after a real removal the kubelet wipes them 30 s after the sockets are gone.
        self.health.monitor.stop()
        self.usage.stop()
        # A check in progress is bounded by the MPS timeouts; then the queued Events get a moment to go out.
        self.daemon_watch.stop(self.mps.ready_timeout + self.mps.command_timeout)
        self.events.stop(timeout=2.0)
        if self._helper is not None:
            self._helper.stop()  # in-flight calls finish before NVML is closed below
        # A probe still running has a throwaway daemon to stop; it is bounded by the manager's timeouts.
        self.multi_user.join(self.mps.ready_timeout + self.mps.stop_timeout)
        self.discovery.close()
        self.state.mig.close()

