"""Planning a node-local pool's ResourceSlices: pure functions, no I/O, no logging.

Two steps, as in ``k8s.io/dynamic-resource-allocation/resourceslice`` (resource-api reference,
section 5):

* :func:`plan_slices`: devices, the pool's counter sets and the server's release -> the desired
  slices. The devices and counters are checked first (:mod:`.slicevalidation`,
  :mod:`.slicecounters`), then laid out (:mod:`.slicelayout`: in order, each slice filled up to
  the cap that applies to it (:mod:`.slicelimits`); counter sets split or combined by release) and
  each slice checked against the per-slice counter limits.
* :func:`slice_writes`: desired slices and what the server holds -> the writes that make them
  match (:class:`SliceWrites`), by the pool-generation rules: pool name = node name,
  ``spec.nodeName`` = node, slices owned by the Node; slice names from ``generateName``
  ``<index as 5+ hex digits>-<driver>-<node>-`` (1.36 form), existing slices matched to desired
  ones by that index; the generation kept when nothing is created and at most one slice changes
  (one update is atomic), otherwise bumped with every slice rewritten; obsolete slices deleted
  first, then changed ones updated with a full PUT, then missing ones created.

:func:`dropped_fields` explains a stored slice that differs from what was sent.
:mod:`.slicepublisher` does the I/O.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from driver.kubeletplugin.slicecounters import validate_consumption, validate_counter_sets, validate_slice_counters
from driver.kubeletplugin.slicelayout import device_cap, layout_slices
from driver.kubeletplugin.slicelimits import SliceLimits
from driver.kubeletplugin.slicemodel import CounterSet, Device, PlannedSlice
from driver.kubeletplugin.slicevalidation import quantity_value, validate_devices

Obj = dict[str, Any]

# The apiserver keeps the first 58 characters of generateName, then adds 5 random ones.
_GENERATE_NAME_KEPT = 58
_GENERATED_SUFFIX_LENGTH = 5
_INDEX_PREFIX = re.compile(r"^([0-9a-f]{5,})-")
# When a field is missing from what the server stored, the feature gate that is likely off.
_FEATURE_GATE_OF_FIELD = {
    "taints": "DRADeviceTaints",
    "consumesCounters": "DRAPartitionableDevices",
    "sharedCounters": "DRAPartitionableDevices",
    "perDeviceNodeSelection": "DRAPartitionableDevices",
    "bindsToNode": "DRADeviceBindingConditions",
    "bindingConditions": "DRADeviceBindingConditions",
    "bindingFailureConditions": "DRADeviceBindingConditions",
    "allowMultipleAllocations": "DRAConsumableCapacity",
    "requestPolicy": "DRAConsumableCapacity",
    "ints": "DRAListTypeAttributes",
    "bools": "DRAListTypeAttributes",
    "strings": "DRAListTypeAttributes",
    "versions": "DRAListTypeAttributes",
}


class InvalidDevices(ValueError):
    """The devices would make the API server reject, or the scheduler ignore, the pool."""

    def __init__(self, problems: Sequence[str]):
        super().__init__("; ".join(problems))
        self.problems = list(problems)


# ----- devices -> slices -----------------------------------------------------------------------


def plan_slices(devices: Sequence[Device], driver_name: str, limits: SliceLimits,
                counter_sets: Sequence[CounterSet] = ()) -> list[PlannedSlice]:
    """The slices to publish for ``devices`` and the pool's ``counter_sets`` (:mod:`.slicelayout`);
    :class:`InvalidDevices` lists every problem at once, before and after the layout."""
    problems = validate_devices(devices, driver_name, limits)
    problems += validate_counter_sets(counter_sets, limits)
    problems += validate_consumption(devices, counter_sets, limits)
    if problems:
        raise InvalidDevices(problems)
    slices = layout_slices(devices, counter_sets, limits)
    for index, planned in enumerate(slices):
        problems += validate_slice_counters(index, planned, limits)
        cap = device_cap(planned.devices, limits)
        if len(planned.devices) > cap:
            # Only a 1.34 counter set's slice can get here: its devices cannot move to another slice.
            problems.append(f"slice {index}: {len(planned.devices)} devices share its counter sets, the limit is "
                            f"{cap} devices per slice on Kubernetes 1.{limits.minor_version}")
    if problems:
        raise InvalidDevices(problems)
    return slices


# ----- slices -> writes ------------------------------------------------------------------------


def slice_name_prefix(index: int, driver_name: str, node_name: str) -> str:
    """``generateName`` of the slice at ``index`` (the Go helper's 1.36+ naming)."""
    return f"{index:05x}-{driver_name}-{node_name}-"


def slice_index(name: str, driver_name: str, node_name: str) -> int | None:
    """The index encoded in a slice name made from :func:`slice_name_prefix`, else None."""
    match = _INDEX_PREFIX.match(name)
    if match is None:
        return None
    index = int(match.group(1), 16)
    expected = slice_name_prefix(index, driver_name, node_name)[:_GENERATE_NAME_KEPT]
    generated = name[:-_GENERATED_SUFFIX_LENGTH]
    return index if generated == expected and len(name) == len(expected) + _GENERATED_SUFFIX_LENGTH else None


def canonical_spec(spec: Obj) -> str:
    """A comparable form of a slice spec: absent ``devices`` / ``sharedCounters`` = empty, quantities by value."""
    normal = copy.deepcopy(spec)
    normal["devices"] = normal.get("devices") or []
    if not normal.get("sharedCounters"):
        normal.pop("sharedCounters", None)
    values: list[Obj] = []
    for device in normal["devices"]:
        values.extend((device.get("capacity") or {}).values())
        values.extend(c for entry in device.get("consumesCounters") or []
                      for c in (entry.get("counters") or {}).values())
    values.extend(c for counter_set in normal.get("sharedCounters") or []
                  for c in (counter_set.get("counters") or {}).values())
    for holder in values:
        value = quantity_value(str(holder.get("value", "")))
        if value is not None:
            holder["value"] = str(value.normalize())
    return json.dumps(normal, sort_keys=True)


def missing_fields(sent: Any, stored: Any, path: str = "spec") -> list[str]:
    """Paths of what was sent but is absent or different in what the server stored.

    List positions are written ``[*]`` so one dropped field of many devices is named once.
    """
    if isinstance(sent, dict) and isinstance(stored, dict):
        found: list[str] = []
        for key, value in sent.items():
            if key not in stored:
                found.append(f"{path}.{key}")
            else:
                found.extend(missing_fields(value, stored[key], f"{path}.{key}"))
        return list(dict.fromkeys(found))
    if isinstance(sent, list) and isinstance(stored, list) and len(sent) == len(stored):
        nested = [p for s, t in zip(sent, stored, strict=True) for p in missing_fields(s, t, f"{path}[*]")]
        return list(dict.fromkeys(nested))
    return [] if sent == stored else [path]


@dataclass(frozen=True)
class SliceWrites:
    """The writes that make the server match the desired slices, in the order to apply them."""

    generation: int
    deletes: list[Obj] = field(default_factory=list)
    updates: list[Obj] = field(default_factory=list)
    creates: list[Obj] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.deletes or self.updates or self.creates)


