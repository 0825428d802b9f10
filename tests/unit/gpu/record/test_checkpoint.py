"""CheckpointStore: the envelope format, forward compatibility, corrupt files, atomic saves, the re-read cache."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import pytest

from cdi import atomicswap
from driver.gpu.claimconfig.choices import DeviceKind
from driver.gpu.discovery.inventory import ComputeMode
from driver.gpu.record.checkpoint import (
    CHECKPOINT_VERSION,
    Checkpoint,
    CheckpointCorrupt,
    CheckpointStore,
    ClaimPhase,
    ClaimRecord,
    PreparedDeviceRecord,
)
from driver.kubeletplugin.types import PreparedDevice

GPU = "GPU-11111111-2222-3333-4444-555555555555"
CORRUPT_NAME = re.compile(r"^checkpoint\.json\.corrupt-\d{8}T\d{6}$")


def _claim(uid: str = "uid-1", phase: ClaimPhase = ClaimPhase.PREPARE_COMPLETED) -> ClaimRecord:
    device = PreparedDevice(request_names=["gpu"], pool_name="node-a", device_name="gpu-0",
                            cdi_device_ids=[f"k8s.gpu.tessera.dev/claim={uid}-gpu-0"])
    return ClaimRecord(uid=uid, namespace="default", name="claim", phase=phase,
                       devices=[PreparedDeviceRecord(device=device, kind="gpu", gpu_uuid=GPU, gpu_minor=0)],
                       cdi_spec_file=f"k8s.gpu.tessera.dev-claim_{uid}.json")


def _checkpoint(*uids: str) -> Checkpoint:
    return Checkpoint(boot_id="boot-1", claims={uid: _claim(uid) for uid in uids})


def _sha(data: Any) -> str:
    # The documented on-disk rule: sha256 of the canonical JSON of the parsed ``data`` object.
    return "sha256:" + hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _write_envelope(path: Path, data: Any, version: Any = CHECKPOINT_VERSION, checksum: str | None = None) -> None:
    envelope = {"version": version, "checksum": _sha(data) if checksum is None else checksum, "data": data}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(envelope))


def _set_aside_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if ".corrupt-" in p.name)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "checkpoint.json"


def test_missing_file_loads_as_an_empty_checkpoint(path: Path) -> None:
    cp = CheckpointStore(path).load()
    assert cp.claims == {} and cp.mps_daemons == {} and cp.boot_id is None
    assert not path.exists()


def test_save_then_load_round_trips_in_a_fresh_store(path: Path) -> None:
    original = _checkpoint("a", "b")
    CheckpointStore(path).save(original)
    loaded = CheckpointStore(path).load()
    assert loaded == original
    assert loaded.claims["a"].devices[0].device.device_name == "gpu-0"


def test_saved_file_is_the_documented_envelope(path: Path) -> None:
    CheckpointStore(path).save(_checkpoint("a"))
    envelope = json.loads(path.read_text())
    assert set(envelope) == {"version", "checksum", "data"}
    assert envelope["version"] == CHECKPOINT_VERSION
    assert envelope["checksum"] == _sha(envelope["data"])
    assert envelope["data"]["claims"]["a"]["phase"] == "PrepareCompleted"


def test_saved_file_is_private_to_the_driver(path: Path) -> None:
    CheckpointStore(path).save(_checkpoint("a"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_fields_from_a_newer_driver_are_ignored(path: Path) -> None:
    data = _checkpoint("a").model_dump(mode="json")
    data["future_top_level"] = {"anything": [1, 2]}
    data["claims"]["a"]["future_claim_field"] = "x"
    data["claims"]["a"]["devices"][0]["future_device_field"] = 7
    _write_envelope(path, data)
    loaded = CheckpointStore(path).load()
    assert loaded.claims["a"].uid == "a"
    assert loaded.claims["a"].devices[0].gpu_uuid == GPU
    assert path.exists(), "a valid newer checkpoint must not be set aside"


def test_a_newer_version_number_with_known_fields_still_loads(path: Path) -> None:
    _write_envelope(path, _checkpoint("a").model_dump(mode="json"), version=CHECKPOINT_VERSION + 1)
    assert set(CheckpointStore(path).load().claims) == {"a"}


def _valid_data() -> dict[str, Any]:
    return _checkpoint("a").model_dump(mode="json")


def _bad_json(path: Path) -> None:
    path.write_text("{not json")


def _truncated(path: Path) -> None:
    CheckpointStore(path).save(_checkpoint("a"))
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])


def _checksum_mismatch(path: Path) -> None:
    data = _valid_data()
    checksum = _sha(data)
    data["claims"]["a"]["name"] = "tampered"
    _write_envelope(path, data, checksum=checksum)


def _version_is_a_string(path: Path) -> None:
    _write_envelope(path, _valid_data(), version="1")


def _version_zero(path: Path) -> None:
    _write_envelope(path, _valid_data(), version=0)


def _data_missing(path: Path) -> None:
    path.write_text(json.dumps({"version": 1, "checksum": "sha256:x"}))


def _not_an_object(path: Path) -> None:
    path.write_text("[1, 2, 3]")


def _data_does_not_validate(path: Path) -> None:
    data = _valid_data()
    data["claims"]["a"]["phase"] = "Halfway"  # correct checksum, but not a known phase
    _write_envelope(path, data)


def _empty_file(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("corrupt", [_bad_json, _truncated, _checksum_mismatch, _version_is_a_string, _version_zero,
                                     _data_missing, _not_an_object, _data_does_not_validate, _empty_file])
def test_corrupt_file_is_set_aside_and_reported(path: Path, corrupt: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    corrupt(path)
    before = path.read_bytes()
    store = CheckpointStore(path)
    with pytest.raises(CheckpointCorrupt) as info:
        store.load()
    assert info.value.reason
    aside = info.value.set_aside
    assert CORRUPT_NAME.match(aside.name), aside.name
    assert aside.parent == path.parent
    assert aside.read_bytes() == before, "the set-aside file keeps the original bytes for a post-mortem"
    assert not path.exists()
    # After setting it aside the store starts over: the next load is an empty checkpoint, not a crash loop.
    assert store.load().claims == {}


def test_checksum_mismatch_reason_says_so(path: Path) -> None:
    path.parent.mkdir(parents=True)
    _checksum_mismatch(path)
    with pytest.raises(CheckpointCorrupt, match="checksum"):
        CheckpointStore(path).load()


def test_invalid_version_reason_names_the_version(path: Path) -> None:
    path.parent.mkdir(parents=True)
    _version_is_a_string(path)
    with pytest.raises(CheckpointCorrupt, match="version"):
        CheckpointStore(path).load()


def test_save_leaves_only_the_file_and_its_swap_companion(path: Path) -> None:
    store = CheckpointStore(path)
    store.save(_checkpoint("a"))
    store.save(_checkpoint("a", "b"))
    store.save(_checkpoint("c"))
    # The companion holds the previous content, ready to be overwritten by the next save (cdi/atomicswap.py).
    assert sorted(p.name for p in path.parent.iterdir()) == [".checkpoint.json.swap.tmp", "checkpoint.json"]
    assert set(CheckpointStore(path).load().claims) == {"c"}
    assert stat.S_IMODE((path.parent / ".checkpoint.json.swap.tmp").stat().st_mode) == 0o600


def test_save_without_a_swapping_kernel_renames_and_leaves_no_temporary_file(
        path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(atomicswap, "_RENAMEAT2", None)  # Linux before 3.15, or a file system without it
    store = CheckpointStore(path)
    store.save(_checkpoint("a"))
    store.save(_checkpoint("a", "b"))
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.json"]
    assert set(CheckpointStore(path).load().claims) == {"a", "b"}


def test_failed_write_keeps_the_old_file_and_the_cache(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = CheckpointStore(path)
    store.save(_checkpoint("old"))
    before = path.read_bytes()

    def refuse(fd: int) -> None:
        raise OSError("simulated fdatasync failure")

    monkeypatch.setattr(os, "fdatasync", refuse)
    with pytest.raises(OSError, match="simulated fdatasync failure"):
        store.save(_checkpoint("new"))
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert set(CheckpointStore(path).load().claims) == {"old"}
    assert set(store.load().claims) == {"old"}, "the failed save must not poison this store's cache"


def test_write_by_another_store_is_seen_on_next_load(path: Path) -> None:
    first, second = CheckpointStore(path), CheckpointStore(path)
    first.save(_checkpoint("a"))
    assert set(first.load().claims) == {"a"}
    second.save(_checkpoint("a", "b"))  # another plugin process during a rolling update
    assert set(first.load().claims) == {"a", "b"}
    second.save(_checkpoint())
    assert first.load().claims == {}


def test_file_removed_behind_the_store_loads_empty(path: Path) -> None:
    store = CheckpointStore(path)
    store.save(_checkpoint("a"))
    path.unlink()
    assert store.load().claims == {}


def test_loaded_checkpoint_is_a_private_copy(path: Path) -> None:
    store = CheckpointStore(path)
    store.save(_checkpoint("a"))
    mine = store.load()
    mine.claims["a"].phase = ClaimPhase.PREPARE_STARTED
    mine.claims.pop("a")
    again = store.load()
    assert again.claims["a"].phase == ClaimPhase.PREPARE_COMPLETED


def test_saved_checkpoint_mutated_afterwards_does_not_change_what_loads(path: Path) -> None:
    store = CheckpointStore(path)
    cp = _checkpoint("a")
    store.save(cp)
    cp.claims.clear()
    assert set(store.load().claims) == {"a"}


def test_claim_record_lists_its_gpus() -> None:
    assert _claim().gpu_uuids == {GPU}


def test_a_device_kind_is_saved_as_its_type_attribute_and_loads_as_the_kind(path: Path) -> None:
    CheckpointStore(path).save(_checkpoint("a"))
    saved = json.loads(path.read_text())["data"]["claims"]["a"]["devices"][0]
    assert saved["kind"] == "gpu" and type(saved["kind"]) is str
    assert CheckpointStore(path).load().claims["a"].devices[0].kind is DeviceKind.GPU


def test_a_daemons_claims_are_those_that_started_it_or_share_it() -> None:
    cp = _checkpoint("own", "share-a", "share-b", "none")
    cp.claims["own"].owned_mps_daemons.append("claim-1")
    cp.claims["share-a"].shared_mps_daemons.append("plan-1")
    cp.claims["share-b"].shared_mps_daemons.append("plan-1")
    assert cp.claims["own"].mps_daemon_ids == ["claim-1"]
    assert [c.uid for c in cp.claims_using("claim-1")] == ["own"]
    assert [c.uid for c in cp.claims_using("plan-1")] == ["share-a", "share-b"]
    assert cp.claims_using("plan-2") == []


def test_a_second_corruption_in_the_same_second_keeps_the_first_evidence(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoint.json")
    for content in ("{first", "{second"):
        store.path.write_text(content)
        with pytest.raises(CheckpointCorrupt):
            store.load()
    kept = sorted(p.read_text() for p in tmp_path.glob("checkpoint.json.corrupt-*"))
    assert kept == ["{first", "{second"]


def test_peek_reads_without_side_effects(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoint.json")
    assert store.peek() is None
    store.save(Checkpoint(boot_id="b"))
    peeked = store.peek()
    assert peeked is not None and peeked.boot_id == "b"
    store.path.write_text("{bad")
    with pytest.raises(ValueError):
        store.peek()
    assert store.path.read_text() == "{bad"


def test_shared_reads_reuse_the_parsed_checkpoint_until_another_writer_changes_the_file(path: Path) -> None:
    store = CheckpointStore(path)
    store.save(_checkpoint("u1"))
    first = store.load(shared=True)
    assert store.load(shared=True) is first, "unchanged file: no re-read, no copy"
    private = store.load()
    private.claims.clear()
    assert store.load(shared=True).claims.keys() == {"u1"}, "a private copy's changes stay private"
    CheckpointStore(path).save(_checkpoint("u1", "u2"))  # the other plugin pod of a rolling update
    assert store.load(shared=True).claims.keys() == {"u1", "u2"}


def test_compute_modes_and_exclusive_gpus_round_trip(path: Path) -> None:
    cp = _checkpoint("u1")
    cp.claims["u1"].exclusive_gpus = [GPU]
    cp.compute_modes[GPU] = ComputeMode.PROHIBITED
    CheckpointStore(path).save(cp)
    loaded = CheckpointStore(path).load()
    assert loaded.compute_modes == {GPU: ComputeMode.PROHIBITED} and loaded.claims["u1"].exclusive_gpus == [GPU]
