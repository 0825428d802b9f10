"""The steps of a start that read the cluster and the node, and the recovery after them (``app.py``).

Each returns what the next needs, or raises :class:`StartupError` with a message naming what to fix.
"""

from __future__ import annotations

from pathlib import Path

from driver import nodelayout
from driver.commands.run.plansource import PlanSource
from driver.config import Settings, StartupError
from driver.gpu.discovery.inventory import Discovery, NodeInventory
from driver.gpu.published.devices import make_view
from driver.gpu.published.sharelayout import SharingLayout
from driver.gpu.published.sharingplan import PlanError
from driver.gpu.published.targets import NodeView
from driver.gpu.recovery import recover
from driver.gpu.runtime.migclaims import own_instances
from driver.gpu.state import DeviceState
from driver.kubeletplugin.kubeclient import KubeApiError, KubeClient, KubeConfigError, load_api_client


def api_client(settings: Settings) -> KubeClient:
    if not settings.node_name:
        raise StartupError("the node name is required: set --node-name or NODE_NAME (downward API spec.nodeName)")
    try:
        return load_api_client(settings.kubeconfig)
    except KubeConfigError as exc:
        raise StartupError(str(exc)) from exc


def discover(settings: Settings) -> tuple[Discovery, NodeInventory]:
    """The node's discovery, opened, and its first inventory."""
    try:
        discovery = nodelayout.open_discovery(settings, settings.node_name)
        return discovery, discovery.discover()
    except (RuntimeError, ValueError, ImportError, OSError) as exc:  # no NVML/driver, or a bad simulated layout
        raise StartupError(f"GPU discovery failed: {exc}") from exc


def desired_layout(settings: Settings, plans: PlanSource, inventory: NodeInventory) -> SharingLayout:
    try:
        return plans.desired_layout(inventory)
    except PlanError as exc:
        raise StartupError(f"invalid sharing plan: {exc}") from exc
    except KubeApiError as exc:
        raise StartupError(f"cannot read Node {settings.node_name!r} to choose its sharing plan "
                           f"(label {settings.sharing_plan_label}): {exc}") from exc


def recover_and_lay_out(state: DeviceState, discovery: Discovery, plans: PlanSource, inventory: NodeInventory,
                        desired: SharingLayout, state_dir: Path) -> NodeView:
    """Finish or roll back what a crash interrupted, then put the sharing plan in force: the view to publish."""
    recover(state)
    own = own_instances(state.ledger.read())
    if own or state.mig.changes:
        # Dynamic MIG: instances of claims keep their GPU dynamic, and what recovery destroyed or re-created
        # (an interrupted prepare's, a reboot's) is seen again before anything is published or prepared.
        inventory = discovery.discover()
        desired = plans.desired_layout(inventory, own)
    view, _deferred = state.apply_layout(make_view(inventory, {}), desired)
    plans.save(state_dir)
    return view
