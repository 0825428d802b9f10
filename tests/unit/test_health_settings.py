"""Device-health settings: from the chart's values through the container's environment to Settings."""

from __future__ import annotations

import argparse

import pytest

from deploy.render import render_objects
from driver.config import SettingsError, add_settings_arguments, parse_settings, settings_from_args


def plugin_env(values: dict[str, object]) -> dict[str, str]:
    [daemonset] = [o for o in render_objects(values) if o["kind"] == "DaemonSet"
                   and o["metadata"]["labels"].get("app.kubernetes.io/component") == "kubelet-plugin"]
    [container] = [c for c in daemonset["spec"]["template"]["spec"]["containers"] if c["name"] == "plugin"]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_chart_health_values_become_the_drivers_settings() -> None:
    env = plugin_env({"health": {"ignoredXids": [74, 92], "deviceTaints": "always", "taintEffect": "NoExecute"}})
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    settings = settings_from_args(parser.parse_args([]), {k: env[k] for k in
                                                          ("IGNORED_XIDS", "DEVICE_TAINTS", "HEALTH_TAINT_EFFECT")})
    assert (settings.ignored_xids, settings.device_taints, settings.health_taint_effect) == (
        "74,92", "always", "NoExecute")
    default = plugin_env({})
    assert (default["IGNORED_XIDS"], default["DEVICE_TAINTS"], default["HEALTH_TAINT_EFFECT"]) == (
        "", "auto", "NoSchedule")


@pytest.mark.parametrize(("flag", "value"), [("--ignored-xids", "79,abc"), ("--device-taints", "sometimes"),
                                             ("--health-taint-effect", "None")])
def test_bad_health_flags_are_refused(flag: str, value: str) -> None:
    with pytest.raises(SettingsError):
        parse_settings([flag, value], environ={})
