"""SIMULATION: a minimal stand-in for the scheduler's allocator, for the demo and tests.

A real cluster's scheduler evaluates DeviceClass and request CEL selectors in full. This one
understands only what the examples need (a DeviceClass of this driver, ``count`` or
``allocationMode: All``, ``adminAccess`` (devices other claims hold, nothing taken), ``tolerations``
copied into the results, and selectors
that are conjunctions of ``device.attributes['<domain>'].<attr> == '<value>'``,
``device.attributes['<domain>'].<attr>.startsWith('<prefix>')`` and
``device.capacity['<domain>'].<name>.compareTo(quantity('<q>')) <op> 0``) and refuses anything else
loudly rather than allocating something the real scheduler would not.

Devices with ``allowMultipleAllocations`` (consumable capacity, KEP-5075) are shared: each request
consumes ``capacity.requests`` (or the policy's default), rounded up to the policy's step as the
scheduler does, and gets a ``shareID`` and ``consumedCapacity`` in its result; a device is chosen
only while what its shares consumed stays within its capacity.

Devices that consume counters (partitionable devices, KEP-4815: dynamic MIG placements and the
whole GPU beside them) are chosen only while every counter they consume is still available in
their pool's counter sets (``sharedCounters``, from any slice of the pool) after what the devices
in ``taken`` consume, as the scheduler counts them; so overlapping MIG placements, or a whole GPU
and any of its placements, are never allocated together.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from typing import Any

from driver.gpu.claimconfig.quantity import parse_quantity

Obj = dict[str, Any]

_EQUALITY = re.compile(r"""device\.attributes\['(?P<domain>[^']+)'\]\.(?P<attr>\w+)\s*==\s*['"](?P<value>[^'"]*)['"]""")
_PREFIX = re.compile(r"""device\.attributes\['(?P<domain>[^']+)'\]\.(?P<attr>\w+)"""
                     r"""\.startsWith\(['"](?P<value>[^'"]*)['"]\)""")
_CAPACITY = re.compile(r"""device\.capacity\['(?P<domain>[^']+)'\]\.(?P<name>\w+)\.compareTo\(quantity\(['"]"""
                       r"""(?P<value>[^'"]+)['"]\)\)\s*(?P<op>>=|<=|==|!=|>|<)\s*0""")
_COMPARISONS = {">=": lambda c: c >= 0, "<=": lambda c: c <= 0, "==": lambda c: c == 0, "!=": lambda c: c != 0,
                ">": lambda c: c > 0, "<": lambda c: c < 0}


class AllocationError(Exception):
    pass


def class_types(driver_name: str) -> dict[str, str]:
    """DeviceClass name -> the ``type`` attribute it selects (as the chart defines them)."""
    return {driver_name: "gpu", f"mig.{driver_name}": "mig", f"mps.{driver_name}": "mps",
            f"timeslice.{driver_name}": "timeslice", f"consumable.{driver_name}": "consumable"}


def _attribute(device: Obj, key: str) -> object:
    value = device.get("attributes", {}).get(key, {})
    return next(iter(value.values()), None) if value else None


def _term_holds(device: Obj, driver_name: str, term: str, expression: str) -> bool:
    if (m := _EQUALITY.fullmatch(term) or _PREFIX.fullmatch(term)) is not None:
        key = m["attr"] if m["domain"] == driver_name else f"{m['domain']}/{m['attr']}"
        value = _attribute(device, key)
        return str(value) == m["value"] if m.re is _EQUALITY else str(value).startswith(m["value"])
    if (m := _CAPACITY.fullmatch(term)) is not None:
        key = m["name"] if m["domain"] == driver_name else f"{m['domain']}/{m['name']}"
        have = device.get("capacity", {}).get(key, {}).get("value")
        if have is None:
            return False
        try:
            wanted = parse_quantity(m["value"], f"selector {expression!r}")
            have_value = parse_quantity(have, f"capacity {key} of {device.get('name')}")
        except ValueError as exc:
            raise AllocationError(str(exc)) from exc
        return bool(_COMPARISONS[m["op"]]((have_value > wanted) - (have_value < wanted)))
    raise AllocationError(f"the simulated allocator cannot evaluate the selector {expression!r}")


def _matches(device: Obj, driver_name: str, selectors: Iterable[Obj]) -> bool:
    for selector in selectors:
        expression = selector.get("cel", {}).get("expression", "")
        if not all(_term_holds(device, driver_name, t.strip(), expression) for t in expression.split("&&")):
            return False
    return True


def _share_amounts(device: Obj, requested: Obj) -> dict[str, int] | None:
    """What one share of a consumable ``device`` consumes for ``requested`` (name -> quantity); None if the
    request asks for a capacity the device lacks or more than its policy allows."""
    amounts: dict[str, int] = {}
    for key in requested:
        if key not in (device.get("capacity") or {}):
            return None
    for key, capacity in (device.get("capacity") or {}).items():
        policy = capacity.get("requestPolicy")
        if key in requested:
            want = parse_quantity(str(requested[key]), f"capacity.requests.{key}")
        elif policy is not None:
            want = parse_quantity(str(policy["default"]), f"requestPolicy.default of {key}")
        else:
            continue  # without a policy, an unrequested capacity is not consumed
        rng = (policy or {}).get("validRange")
        if rng is not None:
            low = parse_quantity(str(rng["min"]), "validRange.min")
            step = parse_quantity(str(rng.get("step", "1")), "validRange.step")
            want = max(want, low)
            want = low + -(-(want - low) // step) * step  # the scheduler rounds up to the step grid
            if "max" in rng and want > parse_quantity(str(rng["max"]), "validRange.max"):
                return None
        amounts[key] = want
    return amounts


def _fits(device: Obj, amounts: dict[str, int], used: dict[str, int]) -> bool:
    for key, want in amounts.items():
        total = parse_quantity(str(device["capacity"][key]["value"]), f"capacity {key}")
        if used.get(key, 0) + want > total:
            return False
    return True


CounterKey = tuple[str, str]  # (pool, counter set)


def _counter_amounts(counters: Obj, what: str) -> dict[str, int]:
    return {name: parse_quantity(str(c.get("value")), f"counter {name} of {what}") for name, c in counters.items()}


def _counters_left(slices: list[Obj], devices: list[tuple[str, Obj]],
                   taken: set[str]) -> dict[CounterKey, dict[str, int]]:
    """Each pool's counter sets less what the taken devices consume."""
    left: dict[CounterKey, dict[str, int]] = {}
    for s in slices:
        pool = s["spec"]["pool"]["name"]
        for counter_set in s["spec"].get("sharedCounters") or []:
            left[(pool, counter_set["name"])] = _counter_amounts(counter_set.get("counters") or {}, counter_set["name"])
    for pool, d in devices:
        if d["name"] in taken:
            for entry in d.get("consumesCounters") or []:
                have = left.get((pool, entry["counterSet"]), {})
                for name, amount in _counter_amounts(entry.get("counters") or {}, d["name"]).items():
                    have[name] = have.get(name, 0) - amount
    return left


def _counters_fit(pool: str, device: Obj, left: dict[CounterKey, dict[str, int]]) -> bool:
    for entry in device.get("consumesCounters") or []:
        have = left.get((pool, entry["counterSet"]))
        if have is None:  # the scheduler ignores a device whose counter set the pool lacks
            return False
        for name, amount in _counter_amounts(entry.get("counters") or {}, device["name"]).items():
            if amount > have.get(name, 0):
                return False
    return True


def allocate(claim: Obj, slices: list[Obj], driver_name: str, taken: set[str],
             consumed: dict[str, dict[str, int]] | None = None) -> Obj:
    """Return ``claim`` with ``status.allocation`` filled from free devices of ``slices``.

    ``taken`` holds device names already allocated; the chosen ones are added to it (and what they
    consume of their pool's counters counts against later choices). ``consumed``
    (device name -> capacity name -> amount) is what shares of consumable devices took so far; the
    chosen shares are added to it.
    """
    consumed = {} if consumed is None else consumed
    types = class_types(driver_name)
    devices = [(s["spec"]["pool"]["name"], d) for s in slices for d in s["spec"].get("devices", [])]
    spec = claim["spec"]["devices"]
    results: list[Obj] = []
    for request in spec.get("requests", []):
        exact = request.get("exactly")
        if exact is None:
            raise AllocationError(f"request {request['name']!r}: the simulated allocator only handles 'exactly'")
        wanted_type = types.get(exact["deviceClassName"])
        if wanted_type is None:
            raise AllocationError(f"request {request['name']!r}: unknown DeviceClass {exact['deviceClassName']!r}")
        requested = (exact.get("capacity") or {}).get("requests") or {}
        admin = exact.get("adminAccess") is True  # sees devices other claims hold; takes and consumes nothing
        every = exact.get("allocationMode") == "All"
        chosen: set[str] = set()
        for _ in range(len(devices) if every else int(exact.get("count", 1))):
            choice = None
            left = _counters_left(slices, devices, taken)
            for pool, d in devices:
                again = d["name"] in chosen if admin or every else False  # `taken` does it for the others
                if (d["name"] in taken and not admin) or again or _attribute(d, "type") != wanted_type \
                        or not _matches(d, driver_name, exact.get("selectors", [])):
                    continue
                if d.get("consumesCounters") and not admin and not _counters_fit(pool, d, left):
                    continue
                amounts = _share_amounts(d, requested) if d.get("allowMultipleAllocations") and not admin else None
                if d.get("allowMultipleAllocations") and not admin and (
                        amounts is None or not _fits(d, amounts, consumed.get(d["name"], {}))):
                    continue
                choice = (pool, d, amounts)
                break
            if choice is None and every and chosen:
                break
            if choice is None:
                raise AllocationError(f"request {request['name']!r}: no free {wanted_type} device matches")
            pool, device, amounts = choice
            chosen.add(device["name"])
            result: Obj = {"request": request["name"], "driver": driver_name, "pool": pool, "device": device["name"]}
            if exact.get("tolerations"):
                result["tolerations"] = list(exact["tolerations"])
            if admin:
                result["adminAccess"] = True
                if device.get("allowMultipleAllocations"):
                    result["shareID"] = str(uuid.uuid4())
            elif amounts is None:
                taken.add(device["name"])
            else:
                used = consumed.setdefault(device["name"], {})
                for key, want in amounts.items():
                    used[key] = used.get(key, 0) + want
                result["shareID"] = str(uuid.uuid4())
                result["consumedCapacity"] = {k: str(v) for k, v in sorted(amounts.items())}
            results.append(result)
    config = [{"source": "FromClaim", "requests": c.get("requests", []), "opaque": c["opaque"]}
              for c in spec.get("config", []) if "opaque" in c]
    allocated = dict(claim)
    allocated["status"] = {"allocation": {"devices": {"results": results, "config": config}}}
    return allocated


def claim_from_template(template: Obj, name: str, namespace: str = "default") -> Obj:
    """A ResourceClaim as the controller would create it for a pod from ``template``."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4())},
            "spec": template["spec"]["spec"]}
