"""Pydantic models of a CDI spec file (spec versions up to 1.1.0), as strict as the runtimes' loader.

containerd, CRI-O, podman and Docker all vendor the reference Go library, which ignores a whole
file on any unknown key, bad name, bad env entry, bad device node, hook or mount, or a declared
version older than the content needs. This model and its parts (``cdi/edits.py``) reject exactly
those files, each problem named by its path in the file (``devices[2].containerEdits.env[0]: "FOO"
is not KEY=VALUE``), so an invalid spec fails here instead of silently in a runtime at container
creation.

Python attributes are snake_case; the wire keys are the aliases, and files are parsed by alias only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    Field,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from cdi.edits import Annotations, ContainerEdits, Device, WireModel
from cdi.names import quoted, split_kind
from cdi.version import (
    LATEST_VERSION,
    VALID_VERSIONS,
    content_minimum,
    is_valid_version,
    version_at_least,
)
from cdi.yamlload import load_yaml


class SpecError(ValueError):
    """A spec the reference loader would reject; ``problems`` holds one ``path: reason`` per problem."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = tuple(problems)
        super().__init__(f"invalid CDI spec {source}: " + "; ".join(problems))


class Spec(WireModel):
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


def minimum_version(spec: Spec) -> str:
    """The oldest ``cdiVersion`` the loader accepts for this content (section 1.1 of the CDI reference)."""
    return minimum_version_reason(spec)[0]


def minimum_version_reason(spec: Spec) -> tuple[str, str]:
    """The minimum version and which part of the spec forces it, for error messages (:mod:`cdi.version`)."""
    return content_minimum(kind=spec.kind, annotations=spec.annotations, devices=spec.devices,
                           container_edits=spec.container_edits)


def with_minimum_version(spec: Spec) -> Spec:
    """A copy of ``spec`` declaring exactly its minimum version; always what we write to disk."""
    # No re-validation needed: the computed minimum is by definition valid for this content.
    return spec.model_copy(update={"cdi_version": minimum_version(spec)})


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
