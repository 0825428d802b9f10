"""Pydantic models of a CDI spec file (spec versions up to 1.1.0), as strict as the runtimes' loader.

containerd, CRI-O, podman and Docker all vendor the reference Go library, which ignores a whole
file on any unknown key, bad name, bad env entry, bad device node, hook or mount, or a declared
version older than the content needs. These models reject exactly those files, each problem named
by its path in the file (``devices[2].containerEdits.env[0]: "FOO" is not KEY=VALUE``), so an
invalid spec fails here instead of silently in a runtime at container creation.

Python attributes are snake_case; the wire keys are the aliases, and files are parsed by alias only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from cdi.names import check_device_name, quoted, split_kind
from cdi.version import (
    LATEST_VERSION,
    VALID_VERSIONS,
    is_valid_version,
    minimum_version_reason,
    version_at_least,
    with_minimum_version,
)
from cdi.yamlload import load_yaml

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


class SpecError(ValueError):
    """A spec the reference loader would reject; ``problems`` holds one ``path: reason`` per problem."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        super().__init__(f"invalid CDI spec {source}: " + "; ".join(problems))


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


class _WireModel(BaseModel):
    # Frozen because a spec is a value; files are parsed by alias only (see Spec.from_wire).
    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True, validate_by_alias=True)


class DeviceNode(_WireModel):
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


class Mount(_WireModel):
    host_path: NonEmptyStr = Field(alias="hostPath")
    container_path: NonEmptyStr = Field(alias="containerPath")
    options: list[StrictStr] = Field(default_factory=list)
    type: StrictStr = ""


class Hook(_WireModel):
    hook_name: HookName = Field(alias="hookName")
    path: NonEmptyStr
    # args[0] is argv[0], the program name, as in OCI hooks.
    args: list[StrictStr] = Field(default_factory=list)
    env: list[EnvEntry] = Field(default_factory=list)
    timeout: StrictInt | None = None


class IntelRdt(_WireModel):
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


class LinuxNetDevice(_WireModel):
    host_interface_name: NonEmptyStr = Field(alias="hostInterfaceName")
    name: NonEmptyStr


class ContainerEdits(_WireModel):
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


class Device(_WireModel):
    name: DeviceName
    annotations: Annotations = Field(default_factory=dict)
    container_edits: ContainerEdits = Field(alias="containerEdits")

    @field_validator("container_edits")
    @classmethod
    def _not_empty(cls, edits: ContainerEdits) -> ContainerEdits:
        if edits.is_empty():
            raise ValueError('has no edits: a device needs at least one (the loader rejects "empty device edits")')
        return edits


class Spec(_WireModel):
    cdi_version: StrictStr = Field(alias="cdiVersion")
    kind: StrictStr
    annotations: Annotations = Field(default_factory=dict)
    devices: list[Device]
    # Applied once to a container when any device of this spec is injected.
    container_edits: ContainerEdits = Field(default_factory=ContainerEdits, alias="containerEdits")

    @field_validator("cdi_version")
    @classmethod
    def _known_version(cls, value: str) -> str:
        if not is_valid_version(value):
            raise ValueError(f"{quoted(value)} is not a CDI spec version (expected one of {', '.join(VALID_VERSIONS)})")
        return value

    @field_validator("kind")
    @classmethod
    def _valid_kind(cls, value: str) -> str:
        split_kind(value)
        return value

    @field_validator("devices")
    @classmethod
    def _some_unique_devices(cls, devices: list[Device]) -> list[Device]:
        if not devices:
            raise ValueError("a spec needs at least one device")
        first_index: dict[str, int] = {}
        for i, device in enumerate(devices):
            if device.name in first_index:
                raise ValueError(f"device name {quoted(device.name)} is used by [{first_index[device.name]}] and [{i}]")
            first_index[device.name] = i
        return devices

    @model_validator(mode="after")
    def _version_covers_content(self) -> Spec:
        required, reason = minimum_version_reason(self)
        if not version_at_least(self.cdi_version, required):
            raise ValueError(
                f"cdiVersion: {quoted(self.cdi_version)} is older than {required}, required because {reason}")
        return self

    @property
    def vendor(self) -> str:
        return split_kind(self.kind)[0]

    @property
    def device_class(self) -> str:
        return split_kind(self.kind)[1]

    @classmethod
    def build(
        cls,
        kind: str,
        devices: list[Device],
        container_edits: ContainerEdits | None = None,
        annotations: dict[str, str] | None = None,
    ) -> Spec:
        """A spec declaring exactly the minimum version its content needs."""
        draft = cls(
            cdi_version=LATEST_VERSION,
            kind=kind,
            devices=devices,
            container_edits=container_edits or ContainerEdits(),
            annotations=annotations or {},
        )
        return with_minimum_version(draft)

    def to_wire(self) -> dict[str, Any]:
        """The file's content: wire keys, declaration order, unset and empty optional fields left out.

        Leaving out defaults mirrors Go's ``omitempty``, so the loader reads back the same values.
        """
        return self.model_dump(mode="json", by_alias=True, exclude_defaults=True)

    def to_json(self) -> str:
        return json.dumps(self.to_wire(), indent=2, ensure_ascii=False) + "\n"

    @classmethod
    def from_wire(cls, data: object, source: str = "<data>") -> Spec:
        """Validate parsed file content by wire keys only, raising SpecError with every problem."""
        if not isinstance(data, dict):
            raise SpecError(source, [f"the top level must be a mapping, got {type(data).__name__}"])
        try:
            return cls.model_validate(data, by_alias=True, by_name=False)
        except ValidationError as exc:
            raise SpecError(source, validation_problems(exc)) from exc

    @classmethod
    def from_text(cls, text: str, source: str = "<text>") -> Spec:
        """Parse a spec from YAML or JSON text (JSON is YAML), rejecting duplicate keys as the loader does."""
        data: object
        json_error: ValueError | None = None
        if text.lstrip().startswith("{"):
            # Most likely JSON, as this package writes it: the json module is ~100x faster than
            # PyYAML, which matters on the prepare path where every written spec is parsed back once.
            # A YAML flow mapping also starts with "{" and the Go loader accepts it, so text that is
            # not JSON still gets the YAML parse.
            try:
                data = json.loads(text, object_pairs_hook=_unique_json_object)
            except ValueError as exc:
                json_error = exc
            else:
                return cls.from_wire(data, source)
        try:
            data = load_yaml(text)
        except yaml.YAMLError as exc:
            problem = (f"not valid YAML or JSON: {exc}" if json_error is None
                       else f"not valid JSON ({json_error}) nor YAML ({exc})")
            raise SpecError(source, [problem]) from exc
        return cls.from_wire(data, source)

    @classmethod
    def from_file(cls, path: Path) -> Spec:
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SpecError(str(path), [f"not UTF-8 text: {exc}"]) from exc
        return cls.from_text(text, str(path))


def _unique_json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def validation_problems(exc: ValidationError) -> list[str]:
    """One ``path: reason`` line per pydantic error, paths spelled as in the file (``devices[0].name``)."""
    problems = []
    for error in exc.errors():
        path = ""
        for part in error["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        problems.append(f"{path}: {_reason(error)}" if path else _reason(error))
    return problems


def _reason(error: Any) -> str:
    kind = error["type"]
    if kind == "value_error":
        return str(error["ctx"]["error"])
    if kind == "extra_forbidden":
        return "unknown key (the loader's strict parse rejects the whole file)"
    if kind == "missing":
        return "required key is missing"
    shown = json.dumps(error["input"], default=repr)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return f"{error['msg']} (got {shown})"
