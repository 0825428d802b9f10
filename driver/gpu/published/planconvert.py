"""NVIDIA device plugin sharing configs turned into Tessera sharing plans: a pure function, no I/O.

:func:`convert` maps each config (one per ConfigMap key) onto a plan of the same name and lists, one
finding each, what a plan cannot carry or carries differently. A finding that ``differs`` means a
node on the plan publishes something other than the device plugin served with the config (the
command then exits 1); the others say what stays as it was, or is stricter or looser, and how.

What the device plugin does, from NVIDIA/k8s-device-plugin:

* MPS: each replica's pinned memory is the GPU's memory / replicas in whole MiB, and its active
  thread percentage 100 / replicas, rounded down (``cmd/mps-control-daemon/mps/daemon.go``,
  ``perDevicePinnedDeviceMemoryLimits``, ``activeThreadPercentage``): Tessera's MPS share defaults
  (``pinnedMemoryLimit`` GPU memory / shares in whole MiB, ``activeThreadPercentage`` floor(100 /
  shares)), so the plan names neither. Both put the GPU in EXCLUSIVE_PROCESS. The plugin refuses MPS
  on MIG devices ("sharing using MPS is not supported for MIG devices").
* ``failRequestsGreaterThanOne`` defaults to false for time slicing and true for MPS.
* ``rename``, ``devices`` and the top-level ``resources`` are ignored by the released plugin
  (``DisableResourceNamingInConfig``, called at every start: "Disable renaming / device selection");
  ``renameByDefault`` works and serves shares as ``<name>.shared``.
* ``migStrategy``: ``nvidia.com/gpu`` is every whole GPU under ``none`` and the non-MIG GPUs under
  ``mixed``, where ``nvidia.com/mig-<profile>`` are the MIG devices; under ``single`` every GPU is
  MIG with one profile and ``nvidia.com/gpu`` names its MIG devices.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from driver.gpu.published.deviceplugincfg import DevicePluginConfig, ReplicatedResources

GPU_RESOURCE = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
MAX_SHARES = 48  # sharingplan.MpsShares / TimeSlicingShares
# Kubernetes label value syntax: nodes select a plan (and the device plugin a config) by a label value.
_LABEL_VALUE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
# A compute-instance profile ("1c.3g.20gb"): a part of a GPU instance, which a plan cannot select.
_CI_PROFILE = re.compile(r"\d+c\.")

_CLASS = {"mps": "mps.gpu.tessera.dev", "timeSlicing": "timeslice.gpu.tessera.dev"}


@dataclass(frozen=True)
class Finding:
    """One thing about one config that the plan says differently, or cannot say."""

    where: str  # "<key>: sharing.mps.resources[0] (nvidia.com/gpu)"
    text: str
    differs: bool = False  # nodes on the plan publish something other than the device plugin did

    def line(self) -> str:
        return f"{self.where}: {self.text}"


@dataclass(frozen=True)
class Conversion:
    plans: dict[str, Any]  # the sharing plans file, as data
    findings: tuple[Finding, ...]

    @property
    def differs(self) -> bool:
        return any(f.differs for f in self.findings)


def convert(configs: Mapping[str, DevicePluginConfig], default: str | None) -> Conversion:
    """One plan per config key, ``defaultPlan`` ``default`` (a key of ``configs``, or None)."""
    findings: list[Finding] = []
    plans: dict[str, Any] = {}
    for key, config in configs.items():
        if not _LABEL_VALUE.fullmatch(key):
            findings.append(Finding(key, "not a label value (at most 63 letters, digits, '-', '_', '.'), so no node "
                                         "could select it as a plan: not converted", differs=True))
            continue
        plans[key], plan_findings = _plan(key, config)
        findings += plan_findings
    data: dict[str, Any] = {}
    if default is not None and default in plans:
        data["defaultPlan"] = default
    data["plans"] = plans
    return Conversion(data, tuple(findings))


def _plan(key: str, config: DevicePluginConfig) -> tuple[dict[str, Any], list[Finding]]:
    findings = [Finding(f"{key}: flags.{name}", "runs the device plugin itself; a sharing plan has no counterpart "
                                                "(Tessera's own settings are the chart's values)")
                for name in sorted(config.flags.others())]
    if config.resources:
        findings.append(Finding(f"{key}: resources", "custom resource names; the device plugin ignores them too "
                                                     "(DisableResourceNamingInConfig): not converted"))
    if config.imex:
        findings.append(Finding(f"{key}: imex", "IMEX channels are not GPUs and no plan hands them out (NVIDIA's "
                                                "compute-domain DRA driver does): not converted", differs=True))
    sharing = config.sharing
    if sharing.mps is not None and sharing.timeSlicing is not None:
        findings.append(Finding(f"{key}: sharing.timeSlicing", "ignored: with sharing.mps set the device plugin "
                                                               "shares by MPS only, and so does the plan"))
    form, shared = ("mps", sharing.mps) if sharing.mps is not None else ("timeSlicing", sharing.timeSlicing)
    if shared is None:
        return {}, findings
    entries, entry_findings = _entries(f"{key}: sharing.{form}", form, shared, config.flags.migStrategy)
    return ({"gpus": entries} if entries else {}), findings + entry_findings


def _entries(where: str, form: str, shared: ReplicatedResources,
             strategy: str) -> tuple[list[dict[str, Any]], list[Finding]]:
    findings: list[Finding] = []
    fail = shared.failRequestsGreaterThanOne if shared.failRequestsGreaterThanOne is not None else form == "mps"
    if fail:
        findings.append(Finding(f"{where}.failRequestsGreaterThanOne",
                                "allowMultipleSharesPerClaim: false refuses a claim holding two shares of one GPU; "
                                "a claim for shares of different GPUs is admitted, where the device plugin failed "
                                "every request for more than one replica"))
    if shared.renameByDefault:
        findings.append(Finding(f"{where}.renameByDefault", f"the device plugin served the shares as <name>.shared; "
                                f"Tessera has no resource names: the shares are devices of DeviceClass "
                                f"{_CLASS[form]}, so pods that asked for nvidia.com/gpu.shared need a claim "
                                "(docs/migration.md)", differs=True))
    if form == "mps":
        findings.append(Finding(f"{where}", "MPS shares admit only claims whose pods cannot run as host root "
                                "(clients: nonRoot), which could retune or stop the daemon every share uses; the "
                                "device plugin admitted any pod. Set mps.clients: any to admit them (the limits "
                                "are then advisory; docs/sharing.md)"))
    entries: list[dict[str, Any]] = []
    seen: set[str] = set()
    for index, resource in enumerate(shared.resources):
        here = f"{where}.resources[{index}] ({resource.name})"
        if resource.rename is not None:
            findings.append(Finding(here, f"rename {resource.rename}: the device plugin ignores it "
                                          "(DisableResourceNamingInConfig), and a plan names no resources"))
        if resource.devices != "all":
            findings.append(Finding(here, f"devices {resource.devices!r}: the device plugin ignores it and shares "
                                          "every device (DisableResourceNamingInConfig), and so does the plan; to "
                                          "share only some GPUs, give the entry match: {minor: N} or {uuid: GPU-...}"))
        if resource.name in seen:
            findings.append(Finding(here, "a second entry for the same resource: only the first is converted",
                                    differs=True))
            continue
        seen.add(resource.name)
        matches, problem = _matches(resource.name, strategy)
        if problem is not None:
            findings.append(problem.at(here))
            continue
        if form == "mps" and any("migProfile" in m for m in matches):
            findings.append(Finding(here, "the device plugin refuses MPS on MIG devices (it fails to start); the "
                                          "plan shares each MIG instance by MPS, with limits relative to the instance"))
        shares = resource.replicas
        if shares == 1:
            findings.append(Finding(here, "replicas 1 shares nothing: published unshared, as the device plugin did"))
            continue
        if shares > MAX_SHARES:
            findings.append(Finding(here, f"replicas {shares}: a plan splits a device into at most {MAX_SHARES} "
                                          f"shares; converted to {MAX_SHARES}", differs=True))
            shares = MAX_SHARES
        for match in matches:
            entries.append({"match": match, form: {"shares": shares}, "allowMultipleSharesPerClaim": not fail})
    return entries, findings


@dataclass(frozen=True)
class _Unconverted:
    text: str
    differs: bool

    def at(self, where: str) -> Finding:
        return Finding(where, f"{self.text}: not converted", self.differs)


def _matches(name: str, strategy: str) -> tuple[list[dict[str, Any]], _Unconverted | None]:
    """The plan ``match`` selectors for a device plugin resource under ``strategy``, or why there are none."""
    if name == GPU_RESOURCE:
        if strategy == "single":
            # Every GPU of a node is MIG with one profile, and nvidia.com/gpu names its instances; a node
            # without MIG GPUs serves whole GPUs under the same name.
            return [{"migProfile": "*"}, {"all": True}], None
        return [{"all": True}], None
    if name.startswith(MIG_RESOURCE_PREFIX):
        profile = name.removeprefix(MIG_RESOURCE_PREFIX)
        if strategy != "mixed":
            return [], _Unconverted(f"the device plugin serves {name} only under migStrategy mixed (here {strategy}), "
                                    "so it shared nothing", differs=False)
        if _CI_PROFILE.match(profile):
            return [], _Unconverted(f"{profile} is a compute-instance profile (a part of a GPU instance); plans share "
                                    "whole MIG instances only", differs=True)
        return [{"migProfile": profile}], None
    return [], _Unconverted(f"not a resource the device plugin shares ({GPU_RESOURCE} or "
                            f"{MIG_RESOURCE_PREFIX}<profile>), so it shared nothing", differs=False)
