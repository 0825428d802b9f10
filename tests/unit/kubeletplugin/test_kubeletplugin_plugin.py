"""KubeletPlugin sockets and registration, driven by the kubelet emulator; plus the liveness check."""

from __future__ import annotations

import socket
import stat
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from driver.kubeletplugin.activity import DraActivity
from driver.kubeletplugin.api import dra_v1_pb2, dra_v1_pb2_grpc
from driver.kubeletplugin.claimbatch import ClaimBatch
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.liveness import check_plugin
from driver.kubeletplugin.plugin import KubeletPlugin
from driver.kubeletplugin.telemetry import Telemetry
from driver.kubeletplugin.types import ClaimRef, Deadline, DRADriver, PreparedDevice, PrepareResult
from driver.simulation.kubelet import KubeletDevice, KubeletEmulator, KubeletProtocolError, PrepareAnswer
from tests.support.kubeletplugin import Dirs

DRIVER = "gpu.tessera.dev"
POD_UID = "7f3c2a1e-pod"
CLAIM = ClaimRef(namespace="ns", name="claim", uid="7c1e4b2a-3d5f-4e6a-9b8c-0d1e2f3a4b5c")


class EchoDriver:
    """Prepares every claim as one shared device of its allocation."""

    def prepare_claim(self, claim: ResourceClaim, deadline: Deadline) -> PrepareResult:
        return PrepareResult(
            devices=[
                PreparedDevice(
                    request_names=[r.base_request],
                    pool_name=r.pool,
                    device_name=r.device,
                    cdi_device_ids=[f"k8s.gpu.tessera.dev/claim={claim.metadata.uid}-{r.device}"],
                    share_id=r.share_id,
                )
                for r in claim.results_for(DRIVER)
            ]
        )

    def unprepare_claim(self, claim: ClaimRef) -> str | None:
        return None


class BlockingDriver(EchoDriver):
    """Holds every prepare until ``release`` is set, like prepares waiting on the node lock."""

    def __init__(self) -> None:
        self.entered = threading.Semaphore(0)
        self.release = threading.Event()

    def prepare_claim(self, claim: ResourceClaim, deadline: Deadline) -> PrepareResult:
        self.entered.release()
        self.release.wait(timeout=30)
        return super().prepare_claim(claim, deadline)


class StaticClaims:
    def fetch(self, ref: ClaimRef) -> ResourceClaim:
        return ResourceClaim.model_validate(
            {
                "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
                "status": {
                    "allocation": {
                        "devices": {
                            "results": [
                                {
                                    "request": "gpus/mps",
                                    "driver": DRIVER,
                                    "pool": "node-a",
                                    "device": "gpu-0-mps-1",
                                    "shareID": "share-1",
                                }
                            ]
                        }
                    }
                },
            }
        )


@dataclass
class Rejections:
    errors: list[str] = field(default_factory=list)
    called: threading.Event = field(default_factory=threading.Event)

    def __call__(self, error: str) -> None:
        self.errors.append(error)
        self.called.set()


def make_plugin(
    dirs: Dirs,
    telemetry: Telemetry,
    pod_uid: str | None = None,
    rejections: Rejections | None = None,
    health_services: tuple[str, ...] = (),
    driver: DRADriver | None = None,
) -> KubeletPlugin:
    plugin = KubeletPlugin(
        DRIVER,
        registrar_dir=dirs.registrar,
        plugin_dir=dirs.plugin,
        pod_uid=pod_uid,
        on_registration_failed=rejections or Rejections(),
        max_workers=4,
        health_services=health_services,
    )
    plugin.serve_claims(ClaimBatch(driver or EchoDriver(), StaticClaims(), telemetry, activity=plugin.activity))
    return plugin


def is_socket(path: Path) -> bool:
    return path.exists() and stat.S_ISSOCK(path.lstat().st_mode)


