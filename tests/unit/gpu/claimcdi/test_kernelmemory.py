"""Kernel-enforced GPU memory for consumable shares: detection, the published level, the CDI hook."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from driver.gpu.claimcdi import kernelmemory
from driver.gpu.discovery.inventory import NodeInventory
from driver.gpu.published.consumable import KernelMemoryLimits
from driver.gpu.published.devices import make_view
from driver.gpu.published.sharingplan import SharingPlans, resolve_layout
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.simulation.discovery import SimulatedDiscovery
from driver.simulation.hostroot import build_host_root
from driver.units import GIB
from tests.support.statenode import DRIVER, POOL, StateNode, device_env
from tests.unit.gpu.published.test_consumable import shares_claim

HOOK = "/usr/bin/nvidia-cdi-hook"
R615 = "615.10.01"
V2_DMEM = "cpuset cpu io memory hugetlb pids rdma misc dmem\n"


def test_all_ingredients_present_make_memory_a_kernel_limit() -> None:
    kernel = kernelmemory.check(R615, V2_DMEM, HOOK)
    assert kernel.available and kernel.hook_path == HOOK


@pytest.mark.parametrize(("driver", "controllers", "hook", "missing"), [
    ("580.95.05", V2_DMEM, HOOK, "NVIDIA driver 580.95.05 is older than R615"),
    (None, V2_DMEM, HOOK, "NVIDIA driver version unknown is older than R615"),
    (R615, None, HOOK, "not cgroup v2"),
    (R615, "cpuset cpu io memory pids\n", HOOK, "lacks the 'dmem' controller"),
    (R615, "cpu memory dmemx\n", HOOK, "lacks the 'dmem' controller"),  # a whole word, not a prefix
    (R615, V2_DMEM, None, "no 'apply-cuda-memory-limits' hook"),
])
def test_each_missing_ingredient_keeps_the_level_per_process_and_is_named(
        driver: str | None, controllers: str | None, hook: str | None, missing: str) -> None:
    kernel = kernelmemory.check(driver, controllers, hook)
    assert not kernel.available and kernel.hook_path is None
    assert missing in kernel.reason


def test_every_missing_ingredient_is_named_at_once() -> None:
    reason = kernelmemory.check("550.1", None, None).reason
    assert "older than R615" in reason and "not cgroup v2" in reason and "hook" in reason


def simulated(layout: str, root: Path) -> tuple[NodeInventory, Path]:
    inventory = SimulatedDiscovery(layout, POOL).discover()
    return inventory, build_host_root(root, inventory).toolkit_spec


def test_detection_reads_the_simulated_host_with_kernel_memory_limits(tmp_path: Path) -> None:
    inventory, spec = simulated("kernel-memory", tmp_path)
    assert (tmp_path / "sys/fs/cgroup/cgroup.controllers").read_text().split()[-1] == "dmem"
    kernel = kernelmemory.detect(tmp_path, inventory.driver_version, spec)
    assert kernel == KernelMemoryLimits(True, kernel.reason, hook_path=HOOK)


def test_detection_on_an_ordinary_simulated_node_names_what_is_missing(tmp_path: Path) -> None:
    inventory, spec = simulated("demo", tmp_path)
    kernel = kernelmemory.detect(tmp_path, inventory.driver_version, spec)
    assert not kernel.available
    assert "older than R615" in kernel.reason and "'dmem'" in kernel.reason and "hook" in kernel.reason


def test_detection_without_a_toolkit_spec_or_with_a_broken_one_finds_no_hook(tmp_path: Path) -> None:
    inventory, spec = simulated("kernel-memory", tmp_path)
    assert not kernelmemory.detect(tmp_path, inventory.driver_version, None).available
    spec.write_text("cdiVersion: 0.5.0\nkind: [not a kind\n")
    assert kernelmemory.memory_limit_hook(spec) is None
    assert kernelmemory.memory_limit_hook(tmp_path / "missing.yaml") is None


# ----------------------------------------------------------------------------- published and prepared

KERNEL = KernelMemoryLimits(True, "detected", hook_path=HOOK)


def consumable_layout(inventory: NodeInventory, kernel: KernelMemoryLimits | None) -> Any:
    plan = SharingPlans.model_validate(
        {"plans": {"p": {"gpus": [{"match": {"minor": 0}, "consumable": {}}]}}}).plans["p"]
    return resolve_layout(plan, inventory, "p", kernel=kernel)


@pytest.mark.parametrize(("kernel", "level"), [(KERNEL, "kernel"), (None, "mps-advisory"),
                                               (KernelMemoryLimits(False, "no dmem"), "mps-advisory")])
def test_the_device_publishes_the_detected_level(kernel: KernelMemoryLimits | None, level: str) -> None:
    inventory = SimulatedDiscovery("demo", POOL).discover()
    [device] = [d for d in make_view(inventory, consumable_layout(inventory, kernel)).devices
                if d.name == "gpu-0-shared"]
    attrs = device.to_wire()["attributes"]
    assert attrs["memoryLimitEnforcement"] == {"string": level}
    assert attrs["computeLimitEnforcement"] == {"string": "mps-advisory"}


def prepared_spec(state_node: StateNode, kernel: KernelMemoryLimits | None) -> dict[str, Any]:
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), consumable_layout(state_node.inventory, kernel))
    uid = "0b6f3c1e-8d2a-4c5b-9e7f-1a2b3c4d5e6f"
    state.prepare(shares_claim(uid, "10Gi", "33"))
    return state_node.spec_json(uid)


def test_a_kernel_node_puts_the_claims_memory_as_a_hard_limit_hook_in_its_spec(state_node: StateNode) -> None:
    spec = prepared_spec(state_node, KERNEL)
    edits = spec["devices"][0]["containerEdits"]
    assert edits["hooks"] == [{
        "hookName": "createRuntime", "path": HOOK,
        "args": ["nvidia-cdi-hook", "apply-cuda-memory-limits", "--driver-root", "/", "--gpu-id", state_node.uuid(0)]}]
    env = device_env(spec)
    mib = str(10 * GIB >> 20)
    # Both forms: the hook looks the plural names up first, so a plural one from elsewhere cannot win.
    assert [e for e in env if e.startswith("NVIDIA_GPU_MEMORY_")] == [
        f"NVIDIA_GPU_MEMORY_REQUESTS={mib}", f"NVIDIA_GPU_MEMORY_LIMITS={mib}",
        f"NVIDIA_GPU_MEMORY_REQUEST={mib}", f"NVIDIA_GPU_MEMORY_LIMIT={mib}"]
    # MPS still caps each process too; the kernel limit covers the container's processes together.
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M" in env
    assert spec["devices"][0]["annotations"][f"{DRIVER}/consumed"] == f"{10 * GIB},33"


def test_without_kernel_limits_the_spec_has_no_hook_and_no_memory_variables(state_node: StateNode) -> None:
    spec = prepared_spec(state_node, None)
    assert "hooks" not in spec["devices"][0]["containerEdits"]
    assert not [e for e in device_env(spec) if e.startswith("NVIDIA_GPU_MEMORY_")]


def test_the_plugin_detects_at_start_and_again_at_each_rescan(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from driver.commands.run.plansource import PlanSource
    from driver.config import Settings

    inventory, spec = simulated("kernel-memory", tmp_path / "host")
    settings = Settings(node_name="node-a", plugins_dir=tmp_path / "plugins", cdi_root=tmp_path / "cdi",
                        host_root=tmp_path / "host", nvidia_cdi_spec=spec)
    source = PlanSource(settings, api=None)  # type: ignore[arg-type]  # detection never calls the API server
    with caplog.at_level("INFO", logger="driver.commands.run.plansource"):
        assert source.detect_kernel_memory(inventory).available
        assert source.detect_kernel_memory(inventory).available  # a rescan, unchanged: no second log line
        controllers = tmp_path / "host" / "sys/fs/cgroup/cgroup.controllers"
        controllers.write_text(controllers.read_text().replace(" dmem", ""))  # e.g. booted into an older kernel
        kernel = source.detect_kernel_memory(inventory)
    assert not kernel.available and "'dmem'" in kernel.reason
    lines = [r.getMessage() for r in caplog.records if "kernel-enforced" in r.getMessage()]
    assert lines == ["kernel-enforced GPU memory limits for consumable shares: available",
                     "kernel-enforced GPU memory limits for consumable shares: not available"]


def reserved(claim: ResourceClaim, *pod_uids: str) -> ResourceClaim:
    """``claim`` reserved for pods (as the scheduler writes status.reservedFor)."""
    wire = claim.model_dump(by_alias=True, exclude_none=True)
    wire["status"]["reservedFor"] = [{"resource": "pods", "name": f"pod-{p}", "uid": p} for p in pod_uids]
    return ResourceClaim.model_validate(wire)


def test_two_kernel_limited_claims_of_one_pod_are_logged_as_a_possible_collision(
        state_node: StateNode, caplog: pytest.LogCaptureFixture) -> None:
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), consumable_layout(state_node.inventory, KERNEL))
    with caplog.at_level("WARNING", logger="driver.gpu.claimcdi.kernelmemory"):
        state.prepare(reserved(shares_claim("a", "10Gi", "33"), "pod-1"))
        state.prepare(reserved(shares_claim("b", "20Gi", "33"), "pod-2"))  # another pod: nothing to say
        assert [r for r in caplog.records if r.name == "driver.gpu.claimcdi.kernelmemory"] == []
        state.prepare(reserved(shares_claim("c", "4Gi", "33"), "pod-1"))
    [warning] = [r for r in caplog.records if r.name == "driver.gpu.claimcdi.kernelmemory"]
    assert "one container" in warning.getMessage() and "NVIDIA_GPU_MEMORY_LIMIT" in warning.getMessage()
    assert (warning.claim_uid, warning.other_claim_uid, warning.pod_uids) == ("c", "a", ["pod-1"])  # type: ignore[attr-defined]


def test_without_kernel_limits_claims_of_one_pod_are_not_a_collision(state_node: StateNode) -> None:
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), consumable_layout(state_node.inventory, None))
    a, b = reserved(shares_claim("a", "10Gi", "33"), "pod-1"), reserved(shares_claim("b", "4Gi", "33"), "pod-1")
    for claim in (a, b):
        state.prepare(claim)
    cp = state_node.store.load()
    assert kernelmemory.warn_if_shared_pod(cp.claims["b"], cp) == []
