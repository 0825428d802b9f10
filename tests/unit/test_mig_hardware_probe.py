"""scripts/mig-hardware-probe.py's logic against the simulated NVML: it settles whether a MIG instance re-created at
one placement gets its old UUID, reads what it must with an instance there, and leaves the GPU as it found it."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from driver.simulation.discovery import SimulatedDiscovery
from driver.simulation.migengine import SimulatedMigPartitioner

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "mig-hardware-probe.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mig_hardware_probe", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class NotSupported(Exception):
    value = 3


class FakeNvml:
    """The four pynvml reads the probe makes besides the partitioner's (nvml.h's answers with MIG instances)."""

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        return uuid

    def nvmlDeviceGetFieldValues(self, handle: str, fields: list[int]) -> list[Any]:
        assert fields == [230]
        return [SimpleNamespace(nvmlReturn=0, valueType=1, value=SimpleNamespace(uiVal=0))]

    def nvmlDeviceGetSupportedEventTypes(self, handle: str) -> int:
        return 0x8000 | 0x20

    def nvmlDeviceGetRemappedRows(self, handle: str) -> tuple[int, int, int, int]:
        raise NotSupported("Not Supported")


@pytest.mark.parametrize("name_derived", [False, True])
def test_the_probe_compares_the_uuids_of_an_instance_made_twice_and_leaves_nothing(tmp_path: Path,
                                                                                    name_derived: bool) -> None:
    probe = load_script()
    partitioner = SimulatedMigPartitioner.for_layout("dynamic-mig", "node-a", tmp_path / "mig.json")
    if name_derived:
        partitioner.use_name_derived_uuids()
    gpu = SimulatedDiscovery("dynamic-mig", "node-a").discover().gpus[0]
    report = probe.probe_gpu(FakeNvml(), partitioner, gpu, tmp_path / "dev.json", None)
    assert "error" not in report, report
    assert (report["profile"], report["placement"]) == ("1g.10gb", 0)
    assert report["same_ids"] is True and report["same_uuid"] is name_derived
    assert report["uuid_version_nibbles"] == ["5", "5"]
    assert report["remapped_rows_with_instance"] == {"error": "NotSupported: Not Supported", "nvml_code": 3}
    assert report["field_230_before"] == {"nvmlReturn": 0, "valueType": 1, "value": 0}
    assert report["event_mask"]["recovery_action_0x8000"] and not report["event_mask"]["gpu_unavailable_0x4000"]
    assert report["left_on_gpu"] == [] and partitioner.instances(gpu.uuid) == []
