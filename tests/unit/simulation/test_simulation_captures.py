"""The simulated H200 reports what NVML reported on a real H200 (driver 580.159.04), profile by profile.

The capture under tests/support/captures is scripts/mig-profile-probe.py's output on the lent GPU;
driver/simulation/nvml-captures.json carries its facts into the simulation. This test ties the two, so
neither can drift from the hardware unnoticed.
"""

from __future__ import annotations

import json
from pathlib import Path

from driver.simulation.discovery import mig_profile_infos
from driver.simulation.gpus import gpu_model
from driver.units import MIB

CAPTURE = Path(__file__).resolve().parents[2] / "support" / "captures" / "h200-580.159.04-mig-profiles.json"


def test_simulated_h200_profiles_are_the_captured_ones() -> None:
    captured = {p["id"]: p for p in json.loads(CAPTURE.read_text())["gpus"][0]["profiles"] if "id" in p}
    infos = {info.gi_profile_id: info for info in mig_profile_infos(gpu_model("H200").mig_profiles)}
    assert set(infos) == set(captured)
    for gi_id, info in infos.items():
        real = captured[gi_id]
        assert real["name"] == f"MIG {info.name}"
        assert info.memory_bytes == real["memorySizeMB"] * MIB
        assert info.multiprocessors == real["multiprocessorCount"]
        assert (info.copy_engines, info.decoders, info.encoders, info.jpeg_engines, info.ofa_engines) == (
            real["copyEngineCount"], real["decoderCount"], real["encoderCount"], real["jpegCount"], real["ofaCount"])
        assert [[s, info.memory_slices] for s in info.placement_starts] == real["placements"]
        assert info.compute_slices == real["sliceCount"]


def test_models_without_a_capture_keep_the_table_and_nvidias_published_engines() -> None:
    one = next(p for p in gpu_model("H100-80GB").mig_profiles if p.name == "1g.10gb")
    assert (one.memory_mib, one.engines.copy_engines, one.engines.decoders, one.engines.ofa_engines) == (9984, 1, 1, 0)
    # The A100's 1g.5gb has no decoder at all, its +me one of each; its 7g.40gb five decoders, one JPEG and OFA.
    a100 = {p.name: p.engines for p in gpu_model("A100-40GB").mig_profiles}
    assert (a100["1g.5gb"].decoders, a100["1g.5gb+me"].ofa_engines, a100["7g.40gb"].decoders) == (0, 1, 5)
