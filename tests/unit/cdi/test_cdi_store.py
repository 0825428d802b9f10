"""CDI spec files on disk: atomic replacement that never leaves a partial or temporary file,
validation before anything is written, idempotent removal, and listing for orphan cleanup."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdi import (
    ContainerEdits,
    Device,
    DeviceNode,
    Spec,
    SpecError,
    list_specs,
    read_spec,
    remove_spec,
    transient_spec_name,
    write_spec,
)

KIND = "k8s.gpu.tessera.dev/claim"
CLAIM_UID = "6f1c2d1e-8d0a-4c1e-9f3b-2a7f4c9e0b11"
FILENAME = f"k8s.gpu.tessera.dev-claim_{CLAIM_UID}.json"


def claim_spec(env_value: str = "1") -> Spec:
    node = DeviceNode(path="/dev/nvidia0", type="c", major=195, minor=0, file_mode=0o666)
    device = Device(
        name=f"{CLAIM_UID}-gpu-0",
        container_edits=ContainerEdits(env=[f"TESSERA_TEST={env_value}"], device_nodes=[node]),
    )
    return Spec.build(KIND, [device])


@pytest.fixture
def umask_077() -> Iterator[None]:
    previous = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(previous)


def test_transient_spec_name() -> None:
    assert transient_spec_name("k8s.gpu.tessera.dev", "claim", CLAIM_UID) == FILENAME
    assert transient_spec_name("vendor.com", "class", "a/b", ext=".yaml") == "vendor.com-class_a_b.yaml"


@pytest.mark.parametrize(
    ("vendor", "cls", "transient_id", "ext", "expected"),
    [
        ("vendor.com", "class", "x", ".yml", "not read by runtimes"),
        ("vendor.com", "class", "", ".json", "id is empty"),
        ("-vendor.com", "class", "x", ".json", "must start with a letter"),
        ("vendor.com", "cl ass", "x", ".json", "may contain only"),
    ],
)
def test_transient_spec_name_rejects(vendor: str, cls: str, transient_id: str, ext: str, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        transient_spec_name(vendor, cls, transient_id, ext=ext)


def test_write_creates_directory_and_a_loadable_file(tmp_path: Path) -> None:
    directory = tmp_path / "run" / "cdi"
    spec = claim_spec()

    path = write_spec(directory, FILENAME, spec)

    assert path == directory / FILENAME
    assert read_spec(path) == spec
    assert os.listdir(directory) == [FILENAME]
    assert stat.S_IMODE(directory.stat().st_mode) & 0o755 == stat.S_IMODE(directory.stat().st_mode)


def test_written_file_is_0644_whatever_the_umask(tmp_path: Path, umask_077: None) -> None:
    path = write_spec(tmp_path, FILENAME, claim_spec())

    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_a_created_spec_directory_is_0755_whatever_the_umask(tmp_path: Path, umask_077: None) -> None:
    write_spec(tmp_path / "cdi", FILENAME, claim_spec())

    assert stat.S_IMODE((tmp_path / "cdi").stat().st_mode) == 0o755


def test_written_file_is_the_json_wire_form(tmp_path: Path) -> None:
    path = write_spec(tmp_path, FILENAME, claim_spec())

    raw = path.read_text()
    wire = json.loads(raw)

    assert wire["cdiVersion"] == "0.5.0"
    assert wire["devices"][0]["containerEdits"]["deviceNodes"][0]["fileMode"] == 438
    assert '"fileMode": 438' in raw


def test_write_replaces_the_previous_content(tmp_path: Path) -> None:
    write_spec(tmp_path, FILENAME, claim_spec("old"))

    write_spec(tmp_path, FILENAME, claim_spec("new"))

    assert read_spec(tmp_path / FILENAME) == claim_spec("new")
    assert os.listdir(tmp_path) == [FILENAME]


def test_temporary_name_is_one_runtimes_skip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    renames: list[tuple[str, str]] = []
    real_replace = os.replace

    def recording_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        renames.append((os.fspath(src), os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", recording_replace)

    write_spec(tmp_path, FILENAME, claim_spec())

    [(src, dst)] = renames
    assert Path(src).parent == tmp_path
    assert Path(src).name.startswith(".")
    assert src.endswith(".tmp")
    assert dst == str(tmp_path / FILENAME)


@pytest.mark.parametrize("failing", ["fdatasync", "fchmod", "replace"])
def test_failed_write_keeps_the_old_file_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    write_spec(tmp_path, FILENAME, claim_spec("old"))
    old_bytes = (tmp_path / FILENAME).read_bytes()

    def broken(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, failing, broken)

    with pytest.raises(OSError, match="No space left"):
        write_spec(tmp_path, FILENAME, claim_spec("new"))

    assert (tmp_path / FILENAME).read_bytes() == old_bytes
    assert os.listdir(tmp_path) == [FILENAME]


def test_failed_first_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", broken)

    with pytest.raises(OSError):
        write_spec(tmp_path, FILENAME, claim_spec())

    assert os.listdir(tmp_path) == []


def test_invalid_spec_never_reaches_disk(tmp_path: Path) -> None:
    write_spec(tmp_path, FILENAME, claim_spec("old"))
    old_bytes = (tmp_path / FILENAME).read_bytes()
    spec = claim_spec("new")
    # Frozen models still hold mutable lists: the check must cover what is actually written.
    spec.devices[0].container_edits.env.append("NOT_KEY_VALUE")

    with pytest.raises(SpecError, match=r'devices\[0\]\.containerEdits\.env\[1\]: "NOT_KEY_VALUE"'):
        write_spec(tmp_path, FILENAME, spec)

    assert (tmp_path / FILENAME).read_bytes() == old_bytes
    assert os.listdir(tmp_path) == [FILENAME]


def test_spec_declaring_too_old_a_version_is_not_written(tmp_path: Path) -> None:
    directory = tmp_path / "cdi"
    too_old = claim_spec().model_copy(update={"cdi_version": "0.3.0"})

    with pytest.raises(SpecError, match=r'cdiVersion: "0\.3\.0" is older than 0\.5\.0'):
        write_spec(directory, FILENAME, too_old)

    assert not directory.exists()


@pytest.mark.parametrize("filename", ["", "..", "../escape.json", "sub/x.json", "spec.yml", "spec.json.tmp", "spec"])
def test_write_rejects_names_runtimes_would_not_read(tmp_path: Path, filename: str) -> None:
    with pytest.raises(ValueError, match="spec file name"):
        write_spec(tmp_path / "cdi", filename, claim_spec())

    assert not (tmp_path / "cdi").exists()
    assert not (tmp_path / "escape.json").exists()


def test_yaml_extension_is_accepted(tmp_path: Path) -> None:
    path = write_spec(tmp_path, "vendor.com-class_x.yaml", claim_spec())

    assert read_spec(path) == claim_spec()


def test_remove_is_idempotent(tmp_path: Path) -> None:
    write_spec(tmp_path, FILENAME, claim_spec())

    assert remove_spec(tmp_path, FILENAME) is True
    assert os.listdir(tmp_path) == []
    assert remove_spec(tmp_path, FILENAME) is False
    assert remove_spec(tmp_path / "missing", FILENAME) is False


def test_remove_rejects_a_path_outside_the_directory(tmp_path: Path) -> None:
    (tmp_path / "keep.json").write_text("{}")

    with pytest.raises(ValueError, match="plain file name"):
        remove_spec(tmp_path / "cdi", "../keep.json")

    assert (tmp_path / "keep.json").exists()


def test_read_spec_names_the_file_and_the_problem(tmp_path: Path) -> None:
    path = tmp_path / FILENAME
    path.write_text(json.dumps({"cdiVersion": "0.3.0", "kind": KIND, "devices": [{"name": "gpu-0"}]}))

    with pytest.raises(SpecError) as caught:
        read_spec(path)

    assert str(path) in str(caught.value)
    assert caught.value.problems == ("devices[0].containerEdits: required key is missing",)


def test_read_spec_of_a_missing_file_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        read_spec(tmp_path / FILENAME)


def test_list_specs_returns_only_matching_regular_spec_files(tmp_path: Path) -> None:
    prefix = "k8s.gpu.tessera.dev-claim_"
    wanted = [f"{prefix}b.json", f"{prefix}a.yaml", f"{prefix}c.json"]
    for name in [*wanted, f"{prefix}d.yml", f"{prefix}e.json.tmp", f".{prefix}f.json.x1.tmp", "other-claim_a.json"]:
        (tmp_path / name).write_text("{}")
    (tmp_path / f"{prefix}dir.json").mkdir()
    (tmp_path / f"{prefix}link.json").symlink_to(tmp_path / wanted[0])

    found = list_specs(tmp_path, prefix)

    assert found == sorted(tmp_path / name for name in wanted)


def test_list_specs_of_a_missing_directory_is_empty(tmp_path: Path) -> None:
    assert list_specs(tmp_path / "missing", "x") == []


def test_list_specs_finds_what_write_spec_wrote(tmp_path: Path) -> None:
    write_spec(tmp_path, FILENAME, claim_spec())

    assert list_specs(tmp_path, "k8s.gpu.tessera.dev-claim_") == [tmp_path / FILENAME]
