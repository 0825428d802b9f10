"""The part of a ResourceClaim a node plugin reads, as strict-enough pydantic models.

Claims are read as raw JSON and parsed here rather than through the kubernetes client's own
models, which drop fields newer than the client and differ between client versions.
"""

from __future__ import annotations

import threading
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from driver.kubeletplugin.reservedpods import Consumer, PodReader, PodsUnreadable, ReservedPods, judge_consumers


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


class DeviceToleration(_ServerObject):
    """A toleration copied from the request into its allocation result (``tolerations``)."""

    key: str = ""
    operator: str = "Equal"  # Exists | Equal (the API's default); anything else tolerates nothing
    value: str = ""
    effect: str = ""  # empty: every effect


class DeviceRequestAllocationResult(_ServerObject):
    request: str
    driver: str
    pool: str
    device: str
    # True: a device other claims may hold, handed out for monitoring (namespaces labelled for admin access).
    admin_access: bool | None = Field(default=None, alias="adminAccess")
    tolerations: list[DeviceToleration] = Field(default_factory=list)
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


class _LazyPods:
    """A claim's pod reader and what it read. Equal to any other, so a claim's equality stays its fields'."""

    def __init__(self) -> None:
        self.reader: PodReader | None = None
        self.found: ReservedPods | None = None
        self.mutex = threading.Lock()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _LazyPods)

    def __hash__(self) -> int:
        return 0


class ResourceClaim(_ServerObject):
    metadata: ObjectMeta
    status: ResourceClaimStatus = Field(default_factory=ResourceClaimStatus)
    # Set by the claim source (ClaimFetcher) so a driver can read the claim's pods when it needs them.
    _pods: _LazyPods = PrivateAttr(default_factory=lambda: _LazyPods())

    def with_pod_reader(self, reader: PodReader) -> ResourceClaim:
        """This claim, able to read its reserved pods through ``reader`` (see :meth:`reserved_pods`)."""
        self._pods.reader = reader
        return self

    def reserved_pods(self, timeout_s: float) -> ReservedPods:
        """The consumers in ``status.reservedFor``, pods read from the API server on first use, then kept.

        Lazy, so a driver that never asks costs nothing. A claim reserved for no pod gives an answer
        without a request (and whose ``findings()`` refuse it); one that names pods but came from a
        source that cannot read them raises :class:`PodsUnreadable`, as does a failed read.
        """
        lazy = self._pods
        with lazy.mutex:
            if lazy.found is not None:
                return lazy.found
            consumers = [Consumer(r.api_group, r.resource, r.name, r.uid) for r in self.status.reserved_for]
            refs = [(self.metadata.namespace, c.name, c.uid) for c in consumers if c.is_pod]
            if refs and lazy.reader is None:
                raise PodsUnreadable("this claim source cannot read the pods the claim is reserved for")
            read = lazy.reader.read_pods(refs, timeout_s) if refs and lazy.reader is not None else []
            if len(read) != len(refs):
                raise PodsUnreadable(f"{len(read)} answers came back for the claim's {len(refs)} pods")
            lazy.found = judge_consumers(self.metadata.namespace, consumers, read)
            return lazy.found

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
