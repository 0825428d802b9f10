"""The opaque configuration API users put in claims and classes: ``gpu.tessera.dev/v1alpha1``.

The kinds and fields mirror NVIDIA's ``resource.nvidia.com/v1beta1`` (``GpuConfig``,
``MigDeviceConfig``, ``sharing.strategy``, ``mpsConfig``, ``timeSlicingConfig``) so a user moves
over by changing ``apiVersion``. Field names are the API's camelCase names, so error paths read
exactly like what the user wrote. Decoding is strict: unknown fields and wrong types are errors,
reported one line per problem by :func:`describe_validation_error` (shared with the sharing plan).

The resolved form used at prepare time (:class:`MpsLimits`) is computed by
:func:`resolve_mps_limits` once the claim's devices are known.
"""

from __future__ import annotations

import json
import types
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Final, Literal, Union, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import ErrorDetails

from driver.gpu.claimconfig.choices import MpsClients, TimeSliceInterval
from driver.gpu.claimconfig.echo import show, show_path_part
from driver.gpu.claimconfig.quantity import check_shm_size, parse_quantity
from driver.gpu.errors import DriverError
from driver.units import MIB

API_VERSION: Final = "gpu.tessera.dev/v1alpha1"

# NVIDIA's API, which this one mirrors: named in the error so the fix is obvious.
_NVIDIA_API_VERSION = "resource.nvidia.com/v1beta1"


class ConfigError(DriverError, ValueError):
    """An opaque config the driver cannot use; the message is shown to the user as is."""


def _quantity(value: object) -> object:
    # Parsed before pydantic's strict int check; the field path is added by describe_validation_error.
    if isinstance(value, str | int) and not isinstance(value, bool):
        try:
            return parse_quantity(value, "value")
        except ValueError as exc:
            raise ValueError(str(exc).removeprefix("value: ")) from exc
    raise ValueError(f'expected a quantity such as "10Gi" or "512Mi", got {show(value)}')


# A memory quantity ("10Gi", 1073741824), held as whole bytes.
ByteQuantity = Annotated[int, BeforeValidator(_quantity)]
# The size of an MPS daemon's own /dev/shm tmpfs, where a plan or a claim names one.
ShmSize = Annotated[int, BeforeValidator(_quantity), AfterValidator(check_shm_size)]


def _percentage(value: int | None) -> int | None:
    if value is not None and not 1 <= value <= 100:
        raise ValueError(f"{value} is out of range; expected an integer from 1 to 100")
    return value