def slice_writes(existing: Sequence[Obj], desired: Sequence[PlannedSlice], *, driver_name: str, node_name: str,
              owner: Obj | None, adopted: Mapping[str, str]) -> SliceWrites:
    """Compare the slices on the server with the desired ones (generation rules of section 5.3).

    ``adopted`` maps the canonical spec we sent to the canonical spec the server stored
    instead, so a difference the server insists on is not written again.
    """
    def in_pool(slice_: Obj) -> bool:
        return bool(slice_.get("spec", {}).get("pool", {}).get("name") == node_name)

    ours = [s for s in existing if in_pool(s)]
    top = max((int(s["spec"]["pool"].get("generation", 0)) for s in ours), default=0)
    matched: dict[int, Obj] = {}
    obsolete = [s for s in existing if not in_pool(s)]
    by_preference = sorted(ours, key=lambda s: (-int(s["spec"]["pool"].get("generation", 0)), s["metadata"]["name"]))
    for candidate in by_preference:
        index = slice_index(candidate["metadata"]["name"], driver_name, node_name)
        generation = int(candidate["spec"]["pool"].get("generation", 0))
        if index is None or index >= len(desired) or index in matched or generation < top:
            obsolete.append(candidate)
        else:
            matched[index] = candidate

    def spec_at(index: int, generation: int) -> Obj:
        current = matched.get(index)
        return _desired_spec(desired[index], generation=generation, count=len(desired), driver_name=driver_name,
                             node_name=node_name, existing_spec=current["spec"] if current else None)

    def differs(index: int) -> bool:
        current = matched[index]
        wanted = canonical_spec(spec_at(index, top))
        have = canonical_spec(current["spec"])
        return (have != wanted and adopted.get(wanted) != have) or not _owned_by(current, owner)

    missing = [i for i in range(len(desired)) if i not in matched]
    changed = [i for i in sorted(matched) if differs(i)]
    generation = top if not missing and len(changed) <= 1 else top + 1
    rewrite = changed if generation == top else sorted(matched)
    return SliceWrites(
        generation=generation,
        deletes=obsolete,
        updates=[_update_body(matched[i], spec_at(i, generation), owner) for i in rewrite],
        creates=[_create_body(slice_name_prefix(i, driver_name, node_name), spec_at(i, generation), owner)
                 for i in missing],
    )