def leave_stale_socket(path: Path) -> None:
    """A socket file nobody listens on, as a crashed process leaves it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))


def test_socket_names_without_pod_uid(dirs: Dirs, telemetry: Telemetry) -> None:
    plugin = make_plugin(dirs, telemetry)
    assert plugin.registration_socket == dirs.registrar / "gpu.tessera.dev-reg.sock"
    assert plugin.dra_socket == dirs.plugin / "dra.sock"
    with plugin:
        assert is_socket(plugin.registration_socket) and is_socket(plugin.dra_socket)


def test_socket_names_with_pod_uid(dirs: Dirs, telemetry: Telemetry) -> None:
    plugin = make_plugin(dirs, telemetry, pod_uid=POD_UID)
    assert plugin.registration_socket == dirs.registrar / f"gpu.tessera.dev-{POD_UID}-reg.sock"
    assert plugin.dra_socket == dirs.plugin / f"dra-{POD_UID}.sock"
    with plugin:
        assert is_socket(plugin.registration_socket) and is_socket(plugin.dra_socket)


def test_sockets_and_the_plugin_dir_are_private_and_the_registrar_dir_keeps_its_mode(
    dirs: Dirs, telemetry: Telemetry
) -> None:
    dirs.registrar.mkdir(mode=0o755)
    dirs.registrar.chmod(0o755)
    dirs.plugin.mkdir(parents=True)
    dirs.plugin.chmod(0o755)  # as an older release or a hostPath DirectoryOrCreate leaves it
    with make_plugin(dirs, telemetry) as plugin:
        assert stat.S_IMODE(plugin.dra_socket.stat().st_mode) == 0o600
        assert stat.S_IMODE(plugin.registration_socket.stat().st_mode) == 0o600
        assert stat.S_IMODE(dirs.plugin.stat().st_mode) == 0o700
        assert stat.S_IMODE(dirs.registrar.stat().st_mode) == 0o755


def test_default_plugin_dir_is_the_drivers_own(telemetry: Telemetry) -> None:
    plugin = KubeletPlugin(DRIVER, on_registration_failed=Rejections())
    assert plugin.registration_socket == Path("/var/lib/kubelet/plugins_registry/gpu.tessera.dev-reg.sock")
    assert plugin.dra_socket == Path("/var/lib/kubelet/plugins/gpu.tessera.dev/dra.sock")


@pytest.mark.parametrize(
    ("field_name", "kwargs"),
    [
        ("driver_name", {"driver_name": "gpu/evil"}),
        ("driver_name", {"driver_name": ""}),
        ("pod_uid", {"pod_uid": "../x"}),
    ],
)
def test_bad_names_are_refused(dirs: Dirs, telemetry: Telemetry, field_name: str, kwargs: dict[str, str]) -> None:
    args: dict[str, str] = {"driver_name": DRIVER, **kwargs}
    with pytest.raises(ValueError, match=field_name):
        KubeletPlugin(
            args["driver_name"],
            registrar_dir=dirs.registrar,
            plugin_dir=dirs.plugin,
            pod_uid=args.get("pod_uid"),
            on_registration_failed=Rejections(),
        )


def test_too_long_socket_path_is_refused_before_binding(dirs: Dirs, telemetry: Telemetry) -> None:
    deep = dirs.plugin / ("d" * 120)
    with pytest.raises(ValueError, match="at most 105"):
        KubeletPlugin(
            DRIVER,
            registrar_dir=dirs.registrar,
            plugin_dir=deep,
            on_registration_failed=Rejections(),
        )
    assert not deep.exists()


def test_stale_files_at_the_socket_paths_are_replaced(dirs: Dirs, telemetry: Telemetry) -> None:
    plugin = make_plugin(dirs, telemetry)
    leave_stale_socket(plugin.registration_socket)
    plugin.dra_socket.parent.mkdir(parents=True)
    plugin.dra_socket.write_text("left over")
    with plugin, KubeletEmulator(dirs.registrar) as kubelet:
        kubelet.wait_for_plugin(DRIVER, timeout=10)
        assert is_socket(plugin.dra_socket)
        assert kubelet.prepare([CLAIM])[CLAIM.uid].error is None


def test_stop_removes_only_its_own_sockets(dirs: Dirs, telemetry: Telemetry) -> None:
    other_registration = dirs.registrar / f"{DRIVER}-other-pod-reg.sock"
    other_dra = dirs.plugin / "dra-other-pod.sock"
    leave_stale_socket(other_registration)
    leave_stale_socket(other_dra)
    plugin = make_plugin(dirs, telemetry, pod_uid=POD_UID)
    plugin.start()
    plugin.stop()
    assert not plugin.registration_socket.exists() and not plugin.dra_socket.exists()
    assert is_socket(other_registration) and is_socket(other_dra)


def test_failed_start_leaves_nothing_behind(dirs: Dirs, telemetry: Telemetry) -> None:
    plugin = make_plugin(dirs, telemetry)
    plugin.registration_socket.mkdir(parents=True)  # a directory where the socket must go
    with pytest.raises(IsADirectoryError, match="directory is in the way"):
        plugin.start()
    assert not plugin.dra_socket.exists()
    plugin.registration_socket.rmdir()
    with plugin:  # and it can start cleanly afterwards
        assert is_socket(plugin.registration_socket)


def test_registers_with_the_kubelet_and_serves_claims(dirs: Dirs, telemetry: Telemetry) -> None:
    with make_plugin(dirs, telemetry, pod_uid=POD_UID) as plugin, KubeletEmulator(dirs.registrar) as kubelet:
        registered = kubelet.wait_for_plugin(DRIVER, timeout=10)

        assert registered.accepted
        assert registered.registration_socket == plugin.registration_socket
        assert registered.endpoint == str(plugin.dra_socket)
        assert registered.supported_versions == ("v1.DRAPlugin", "v1beta1.DRAPlugin")
        assert registered.api_version == "v1.DRAPlugin"
        assert plugin.registered.wait(timeout=10)
        status = plugin.registration_status
        assert status is not None and status.registered and status.error == ""

        assert kubelet.prepare([CLAIM]) == {
            CLAIM.uid: PrepareAnswer(
                devices=(
                    KubeletDevice(
                        request_names=("gpus",),
                        pool_name="node-a",
                        device_name="gpu-0-mps-1",
                        cdi_device_ids=(f"k8s.gpu.tessera.dev/claim={CLAIM.uid}-gpu-0-mps-1",),
                        share_id="share-1",
                    ),
                )
            )
        }
        assert kubelet.unprepare([CLAIM]) == {CLAIM.uid: None}


def test_old_kubelet_uses_v1beta1(dirs: Dirs, telemetry: Telemetry) -> None:
    with (
        make_plugin(dirs, telemetry) as _plugin,
        KubeletEmulator(dirs.registrar, supported_versions=("v1beta1.DRAPlugin",)) as kubelet,
    ):
        assert kubelet.wait_for_plugin(DRIVER, timeout=10).api_version == "v1beta1.DRAPlugin"
        (device,) = kubelet.prepare([CLAIM])[CLAIM.uid].devices
        assert device.device_name == "gpu-0-mps-1"
        assert device.share_id is None  # v1beta1 cannot carry it


def test_kubelet_without_a_common_api_rejects_and_the_plugin_is_told(dirs: Dirs, telemetry: Telemetry) -> None:
    rejections = Rejections()
    with (
        make_plugin(dirs, telemetry, rejections=rejections),
        KubeletEmulator(dirs.registrar, supported_versions=("v2.DRAPlugin",)) as kubelet,
    ):
        with pytest.raises(KubeletProtocolError, match="none of the versions"):
            kubelet.wait_for_plugin(DRIVER, timeout=10)
        assert rejections.called.wait(timeout=10)
        assert "none of the versions" in rejections.errors[0]


def test_rejection_calls_back_with_the_kubelets_error(dirs: Dirs, telemetry: Telemetry) -> None:
    rejections = Rejections()
    with make_plugin(dirs, telemetry, rejections=rejections) as plugin, KubeletEmulator(dirs.registrar) as kubelet:
        registered = kubelet.wait_for_plugin(DRIVER, timeout=10, reject_with="endpoint already registered")

        assert not registered.accepted
        assert rejections.called.wait(timeout=10)
        assert rejections.errors == ["endpoint already registered"]
        assert not plugin.registered.is_set()
        status = plugin.registration_status
        assert status is not None and not status.registered and status.error == "endpoint already registered"


def test_health_services_are_advertised_after_the_dra_apis(dirs: Dirs, telemetry: Telemetry) -> None:
    with (
        make_plugin(dirs, telemetry, health_services=("v1alpha1.DRAResourceHealth",)),
        KubeletEmulator(dirs.registrar) as kubelet,
    ):
        registered = kubelet.wait_for_plugin(DRIVER, timeout=10)
        assert registered.supported_versions == ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
        assert registered.api_version == "v1.DRAPlugin"


def test_emulator_ignores_dot_files_and_non_sockets(dirs: Dirs, telemetry: Telemetry) -> None:
    dirs.registrar.mkdir(parents=True)
    (dirs.registrar / "not-a-socket-reg.sock").write_text("")
    leave_stale_socket(dirs.registrar / ".hidden-reg.sock")
    with make_plugin(dirs, telemetry) as plugin:
        assert KubeletEmulator(dirs.registrar).registration_sockets() == [plugin.registration_socket]


def test_liveness_fails_for_a_dead_server_behind_the_socket(dirs: Dirs, telemetry: Telemetry) -> None:
    with make_plugin(dirs, telemetry) as plugin:
        plugin.dra_socket.unlink()
        leave_stale_socket(plugin.dra_socket)  # the file is there but nothing listens
        ok, detail = check_plugin(plugin, timeout=5)
    assert not ok
    assert "DRA socket" in detail and "NodePrepareResources failed: UNAVAILABLE" in detail


def test_liveness_fails_for_another_drivers_socket(dirs: Dirs, telemetry: Telemetry) -> None:
    with make_plugin(dirs, telemetry) as plugin:
        ok, detail = check_plugin(_Renamed(plugin, "other.example.com"), timeout=10)
    assert not ok
    assert "expected DRAPlugin 'other.example.com'" in detail


WORKERS = 4  # make_plugin's DRA worker pool


@contextmanager
def prepares_blocked_in_driver(plugin: KubeletPlugin, driver: BlockingDriver, count: int) -> Iterator[None]:
    """``count`` kubelet prepare calls, each held inside the driver until the block ends."""
    with grpc.insecure_channel(f"unix://{plugin.dra_socket}") as channel:
        stub = dra_v1_pb2_grpc.DRAPluginStub(channel)
        requests = [dra_v1_pb2.NodePrepareResourcesRequest(claims=[dra_v1_pb2.Claim(namespace="ns", name=f"c{i}",
                                                                                   uid=f"00000000-0000-4000-8000-{i:012x}")])
                    for i in range(count)]
        calls = [stub.NodePrepareResources.future(request, timeout=30) for request in requests]
        try:
            for _ in range(count):
                assert driver.entered.acquire(timeout=10), "a prepare never reached the driver"
            yield
        finally:
            driver.release.set()
            for call in calls:
                call.result()  # the held calls finish once released


def test_liveness_of_an_idle_plugin_calls_both_sockets(dirs: Dirs, telemetry: Telemetry) -> None:
    with make_plugin(dirs, telemetry) as plugin:
        ok, detail = check_plugin(plugin, timeout=10)
        assert plugin.dra_activity().in_flight == 0
    assert ok, detail
    assert detail.endswith("answer")


def test_liveness_stays_healthy_while_prepares_fill_the_worker_pool(dirs: Dirs, telemetry: Telemetry) -> None:
    driver = BlockingDriver()
    with make_plugin(dirs, telemetry, driver=driver) as plugin, prepares_blocked_in_driver(plugin, driver, WORKERS):
        assert plugin.dra_activity().in_flight == WORKERS
        ok, detail = check_plugin(plugin, timeout=10)
        assert ok, detail
        assert f"busy: {WORKERS} calls in flight" in detail


def test_liveness_fails_when_calls_in_flight_make_no_progress(dirs: Dirs, telemetry: Telemetry) -> None:
    driver = BlockingDriver()
    with make_plugin(dirs, telemetry, driver=driver) as plugin, prepares_blocked_in_driver(plugin, driver, WORKERS):
        # A zero window: the calls in flight have made no progress "recently", so the DRA socket is called.
        ok, detail = check_plugin(plugin, timeout=0.5, progress_window_s=0.0)
    assert not ok
    assert "DRA socket" in detail and "DEADLINE_EXCEEDED" in detail
    assert f"{WORKERS} calls in flight, no progress for" in detail


def test_liveness_with_calls_in_flight_still_checks_the_registration_socket(dirs: Dirs, telemetry: Telemetry) -> None:
    driver = BlockingDriver()
    with make_plugin(dirs, telemetry, driver=driver) as plugin, prepares_blocked_in_driver(plugin, driver, 1):
        ok, detail = check_plugin(plugin, timeout=10)
        assert ok, detail
        ok_other, detail_other = check_plugin(_Renamed(plugin, "other.example.com"), timeout=10)
    assert not ok_other
    assert "expected DRAPlugin 'other.example.com'" in detail_other


def test_liveness_of_a_stopped_plugin_reports_the_missing_socket(dirs: Dirs, telemetry: Telemetry) -> None:
    plugin = make_plugin(dirs, telemetry)
    plugin.start()
    plugin.stop()
    ok, detail = check_plugin(plugin, timeout=10)
    assert not ok
    assert "registration socket" in detail and "missing" in detail


def test_liveness_detail_names_no_host_path(dirs: Dirs, telemetry: Telemetry,
                                            caplog: pytest.LogCaptureFixture) -> None:
    # It is served on the HTTP port, which the pod network can reach; the paths go to the log.
    root = str(dirs.plugin.parent.parent)
    with make_plugin(dirs, telemetry) as plugin:
        ok, detail = check_plugin(plugin, timeout=10)
        assert ok and root not in detail, detail
        plugin.dra_socket.unlink()
        leave_stale_socket(plugin.dra_socket)  # nobody listens: gRPC's error quotes the address
        ok, detail = check_plugin(plugin, timeout=10)
        assert not ok
        assert detail.startswith("DRA socket: empty NodePrepareResources failed: UNAVAILABLE"), detail
        assert root not in detail and "/" not in detail, detail
    assert any(getattr(r, "dra_socket", None) == str(plugin.dra_socket) for r in caplog.records)


@dataclass
class _Renamed:
    """A plugin as seen by a probe configured with another driver name."""

    plugin: KubeletPlugin
    driver_name: str

    @property
    def registration_socket(self) -> Path:
        return self.plugin.registration_socket

    @property
    def dra_socket(self) -> Path:
        return self.plugin.dra_socket

    def dra_activity(self) -> DraActivity:
        return self.plugin.dra_activity()
