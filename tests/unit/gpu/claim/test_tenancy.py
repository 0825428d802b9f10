"""Who may share an MPS daemon: the pod-security rules, the ``clients`` settings, and how limits are published.

The control protocol part runs against the stand-in and
NVIDIA's own daemons: a non-root UID is refused by 550 and obeyed by 535, which is what
``mps_control_guarded`` (and so ``mps-per-process``) rests on.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from driver.gpu.claimconfig.api import ConfigError, parse_config
from driver.gpu.claimconfig.choices import MpsClients
from driver.gpu.discovery.inventory import GpuInfo, NodeInventory
from driver.gpu.errors import PrepareError
from driver.gpu.published.devices import make_view
from driver.gpu.published.sharelayout import Enforcement, GpuForm, mps_control_guarded, mps_enforcement
from driver.gpu.published.sharingplan import PlanError, SharingPlans, load_plans, resolve_layout, select_plan
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.podfetch import PodFetcher
from driver.kubeletplugin.podspec import Pod
from driver.kubeletplugin.reservedpods import PodReader, PodRef, PodsUnreadable
from driver.simulation.apiserver import FakeApiServer
from tests.support.mpsdaemons import MpsDaemonKind, daemon_params
from tests.support.processes import poll_until, standin_sandbox
from tests.support.statenode import StateNode, claim, gpu_config, mps_shares

# --- reading a claim's pods -------------------------------------------------------------------


@pytest.fixture
def apiserver() -> Iterator[FakeApiServer]:
    server = FakeApiServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def claim_for(*pods: tuple[str, str]) -> ResourceClaim:
    return ResourceClaim.model_validate({"metadata": {"name": "c", "namespace": "ns", "uid": "u"}, "status": {
        "reservedFor": [{"resource": "pods", "name": name, "uid": uid} for name, uid in pods]}})


def test_reserved_pods_are_read_by_name_once_and_judged_by_uid(apiserver: FakeApiServer) -> None:
    apiserver.put_pod({"metadata": {"name": "a", "namespace": "ns", "uid": "uid-a"},
                       "spec": {"containers": [{"name": "c0"}]}})
    apiserver.put_pod({"metadata": {"name": "b", "namespace": "ns", "uid": "uid-b2"}, "spec": {}})
    claim = claim_for(("a", "uid-a"), ("b", "uid-b"), ("gone", "uid-c"))
    claim.with_pod_reader(PodFetcher(apiserver.api_client()))
    pods = claim.reserved_pods(5.0)
    assert [str(p) for p in pods.pods] == ["ns/a"]
    assert pods.skipped == ("pod ns/gone",)
    assert [u.line.split(";")[0] for u in pods.unknown] == [
        'status.reservedFor[1] names pod ns/b with uid "uid-b", but pod ns/b has uid "uid-b2"']
    assert [f.describe().split(":")[0] for f in pods.findings()] == [
        "status.reservedFor[1] names pod ns/b with uid \"uid-b\", but pod ns/b has uid \"uid-b2\"; the kubelet matches "
        "pods by uid, so the pod that would use the claim cannot be checked", *['pod ns/a container "c0"'] * 3]
    requests = len(apiserver.requests)
    assert claim.reserved_pods(5.0) is pods and len(apiserver.requests) == requests, "read once per claim"


def test_a_claim_reserved_for_no_pod_reads_nothing_and_one_without_a_reader_cannot_be_checked() -> None:
    assert claim_for().reserved_pods(5.0).pods == ()
    with pytest.raises(PodsUnreadable, match="cannot read the pods"):
        claim_for(("a", "uid-a")).reserved_pods(5.0)


def test_what_the_server_sent_is_echoed_on_one_line(apiserver: FakeApiServer) -> None:
    apiserver.put_pod({"metadata": {"name": "odd", "namespace": "ns", "uid": "uid-odd",
                                    "annotations": {"x\nFAKE: y": 5}}, "spec": {}})
    with pytest.raises(PodsUnreadable) as caught:
        claim_for(("odd", "uid-odd")).with_pod_reader(PodFetcher(apiserver.api_client())).reserved_pods(5.0)
    assert str(caught.value).startswith('pod ns/odd: the API server returned an object this driver cannot read (at '
                                        '"metadata.annotations.x\\nFAKE: y": '), str(caught.value)
    gone = claim_for(("a\nb", "uid-a")).with_pod_reader(PodFetcher(apiserver.api_client())).reserved_pods(5.0)
    assert [f.describe() for f in gone.findings()] == [
        'every pod the claim is reserved for is gone (pod "ns/a\\nb"), so none can use it']


# --- the settings -----------------------------------------------------------------------------

H100 = GpuInfo(minor=0, index=0, uuid="GPU-00000000-0000-0000-0000-000000000001", product_name="NVIDIA H100",
               memory_bytes=80 << 30, cuda_compute_capability="9.0")


def plans(mps: dict[str, Any]) -> SharingPlans:
    return SharingPlans.model_validate({"plans": {"p": {"gpus": [{"match": {"all": True}, "mps": mps}]}}})


def test_plan_mps_clients_default_to_non_root_and_take_any(tmp_path: Path) -> None:
    inventory = NodeInventory(driver_version="550.163.01", gpus=(H100,))
    for mps, clients in (({"shares": 2}, "nonRoot"), ({"shares": 2, "clients": "any"}, "any")):
        name, plan = select_plan(plans(mps), {"l": "p"}, "l")
        assert resolve_layout(plan, inventory, name)[H100.uuid].mps_clients == clients
    bad = tmp_path / "plans.yaml"
    bad.write_text("plans:\n  p:\n    gpus:\n    - match: {all: true}\n      mps: {shares: 2, clients: root}\n")
    with pytest.raises(PlanError, match=r"plans\.p\.gpus\[0\]\.mps\.clients: \"root\" is not allowed; expected "
                                        r"'nonRoot' or 'any'"):
        load_plans(bad)


def mps_config(**mps: Any) -> dict[str, Any]:
    return {"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig",
            "sharing": {"strategy": "MPS", "mpsConfig": mps}}


def test_per_claim_mps_clients_default_to_any_and_are_decoded_strictly() -> None:
    config = parse_config(mps_config())
    assert config.sharing is not None and config.sharing.mpsConfig is not None
    assert config.sharing.mpsConfig.clients == "any"
    config = parse_config(mps_config(clients="nonRoot"))
    assert config.sharing is not None and config.sharing.mpsConfig is not None
    assert config.sharing.mpsConfig.clients == "nonRoot"
    for bad, shown in (("NonRoot", '"NonRoot"'), (True, "true")):
        with pytest.raises(ConfigError, match=rf"^GpuConfig\.sharing\.mpsConfig\.clients: {shown} is not allowed; "
                                              r"expected 'nonRoot' or 'any'$"):
            parse_config(mps_config(clients=bad))


# --- how limits are published -----------------------------------------------------------------


@pytest.mark.parametrize(("clients", "driver_version", "level"), [
    ("nonRoot", "550.163.01", Enforcement.MPS_PER_PROCESS),
    ("nonRoot", "580.95.05", Enforcement.MPS_PER_PROCESS),
    ("nonRoot", "535.261.03", Enforcement.MPS_ADVISORY),  # 535 takes settings from any UID
    ("nonRoot", "545.29.06", Enforcement.MPS_ADVISORY),  # not measured: counted as taking them
    ("nonRoot", None, Enforcement.MPS_ADVISORY),
    ("nonRoot", "unknown", Enforcement.MPS_ADVISORY),
    ("any", "580.95.05", Enforcement.MPS_ADVISORY),
    ("any", "535.261.03", Enforcement.MPS_ADVISORY),
])
def test_mps_share_enforcement_by_clients_and_driver_branch(clients: MpsClients, driver_version: str | None,
                                                            level: Enforcement) -> None:
    shares = GpuForm(strategy="MPS", count=2, active_thread_percentage=50, memory_bytes_per_share=1 << 30,
                       mps_clients=clients)
    view = make_view(NodeInventory(driver_version=driver_version, gpus=(H100,)), {H100.uuid: shares})
    attrs = view.devices[0].model_dump(by_alias=True, exclude_none=True)["attributes"]
    assert attrs["memoryLimitEnforcement"] == {"string": level.value}
    assert attrs["computeLimitEnforcement"] == {"string": level.value}
    assert mps_enforcement(clients, driver_version, exclusive=False) == Enforcement.MPS_ADVISORY


# --- what the daemons do with a non-root UID's settings ----------------------------------------

STANDIN_535 = MpsDaemonKind("standin-535", None, writes_pid_file=False, knows_multi_user=False, guards_settings=False)
# The driver version each daemon belongs to; the stand-in's default model is a current driver.
VERSIONS = {"standin": "580.95.05", "standin-535": "535.261.03", "nvidia-550": "550.163.01",
            "nvidia-535": "535.261.03"}


@pytest.mark.skipif(os.geteuid() != 0, reason="running the control client as another UID needs root")
@pytest.mark.parametrize("kind", [*daemon_params(), pytest.param(STANDIN_535, id="standin-535")])
def test_what_a_non_root_uid_can_do_to_the_daemon_matches_the_published_rule(kind: MpsDaemonKind) -> None:
    with standin_sandbox("tst", []) as top:
        kind.install(top / "root" / "usr" / "bin")
        top.chmod(0o755)  # UID 65534 must reach the binary and the pipe dir
        (top / "p").mkdir()
        (top / "l").mkdir()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_SIM_", "CUDA_MPS_"))}
        env |= {"CUDA_MPS_PIPE_DIRECTORY": str(top / "p"), "CUDA_MPS_LOG_DIRECTORY": str(top / "l")}
        if kind is STANDIN_535:
            env["TESSERA_SIM_MPS_DRIVER"] = "535"
        control = str(top / "root" / "usr" / "bin" / "nvidia-cuda-mps-control")
        daemon = subprocess.Popen([control, "-f"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            poll_until(lambda: subprocess.run([control], input="get_default_active_thread_percentage\n", env=env,
                                              capture_output=True, text=True, timeout=10).stdout.strip() == "100.0",
                       "the daemon to answer")
            nobody = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", control],
                                    input="set_default_active_thread_percentage 50\nquit\n",
                                    env=env, capture_output=True, text=True, timeout=10)
            after = subprocess.run([control], input="get_default_active_thread_percentage\n", env=env,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            guarded = after == "100.0"
            assert guarded == mps_control_guarded(VERSIONS[kind.name]) == kind.guards_settings, nobody.stdout
            assert "Not enough privilege to execute quit command" in nobody.stdout  # no model lets it quit
            assert daemon.poll() is None
        finally:
            subprocess.run([control], input="quit\n", env=env, capture_output=True, text=True, timeout=10)
            try:
                daemon.wait(timeout=10)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()


# --- the check at prepare, on DeviceState --------------------------------------------------------


class RootPods:
    """Every reserved pod exists and runs its one container as root (no securityContext)."""

    def read_pods(self, refs: Sequence[PodRef], timeout_s: float) -> list[Pod | None]:
        return [Pod.model_validate({"metadata": {"namespace": ns, "name": name, "uid": uid},
                                    "spec": {"containers": [{"name": "main"}]}}) for ns, name, uid in refs]


def for_pod(c: ResourceClaim, reader: PodReader | None) -> ResourceClaim:
    data = c.model_dump(by_alias=True)
    data["status"]["reservedFor"] = [{"resource": "pods", "name": "train-0", "uid": "pod-uid"}]
    reserved = ResourceClaim.model_validate(data)
    return reserved if reader is None else reserved.with_pod_reader(reader)


def test_a_claims_own_daemon_with_clients_non_root_refuses_a_root_pod_before_anything_starts(
        state_node: StateNode) -> None:
    state = state_node.state()
    refused = for_pod(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS", mpsConfig={"clients": "nonRoot"})]),
                      RootPods())
    with pytest.raises(PrepareError) as caught:
        state.prepare(refused)
    assert str(caught.value) == (
        'pod default/train-0 container "main": spec.containers[0].securityContext.runAsNonRoot is not true here or in '
        'spec.securityContext; Pod Security "restricted" requires true (without it the image\'s user decides, and '
        "that may be root) (2 more findings); the claim's own MPS daemon on gpu-0 admits only pods that meet Pod "
        'Security "baseline" and cannot run as root or group root (clients: nonRoot); set '
        "securityContext.runAsNonRoot: true on the pod or container, or set clients: any in the claim's mpsConfig")
    assert state_node.mps.started() == [] and state_node.cdi_files() == [] and state.ledger.read().claims == {}

    state.prepare(for_pod(claim("u2", "gpu-0", configs=[gpu_config(strategy="MPS")]), RootPods()))
    record = state.ledger.read().claims["u2"]
    assert (record.mps_clients, record.mps_enforcement) == ("any", Enforcement.MPS_ADVISORY)


def test_plan_shares_fail_closed_when_pods_cannot_be_read_or_none_is_reserved(state_node: StateNode) -> None:
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(0): mps_shares(2)})
    with pytest.raises(PrepareError, match="admits only non-root clients, so the pods the claim is reserved for must "
                                           "be checked first, but this claim source cannot read"):
        state.prepare(for_pod(claim("u1", "gpu-0-mps-0"), None))
    assert state_node.mps.started() == []
    unreserved = claim("u2", "gpu-0-mps-1").model_dump(by_alias=True)
    unreserved["status"]["reservedFor"] = []
    with pytest.raises(PrepareError) as caught:
        state.prepare(ResourceClaim.model_validate(unreserved))
    assert str(caught.value) == (
        "the claim is reserved for no pod (status.reservedFor is empty); the MPS daemon shared with other claims on "
        'gpu-0 admits only pods that meet Pod Security "baseline" and cannot run as root or group root (clients: '
        "nonRoot); reserve the claim for the pod that uses it, or use a share whose plan sets clients: any")
    assert state_node.mps.started() == []
    state.prepare(claim("u3", "gpu-0-mps-1"))  # reserved for a pod that runs as a non-root user and group
    record = state.ledger.read().claims["u3"]
    # The simulated node's driver is R580: its daemon refuses non-root control.
    assert (record.mps_clients, record.mps_enforcement) == ("nonRoot", Enforcement.MPS_PER_PROCESS)
