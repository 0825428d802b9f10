"""Pydantic models of the ResourceSlice device schema (resource.k8s.io/v1), wire-shaped.

A driver builds a list of :class:`Device`; the publisher splits them into slices. Field names
in the wire form (``to_wire``) are exactly the API's, so a slice is never lossy-converted
through the kubernetes client's models.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class DeviceAttribute(BaseModel):
    """Exactly one typed value, as the API's union requires."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    int_value: int | None = Field(default=None, alias="int")
    bool_value: bool | None = Field(default=None, alias="bool")
    string: str | None = None
    version: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> DeviceAttribute:
        set_fields = [v for v in (self.int_value, self.bool_value, self.string, self.version) if v is not None]
        if len(set_fields) != 1:
            raise ValueError("a device attribute must have exactly one of int, bool, string, version")
        return self

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


def string_attr(value: str) -> DeviceAttribute:
    return DeviceAttribute(string=value)


def int_attr(value: int) -> DeviceAttribute:
    return DeviceAttribute(int_value=value)


def bool_attr(value: bool) -> DeviceAttribute:
    return DeviceAttribute(bool_value=value)


def version_attr(value: str) -> DeviceAttribute:
    return DeviceAttribute(version=value)


class CapacityRequestRange(BaseModel):
    """``validRange`` of a request policy: quantities from ``min`` to ``max`` in steps of ``step``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min: str
    max: str | None = None
    step: str | None = None


class CapacityRequestPolicy(BaseModel):
    """How much of a consumable capacity one allocation may take (only on allowMultipleAllocations devices)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    default: str
    valid_range: CapacityRequestRange = Field(alias="validRange")

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class DeviceCapacity(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # A Kubernetes quantity, always a string on the wire ("80Gi", "132").
    value: str
    request_policy: CapacityRequestPolicy | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"value": self.value}
        if self.request_policy is not None:
            wire["requestPolicy"] = self.request_policy.to_wire()
        return wire


class DeviceTaint(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    key: str
    value: str | None = None
    effect: str
    time_added: str | None = Field(default=None, alias="timeAdded")

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


class Counter(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    value: str  # a Kubernetes quantity

    def to_wire(self) -> dict[str, Any]:
        return {"value": self.value}


class CounterSet(BaseModel):
    """Named counters a pool offers (``spec.sharedCounters``); devices consume from them, so the
    scheduler never allocates devices whose consumption together exceeds a counter."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    counters: dict[str, Counter]

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "counters": {k: v.to_wire() for k, v in sorted(self.counters.items())}}


class DeviceCounterConsumption(BaseModel):
    """What a device takes from one counter set of its pool while it is allocated."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    counter_set: str = Field(alias="counterSet")
    counters: dict[str, Counter]

    def to_wire(self) -> dict[str, Any]:
        return {"counterSet": self.counter_set, "counters": {k: v.to_wire() for k, v in sorted(self.counters.items())}}


def counters(values: dict[str, str]) -> dict[str, Counter]:
    """Counter name -> quantity, as the API's map of ``Counter``."""
    return {name: Counter(value=value) for name, value in values.items()}


class Device(BaseModel):
    """One allocatable device. Attribute keys are unqualified (driver domain) or ``domain/id``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    attributes: dict[str, DeviceAttribute] = Field(default_factory=dict)
    capacity: dict[str, DeviceCapacity] = Field(default_factory=dict)
    taints: list[DeviceTaint] = Field(default_factory=list)
    # Consumable capacity (KEP-5075): many claims may hold this device at once, each a share of it.
    allow_multiple_allocations: bool = False
    # Partitionable devices (KEP-4815): counters this device takes from its pool's counter sets.
    consumes_counters: tuple[DeviceCounterConsumption, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"name": self.name}
        if self.allow_multiple_allocations:
            wire["allowMultipleAllocations"] = True
        if self.attributes:
            wire["attributes"] = {k: v.to_wire() for k, v in sorted(self.attributes.items())}
        if self.capacity:
            wire["capacity"] = {k: v.to_wire() for k, v in sorted(self.capacity.items())}
        if self.consumes_counters:
            wire["consumesCounters"] = [c.to_wire() for c in self.consumes_counters]
        if self.taints:
            wire["taints"] = [t.to_wire() for t in self.taints]
        return wire


class PlannedSlice(BaseModel):
    """What one slice of the pool holds: devices, counter sets, or (1.34's combined layout) both."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    devices: tuple[Device, ...] = ()
    shared_counters: tuple[CounterSet, ...] = ()