def _desired_spec(planned: PlannedSlice, *, generation: int, count: int, driver_name: str, node_name: str,
                  existing_spec: Obj | None) -> Obj:
    wire = [d.to_wire() for d in planned.devices]
    if existing_spec is not None:
        _keep_taint_times(wire, existing_spec)
    spec: Obj = {
        "driver": driver_name,
        "nodeName": node_name,
        "pool": {"name": node_name, "generation": generation, "resourceSliceCount": count},
    }
    # A counters-only slice leaves devices out (1.35+ reads an empty list the same; on 1.34 only a dynamic GPU all of
    # whose placements someone else's instance covers gives one, which the strict 1.34 schema accepts).
    if wire or not planned.shared_counters:
        spec["devices"] = wire
    if planned.shared_counters:
        spec["sharedCounters"] = [s.to_wire() for s in planned.shared_counters]
    return spec


def _keep_taint_times(devices: list[Obj], existing_spec: Obj) -> None:
    # The server stamps timeAdded on taints that lack it; sending it back keeps the taint the same.
    stamped = {
        (d.get("name"), t.get("key"), t.get("value"), t.get("effect")): t["timeAdded"]
        for d in existing_spec.get("devices") or [] for t in d.get("taints") or [] if t.get("timeAdded")
    }
    for device in devices:
        for taint in device.get("taints", []):
            key = (device["name"], taint.get("key"), taint.get("value"), taint.get("effect"))
            if "timeAdded" not in taint and key in stamped:
                taint["timeAdded"] = stamped[key]


def _owned_by(slice_: Obj, owner: Obj | None) -> bool:
    if owner is None:
        return True
    return any(ref.get("uid") == owner["uid"] for ref in slice_["metadata"].get("ownerReferences") or [])


def _create_body(generate_name: str, spec: Obj, owner: Obj | None) -> Obj:
    metadata: Obj = {"generateName": generate_name}
    if owner is not None:
        metadata["ownerReferences"] = [owner]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": metadata, "spec": spec}


def _update_body(current: Obj, spec: Obj, owner: Obj | None) -> Obj:
    # Like the Go controller: the existing object's metadata (labels, resourceVersion for the
    # conflict check) with our spec. managedFields left out means "unchanged" to the server.
    metadata = copy.deepcopy(current["metadata"])
    metadata.pop("managedFields", None)
    if owner is not None:
        others = [r for r in metadata.get("ownerReferences") or [] if r.get("kind") != "Node"]
        metadata["ownerReferences"] = [*others, owner]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": metadata, "spec": spec}


def dropped_fields(sent_spec: Obj, stored_spec: Obj) -> tuple[list[str], list[str]]:
    """What the server dropped or changed of ``sent_spec`` (by canonical comparison), and the
    feature gates that are probably off because of it. Both empty when the server only added
    defaults."""
    dropped = missing_fields(json.loads(canonical_spec(sent_spec)), json.loads(canonical_spec(stored_spec)))
    gates = sorted({_FEATURE_GATE_OF_FIELD[p.rsplit(".", 1)[-1]] for p in dropped
                    if p.rsplit(".", 1)[-1] in _FEATURE_GATE_OF_FIELD})
    return dropped, gates
