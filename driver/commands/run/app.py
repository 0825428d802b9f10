"""The driver's initialisation and running: wire the GPU side (discovery, state, devices) to the plugin helper.

``driver/commands/run/startup.py`` serves the sockets and registers first, then builds :class:`DriverApp` on a
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
from functools import partial

from driver import nodelayout
from driver.commands.run.healthsource import open_health_source, open_process_source
from driver.commands.run.initsteps import api_client, desired_layout, discover, recover_and_lay_out
from driver.commands.run.nodeevents import post_node_event
from driver.commands.run.plansource import CONSUMABLE_GATE as CONSUMABLE_GATE
from driver.commands.run.plansource import PARTITIONABLE_GATE as PARTITIONABLE_GATE
from driver.commands.run.plansource import PlanSource as PlanSource
from driver.config import Settings
from driver.gpu.claim.limitstatement import unconfirmed_gpus, with_unconfirmed_limits
from driver.gpu.claimcdi.toolkit import toolkit_spec_changed
from driver.gpu.claimstatus import STATUS_FILE, ClaimStatusSource
from driver.gpu.discovery.inventory import NodeInventory
from driver.gpu.driver import GpuDriver
from driver.gpu.health.monitor import HealthMonitor
from driver.gpu.health.node import NodeHealth
from driver.gpu.health.published import taints_decision
from driver.gpu.health.report import HEALTH_FILE
from driver.gpu.health.usagereport import USAGE_FILE
from driver.gpu.health.usagewatch import ClaimUsageWatch
from driver.gpu.health.xids import parse_ignored_xids
from driver.gpu.host.capnodes import MIG_CONFIG, ensure_nodes_best_effort
from driver.gpu.mps.hostcheck import default_tools
from driver.gpu.mps.hostclient import MpsHostLauncher
from driver.gpu.mps.launch import DaemonLauncher
from driver.gpu.mps.locallauncher import LocalLauncher
from driver.gpu.mps.manager import MpsManager
from driver.gpu.mps.shmmount import ShmTmpfs
from driver.gpu.published.devices import make_view
from driver.gpu.published.ownership import OwnershipWatch, owned_view
from driver.gpu.published.sharingplan import PlanError
from driver.gpu.published.targets import NodeView
from driver.gpu.runtime.mig import capabilities_of
from driver.gpu.runtime.migclaims import own_instances
from driver.gpu.runtime.multiuser import MultiUserGate, MultiUserProbe, probe_gpu, single_user_gpus, supports_multi_user
from driver.gpu.runtime.sharing import WATCH_CHECK_S
from driver.gpu.runtime.timeslice import TimeSlicer
from driver.gpu.state import DeviceState, StatePaths
from driver.gpu.watch.daemonwatch import DaemonWatcher, MpsReports, revive_daemons
from driver.gpu.watch.migwatch import check_mig_instances
from driver.gpu.watch.modewatch import ComputeModeReports, check_compute_modes
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.events import EventRecorder
from driver.kubeletplugin.healthservice import HealthBoard
from driver.kubeletplugin.helper import Helper, TelemetryNames
from driver.kubeletplugin.kubeclient import KubeApiError
from driver.kubeletplugin.nodewatch import NodeMeta, NodeWatch
from driver.kubeletplugin.types import ClaimRef

log = logging.getLogger(__name__)


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
    return LocalLauncher(settings.driver_root, shm=shm,
                         capability_roots=(settings.host_root, nodelayout.own_dev_root(settings)))


class DriverApp:
    """The initialised driver: constructing it is the initialisation; the plugin's sockets are already served."""

    def __init__(self, settings: Settings, health_board: HealthBoard):
        """``health_board``: the board the plugin already serves the kubelet's health stream from."""
        self.settings = settings
        # What the cluster and the node have: the API, the GPUs, the Node and the sharing plan it wants.
        self.api = api_client(settings)
        self.discovery, inventory = discover(settings)
        self.node = self._watch_node()
        self.plans = PlanSource(settings, self.api, node_labels=lambda: self.node.meta().labels)
        desired = desired_layout(settings, self.plans, inventory)
        # The moving parts, wired before recovery sets any of them going.
        self._helper: Helper | None = None
        self._node_uid: str | None = None
        self._next_scan = 0.0
        self._mig_changes_seen = 0
        paths = state_paths(settings)
        self.mps_launcher = choose_launcher(settings)
        self.mps = MpsManager(settings.driver_root, settings.state_dir / "mps", self.mps_launcher,
                              shm_dir=settings.mps_shm_dir)
        # Multi-user MPS is probed after registration (a daemon start); until then plan daemons and
        # the published mpsMultiUser attribute say single-user, the answer that hides nothing.
        self.multi_user = MultiUserProbe(partial(supports_multi_user, self.mps))
        self._multi_user_published = False
        self._single_user_gpus: tuple[str, ...] = ()
        self.state = self._device_state(paths, inventory)
        # Tenants that change or stop a shared MPS daemon: counted, logged and told to each claim's owner
        # as an Event (posted from the recorder's thread, never inside a prepare).
        self.events = EventRecorder(self.api, controller=f"{settings.driver_name}/kubelet-plugin",
                                    instance=settings.node_name)
        self.ownership = self._ownership(inventory)
        self.mps_reports = MpsReports(self.events)
        self.claim_status = ClaimStatusSource(self.state.ledger.read, lambda: self.state.view,
                                              lambda view: self.health.unhealthy(view),
                                              report_path=settings.state_dir / STATUS_FILE)
        self.mode_reports = ComputeModeReports(self.events)
        self.daemon_watch = DaemonWatcher(self.state, settings.mps_limit_check_interval,
                                          also=[partial(check_compute_modes, self.state, self.mode_reports),
                                                partial(check_mig_instances, self.state, self.events)])
        self._wire_runtime()
        # Recovery, then the plan in force: what is published first; then health and the claims' usage.
        self.devices = recover_and_lay_out(self.state, self.discovery, self.plans, inventory, desired,
                                           settings.state_dir).devices
        self.health = NodeHealth(HealthMonitor(parse_ignored_xids(settings.ignored_xids)), health_board,
                                 driver_name=settings.driver_name, pool_name=settings.node_name,
                                 taint_effect=settings.health_taint_effect,
                                 report_path=settings.state_dir / HEALTH_FILE)
        self.health_source = open_health_source(settings, lambda: self.state.view.inventory, os.environ,
                                                self.discovery.discover)
        self._wire_health()
        self.usage = ClaimUsageWatch(open_process_source(settings, lambda: self.state.view.inventory, os.environ),
                                     self.state.ledger.read, lambda: self.state.view,
                                     report_path=settings.state_dir / USAGE_FILE)
        self._publish_lock = threading.Lock()

    def _watch_node(self) -> NodeWatch:
        """The Node's labels (the sharing plan) and UID (the slices' owner): listed once, then watched."""
        node = NodeWatch(self.api, self.settings.node_name)
        try:
            node.sync()
        except KubeApiError as exc:
            log.warning("cannot read Node %s yet, will retry: %s", self.settings.node_name, exc)
        return node

    def _ownership(self, inventory: NodeInventory) -> OwnershipWatch:
        """Another GPU allocator on the node keeps the GPUs it may hand out unpublished
        (driver/gpu/published/ownership.py)."""
        settings = self.settings
        withheld = partial(post_node_event, self.events, self.api, settings.node_name, "OtherGpuAllocator",
                           "WithholdGpus")
        ownership = OwnershipWatch(settings.device_plugins_dir, settings.registrar_dir, settings.driver_name,
                                   settings.owned_gpus, withheld)
        ownership.refresh(inventory)
        return ownership

    def _device_state(self, paths: StatePaths, inventory: NodeInventory) -> DeviceState:
        settings = self.settings
        compute_modes = nodelayout.open_compute_modes(settings)  # NVML (or its simulation double), once
        state = DeviceState(
            driver_name=settings.driver_name, pool_name=settings.node_name, paths=paths,
            toolkit=nodelayout.load_toolkit(settings), mps=self.mps,
            timeslicer=TimeSlicer(settings.driver_root, compute_modes), compute_modes=compute_modes,
            view=make_view(inventory, {}), mps_multi_user=False,
            mig=partial(nodelayout.open_mig_partitioner, settings))  # opened at the first dynamic MIG claim
        # A plan daemon started before the probe answered would stay single-user while claims use it.
        state.multi_user_gate = MultiUserGate(self.multi_user, lambda: state.view.inventory, self._use_multi_user).wait
        return state

    def _wire_runtime(self) -> None:
        """The runtime's reports and hooks, before recovery starts daemons or makes MIG instances again."""
        settings = self.settings
        self.state.sharing.reports = self.mps_reports
        self.mps_reports.restored = self._limits_restored
        # Before a daemon or an NVML create opens a MIG instance, its capability nodes are made in this process's
        # /dev (and the MPS host's, told by the request), from the claims the checkpoint records.
        self.mps.capabilities = lambda uuids: capabilities_of(self.state.ledger.read(), uuids)
        self.state.mig.before_create = partial(ensure_nodes_best_effort, settings.host_root,
                                               nodelayout.own_dev_root(settings), [MIG_CONFIG])
        # A prepare joins a daemon whose limits the watcher confirmed this recently without a control command.
        self.state.sharing.confirmations.fresh_for = settings.mps_limit_check_interval
        self.state.sharing.confirmations.round_s = WATCH_CHECK_S
        # The shares' published limit statement follows (off the watcher's thread: it holds GPU locks).
        self.mps_reports.on_change = lambda: threading.Thread(
            target=self._publish_on_health_change, name="publish-limit-statement", daemon=True).start()

    def _wire_health(self) -> None:
        """New claims on unhealthy devices are refused, unless they tolerate the devices' taints."""
        self.health.not_watched = self.health_source.not_watched
        self.state.device_problems = lambda: self.health.problems(self.state.view)
        self.state.device_taints = lambda: self.health.taints(self.state.view)

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
        # An instance destroyed after discovery listed it, its claim's record dropped before the view is applied,
        # would pass for someone else's and take its placement off the view (a claim allocated it then fails):
        # such an inventory is not applied; the next tick discovers again, as a MIG change was made.
        changes = self.state.mig.changes
        inventory = self.discovery.discover()
        self.ownership.refresh(inventory)
        try:
            desired = self.plans.desired_layout(inventory, own_instances(self.state.ledger.read(), inventory))
        except PlanError as exc:
            log.error("the sharing plan became invalid; keeping the one in force", extra={"reason": str(exc)})
            desired = self.state.view.layout
        view, _deferred = self.state.apply_layout(make_view(inventory, {}), desired,
                                                  current=lambda: self.state.mig.changes == changes)
        self.plans.save(self.settings.state_dir)
        self.publish(view)
        # A daemon that died (with the MPS host, or with this container when daemons are our own
        # children) is restarted here with the same limits; live ones are only looked up in /proc.
        revive_daemons(self.state)

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
        if available and not self._multi_user_published:
            self._multi_user_published = self.state.mps_multi_user = True
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

    def _use_multi_user(self) -> None:
        """Plan daemons started from now on are multi-user (the devices are republished at the next tick)."""
        self.state.mps_multi_user = True

    def _follow_multi_user_safely(self) -> None:
        try:
            self.follow_multi_user()
        except Exception:
            log.exception("applying the MPS multi-user probe failed; will retry")

    def publish(self, view: NodeView) -> None:
        """Publish ``view``'s devices of GPUs this driver owns (tainted where unhealthy) and tell the kubelet their
        health."""
        view = owned_view(view, self.ownership.ownership)
        with self._publish_lock:
            devices = with_unconfirmed_limits(self.health.devices(view), unconfirmed_gpus(self.state.ledger.read()))
            self.helper.publish(devices, view.counter_sets)
            self.health.update_board(view)

    def _publish_on_health_change(self) -> None:
        try:
            self.publish(self.state.view)
        except Exception:
            log.exception("publishing a device health change failed; the next rescan retries")
        self._claim_statuses_changed()

    def _claim_statuses_changed(self) -> None:
        """Every prepared claim's status is written again where it changed (claims whose didn't cost nothing)."""
        try:
            for ref in self.claim_status.prepared_claims():
                self.helper.claim_status_changed(ref)
        except Exception:
            log.exception("queueing claim status writes failed")

    def _limits_restored(self, claims: list[ClaimRef]) -> None:
        for ref in claims:
            self.claim_status.limits_restored(ref.uid)
            if self._helper is not None:
                self._helper.claim_status_changed(ref)

    def _node_changed(self, meta: NodeMeta) -> None:
        """A label (the sharing plan) changes what is published within a tick; a new UID (the Node re-created)
        re-owns the slices."""
        self._next_scan = 0.0
        if meta.uid != self._node_uid and meta.uid is not None and self._helper is not None:
            self._helper.resync_slices()
        self._node_uid = meta.uid

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
        def admit(claim: ResourceClaim) -> str | None:
            prepared = claim.metadata.uid in self.state.ledger.read().claims
            return self.ownership.admit(claim, settings.driver_name, self.state.view, prepared)

        helper.complete(GpuDriver(self.state, admit), api=self.api,
                        names=TelemetryNames(service="tessera-kubelet-plugin", metric_prefix="tessera"),
                        claim_status=self.claim_status, node_uid=self.node.uid)
        self._node_uid = self.node.uid()
        self.node.add_listener(self._node_changed)
        self.node.start()
        self.helper.telemetry.observe_gauge("prepared_claims", "Claims prepared on this node",
                                            lambda: float(self.state.prepared_count()))
        self._start_health()
        self.mps_reports.register_metrics(self.helper.telemetry)
        self.mode_reports.register_metrics(self.helper.telemetry)
        self.events.start()
        self.daemon_watch.start()
        log.info("driver started", extra={"driver": settings.driver_name, "node": settings.node_name,
                                          "http_port": self.helper.http_port,
                                          "dra_socket": str(self.helper.dra_socket),
                                          "simulated": settings.simulate is not None,
                                          "mps_daemons": self.mps_launcher.describe()})
        self._follow_multi_user_safely()
        self._claim_statuses_changed()  # after a restart: claims prepared before it show their status (no duplicates)
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
        self.node.stop()
        # A check in progress is bounded by the MPS timeouts; then the queued Events get a moment to go out.
        self.daemon_watch.stop(self.mps.ready_timeout + self.mps.command_timeout)
        self.events.stop(timeout=2.0)
        if self._helper is not None:
            self._helper.stop()  # in-flight calls finish before NVML is closed below
        # A probe still running has a throwaway daemon to stop; it is bounded by the manager's timeouts.
        self.multi_user.join(self.mps.ready_timeout + self.mps.stop_timeout)
        self.discovery.close()
        self.state.mig.close()

