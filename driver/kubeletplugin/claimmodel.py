"""The part of a ResourceClaim a node plugin reads, as strict-enough pydantic models.

Claims are read as raw JSON and parsed here rather than through the kubernetes client's own
models, which drop fields newer than the client and differ between client versions.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _ServerObject(BaseModel):
    # Server objects carry many fields a node plugin does not need; ignore them.
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True)


class ObjectMeta(_ServerObject):
    name: str
    namespace: str = ""
    uid: str
    annotations: dict[str, str] = Field(default_factory=dict)


class OpaqueDeviceConfiguration(_ServerObject):
    driver: str
    parameters: dict[str, Any] = Field(default_factory=dict)


class DeviceAllocationConfiguration(_ServerObject):
    source: str = ""
    requests: list[str] = Field(default_factory=list)
    opaque: OpaqueDeviceConfiguration | None = None


class DeviceRequestAllocationResult(_ServerObject):
    request: str
    driver: str
    pool: str
    device: str
    admin_access: bool | None = Field(default=None, alias="adminAccess")
    share_id: str | None = Field(default=None, alias="shareID")
    consumed_capacity: dict[str, str] | None = Field(default=None, alias="consumedCapacity")

    @property
    def base_request(self) -> str:
        """The request name containers refer to: the part before '/' of a firstAvailable result."""
        return self.request.split("/", 1)[0]


class DeviceAllocationResult(_ServerObject):
    results: list[DeviceRequestAllocationResult] = Field(default_factory=list)
    config: list[DeviceAllocationConfiguration] = Field(default_factory=list)


class AllocationResult(_ServerObject):
    devices: DeviceAllocationResult | None = None


class ResourceClaimConsumerReference(_ServerObject):
    resource: str
    name: str
    uid: str
    api_group: str = Field(default="", alias="apiGroup")


class ResourceClaimStatus(_ServerObject):
    allocation: AllocationResult | None = None
    reserved_for: list[ResourceClaimConsumerReference] = Field(default_factory=list, alias="reservedFor")


class ResourceClaim(_ServerObject):
    metadata: ObjectMeta
    status: ResourceClaimStatus = Field(default_factory=ResourceClaimStatus)

    @property
    def allocation(self) -> DeviceAllocationResult | None:
        alloc = self.status.allocation
        return alloc.devices if alloc is not None else None

    @property
    def pod_uids(self) -> list[str]:
        """The pods the claim is reserved for (core group ``pods``): whose processes use its devices."""
        return [r.uid for r in self.status.reserved_for if r.resource == "pods" and r.api_group == ""]

    def results_for(self, driver_name: str) -> list[DeviceRequestAllocationResult]:
        alloc = self.allocation
        return [r for r in alloc.results if r.driver == driver_name] if alloc else []

    def configs_for(self, driver_name: str) -> list[DeviceAllocationConfiguration]:
        """Opaque configs for this driver in allocation order (class entries first, then claim)."""
        alloc = self.allocation
        if alloc is None:
            return []
        return [c for c in alloc.config if c.opaque is not None and c.opaque.driver == driver_name]
