"""When a daemon's limits count as confirmed, or as drifted for want of a read-back; and what is published then."""

from __future__ import annotations

import time

from driver.gpu.claim.limitstatement import unconfirmed_gpus, with_unconfirmed_limits
from driver.gpu.mps.model import MpsDaemonRecord, MpsDaemonSpec
from driver.gpu.record.checkpoint import Checkpoint
from driver.gpu.runtime.limitconfirm import LimitConfirmations
from driver.kubeletplugin.slicemodel import Device, string_attr


def test_a_prepare_needs_no_read_back_within_the_watch_interval_of_a_confirmation() -> None:
    confirmations = LimitConfirmations(fresh_for=60.0)
    assert not confirmations.fresh("d")
    confirmations.confirmed("d")
    assert confirmations.fresh("d")
    assert not LimitConfirmations(fresh_for=0.0).fresh("d"), "no watcher: every prepare reads back"


def test_read_backs_failing_for_longer_than_the_interval_are_one_drift_episode_until_confirmed() -> None:
    confirmations = LimitConfirmations(fresh_for=0.0)
    confirmations.confirmed("d")
    time.sleep(0.01)  # the interval (0 s) has passed since the confirmation
    assert not confirmations.failing("d")
    assert confirmations.failed("d", "busy") is True
    assert confirmations.failing("d"), "the watcher's next look is shorter"
    assert not confirmations.fresh("d"), "a failed read-back ends the freshness"
    assert confirmations.failed("d", "still busy") is False, "one report per episode"
    assert confirmations.drifted("d") == "still busy"
    assert confirmations.not_yet_told("d", ["a", "b"]) == ["a", "b"]
    assert confirmations.not_yet_told("d", ["a", "b", "joining"]) == ["joining"]
    assert confirmations.confirmed("d") is True, "the episode ends"
    assert not confirmations.failing("d")
    assert confirmations.drifted("d") is None
    assert confirmations.not_yet_told("d", ["a"]) == ["a"], "a new episode tells everyone again"


def test_a_failure_within_the_interval_is_not_yet_drift() -> None:
    confirmations = LimitConfirmations(fresh_for=60.0)
    confirmations.confirmed("d")
    assert confirmations.failed("d", "busy") is False
    assert confirmations.drifted("d") is None


def _share(name: str, gpu: str, level: str) -> Device:
    return Device(name=name, attributes={"parentUUID": string_attr(gpu), "memoryLimitEnforcement": string_attr(level),
                                         "computeLimitEnforcement": string_attr(level)})


def test_only_mps_shares_of_gpus_with_unconfirmed_limits_are_published_as_unconfirmed() -> None:
    devices = [_share("gpu-0-mps-0", "GPU-0", "mps-per-process"), _share("gpu-1-mps-0", "GPU-1", "mps-advisory"),
               _share("gpu-0-ts-0", "GPU-0", "none"), Device(name="gpu-0")]
    published = with_unconfirmed_limits(devices, {"GPU-0"})
    statements = {d.name: (d.attributes.get("memoryLimitEnforcement"), d.attributes.get("computeLimitEnforcement"))
                  for d in published}
    assert statements["gpu-0-mps-0"] == (string_attr("mps-unconfirmed"), string_attr("mps-unconfirmed"))
    assert statements["gpu-1-mps-0"] == (string_attr("mps-advisory"), string_attr("mps-advisory"))
    assert statements["gpu-0-ts-0"] == (string_attr("none"), string_attr("none"))
    assert published[3] == devices[3]
    assert with_unconfirmed_limits(devices, set()) == devices


def test_the_unconfirmed_gpus_are_those_the_recorded_daemon_serves() -> None:
    spec = MpsDaemonSpec(daemon_id="plan-1", gpu_uuids=["GPU-0", "GPU-1"])
    record = MpsDaemonRecord(spec=spec, pid=1, pipe_dir="/p", log_dir="/l", started_at="x", process_start_time=1)
    cp = Checkpoint(mps_daemons={"plan-1": record}, mps_limits_unconfirmed={"plan-1": "since x: busy",
                                                                           "gone": "since y"})
    assert unconfirmed_gpus(cp) == {"GPU-0", "GPU-1"}
