"""CDI spec models: each rule of the reference loader is enforced with the offending path named,
files are parsed strictly, and the JSON written is small, stable and loads back unchanged."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from cdi import (
    ContainerEdits,
    Device,
    DeviceNode,
    Hook,
    IntelRdt,
    Mount,
    Spec,
    SpecError,
    parse_qualified_name,
    qualified_device_name,
    split_kind,
)

Wire = dict[str, Any]


def valid_wire() -> Wire:
    return {
        "cdiVersion": "0.3.0",
        "kind": "example.com/gpu",
        "devices": [
            {"name": "gpu0", "containerEdits": {"env": ["A=1"]}},
            {"name": "gpu1", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia1"}]}},
        ],
    }


def edits(wire: Wire, device: int = 0) -> Wire:
    result: Wire = wire["devices"][device]["containerEdits"]
    return result


def net_devices(*host_and_container_names: tuple[str, str]) -> Callable[[Wire], object]:
    """Set spec-level netDevices from (hostInterfaceName, name) pairs, declaring 1.1.0, which they need."""
    devices = [{"hostInterfaceName": host, "name": name} for host, name in host_and_container_names]
    return lambda w: w.update(cdiVersion="1.1.0", containerEdits={"netDevices": devices})


def clos_id(value: str) -> Callable[[Wire], object]:
    """Set a spec-level intelRdt with this closID, declaring 0.7.0, which it needs."""
    return lambda w: w.update(cdiVersion="0.7.0", containerEdits={"intelRdt": {"closID": value}})


def rejection(mutate: Callable[[Wire], object]) -> SpecError:
    wire = valid_wire()
    mutate(wire)
    with pytest.raises(SpecError) as caught:
        Spec.from_wire(wire)
    return caught.value


def test_valid_minimal_spec_parses() -> None:
    spec = Spec.from_wire(valid_wire())

    assert spec.kind == "example.com/gpu"
    assert [d.name for d in spec.devices] == ["gpu0", "gpu1"]
    assert spec.devices[1].container_edits.device_nodes[0].path == "/dev/nvidia1"


REJECTED: list[tuple[str, Callable[[Wire], object], str]] = [
    # kind: vendor and class names
    ("kind without class", lambda w: w.update(kind="example.com"), 'kind: "example.com" is not <vendor>/<class>'),
    ("empty class", lambda w: w.update(kind="example.com/"), 'kind: "example.com/": class is empty'),
    ("vendor starts with digit", lambda w: w.update(kind="1example.com/gpu"), 'vendor "1example.com" must start'),
    ("vendor starts with _", lambda w: w.update(kind="_example.com/gpu"), 'vendor "_example.com" must start'),
    ("class ends with -", lambda w: w.update(kind="example.com/gpu-"), 'class "gpu-" must end with a letter'),
    ("bad char in vendor", lambda w: w.update(kind="exa mple.com/gpu"), 'vendor "exa mple.com" may contain only'),
    ("slash in class", lambda w: w.update(kind="example.com/gpu/x"), 'class "gpu/x" may contain only'),
    ("one-letter vendor", lambda w: w.update(kind="e/gpu"), 'vendor "e" is too short'),
    # devices
    ("no devices", lambda w: w.update(devices=[]), "devices: a spec needs at least one device"),
    (
        "duplicate device",
        lambda w: w["devices"][1].update(name="gpu0"),
        'devices: device name "gpu0" is used by [0] and [1]',
    ),
    ("name starts with -", lambda w: w["devices"][0].update(name="-gpu"), 'devices[0].name: "-gpu" must start and end'),
    ("name ends with :", lambda w: w["devices"][0].update(name="gpu:"), 'devices[0].name: "gpu:" must start and end'),
    ("name with =", lambda w: w["devices"][0].update(name="a=b"), 'devices[0].name: "a=b" may contain only'),
    ("empty name", lambda w: w["devices"][0].update(name=""), "devices[0].name: device name is empty"),
    (
        "empty device edits",
        lambda w: w["devices"][1].update(containerEdits={}),
        'devices[1].containerEdits: has no edits: a device needs at least one (the loader rejects "empty device',
    ),
    ("missing device edits", lambda w: w["devices"][1].pop("containerEdits"), "devices[1].containerEdits: required"),
    # env, container and hook
    (
        "env without =",
        lambda w: edits(w).update(env=["FOO"]),
        'devices[0].containerEdits.env[0]: "FOO" is not KEY=VALUE',
    ),
    (
        "env with empty key",
        lambda w: edits(w).update(env=["A=1", "=x"]),
        'containerEdits.env[1]: "=x" is not KEY=VALUE',
    ),
    (
        "spec-level env",
        lambda w: w.update(containerEdits={"env": ["BAR"]}),
        'containerEdits.env[0]: "BAR" is not KEY=VALUE',
    ),
    (
        "hook env",
        lambda w: edits(w).update(hooks=[{"hookName": "createContainer", "path": "/bin/h", "env": ["X"]}]),
        'devices[0].containerEdits.hooks[0].env[0]: "X" is not KEY=VALUE',
    ),
    # device nodes
    (
        "node type",
        lambda w: edits(w, 1)["deviceNodes"][0].update(type="x"),
        'devices[1].containerEdits.deviceNodes[0].type: "x" is not a device node type',
    ),
    (
        "node permissions",
        lambda w: edits(w, 1)["deviceNodes"][0].update(permissions="rwx"),
        'deviceNodes[0].permissions: "rwx" is not cgroup permissions',
    ),
    (
        "node empty path",
        lambda w: edits(w, 1)["deviceNodes"][0].update(path=""),
        "devices[1].containerEdits.deviceNodes[0].path: must not be empty",
    ),
    (
        "negative major",
        lambda w: edits(w, 1)["deviceNodes"][0].update(major=-1),
        "deviceNodes[0].major: Input should be greater than or equal to 0 (got -1)",
    ),
    (
        "file mode with type bits",
        lambda w: edits(w, 1)["deviceNodes"][0].update(fileMode=0o20666),
        "deviceNodes[0].fileMode: 8630 is not permission bits",
    ),
    (
        "file mode as string",
        lambda w: edits(w, 1)["deviceNodes"][0].update(fileMode="0666"),
        'deviceNodes[0].fileMode: Input should be a valid integer (got "0666")',
    ),
    (
        "uid beyond uint32",
        lambda w: edits(w, 1)["deviceNodes"][0].update(uid=2**32),
        "deviceNodes[0].uid: Input should be less than or equal to 4294967295",
    ),
    # hooks
    (
        "unknown hook name",
        lambda w: edits(w).update(hooks=[{"hookName": "preStart", "path": "/bin/h"}]),
        'devices[0].containerEdits.hooks[0].hookName: "preStart" is not a hook name',
    ),
    (
        "hook empty path",
        lambda w: edits(w).update(hooks=[{"hookName": "prestart", "path": ""}]),
        "devices[0].containerEdits.hooks[0].path: must not be empty",
    ),
    # mounts
    (
        "mount empty hostPath",
        lambda w: edits(w).update(mounts=[{"hostPath": "", "containerPath": "/x"}]),
        "devices[0].containerEdits.mounts[0].hostPath: must not be empty",
    ),
    (
        "mount missing containerPath",
        lambda w: edits(w).update(mounts=[{"hostPath": "/x"}]),
        "devices[0].containerEdits.mounts[0].containerPath: required key is missing",
    ),
    # net devices and Intel RDT (with a version new enough for them)
    (
        "duplicate host interface",
        net_devices(("eth0", "a"), ("eth0", "b")),
        'containerEdits.netDevices: duplicate hostInterfaceName "eth0" in [0] and [1]',
    ),
    (
        "duplicate net device name",
        net_devices(("eth0", "a"), ("eth1", "a")),
        'containerEdits.netDevices: duplicate name "a" in [0] and [1]',
    ),
    ("empty net device name", net_devices(("e", "")), "containerEdits.netDevices[0].name: must not be empty"),
    ("closID with slash", clos_id("a/b"), 'containerEdits.intelRdt.closID: "a/b" is not a CLOS ID'),
    ("closID ..", clos_id(".."), 'containerEdits.intelRdt.closID: ".." is not a CLOS ID'),
    # strict parse: unknown keys and wrong types
    ("unknown top-level key", lambda w: w.update(extra="x"), "extra: unknown key"),
    (
        "misspelled additionalGIDs",
        lambda w: edits(w).update(additionalGIDs=[44]),
        "devices[0].containerEdits.additionalGIDs: unknown key",
    ),
    ("snake_case key", lambda w: w.update(cdi_version="0.3.0"), "cdi_version: unknown key"),
    ("unknown node key", lambda w: edits(w, 1)["deviceNodes"][0].update(mode=1), "deviceNodes[0].mode: unknown key"),
    ("name not a string", lambda w: w["devices"][0].update(name=5), "devices[0].name: Input should be a valid string"),
    (
        "bool as int",
        lambda w: edits(w, 1)["deviceNodes"][0].update(major=True),
        "deviceNodes[0].major: Input should be",
    ),
    ("missing cdiVersion", lambda w: w.pop("cdiVersion"), "cdiVersion: required key is missing"),
    ("unknown version", lambda w: w.update(cdiVersion="1.0.1"), 'cdiVersion: "1.0.1" is not a CDI spec version'),
]


@pytest.mark.parametrize(("mutate", "expected"), [(m, e) for _, m, e in REJECTED], ids=[c[0] for c in REJECTED])
def test_loader_rule_rejected_naming_the_field(mutate: Callable[[Wire], object], expected: str) -> None:
    error = rejection(mutate)

    assert expected in str(error)


def test_every_problem_is_reported_at_once() -> None:
    def two_problems(wire: Wire) -> None:
        edits(wire).update(env=["FOO"])
        edits(wire, 1)["deviceNodes"][0].update(type="z")

    error = rejection(two_problems)

    assert len(error.problems) == 2
    assert error.problems[0].startswith("devices[0].containerEdits.env[0]:")
    assert error.problems[1].startswith("devices[1].containerEdits.deviceNodes[0].type:")


ACCEPTED: list[tuple[str, Callable[[Wire], object]]] = [
    ("colon in device name", lambda w: w["devices"][0].update(name="gpu0:1")),
    ("one-character device name", lambda w: w["devices"][0].update(name="g")),
    ("dot in vendor only", lambda w: w.update(kind="k8s.gpu.tessera.dev/claim")),
    ("permissions none", lambda w: edits(w, 1)["deviceNodes"][0].update(permissions="none")),
    ("permissions subset", lambda w: edits(w, 1)["deviceNodes"][0].update(permissions="rw")),
    ("fifo node", lambda w: edits(w, 1)["deviceNodes"][0].update(type="p")),
    ("setgid file mode from a stat", lambda w: edits(w, 1)["deviceNodes"][0].update(fileMode=0o2666)),
    ("env value with =", lambda w: edits(w).update(env=["A=b=c", "EMPTY="])),
    ("root CLOS", clos_id("/")),
    ("empty spec-level edits", lambda w: w.update(containerEdits={})),
]


@pytest.mark.parametrize("mutate", [m for _, m in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_loader_accepts(mutate: Callable[[Wire], object]) -> None:
    wire = valid_wire()
    mutate(wire)

    Spec.from_wire(wire)


def test_duplicate_yaml_key_is_rejected() -> None:
    text = 'cdiVersion: "0.3.0"\nkind: example.com/gpu\nkind: example.com/other\ndevices: []\n'

    with pytest.raises(SpecError, match='duplicate key "kind"'):
        Spec.from_text(text)


def test_duplicate_json_key_is_rejected() -> None:
    wire = json.dumps(valid_wire())
    text = wire[:-1] + ', "kind": "example.com/gpu"}'

    with pytest.raises(SpecError, match="duplicate key"):
        Spec.from_text(text)


def test_yaml_flow_mapping_is_read_like_json() -> None:
    # Starts with "{" like JSON, but unquoted keys and values make it YAML only; the Go loader reads it.
    text = "{cdiVersion: 0.3.0, kind: example.com/gpu, devices: [{name: gpu0, containerEdits: {env: [A=1]}}]}\n"

    spec = Spec.from_text(text)

    assert spec.to_wire() == {"cdiVersion": "0.3.0", "kind": "example.com/gpu",
                              "devices": [{"name": "gpu0", "containerEdits": {"env": ["A=1"]}}]}


def test_yaml_flow_mapping_with_a_duplicate_key_is_rejected() -> None:
    text = "{cdiVersion: 0.3.0, kind: example.com/gpu, kind: example.com/other, devices: []}"

    with pytest.raises(SpecError, match=r'not valid JSON \(.*\) nor YAML \(.*duplicate key "kind"'):
        Spec.from_text(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("- a\n- b\n", "the top level must be a mapping, got list"),
        ("", "the top level must be a mapping, got NoneType"),
        ("cdiVersion: [unclosed\n", "not valid YAML or JSON"),
    ],
)
def test_unparseable_text_is_rejected(text: str, expected: str) -> None:
    with pytest.raises(SpecError, match=expected):
        Spec.from_text(text, source="spec.yaml")


def test_error_names_the_source() -> None:
    with pytest.raises(SpecError, match=r"invalid CDI spec /var/run/cdi/x\.json: "):
        Spec.from_text("[]", source="/var/run/cdi/x.json")


NVIDIA_LIKE_YAML = """\
cdiVersion: "0.7.0"
kind: k8s.gpu.tessera.dev/claim
containerEdits:
  env: ["NVIDIA_VISIBLE_DEVICES=void", "NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu"]
  deviceNodes:
  - {path: /dev/nvidiactl}
  - {path: /dev/nvidia-uvm}
  - path: /dev/nvidia-uvm-tools
    hostPath: /dev/nvidia-uvm-tools
    permissions: rwm
  mounts:
  - hostPath: /usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05
    containerPath: /usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05
    options: [ro, nosuid, nodev, rbind, rprivate]
  - hostPath: /run/nvidia-persistenced/socket
    containerPath: /run/nvidia-persistenced/socket
    options: [nosuid, nodev, rbind, rprivate, noexec]
    type: bind
  hooks:
  - hookName: createContainer
    path: /usr/bin/nvidia-cdi-hook
    args: [nvidia-cdi-hook, create-symlinks, --link, libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so]
    env: [NVIDIA_CTK_DEBUG=false]
  - hookName: createContainer
    path: /usr/bin/nvidia-cdi-hook
    args: [nvidia-cdi-hook, update-ldcache, --folder, /usr/lib/x86_64-linux-gnu]
    env: [NVIDIA_CTK_DEBUG=false]
    timeout: 30
  additionalGids: [44]