class _ApiObject(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# Longer than any device key: GPU and MIG UUIDs are 40 characters, the older MIG form
# ("MIG-GPU-<uuid>/<gi>/<ci>") about 50, and an index a few digits.
_MAX_DEVICE_KEY_CHARS = 64


def _device_keys(value: object) -> object:
    # Checked before the values, so that errors never carry an over-long key in their path.
    if isinstance(value, Mapping):
        for key in value:
            if isinstance(key, str) and len(key) > _MAX_DEVICE_KEY_CHARS:
                raise ValueError(
                    f"key {_show_key(key)} is too long ({len(key)} characters); expected a device UUID "
                    f"or an index into the claim's devices (at most {_MAX_DEVICE_KEY_CHARS} characters)"
                )
    return value


class MpsConfig(_ApiObject):
    """Defaults the claim's MPS control daemon applies to every client process."""

    defaultActiveThreadPercentage: Annotated[int, AfterValidator(_percentage)] | None = None
    defaultPinnedDeviceMemoryLimit: ByteQuantity | None = None
    # Keys: a device UUID, or a decimal index into the claim's devices sorted by UUID.
    defaultPerDevicePinnedMemoryLimit: Annotated[dict[str, ByteQuantity] | None, BeforeValidator(_device_keys)] = None
    # Who may use the claim's daemon: any (the default: it serves this claim's pods only, so the limits
    # bind them only as far as they agree), or nonRoot (pods that could run as host root, and so retune
    # or stop the daemon, are refused at prepare; docs/sharing.md "Tenants").
    clients: MpsClients = "any"
    # The daemon's own /dev/shm tmpfs, shared by the claim's containers; default the node's --mps-shm-size.
    shmSize: ShmSize | None = None


class TimeSlicingConfig(_ApiObject):
    interval: TimeSliceInterval = "Default"


class Sharing(_ApiObject):
    """How the devices a whole-GPU config applies to are shared between the claim's containers."""

    strategy: Literal["MPS", "TimeSlicing"]
    mpsConfig: MpsConfig | None = None
    timeSlicingConfig: TimeSlicingConfig | None = None

    @model_validator(mode="after")
    def _config_matches_strategy(self) -> Sharing:
        if self.strategy == "MPS" and self.timeSlicingConfig is not None:
            raise ValueError(
                'timeSlicingConfig is set but strategy is "MPS"; use mpsConfig with strategy MPS, '
                "or set strategy: TimeSlicing"
            )
        if self.strategy == "TimeSlicing" and self.mpsConfig is not None:
            raise ValueError(
                'mpsConfig is set but strategy is "TimeSlicing"; use timeSlicingConfig with strategy '
                "TimeSlicing, or set strategy: MPS"
            )
        return self


_MIG_TIME_SLICING = (
    "TimeSlicing is not supported on MIG devices: a MIG instance has no settable time slice, and MIG "
    "already isolates instances from each other; use strategy MPS or leave sharing out"
)


class MigSharing(_ApiObject):
    """Sharing of a MIG device: MPS only."""

    strategy: Literal["MPS"]
    mpsConfig: MpsConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_time_slicing(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and (data.get("strategy") == "TimeSlicing" or "timeSlicingConfig" in data):
            raise ValueError(_MIG_TIME_SLICING)
        return data


class GpuConfig(_ApiObject):
    """Config for whole GPUs (and the shares of the node sharing plan, which take no sharing)."""

    apiVersion: Literal["gpu.tessera.dev/v1alpha1"] = API_VERSION
    kind: Literal["GpuConfig"] = "GpuConfig"
    sharing: Sharing | None = None


class MigDeviceConfig(_ApiObject):
    """Config for MIG devices."""

    apiVersion: Literal["gpu.tessera.dev/v1alpha1"] = API_VERSION
    kind: Literal["MigDeviceConfig"] = "MigDeviceConfig"
    sharing: MigSharing | None = None


DeviceConfig = GpuConfig | MigDeviceConfig

_KINDS: dict[str, type[GpuConfig] | type[MigDeviceConfig]] = {
    "GpuConfig": GpuConfig,
    "MigDeviceConfig": MigDeviceConfig,
}


def parse_config(parameters: Mapping[str, Any]) -> DeviceConfig:
    """Decode an opaque config's ``parameters``; ConfigError lists every problem, one per line."""
    if not isinstance(parameters, Mapping):
        raise ConfigError(f"parameters: expected a mapping with apiVersion and kind, got {show(parameters)}")
    api_version = parameters.get("apiVersion")
    if api_version is None:
        raise ConfigError(f"apiVersion: required field is missing; expected {API_VERSION}")
    if api_version != API_VERSION:
        hint = " (same fields, only the apiVersion changes)" if api_version == _NVIDIA_API_VERSION else ""
        raise ConfigError(f"apiVersion {show(api_version)} is not served by this driver; use {API_VERSION}{hint}")
    kind = parameters.get("kind")
    if kind is None:
        raise ConfigError(f"kind: required field is missing; expected one of {', '.join(_KINDS)}")
    model = _KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ConfigError(f"kind {show(kind)} is not served by this driver; expected one of {', '.join(_KINDS)}")
    try:
        return model.model_validate(parameters)
    except ValidationError as exc:
        # Only those shown are described: all ~1,500 of a hostile config took 15 ms per config.
        lines = describe_validation_error(exc, model, kind, limit=MAX_PROBLEMS)
        raise ConfigError(join_problems(lines, total=exc.error_count())) from None


# A config within the API server's 10 KiB can hold ~1,500 unknown fields, and a claim 32 such configs:
# one line each, prefixed per config, made a claim's error ~100 MB in the driver process and more than
# the kubelet's gRPC client takes (4 MiB). The first few problems are what a user fixes first anyway.
MAX_PROBLEMS = 10


def join_problems(lines: Sequence[str], total: int | None = None) -> str:
    """The first :data:`MAX_PROBLEMS` of ``lines``, one per line, then a count of the rest (of ``total``)."""
    shown = list(lines[:MAX_PROBLEMS])
    more = (len(lines) if total is None else total) - len(shown)
    if more > 0:
        shown.append(f"... and {more} more not shown")
    return "\n".join(shown)


class MpsLimits(BaseModel):
    """What an MPS daemon is told: one thread percentage, and a pinned memory limit per device UUID."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    active_thread_percentage: int | None = None
    pinned_memory_bytes: dict[str, int] = Field(default_factory=dict)


def resolve_mps_limits(cfg: MpsConfig, gpu_uuids_sorted: list[str], gpu_memory_bytes: dict[str, int]) -> MpsLimits:
    """Map ``cfg`` onto the claim's devices: index keys become UUIDs, per-device entries beat the default.

    ``gpu_memory_bytes`` may lack a device whose memory is unknown; its limit is then not size-checked.
    """
    uuids = sorted(gpu_uuids_sorted)  # index keys refer to this order; sorting again guards the contract
    limits: dict[str, int] = {}
    if cfg.defaultPinnedDeviceMemoryLimit is not None:
        limits = dict.fromkeys(uuids, cfg.defaultPinnedDeviceMemoryLimit)
    sources = dict.fromkeys(uuids, "mpsConfig.defaultPinnedDeviceMemoryLimit")
    named_by: dict[str, str] = {}
    for key, limit in (cfg.defaultPerDevicePinnedMemoryLimit or {}).items():
        field = f"mpsConfig.defaultPerDevicePinnedMemoryLimit.{show_path_part(key)}"
        uuid = _device_for_key(key, uuids, field)
        if uuid in named_by:
            raise ConfigError(f'{field}: names the same device ({uuid}) as key "{named_by[uuid]}"; keep only one')
        named_by[uuid] = key
        limits[uuid] = limit
        sources[uuid] = field
    for uuid, limit in limits.items():
        _check_limit(sources[uuid], uuid, limit, gpu_memory_bytes.get(uuid))
    return MpsLimits(active_thread_percentage=cfg.defaultActiveThreadPercentage, pinned_memory_bytes=limits)


def _device_for_key(key: str, uuids: list[str], field: str) -> str:
    if len(key) > _MAX_DEVICE_KEY_CHARS:  # parse_config refuses these; a model built otherwise may not
        raise ConfigError(f"mpsConfig.defaultPerDevicePinnedMemoryLimit: key {_show_key(key)} is too long "
                          f"({len(key)} characters); expected a device UUID or an index")
    if _is_ascii_number(key.removeprefix("-")) and key.startswith("-"):
        raise ConfigError(
            f"{field}: index {key} is negative; the claim's devices (sorted by UUID) are indices "
            f"0 to {len(uuids) - 1}: {', '.join(uuids)}"
        )
    if not key.isascii() and any(c.isdigit() for c in key):
        raise ConfigError(f"{field}: an index is written in ASCII digits 0-9 only; expected a UUID from "
                          f"{', '.join(uuids)} or an index from 0 to {len(uuids) - 1}")
    if _is_ascii_number(key):
        # isdecimal() alone would take other scripts' digits too, which int() then reads.
        index = int(key)
        if index >= len(uuids):
            raise ConfigError(
                f"{field}: index {index} is out of range; the claim's devices (sorted by UUID) are "
                f"indices 0 to {len(uuids) - 1}: {', '.join(uuids)}"
            )
        return uuids[index]
    if key not in uuids:
        raise ConfigError(
            f"{field}: {_show_key(key)} is not one of this config's devices; expected a UUID from "
            f"{', '.join(uuids)} or an index from 0 to {len(uuids) - 1}"
        )
    return key


def _is_ascii_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _show_key(key: str) -> str:
    return json.dumps(key[:20] + "..." if len(key) > 20 else key)


def _check_limit(field: str, uuid: str, limit: int, memory: int | None) -> None:
    if limit // MIB == 0:
        raise ConfigError(f"{field}: {limit} bytes is less than 1 MiB; MPS limits are set in whole MiB")
    if memory is not None and limit > memory:
        raise ConfigError(
            f"{field}: {limit // MIB} MiB is more than the {memory // MIB} MiB of memory on device {uuid}"
        )


# --- readable validation errors -------------------------------------------------------------

_TYPE_MESSAGES = {
    "int_type": "expected an integer",
    "string_type": "expected a string",
    "bool_type": "expected true or false",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
    "model_attributes_type": "expected a mapping",
    "list_type": "expected a list",
    "missing": "required field is missing",
}


def describe_validation_error(exc: ValidationError, model: type[BaseModel], root: str = "",
                              limit: int | None = None) -> list[str]:
    """One readable line per problem: ``<path>: <what is wrong>``, paths in the API's field names.

    ``root`` prefixes every path (e.g. the kind); list items are shown as ``[i]``, mapping keys as ``.key``.
    ``limit``: describe only the first that many problems.
    """
    return [_describe(error, model, root) for error in exc.errors(include_url=False)[:limit]]


def _describe(error: ErrorDetails, model: type[BaseModel], root: str) -> str:
    loc = list(error["loc"])
    kind = error["type"]
    ctx = error.get("ctx") or {}
    if kind == "extra_forbidden":
        parent = _model_at(model, loc[:-1])
        known = ", ".join(_field_names(parent)) if parent is not None else ""
        return _prefixed(root, loc[:-1], f"unknown field {show(loc[-1])} (known fields: {known})")
    if loc and loc[-1] == "[key]":  # a mapping key of the wrong type, e.g. YAML read `yes:` as a boolean
        problem = _TYPE_MESSAGES.get(kind, error["msg"])
        return _prefixed(root, loc[:-2], f"key {show(error['input'])}: {problem} (quote the key)")
    if kind == "value_error":
        return _prefixed(root, loc, str(ctx.get("error", error["msg"])))
    if kind == "literal_error":
        return _prefixed(root, loc, f"{show(error['input'])} is not allowed; expected {ctx.get('expected', '')}")
    if kind == "missing":
        return _prefixed(root, loc, _TYPE_MESSAGES[kind])
    message = _TYPE_MESSAGES.get(kind, error["msg"])
    return _prefixed(root, loc, f"{message}, got {show(error['input'])}")


def _prefixed(root: str, loc: list[int | str], message: str) -> str:
    path = _path(root, loc)
    return f"{path}: {message}" if path else message


def _path(root: str, loc: list[int | str]) -> str:
    path = root
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{show_path_part(part)}" if path else show_path_part(part)
    return path


def _field_names(model: type[BaseModel]) -> list[str]:
    return [info.alias or name for name, info in model.model_fields.items()]


def _model_at(model: type[BaseModel], loc: list[int | str]) -> type[BaseModel] | None:
    """The model class found at ``loc`` inside ``model`` (used to list the known fields)."""
    current: object = model
    for part in loc:
        current = _strip_optional(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = next((f for n, f in current.model_fields.items() if (f.alias or n) == part), None)
            if field is None:
                return None
            current = field.annotation
        elif get_origin(current) in (dict, list):
            current = get_args(current)[-1]
        else:
            return None
    current = _strip_optional(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _strip_optional(annotation: object) -> object:
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        return members[0] if len(members) == 1 else annotation
    return annotation
