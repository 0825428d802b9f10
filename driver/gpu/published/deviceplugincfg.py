"""NVIDIA's device plugin sharing configs (``version: v1``), read for ``convert-plan``.

One config is what the device plugin reads with ``--config-file``; the GPU Operator keeps several as
the keys of one ConfigMap (``data: {<key>: <config as a YAML string>}``, ClusterPolicy
``devicePlugin.config.name``) and a node picks one by its label ``nvidia.com/device-plugin.config``.
The models follow NVIDIA/k8s-device-plugin ``api/config/v1`` (config.go, flags.go, replicas.go,
sharing.go): the fields a sharing plan can carry are modelled and checked strictly; the plugin's
operational ``flags`` and its (ignored) ``resources`` renaming are kept as given, to be reported.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from cdi.yamlload import load_yaml
from driver.gpu.claimconfig.api import describe_validation_error
from driver.gpu.errors import DriverError

MigStrategy = Literal["none", "single", "mixed"]


class DevicePluginConfigError(DriverError, ValueError):
    """A config file that cannot be read as device plugin configs; one line per problem."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Flags(BaseModel):
    """``flags``: only ``migStrategy`` shapes what is published; the rest run the plugin itself."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    migStrategy: MigStrategy = "none"

    def others(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


# ``devices``: "all" (the default), a count, or GPU indices / MIG indices ("0:1") / UUIDs.
DeviceSelection = str | int | list[int | str]


class ReplicatedResource(_Strict):
    name: str
    replicas: int
    rename: str | None = None
    devices: DeviceSelection = "all"

    @field_validator("name")
    @classmethod
    def _nvidia_resource(cls, value: str) -> str:
        if not value.startswith("nvidia.com/"):
            raise ValueError(f'"{value}" is not an NVIDIA resource name (nvidia.com/gpu or nvidia.com/mig-<profile>)')
        return value

    @field_validator("replicas")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise ValueError(f"must be at least 1, got {value}")
        return value

    @field_validator("devices", mode="before")
    @classmethod
    def _selection(cls, value: object) -> object:
        # One message for the three forms, rather than one per member of the union.
        if value == "all" or (isinstance(value, list) and all(
                isinstance(item, str) or (isinstance(item, int) and not isinstance(item, bool)) for item in value)):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            if value < 1:
                raise ValueError(f"a count of devices must be at least 1, got {value}")
            return value
        raise ValueError(f'expected "all", a count, or a list of GPU indices, MIG indices or UUIDs, got {value!r}')


class ReplicatedResources(_Strict):
    """``sharing.timeSlicing`` or ``sharing.mps``."""

    renameByDefault: bool = False
    # None: not given. The device plugin's default is false for time slicing and true for MPS.
    failRequestsGreaterThanOne: bool | None = None
    resources: list[ReplicatedResource]

    @field_validator("resources")
    @classmethod
    def _some(cls, value: list[ReplicatedResource]) -> list[ReplicatedResource]:
        if not value:
            raise ValueError("no resources to share (the device plugin refuses this too: \"no resources specified\")")
        return value


class Sharing(_Strict):
    timeSlicing: ReplicatedResources | None = None
    mps: ReplicatedResources | None = None


class DevicePluginConfig(_Strict):
    version: Literal["v1"] = "v1"
    flags: Flags = Flags()
    # Renaming by PCI ID pattern; the device plugin ignores it ("not yet supported"), kept to be reported.
    resources: dict[str, Any] | None = None
    sharing: Sharing = Sharing()
    imex: dict[str, Any] | None = None


def parse_configs(text: str, source: str) -> tuple[dict[str, DevicePluginConfig], bool]:
    """The configs in ``text``: key -> config, and whether it was a ConfigMap. A single config file is one
    key, ``source``'s stem. Raises DevicePluginConfigError naming the key and field."""
    try:
        data = load_yaml(text, source)
    except yaml.YAMLError as exc:
        raise DevicePluginConfigError(f"{source}: not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise DevicePluginConfigError(f"{source}: expected a device plugin config (version: v1, flags, sharing) or "
                                      "a ConfigMap of them (kind: ConfigMap, data)")
    if data.get("kind") == "ConfigMap":
        return _configmap(data, source), True
    return {Path(source).stem: _config(data, source)}, False


def _configmap(data: dict[str, Any], source: str) -> dict[str, DevicePluginConfig]:
    entries = data.get("data")
    if not isinstance(entries, dict) or not entries:
        raise DevicePluginConfigError(f"{source}: data: expected one device plugin config per key, got "
                                      f"{'nothing' if not entries else type(entries).__name__}")
    configs: dict[str, DevicePluginConfig] = {}
    problems: list[str] = []
    for key, value in entries.items():
        where = f"{source}: data.{key}"
        if not isinstance(value, str):
            problems.append(f"{where}: expected the config as a YAML string (ConfigMap data), got "
                            f"{type(value).__name__}")
            continue
        try:
            parsed = load_yaml(value, where)
        except yaml.YAMLError as exc:
            problems.append(f"{where}: not valid YAML: {' '.join(str(exc).split())}")
            continue
        try:
            configs[str(key)] = _config(parsed if parsed is not None else {}, where)
        except DevicePluginConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise DevicePluginConfigError("\n".join(problems))
    return configs


def _config(data: object, where: str) -> DevicePluginConfig:
    try:
        return DevicePluginConfig.model_validate(data)
    except ValidationError as exc:
        lines = describe_validation_error(exc, DevicePluginConfig)
        raise DevicePluginConfigError("\n".join(f"{where}: {line}" for line in lines)) from None
