"""Which opaque config applies to each allocated device, by the rules both reference drivers follow
(dra-example-driver and NVIDIA's ``GetOpaqueDeviceConfigs``).

Built-in defaults come first, then class entries, then claim entries, in allocation order; the
last entry that applies to a result wins whole (fields are never merged). The computation is
pure: the prepare path calls :func:`resolve_configs` and then acts on :func:`group_by_config`,
starting e.g. one MPS daemon per group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from driver.gpu.claimconfig.api import (
    ConfigError,
    DeviceConfig,
    GpuConfig,
    MigDeviceConfig,
    join_problems,
    parse_config,
)
from driver.gpu.claimconfig.choices import SHARE_KINDS, DeviceKind
from driver.kubeletplugin.claimmodel import DeviceAllocationConfiguration, DeviceRequestAllocationResult

_SOURCE_LABELS = {"FromClass": "class config", "FromClaim": "claim config"}


class ResolvedConfig(NamedTuple):
    """The config that won for one result, and where it came from (for logs and error messages)."""

    result: DeviceRequestAllocationResult
    config: DeviceConfig
    origin: str


# Results prepared together because one config object won for all of them.
ConfigGroup = tuple[DeviceConfig, list[DeviceRequestAllocationResult]]


@dataclass(frozen=True)
class _Entry:
    requests: tuple[str, ...]  # empty: applies to every request
    config: DeviceConfig
    origin: str

    def applies_to(self, result: DeviceRequestAllocationResult) -> bool:
        return not self.requests or result.request in self.requests or result.base_request in self.requests


def resolve_configs(
    configs: Sequence[DeviceAllocationConfiguration],
    results: Sequence[DeviceRequestAllocationResult],
    device_kind: Callable[[DeviceRequestAllocationResult], DeviceKind],
    *,
    whole_gpu_class: str,
) -> list[ResolvedConfig]:
    """The winning config for each of ``results``, in order.

    ``configs`` are this driver's entries in allocation order (``ResourceClaim.configs_for``);
    ``device_kind`` says what kind of device a result is;
    ``whole_gpu_class`` is the DeviceClass of whole GPUs (named after the driver), for messages.
    Raises ConfigError listing every problem of the claim, one per line.
    """
    entries = [
        _Entry((), GpuConfig(), "built-in default"),
        _Entry((), MigDeviceConfig(), "built-in default"),
        *_decode(configs),
    ]
    resolved: list[ResolvedConfig] = []
    problems: list[str] = []
    for result in results:
        try:
            resolved.append(_winner(entries, result, device_kind(result), whole_gpu_class))
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError(join_problems(problems))
    return resolved


def group_by_config(resolved: Sequence[ResolvedConfig]) -> list[ConfigGroup]:
    """Results grouped by the config object that won for them (by identity), in first-seen order."""
    groups: dict[int, ConfigGroup] = {}
    for item in resolved:
        # Identity, not equality: two equal entries written separately are prepared separately.
        groups.setdefault(id(item.config), (item.config, []))[1].append(item.result)
    return list(groups.values())


_REQUESTS_SHOWN = 3


def _decode(configs: Sequence[DeviceAllocationConfiguration]) -> list[_Entry]:
    entries: list[_Entry] = []
    problems: list[str] = []
    positions: dict[str, int] = {}
    for config in configs:
        label = _SOURCE_LABELS.get(config.source, "config")
        positions[label] = positions.get(label, 0) + 1
        # A label starts every line of the config's problems: 32 request names of 63 characters would make each ~2 KB.
        shown = list(config.requests[:_REQUESTS_SHOWN])
        if len(config.requests) > _REQUESTS_SHOWN:
            shown.append(f"+{len(config.requests) - _REQUESTS_SHOWN} more")
        requests = f"[{', '.join(shown)}]" if config.requests else "all"
        origin = f"{label} #{positions[label]} (requests: {requests})"
        if config.opaque is None:
            problems.append(f"{origin}: has no opaque parameters; this driver is configured only through opaque")
            continue
        try:
            entries.append(_Entry(tuple(config.requests), parse_config(config.opaque.parameters), origin))
        except ConfigError as exc:
            problems.extend(f"{origin}: {line}" for line in str(exc).splitlines())
    if problems:
        raise ConfigError(join_problems(problems))  # 32 configs of a tenant's: bounded again (api.MAX_PROBLEMS)
    return entries


def _winner(entries: list[_Entry], result: DeviceRequestAllocationResult, kind: DeviceKind,
            whole_gpu_class: str) -> ResolvedConfig:
    wanted = MigDeviceConfig if kind == DeviceKind.MIG else GpuConfig
    what = f'{kind} device {result.device} (request "{result.request}")'
    for entry in reversed(entries):
        if not entry.applies_to(result):
            continue
        if not isinstance(entry.config, wanted):
            if entry.requests:
                raise ConfigError(
                    f"{entry.origin}: {entry.config.kind} cannot configure {what}; use {wanted.__name__} for it"
                )
            continue  # a catch-all entry of another kind is meant for the claim's other devices
        if kind in SHARE_KINDS and isinstance(entry.config, GpuConfig) and entry.config.sharing is not None:
            raise ConfigError(
                f"{entry.origin}: GpuConfig.sharing cannot be applied to {what}: a share's limits come from "
                "the node's sharing plan (a consumable share's from the capacity it consumed). To choose your "
                "own MPS or time-slicing settings, request a whole GPU "
                f"(DeviceClass {whole_gpu_class}) with GpuConfig.sharing, or limit this config with requests: "
                "to the requests for whole GPUs"
            )
        return ResolvedConfig(result, entry.config, entry.origin)
    raise AssertionError("unreachable: the built-in defaults apply to every device kind")
