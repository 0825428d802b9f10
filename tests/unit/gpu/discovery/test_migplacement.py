"""Dynamic MIG, pure: placements of allowed profiles, the GPU's counter set, what each placement consumes."""

from __future__ import annotations

from driver.gpu.discovery.migplacement import (
    MigPlacement,
    counter_values,
    foreign_instances,
    full_profile,
    partitionable_supported,
    placement_consumption,
    placements,
)
from driver.units import MIB
from tests.support.mig import H100_MEMORY, h100, instance, profiles


def test_placements_follow_the_profile_table() -> None:
    found = placements(h100(), ["1g.10gb", "3g.40gb", "4g.40gb", "7g.80gb"])
    assert [(p.profile.name, p.start) for p in found] == [
        ("1g.10gb", s) for s in range(7)] + [("3g.40gb", 0), ("3g.40gb", 4), ("4g.40gb", 0), ("7g.80gb", 0)]
    three = next(p for p in found if p.profile.name == "3g.40gb" and p.start == 4)
    assert three.size == 4 and list(three.memory_slices) == [4, 5, 6, 7]


def test_profiles_not_allowed_or_not_offered_give_no_placement() -> None:
    assert placements(h100(), []) == []
    assert placements(h100(), ["1g.5gb"]) == []  # an A100-40GB profile


def test_a_placement_past_the_last_memory_slice_is_never_published() -> None:
    broken = tuple(p.model_copy(update={"placement_starts": (0, 6)}) if p.name == "3g.40gb" else p for p in profiles())
    assert [p.start for p in placements(h100(table=broken), ["3g.40gb"])] == [0]


def test_overlap() -> None:
    by = {(p.profile.name, p.start): p for p in placements(h100(), ["1g.10gb", "3g.40gb", "4g.40gb"])}
    assert by[("4g.40gb", 0)].overlaps(by[("3g.40gb", 0)])
    assert not by[("4g.40gb", 0)].overlaps(by[("3g.40gb", 4)])
    assert by[("1g.10gb", 3)].overlaps(by[("4g.40gb", 0)]) and not by[("1g.10gb", 4)].overlaps(by[("4g.40gb", 0)])


def test_counter_set_is_the_full_size_profile_plus_memory_and_one_counter_per_slice() -> None:
    gpu = h100()
    assert full_profile(gpu) is not None and full_profile(gpu).name == "7g.80gb"  # type: ignore[union-attr]
    assert counter_values(gpu) == {
        "multiprocessors": 132, "copy-engines": 7, "memory": H100_MEMORY,
        **{f"memory-slice-{i}": 1 for i in range(8)}}


def test_engines_nvml_does_not_report_are_not_counted() -> None:
    engines = {"7g.80gb": {"decoders": 7, "jpeg_engines": 7, "ofa_engines": 1},
               "1g.10gb": {"decoders": 1, "jpeg_engines": 1, "ofa_engines": 0},
               "1g.10gb+me": {"ofa_engines": 1}}
    gpu = h100(table=profiles(engines=engines))
    values = counter_values(gpu)
    assert values["decoders"] == 7 and values["ofa-engines"] == 1 and "encoders" not in values
    me = next(p for p in placements(gpu, ["1g.10gb+me"]) if p.start == 2)
    assert placement_consumption(me, values) == {
        "multiprocessors": 16, "copy-engines": 1, "ofa-engines": 1, "memory": 9984 * MIB, "memory-slice-2": 1}


def test_no_counters_without_a_full_size_profile_or_memory() -> None:
    assert counter_values(h100(table=tuple(p for p in profiles() if p.name != "7g.80gb"))) == {}
    assert counter_values(h100(memory_bytes=None)) == {}
    assert counter_values(h100(mig_enabled=False)) == {}


def test_placement_consumption_covers_its_memory_slices() -> None:
    gpu = h100()
    [three] = [p for p in placements(gpu, ["3g.40gb"]) if p.start == 4]
    assert placement_consumption(three, counter_values(gpu)) == {
        "multiprocessors": 60, "copy-engines": 3, "memory": 40448 * MIB,
        "memory-slice-4": 1, "memory-slice-5": 1, "memory-slice-6": 1, "memory-slice-7": 1}


def test_what_fits_by_counters_matches_the_h100_table() -> None:
    gpu = h100()
    offered = counter_values(gpu)

    def fits(*chosen: MigPlacement) -> bool:
        used: dict[str, int] = {}
        for p in chosen:
            for k, v in placement_consumption(p, offered).items():
                used[k] = used.get(k, 0) + v
        return all(v <= offered[k] for k, v in used.items())

    by = {(p.profile.name, p.start): p for p in placements(gpu, [p.name for p in gpu.mig_profiles])}
    assert fits(*(by[("1g.10gb", s)] for s in range(7)))
    assert fits(by[("4g.40gb", 0)], by[("3g.40gb", 4)])
    assert not fits(by[("4g.40gb", 0)], by[("3g.40gb", 0)])
    assert not fits(by[("7g.80gb", 0)], by[("1g.10gb", 6)])
    assert fits(by[("2g.20gb", 0)], by[("2g.20gb", 2)], by[("2g.20gb", 4)], by[("1g.10gb", 6)])


def test_foreign_instances_are_those_not_created_by_tessera() -> None:
    gpu = h100(instances=(instance("1g.10gb", 0, gi_id=3), instance("1g.10gb", 1, gi_id=4)))
    assert foreign_instances(gpu, {(gpu.uuid, 3)}) == ["1g.10gb@1"]
    assert foreign_instances(gpu, {(gpu.uuid, 3), (gpu.uuid, 4)}) == []
    assert foreign_instances(gpu, {("GPU-other", 3)}) == ["1g.10gb@0", "1g.10gb@1"]


def test_partitionable_devices_by_release_and_gate() -> None:
    assert [partitionable_supported(m, False) for m in (34, 35, 36, 37)] == [False, False, True, True]
    assert [partitionable_supported(m, True) for m in (33, 34, 35)] == [False, True, True]
