"""The example claims under examples/.

Each example must be valid for the Kubernetes 1.34 and 1.36 schemas, hold exactly one claim (or
claim template) used by its pods, and select the devices it says it selects. Selection is checked by
evaluating the chart's DeviceClass selectors and the example's own CEL selectors with cel-python
against sample devices shaped like the scheduler's CEL ``device`` variable. cel-python lacks the
Kubernetes ``quantity()`` and ``semver()`` extensions, so minimal stand-ins are defined here.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from functools import total_ordering
from pathlib import Path
from typing import Any

import celpy
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
from celpy import celtypes
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError

from cdi.yamlload import load_yaml_documents
from deploy.render import render_objects

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES_DIR = REPO_ROOT / "examples" / "resourceclaims"
SHARING_PLANS_EXAMPLE = REPO_ROOT / "examples" / "sharing-plans.yaml"
KUBE_VERSIONS = ("1.34", "1.36")
DRIVER = "gpu.tessera.dev"
OTHER_DRIVER = "gpu.example.com"
CLAIM_KINDS = ("ResourceClaimTemplate", "ResourceClaim")

Obj = dict[str, Any]

# --- Kubernetes CEL extensions used by device selectors ------------------------------------------

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E|[eE][-+]?[0-9]+)?$")
_MULTIPLIERS: dict[str, Fraction] = {
    "": Fraction(1),
    "m": Fraction(1, 1000),
    **{suffix: Fraction(1024**power) for power, suffix in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"), 1)},
    **{suffix: Fraction(1000**power) for power, suffix in enumerate(("k", "M", "G", "T", "P", "E"), 1)},
}


@total_ordering
@dataclass(frozen=True, eq=True)
class Quantity:
    """Kubernetes resource.Quantity as CEL sees it: exact, ordered, compared with compareTo."""

    value: Fraction

    @classmethod
    def parse(cls, text: str) -> Quantity:
        match = _QUANTITY.fullmatch(text)
        if match is None:
            raise ValueError(f"not a Kubernetes quantity: {text!r}")
        number, suffix = match.group(1), match.group(2) or ""
        if suffix[:1] in ("e", "E"):
            return cls(Fraction(number) * Fraction(10) ** int(suffix[1:]))
        return cls(Fraction(number) * _MULTIPLIERS[suffix])

    def __lt__(self, other: Quantity) -> bool:
        return self.value < other.value


@total_ordering
@dataclass(frozen=True, eq=True)
class Semver:
    """A strict semantic version (major.minor.patch), as the semver() CEL library parses it."""

    major: int
    minor: int
    patch: int

    @classmethod
    def parse(cls, text: str) -> Semver:
        match = re.fullmatch(r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)", text)
        if match is None:
            raise ValueError(f"not a semantic version: {text!r}")
        return cls(*(int(part) for part in match.groups()))

    def __lt__(self, other: Semver) -> bool:
        return (self.major, self.minor, self.patch) < (other.major, other.minor, other.patch)


def _compare(left: Any, right: Any) -> celtypes.IntType:
    if type(left) is not type(right) or not isinstance(left, Quantity | Semver):
        raise TypeError(f"no such overload: compareTo({type(left).__name__}, {type(right).__name__})")
    return celtypes.IntType((left > right) - (left < right))


CEL_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "quantity": lambda text: Quantity.parse(str(text)),
    "semver": lambda text: Semver.parse(str(text)),
    "compareTo": _compare,
    "isGreaterThan": lambda left, right: celtypes.BoolType(_compare(left, right) > 0),
    "isLessThan": lambda left, right: celtypes.BoolType(_compare(left, right) < 0),
    "major": lambda version: celtypes.IntType(version.major),
    "minor": lambda version: celtypes.IntType(version.minor),
    "patch": lambda version: celtypes.IntType(version.patch),
}


def to_cel(value: Any) -> Any:
    if isinstance(value, Quantity | Semver):
        return value
    if isinstance(value, Mapping):
        return celtypes.MapType({celtypes.StringType(k): to_cel(v) for k, v in value.items()})
    return json_to_cel(value)


def evaluate(expression: str, device: Obj) -> Any:
    env = celpy.Environment()
    program = env.program(env.compile(expression), functions=CEL_FUNCTIONS)
    return program.evaluate({"device": to_cel(device)})


def selects(expressions: list[str], device_name: str, device: Obj) -> bool:
    """All selectors must be true; like the scheduler, stop at the first false one. Errors fail the test
    because a CEL runtime error aborts allocation of the whole claim."""
    for expression in expressions:
        try:
            result = evaluate(expression, device)
        except CELEvalError as error:
            pytest.fail(f"{expression!r} on device {device_name}: {error}")
        if not isinstance(result, celtypes.BoolType):
            pytest.fail(f"{expression!r} on device {device_name}: {result!r}")
        if not result:
            return False
    return True


# --- sample devices, shaped like the CEL `device` variable ---------------------------------------


def tessera_device(device_type: str, memory: str, **attributes: Any) -> Obj:
    return {
        "driver": DRIVER,
        "attributes": {
            DRIVER: {"type": device_type, "driverVersion": Semver(580, 95, 5), **attributes},
            "resource.kubernetes.io": {"pciBusID": "0000:3b:00.0"},
        },
        "capacity": {DRIVER: {"memory": Quantity.parse(memory)}},
    }


A100 = {"productName": "NVIDIA A100-SXM4-80GB", "architecture": "Ampere", "cudaComputeCapability": Semver(8, 0, 0)}
H100 = {"architecture": "Hopper", "cudaComputeCapability": Semver(9, 0, 0)}
T4 = {"productName": "Tesla T4", "architecture": "Turing", "cudaComputeCapability": Semver(7, 5, 0)}

SAMPLE_DEVICES: dict[str, Obj] = {
    "h100": tessera_device("gpu", "80Gi", productName="NVIDIA H100 80GB HBM3", uuid="GPU-1", **H100),
    # Synthetic: an H100 below the 40Gi bound of the CEL example.
    "h100-small": tessera_device("gpu", "32Gi", productName="NVIDIA H100 PCIe", uuid="GPU-2", **H100),
    "t4": tessera_device("gpu", "15Gi", uuid="GPU-3", **T4),
    "mig-1g10gb": tessera_device("mig", "9728Mi", profile="1g.10gb", uuid="MIG-1", parentUUID="GPU-4", **A100),
    "mig-3g40gb": tessera_device("mig", "39Gi", profile="3g.40gb", uuid="MIG-2", parentUUID="GPU-4", **A100),
    # A dynamic MIG placement (created at prepare): no MIG UUID yet, its placement instead.
    "mig-3g40gb-dynamic": tessera_device("mig", "40448Mi", profile="3g.40gb", parentUUID="GPU-9", placement=4,
                                         productName="NVIDIA H100 80GB HBM3", **H100),
    "mps-share": tessera_device(
        "mps",
        "20Gi",
        parentUUID="GPU-5",
        sharingStrategy="MPS",
        shareIndex=0,
        shareCount=4,
        activeThreadPercentage=25,
        **A100,
    ),
    "timeslice-share": tessera_device(
        "timeslice",
        "3840Mi",
        parentUUID="GPU-3",
        sharingStrategy="TimeSlicing",
        shareIndex=1,
        shareCount=4,
        timeSliceInterval="Short",
        **T4,
    ),
    # A consumable H100 (one device, many claims by capacity); MPS limits, advisory (compute mode DEFAULT).
    "consumable-share": {
        **tessera_device("consumable", "81559Mi", parentUUID="GPU-6", sharingStrategy="Consumable",
                         memoryLimitEnforcement="mps-advisory", computeLimitEnforcement="mps-advisory", **H100),
        "allowMultipleAllocations": True,
    },
    # The same on a node where MPS v3 memory partitioning makes memory a kernel-enforced limit.
    "consumable-share-kernel": {
        **tessera_device("consumable", "81559Mi", parentUUID="GPU-7", sharingStrategy="Consumable",
                         memoryLimitEnforcement="kernel", computeLimitEnforcement="mps-advisory", **H100),
        "allowMultipleAllocations": True,
    },
    "other-driver-h100": {
        "driver": OTHER_DRIVER,
        "attributes": {OTHER_DRIVER: {"type": "gpu", "productName": "NVIDIA H100 80GB HBM3"}},
        "capacity": {OTHER_DRIVER: {"memory": Quantity.parse("80Gi")}},
    },
}

WHOLE_GPUS = {"h100", "h100-small", "t4"}
EXPECTED_SELECTION: dict[str, set[str]] = {
    "gpu-whole.yaml": WHOLE_GPUS,
    "gpu-shared-two-containers.yaml": WHOLE_GPUS,
    "gpu-cel-product-memory.yaml": {"h100"},
    "mig-by-profile.yaml": {"mig-1g10gb"},
    "mig-dynamic.yaml": {"mig-3g40gb", "mig-3g40gb-dynamic"},  # by profile: a static 3g.40gb would do too
    "mps-share-from-plan.yaml": {"mps-share"},
    "timeslice-share-from-plan.yaml": {"timeslice-share"},
    "gpu-mps-per-claim.yaml": WHOLE_GPUS,
    "gpu-timeslicing-interval.yaml": WHOLE_GPUS,
    "consumable-share-small.yaml": {"consumable-share", "consumable-share-kernel"},
    "consumable-share-large.yaml": {"consumable-share", "consumable-share-kernel"},
    "consumable-share-kernel-memory.yaml": {"consumable-share-kernel"},  # only where the kernel enforces memory
    "gpu-admin-access-monitoring.yaml": WHOLE_GPUS,
}
EXPECTED_SHARING: dict[str, str] = {"gpu-mps-per-claim.yaml": "MPS", "gpu-timeslicing-interval.yaml": "TimeSlicing"}


# --- helpers over the example files --------------------------------------------------------------


def load(name: str) -> list[Obj]:
    return [o for o in load_yaml_documents((EXAMPLES_DIR / name).read_text()) if o]


def the_claim(objects: list[Obj]) -> Obj:
    claims = [o for o in objects if o["kind"] in CLAIM_KINDS]
    assert len(claims) == 1, "each example holds exactly one ResourceClaimTemplate or ResourceClaim"
    return claims[0]


def claim_spec(claim: Obj) -> Obj:
    spec: Obj = claim["spec"]["spec"] if claim["kind"] == "ResourceClaimTemplate" else claim["spec"]
    return spec


def class_selectors(objects: list[Obj]) -> dict[str, list[str]]:
    return {
        o["metadata"]["name"]: [s["cel"]["expression"] for s in o["spec"]["selectors"]]
        for o in objects
        if o["kind"] == "DeviceClass"
    }


@pytest.fixture(scope="module")
def default_classes() -> dict[str, list[str]]:
    return class_selectors(render_objects())


def request_selectors(name: str, classes: dict[str, list[str]]) -> list[str]:
    """The CEL selectors a device must pass for the example's one request: its class's, then its own."""
    (request,) = claim_spec(the_claim(load(name)))["devices"]["requests"]
    exactly = request["exactly"]
    return classes[exactly["deviceClassName"]] + [s["cel"]["expression"] for s in exactly.get("selectors", [])]


def selected_devices(expressions: list[str]) -> set[str]:
    return {name for name, device in SAMPLE_DEVICES.items() if selects(expressions, name, device)}


# --- tests ---------------------------------------------------------------------------------------


def test_every_example_file_is_checked() -> None:
    assert {p.name for p in EXAMPLES_DIR.glob("*.yaml")} == set(EXPECTED_SELECTION)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", sorted(EXPECTED_SELECTION))
def test_example_objects_are_schema_valid(name: str, version: str) -> None:
    for obj in load(name):
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("name", sorted(EXPECTED_SELECTION))
def test_example_pods_use_its_one_claim(name: str) -> None:
    text = (EXAMPLES_DIR / name).read_text()
    assert text.startswith("# "), "each example opens with a comment saying what it shows"
    objects = load(name)
    claim = the_claim(objects)
    reference = "resourceClaimTemplateName" if claim["kind"] == "ResourceClaimTemplate" else "resourceClaimName"
    pods = [o for o in objects if o["kind"] == "Pod"]
    assert pods
    # A Namespace only where admin access needs its label (test_the_admin_access_example_...).
    assert {o["kind"] for o in objects} - {"Namespace"} == {claim["kind"], "Pod"}
    for pod in pods:
        pod_claims = {c["name"]: c for c in pod["spec"]["resourceClaims"]}
        assert [c[reference] for c in pod_claims.values()] == [claim["metadata"]["name"]]
        for container in pod["spec"]["containers"]:
            assert {c["name"] for c in container["resources"]["claims"]} <= set(pod_claims)
    for request in claim_spec(claim)["devices"]["requests"]:
        assert request["name"] in ("gpu", "mig", "share")


def test_the_admin_access_example_runs_in_a_namespace_labelled_for_it() -> None:
    objects = load("gpu-admin-access-monitoring.yaml")
    (namespace,) = [o for o in objects if o["kind"] == "Namespace"]
    assert namespace["metadata"]["labels"]["resource.kubernetes.io/admin-access"] == "true"
    claim = the_claim(objects)
    (request,) = claim_spec(claim)["devices"]["requests"]
    assert request["exactly"]["adminAccess"] is True
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {
        namespace["metadata"]["name"]}
    assert all(o["kind"] != "Namespace" for name in EXPECTED_SELECTION if name != "gpu-admin-access-monitoring.yaml"
               for o in load(name)), "only admin access needs a namespace of its own"


def test_two_containers_or_two_pods_share_the_claim_where_the_example_says_so() -> None:
    shared = load("gpu-shared-two-containers.yaml")
    (pod,) = [o for o in shared if o["kind"] == "Pod"]
    assert len(pod["spec"]["containers"]) == 2
    mps = load("gpu-mps-per-claim.yaml")
    assert the_claim(mps)["kind"] == "ResourceClaim"
    assert len([o for o in mps if o["kind"] == "Pod"]) == 2


@pytest.mark.parametrize("name", sorted(EXPECTED_SELECTION))
def test_example_selects_the_expected_sample_devices(name: str, default_classes: dict[str, list[str]]) -> None:
    assert selected_devices(request_selectors(name, default_classes)) == EXPECTED_SELECTION[name]


def test_default_device_classes_split_tessera_devices_by_type(default_classes: dict[str, list[str]]) -> None:
    assert {name: selected_devices(expressions) for name, expressions in default_classes.items()} == {
        DRIVER: WHOLE_GPUS,
        f"mig.{DRIVER}": {"mig-1g10gb", "mig-3g40gb", "mig-3g40gb-dynamic"},
        f"mps.{DRIVER}": {"mps-share"},
        f"timeslice.{DRIVER}": {"timeslice-share"},
        f"consumable.{DRIVER}": {"consumable-share", "consumable-share-kernel"},
    }


def test_device_classes_of_another_driver_name_select_only_that_drivers_devices() -> None:
    classes = class_selectors(render_objects({"driverName": OTHER_DRIVER}))
    assert selected_devices(classes[OTHER_DRIVER]) == {"other-driver-h100"}
    assert selected_devices(classes[f"mig.{OTHER_DRIVER}"]) == set()


def published_devices() -> dict[str, Obj]:
    """What the driver itself publishes for a simulated node, converted to the CEL `device` shape."""
    from driver.gpu.claimcdi import kernelmemory
    from driver.gpu.published.devices import make_view
    from driver.gpu.published.sharelayout import GpuForm
    from driver.gpu.published.sharingplan import SharingPlans, resolve_layout
    from driver.simulation.discovery import SimulatedNode, build_inventory

    node = SimulatedNode.model_validate(
        {
            "gpus": [
                {"model": "H100-80GB"},
                {"model": "A100-80GB", "mig": [{"profile": "1g.10gb", "start": 0}, {"profile": "3g.40gb", "start": 4}]},
                {"model": "L4"},
                {"model": "A100-40GB"},
                {"model": "L4"},
                {"model": "H100-80GB"},
                {"model": "H100-80GB"},
            ]
        }
    )
    inventory = build_inventory("examples test node", node, "node-1")
    # gpu-6 as on a node where kernel memory limits were detected (R615, cgroup v2 with dmem, the hook).
    kernel = kernelmemory.check("615.10.01", "cpu memory dmem", "/usr/bin/nvidia-cdi-hook")
    assert kernel.available, kernel.reason
    gib = 1 << 30
    layout = {
        inventory.gpus[2].uuid: GpuForm(
            strategy="MPS", count=4, active_thread_percentage=25, memory_bytes_per_share=gib
        ),
        inventory.gpus[3].uuid: GpuForm(
            strategy="TimeSlicing", count=4, interval="Short", memory_bytes_per_share=gib
        ),
        **resolve_layout(SharingPlans.model_validate({"plans": {"c": {"gpus": [
            {"match": {"uuid": inventory.gpus[5].uuid}, "consumable": {}}]}}}).plans["c"], inventory, "c"),
        **resolve_layout(SharingPlans.model_validate({"plans": {"c": {"gpus": [
            {"match": {"uuid": inventory.gpus[6].uuid}, "consumable": {}}]}}}).plans["c"], inventory, "c",
            kernel=kernel),
    }
    devices: dict[str, Obj] = {}
    for device in make_view(inventory, layout).devices:
        wire = device.to_wire()
        attributes: dict[str, dict[str, Any]] = {}
        for key, attribute in wire.get("attributes", {}).items():
            domain, _, name = key.rpartition("/")
            ((kind, value),) = attribute.items()
            attributes.setdefault(domain or DRIVER, {})[name] = Semver.parse(value) if kind == "version" else value
        capacity = {k: Quantity.parse(v["value"]) for k, v in wire.get("capacity", {}).items()}
        devices[wire["name"]] = {"driver": DRIVER, "attributes": attributes, "capacity": {DRIVER: capacity}}
    return devices


def test_examples_select_what_the_driver_publishes(default_classes: dict[str, list[str]]) -> None:
    # Guards against examples naming attributes or values the driver does not publish.
    devices = published_devices()
    whole = {"gpu-0", "gpu-4"}
    expected = {
        "gpu-cel-product-memory.yaml": {"gpu-0"},
        "mig-by-profile.yaml": {"gpu-1-mig-1g10gb-0"},
        "mig-dynamic.yaml": {"gpu-1-mig-3g40gb-4"},
        "mps-share-from-plan.yaml": {f"gpu-2-mps-{k}" for k in range(4)},
        "timeslice-share-from-plan.yaml": {f"gpu-3-ts-{k}" for k in range(4)},
        "consumable-share-small.yaml": {"gpu-5-shared", "gpu-6-shared"},
        "consumable-share-large.yaml": {"gpu-5-shared", "gpu-6-shared"},
        "consumable-share-kernel-memory.yaml": {"gpu-6-shared"},
    }
    for name in EXPECTED_SELECTION:
        expressions = request_selectors(name, default_classes)
        selected = {n for n, device in devices.items() if selects(expressions, n, device)}
        assert selected == expected.get(name, whole), name


@pytest.mark.parametrize("name", sorted(EXPECTED_SHARING))
def test_opaque_configs_are_accepted_by_the_driver(name: str) -> None:
    from driver.gpu.claimconfig.api import GpuConfig, parse_config

    spec = claim_spec(the_claim(load(name)))
    (config,) = spec["devices"]["config"]
    assert config["requests"] == [r["name"] for r in spec["devices"]["requests"]]
    assert config["opaque"]["driver"] == DRIVER
    parsed = parse_config(config["opaque"]["parameters"])
    assert isinstance(parsed, GpuConfig)
    assert parsed.sharing is not None
    assert parsed.sharing.strategy == EXPECTED_SHARING[name]


def test_sharing_plans_example_loads_in_the_driver() -> None:
    from driver.gpu.published.sharingplan import load_plans

    plans = load_plans(SHARING_PLANS_EXAMPLE)
    assert plans.defaultPlan == "whole"
    assert set(plans.plans) == {"whole", "a100-mps4", "t4-ts", "h100-consumable", "h100-dynamic", "mig-shared"}
    assert plans.plans["h100-dynamic"].gpus[0].dynamicMig is not None
    # First match wins: the explicit whole GPU must come before the catch-all.
    first, catch_all = plans.plans["t4-ts"].gpus
    assert first.whole is True
    assert catch_all.timeSlicing is not None


def test_the_mig_sharing_example_splits_instances_of_the_demo_node() -> None:
    from driver.gpu.published.devices import make_view
    from driver.gpu.published.sharingplan import load_plans, resolve_layout
    from driver.simulation.discovery import SimulatedDiscovery

    inventory = SimulatedDiscovery("demo", "node-a").discover()
    layout = resolve_layout(load_plans(SHARING_PLANS_EXAMPLE).plans["mig-shared"], inventory, "mig-shared")
    assert [d.name for d in make_view(inventory, layout).devices] == [
        "gpu-0", *(f"gpu-1-mig-3g40gb-0-mps-{k}" for k in range(4)), "gpu-1-mig-2g20gb-4",
        "gpu-1-mig-1g10gb-6-ts-0", "gpu-1-mig-1g10gb-6-ts-1", "gpu-2"]


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("quantity('1Gi').compareTo(quantity('1024Mi')) == 0", True),
        ("quantity('1G').compareTo(quantity('1Gi')) < 0", True),
        ("quantity('1500m').compareTo(quantity('1.5')) == 0", True),
        ("quantity('2e3').compareTo(quantity('2k')) == 0", True),
        ("device.capacity['gpu.tessera.dev'].memory.compareTo(quantity('80Gi')) == 0", True),
        ("device.attributes['gpu.tessera.dev'].driverVersion.isGreaterThan(semver('580.9.0'))", True),
        ("device.attributes['gpu.tessera.dev'].cudaComputeCapability.isLessThan(semver('9.0.0'))", False),
        ("device.attributes['gpu.tessera.dev'].cudaComputeCapability.major() == 9", True),
    ],
)
def test_cel_extension_stand_ins_follow_kubernetes(expression: str, expected: bool) -> None:
    # The selection tests above are only as good as these stand-ins.
    assert evaluate(expression, SAMPLE_DEVICES["h100"]) == celtypes.BoolType(expected)


def test_cel_stand_ins_refuse_comparing_a_quantity_with_a_version() -> None:
    with pytest.raises(CELEvalError, match="no such overload"):
        evaluate("device.capacity['gpu.tessera.dev'].memory.compareTo(semver('1.0.0')) == 0", SAMPLE_DEVICES["h100"])


# --- examples/resourceclaims/README.md -----------------------------------------------------------


def test_the_readme_lists_every_example_file() -> None:
    readme = (EXAMPLES_DIR / "README.md").read_text()
    assert [name for name in sorted(EXPECTED_SELECTION) if f"]({name})" not in readme] == []


def test_the_readme_selectors_do_what_it_says_about_nominal_20gb_devices() -> None:
    readme = (EXAMPLES_DIR / "README.md").read_text()
    quarter = tessera_device("mps", "20389Mi", parentUUID="GPU-8", sharingStrategy="MPS", shareIndex=0,
                             shareCount=4, activeThreadPercentage=25, productName="NVIDIA H100 80GB HBM3", **H100)
    mig = tessera_device("mig", "20096Mi", profile="2g.20gb", uuid="MIG-3", parentUUID="GPU-9",
                         productName="NVIDIA H100 80GB HBM3", **H100)
    nominal = "device.capacity['gpu.tessera.dev'].memory.compareTo(quantity('20Gi')) >= 0"
    assert nominal in readme
    assert not selects([nominal], "quarter", quarter) and not selects([nominal], "2g.20gb", mig)
    expressions = [line.split("expression: ", 1)[1] for line in readme.splitlines()
                   if line.startswith("expression: ")]
    bound, profile, share_count = expressions
    assert selects([bound], "quarter", quarter) and selects([bound], "2g.20gb", mig)
    assert selects([profile], "2g.20gb", mig) and not selects([profile], "mig-1g10gb", SAMPLE_DEVICES["mig-1g10gb"])
    assert selects([share_count], "quarter", quarter)
