"""The parts of a CDI spec file: device nodes, mounts, hooks, container edits and devices.

Each is as strict as the runtimes' loader (why: :mod:`cdi.spec`), which assembles them into a
:class:`~cdi.spec.Spec`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

from cdi.names import check_device_name, quoted

HOOK_NAMES: tuple[str, ...] = (
    "prestart",
    "createRuntime",
    "createContainer",
    "startContainer",
    "poststart",
    "poststop",
)
# "" lets the runtime stat the host node; b block, c char, u unbuffered char, p fifo.
DEVICE_NODE_TYPES: tuple[str, ...] = ("", "b", "c", "u", "p")

_UINT32_MAX = 0xFFFF_FFFF
_INT64_MAX = 0x7FFF_FFFF_FFFF_FFFF


def _check_env_entry(entry: str) -> str:
    if entry.find("=") < 1:
        raise ValueError(f"{quoted(entry)} is not KEY=VALUE")
    return entry


def _check_not_empty(value: str) -> str:
    if not value:
        raise ValueError("must not be empty")
    return value


def _check_device_node_type(value: str) -> str:
    if value not in DEVICE_NODE_TYPES:
        raise ValueError(f'{quoted(value)} is not a device node type (expected "", "b", "c", "u" or "p")')
    return value


def _check_hook_name(value: str) -> str:
    if value not in HOOK_NAMES:
        raise ValueError(f"{quoted(value)} is not a hook name (expected one of {', '.join(HOOK_NAMES)})")
    return value


def _sorted_by_key(mapping: dict[str, str]) -> dict[str, str]:
    return dict(sorted(mapping.items()))


EnvEntry = Annotated[StrictStr, AfterValidator(_check_env_entry)]
# Kept sorted so the same annotations always serialise to the same bytes.
Annotations = Annotated[dict[StrictStr, StrictStr], AfterValidator(_sorted_by_key)]
NonEmptyStr = Annotated[StrictStr, AfterValidator(_check_not_empty)]
DeviceName = Annotated[StrictStr, AfterValidator(check_device_name)]
DeviceNodeType = Annotated[StrictStr, AfterValidator(_check_device_node_type)]
HookName = Annotated[StrictStr, AfterValidator(_check_hook_name)]
UInt32 = Annotated[StrictInt, Field(ge=0, le=_UINT32_MAX)]
# The loader rejects negative device numbers: -1 means "any" in a cgroup rule.
DeviceNumber = Annotated[StrictInt, Field(ge=0, le=_INT64_MAX)]


class WireModel(BaseModel):
    # Frozen because a spec is a value; files are parsed by alias only (see Spec.from_wire).
    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True, validate_by_alias=True)


class DeviceNode(WireModel):
    path: NonEmptyStr
    host_path: StrictStr = Field(default="", alias="hostPath")
    type: DeviceNodeType = ""
    major: DeviceNumber = 0
    minor: DeviceNumber = 0
    # Permission bits only, written as a decimal integer (438 = 0o666); never file-type bits like S_IFCHR.
    file_mode: StrictInt | None = Field(default=None, alias="fileMode")
    permissions: StrictStr = ""
    uid: UInt32 | None = None
    gid: UInt32 | None = None

    @field_validator("file_mode")
    @classmethod
    def _permission_bits(cls, value: int | None) -> int | None:
        # Up to 0o7777: what runc's DeviceFromPath (used by nvcdi) reports, file-type bits stripped.
        if value is not None and not 0 <= value <= 0o7777:
            raise ValueError(f"{value} is not permission bits (expected 0..4095, e.g. 438 for 0o666)")
        return value

    @field_validator("permissions")
    @classmethod
    def _cgroup_permissions(cls, value: str) -> str:
        if value != "none" and value.strip("rwm"):
            raise ValueError(f'{quoted(value)} is not cgroup permissions (expected letters of "rwm", or "none")')
        return value


class Mount(WireModel):
    host_path: NonEmptyStr = Field(alias="hostPath")
    container_path: NonEmptyStr = Field(alias="containerPath")
    options: list[StrictStr] = Field(default_factory=list)
    type: StrictStr = ""


class Hook(WireModel):
    hook_name: HookName = Field(alias="hookName")
    path: NonEmptyStr
    # args[0] is argv[0], the program name, as in OCI hooks.
    args: list[StrictStr] = Field(default_factory=list)
    env: list[EnvEntry] = Field(default_factory=list)
    timeout: StrictInt | None = None


class IntelRdt(WireModel):
    clos_id: StrictStr = Field(default="", alias="closID")
    l3_cache_schema: StrictStr = Field(default="", alias="l3CacheSchema")
    mem_bw_schema: StrictStr = Field(default="", alias="memBwSchema")
    # None and [] differ: a present 'schemata' key, even empty, requires spec 1.1.0.
    schemata: list[StrictStr] | None = None
    enable_monitoring: StrictBool = Field(default=False, alias="enableMonitoring")

    @field_validator("clos_id")
    @classmethod
    def _clos_id_is_file_name(cls, value: str) -> str:
        if value == "/":
            return value
        if value in (".", "..") or "/" in value or "\n" in value or len(value.encode()) >= 4096:
            raise ValueError(f'{quoted(value)} is not a CLOS ID (a file name, or "/" for the root CLOS)')
        return value


class LinuxNetDevice(WireModel):
    host_interface_name: NonEmptyStr = Field(alias="hostInterfaceName")
    name: NonEmptyStr


class ContainerEdits(WireModel):
    env: list[EnvEntry] = Field(default_factory=list)
    device_nodes: list[DeviceNode] = Field(default_factory=list, alias="deviceNodes")
    net_devices: list[LinuxNetDevice] = Field(default_factory=list, alias="netDevices")
    hooks: list[Hook] = Field(default_factory=list)
    mounts: list[Mount] = Field(default_factory=list)
    intel_rdt: IntelRdt | None = Field(default=None, alias="intelRdt")
    # The key is 'additionalGids'; SPEC.md prose spells it 'additionalGIDs', which is wrong.
    additional_gids: list[UInt32] = Field(default_factory=list, alias="additionalGids")

    @field_validator("net_devices")
    @classmethod
    def _unique_net_devices(cls, devices: list[LinuxNetDevice]) -> list[LinuxNetDevice]:
        by_key = (
            ("hostInterfaceName", [d.host_interface_name for d in devices]),
            ("name", [d.name for d in devices]),
        )
        for key, values in by_key:
            first_index: dict[str, int] = {}
            for i, value in enumerate(values):
                if value in first_index:
                    raise ValueError(f"duplicate {key} {quoted(value)} in [{first_index[value]}] and [{i}]")
                first_index[value] = i
        return devices

    def is_empty(self) -> bool:
        return not (
            self.env
            or self.device_nodes
            or self.net_devices
            or self.hooks
            or self.mounts
            or self.intel_rdt is not None
            or self.additional_gids
        )


class Device(WireModel):
    name: DeviceName
    annotations: Annotations = Field(default_factory=dict)
    container_edits: ContainerEdits = Field(alias="containerEdits")

    @field_validator("container_edits")
    @classmethod
    def _not_empty(cls, edits: ContainerEdits) -> ContainerEdits:
        if edits.is_empty():
            raise ValueError('has no edits: a device needs at least one (the loader rejects "empty device edits")')
        return edits
