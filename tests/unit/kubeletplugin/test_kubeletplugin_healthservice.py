"""The kubelet device health stream: the board's sending rules and both gRPC versions on a real socket."""

from __future__ import annotations

import threading

import grpc
import pytest

from driver.kubeletplugin.api import drahealth_v1alpha1_pb2, drahealth_v1alpha1_pb2_grpc
from driver.kubeletplugin.claimbatch import ClaimBatch
from driver.kubeletplugin.healthservice import DeviceHealthStatus, Health, HealthBoard
from driver.kubeletplugin.plugin import KubeletPlugin
from driver.kubeletplugin.telemetry import Telemetry
from driver.simulation.kubelet import KubeletEmulator
from tests.support.kubeletplugin import DRIVER, Dirs
from tests.unit.kubeletplugin.test_kubeletplugin_plugin import EchoDriver, Rejections, StaticClaims

HEALTHY = DeviceHealthStatus("node-1", "gpu-0", Health.HEALTHY, "", 100.0)
BROKEN = DeviceHealthStatus("node-1", "gpu-0", Health.UNHEALTHY, "xid-79: XID 79 (GPU has fallen off the bus)", 200.0)


def test_a_stream_gets_the_list_at_once_then_changes_and_ends_on_close() -> None:
    board = HealthBoard(timeout_s=30, resend_s=10)
    board.update([HEALTHY])
    stream = board.stream()
    assert next(stream) == (HEALTHY,)
    board.update([HEALTHY])  # the same list is no change
    board.update([BROKEN])
    assert next(stream) == (BROKEN,)
    board.close()
    assert list(stream) == []
    assert board.open_streams == 0


def test_an_unchanged_list_is_sent_again_before_the_kubelet_would_call_it_stale() -> None:
    board = HealthBoard(timeout_s=2, resend_s=0.05)
    board.update([HEALTHY])
    stream = board.stream()
    assert [next(stream), next(stream)] == [(HEALTHY,), (HEALTHY,)]
    board.close()


def test_the_resend_interval_must_be_inside_the_timeout() -> None:
    with pytest.raises(ValueError, match="below timeout_s"):
        HealthBoard(timeout_s=10, resend_s=10)


def test_both_health_apis_are_served_and_advertised(dirs: Dirs, telemetry: Telemetry) -> None:
    board = HealthBoard()
    board.update([HEALTHY])
    plugin = KubeletPlugin(DRIVER, registrar_dir=dirs.registrar, plugin_dir=dirs.plugin,
                           on_registration_failed=Rejections(), max_workers=4, health=board)
    plugin.serve_claims(ClaimBatch(EchoDriver(), StaticClaims(), telemetry, activity=plugin.activity))
    plugin.start()
    kubelet = KubeletEmulator(dirs.registrar)
    try:
        registered = kubelet.wait_for_plugin(DRIVER)
        assert registered.supported_versions[:2] == ("v1.DRAPlugin", "v1beta1.DRAPlugin")
        assert set(registered.supported_versions[2:]) == {"v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth"}
        watch = kubelet.watch_health()
        try:
            assert watch.api_version == "v1.DRAResourceHealth" and watch.wait_messages(1, 10)
            reported = watch.device("node-1", "gpu-0")
            assert reported is not None and (reported.health, reported.timeout_s) == ("Healthy", 30)
            board.update([BROKEN])
            assert watch.wait_messages(2, 10)
            reported = watch.device("node-1", "gpu-0")
            assert reported is not None and reported.health == "Unhealthy" and reported.last_updated_time == 200
            assert reported.message == BROKEN.message
        finally:
            watch.close()
        # v1alpha1, read directly: the same list with the same fields.
        with grpc.insecure_channel(f"unix://{plugin.dra_socket}") as channel:
            call = drahealth_v1alpha1_pb2_grpc.DRAResourceHealthStub(channel).NodeWatchResources(
                drahealth_v1alpha1_pb2.NodeWatchResourcesRequest())
            first = next(iter(call))
            call.cancel()
        device = first.devices[0]
        assert (device.device.device_name, device.health, device.health_check_timeout_seconds) == (
            "gpu-0", drahealth_v1alpha1_pb2.UNHEALTHY, 30)
        assert device.message == BROKEN.message
        # Stopping the plugin ends open streams instead of waiting for them.
        watch = kubelet.watch_health("v1alpha1.DRAResourceHealth")
        assert watch.wait_messages(1, 10)
        stopped = threading.Thread(target=plugin.stop)
        stopped.start()
        stopped.join(10)
        assert not stopped.is_alive()
        # A clean end (the board closed it), not a cancellation when the server's grace ran out.
        assert watch.wait_ended(10) and watch.ended == "the plugin ended the stream"
        assert watch.device("node-1", "gpu-0") is None  # the kubelet forgets the driver's health
        watch.close()
    finally:
        kubelet.close()
        plugin.stop()