devices:
- name: 6f1c2d1e-8d0a-4c1e-9f3b-2a7f4c9e0b11-gpu-0-mig-1g10gb-3
  containerEdits:
    env: ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]
    deviceNodes:
    - {path: /dev/nvidia0}
    - {path: /dev/nvidia-caps/nvidia-cap30, type: c, major: 236, minor: 30, fileMode: 292}
    - {path: /dev/nvidia-caps/nvidia-cap31, type: c, major: 236, minor: 31, fileMode: 292, uid: 0, gid: 0}
    mounts:
    - {hostPath: /var/lib/tessera/mps/abc/pipe, containerPath: /tmp/nvidia-mps, options: [rw, nosuid, nodev, bind]}
"""


def test_nvidia_like_yaml_round_trips_through_json() -> None:
    parsed = Spec.from_text(NVIDIA_LIKE_YAML)

    text = parsed.to_json()
    reparsed = Spec.from_text(text)

    assert reparsed == parsed
    assert reparsed.to_json() == text
    device = reparsed.devices[0]
    assert device.name == "6f1c2d1e-8d0a-4c1e-9f3b-2a7f4c9e0b11-gpu-0-mig-1g10gb-3"
    assert device.container_edits.device_nodes[1].file_mode == 0o444
    assert reparsed.container_edits.additional_gids == [44]
    assert reparsed.container_edits.hooks[1].args[0] == "nvidia-cdi-hook"


def test_json_uses_wire_keys_and_leaves_out_unset_fields() -> None:
    wire = json.loads(Spec.from_text(NVIDIA_LIKE_YAML).to_json())

    assert list(wire) == ["cdiVersion", "kind", "devices", "containerEdits"]
    assert wire["containerEdits"]["additionalGids"] == [44]
    assert wire["containerEdits"]["deviceNodes"][0] == {"path": "/dev/nvidiactl"}
    assert wire["containerEdits"]["hooks"][0] == {
        "hookName": "createContainer",
        "path": "/usr/bin/nvidia-cdi-hook",
        "args": ["nvidia-cdi-hook", "create-symlinks", "--link", "libcuda.so.1::/usr/lib/x86_64-linux-gnu/libcuda.so"],
        "env": ["NVIDIA_CTK_DEBUG=false"],
    }
    assert wire["containerEdits"]["mounts"][1]["type"] == "bind"
    nodes = wire["devices"][0]["containerEdits"]["deviceNodes"]
    assert nodes[1] == {
        "path": "/dev/nvidia-caps/nvidia-cap30",
        "type": "c",
        "major": 236,
        "minor": 30,
        "fileMode": 292,
    }
    # uid/gid 0 are explicit (root inside the container), unlike unset which means "the process user".
    assert nodes[2]["uid"] == 0
    assert nodes[2]["gid"] == 0


def test_file_mode_is_written_as_a_decimal_integer() -> None:
    node = DeviceNode(path="/dev/nvidia0", type="c", major=195, minor=0, file_mode=0o666)
    spec = Spec.build("example.com/gpu", [Device(name="gpu0", container_edits=ContainerEdits(device_nodes=[node]))])

    assert '"fileMode": 438' in spec.to_json()


def test_json_is_stable_whatever_the_annotation_order() -> None:
    def build(annotations: dict[str, str]) -> str:
        device = Device(name="gpu0", annotations=annotations, container_edits=ContainerEdits(env=["A=1"]))
        return Spec.build("example.com/gpu", [device], annotations=dict(annotations)).to_json()

    assert build({"b.example.com/x": "1", "a.example.com/y": "2"}) == build(
        {"a.example.com/y": "2", "b.example.com/x": "1"}
    )


def test_explicitly_empty_schemata_is_kept() -> None:
    rdt = ContainerEdits(intel_rdt=IntelRdt(schemata=[]))
    spec = Spec.build("example.com/gpu", [Device(name="gpu0", container_edits=rdt)])

    wire = json.loads(spec.to_json())

    assert wire["devices"][0]["containerEdits"]["intelRdt"] == {"schemata": []}
    assert Spec.from_text(spec.to_json()) == spec


def test_models_built_in_python_use_snake_case_and_validate() -> None:
    hook = Hook(hook_name="createContainer", path="/usr/bin/nvidia-cdi-hook", args=["nvidia-cdi-hook", "x"])
    mount = Mount(host_path="/a", container_path="/b", options=["ro"])
    device = Device(name="gpu0", container_edits=ContainerEdits(hooks=[hook], mounts=[mount]))

    assert Spec.build("example.com/gpu", [device]).devices[0].container_edits.hooks[0].hook_name == "createContainer"
    with pytest.raises(ValidationError, match="is not a hook name"):
        Hook(hook_name="bogus", path="/x")
    with pytest.raises(ValidationError, match="must start and end"):
        Device(name="gpu0-", container_edits=ContainerEdits(env=["A=1"]))
    with pytest.raises(ValidationError, match="has no edits"):
        Device(name="gpu0", container_edits=ContainerEdits())


def test_models_are_immutable() -> None:
    spec = Spec.from_wire(valid_wire())

    with pytest.raises(ValidationError):
        spec.kind = "other.com/gpu"  # type: ignore[misc]


def test_vendor_and_class_of_a_spec() -> None:
    spec = Spec.from_wire(valid_wire() | {"kind": "k8s.gpu.tessera.dev/claim"})

    assert (spec.vendor, spec.device_class) == ("k8s.gpu.tessera.dev", "claim")


def test_from_file_reads_yaml(tmp_path: Path) -> None:
    path = tmp_path / "nvidia.yaml"
    path.write_text(NVIDIA_LIKE_YAML)

    assert Spec.from_file(path) == Spec.from_text(NVIDIA_LIKE_YAML)


def test_from_file_rejects_non_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(b"\xff\xfe{}")

    with pytest.raises(SpecError, match="not UTF-8"):
        Spec.from_file(path)


def test_qualified_device_name() -> None:
    name = qualified_device_name("k8s.gpu.tessera.dev/claim", "6f1c2d1e-gpu-0")

    assert name == "k8s.gpu.tessera.dev/claim=6f1c2d1e-gpu-0"
    with pytest.raises(ValueError, match="must start and end"):
        qualified_device_name("k8s.gpu.tessera.dev/claim", "-gpu-0")
    with pytest.raises(ValueError, match="is not <vendor>/<class>"):
        qualified_device_name("gpu.tessera.dev", "gpu-0")


@pytest.mark.parametrize(
    ("device_id", "parts"),
    [
        ("vendor.com/class=dev", ("vendor.com", "class", "dev")),
        ("vendor.com/class=0", ("vendor.com", "class", "0")),
        ("vendor1.com/class.subclass=dev1", ("vendor1.com", "class.subclass", "dev1")),
        ("yet_another-vendor2.com/c-lass_2=dev_1:2.3", ("yet_another-vendor2.com", "c-lass_2", "dev_1:2.3")),
        (
            "k8s.gpu.tessera.dev/claim=6f1c-gpu-0-mig-1g10gb-3",
            ("k8s.gpu.tessera.dev", "claim", "6f1c-gpu-0-mig-1g10gb-3"),
        ),
    ],
)
def test_parse_qualified_name(device_id: str, parts: tuple[str, str, str]) -> None:
    assert parse_qualified_name(device_id) == parts


@pytest.mark.parametrize(
    ("device_id", "expected"),
    [
        ("/dev/nvidia0", "is a path"),
        ("vendor.com/class", "is not <vendor>/<class>=<name>"),
        ("vendor.com/class=", "is not <vendor>/<class>=<name>"),
        ("=dev", "is not <vendor>/<class>=<name>"),
        ("vendor.com=dev", "is not <vendor>/<class>"),
        ("_invalid.com/class=dev", "must start with a letter"),
        ("invalid4.com/class_=dev", "must end with a letter or digit"),
        ("invalid5.com/class=-dev", "must start and end"),
        ("invalid6.com/class=dev:", "must start and end"),
        ("vendor.com/class=a=b", "may contain only"),
    ],
)
def test_parse_qualified_name_rejects(device_id: str, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        parse_qualified_name(device_id)


def test_split_kind() -> None:
    assert split_kind("nvidia.com/gpu") == ("nvidia.com", "gpu")
    with pytest.raises(ValueError, match="class is empty"):
        split_kind("nvidia.com/")
