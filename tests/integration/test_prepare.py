"""NodePrepareResources / NodeUnprepareResources through the real socket, as the kubelet calls them."""

from __future__ import annotations

import json
import threading

from cdi.yamlload import load_yaml
from driver.kubeletplugin.types import ClaimRef
from tests.support.node import SimulatedNode, gpu_config


def test_prepare_and_unprepare_several_claims(sim_node: SimulatedNode) -> None:
    sim_node.start()
    whole = sim_node.claim("whole", [("gpu", "gpu-0")])
    mig = sim_node.claim("mig", [("mig/small", "gpu-1-mig-1g10gb-6")])
    two = sim_node.claim("two", [("a", "gpu-2"), ("b", "gpu-1-mig-2g20gb-4")])
    answers = sim_node.prepare(whole, mig, two)
    assert all(a.error is None for a in answers.values()), answers

    [dev] = answers[whole.uid].devices
    assert (dev.pool_name, dev.device_name, dev.request_names) == ("node-a", "gpu-0", ("gpu",))
    assert dev.cdi_device_ids == (f"k8s.gpu.tessera.dev/claim={whole.uid}-gpu-0",)
    assert dev.share_id is None
    assert answers[mig.uid].devices[0].request_names == ("mig",), "base request name for firstAvailable"
    assert [d.device_name for d in answers[two.uid].devices] == ["gpu-2", "gpu-1-mig-2g20gb-4"]

    spec = json.loads(sim_node.cdi_spec(whole.uid).read_text())
    assert spec["kind"] == "k8s.gpu.tessera.dev/claim"
    assert spec["annotations"]["gpu.tessera.dev/claim"] == "default/whole"
    assert spec["annotations"]["gpu.tessera.dev/claim-uid"] == whole.uid
    assert [d["name"] for d in spec["devices"]] == [f"{whole.uid}-gpu-0"]
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
    common = spec["containerEdits"]
    assert "NVIDIA_VISIBLE_DEVICES=void" in common["env"]
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm"} <= {n["path"] for n in common["deviceNodes"]}
    assert any(m["containerPath"].endswith("libcuda.so.580.95.05") for m in common["mounts"]), "toolkit libraries"

    mig_spec = json.loads(sim_node.cdi_spec(mig.uid).read_text())
    nodes = mig_spec["devices"][0]["containerEdits"]["deviceNodes"]
    assert nodes[0] == {"path": "/dev/nvidia1"}
    assert [n["type"] for n in nodes[1:]] == ["c", "c"], "GI and CI access capability nodes"
    assert len(sim_node.cdi_files()) == 3

    assert sim_node.unprepare(whole, mig, two) == {whole.uid: None, mig.uid: None, two.uid: None}
    assert sim_node.cdi_files() == []
    assert sim_node.checkpoint()["claims"] == {}


def test_prepare_is_idempotent_and_unprepare_of_unknown_or_deleted_claims_succeeds(sim_node: SimulatedNode) -> None:
    sim_node.start()
    ref = sim_node.claim("c", [("gpu", "gpu-0")])
    first = sim_node.prepare_ok(ref)
    mtime = sim_node.cdi_spec(ref.uid).stat().st_mtime_ns
    again = sim_node.prepare_ok(ref)
    assert again.devices == first.devices
    assert sim_node.cdi_spec(ref.uid).stat().st_mtime_ns == mtime, "a repeated prepare does not redo work"
    sim_node.api.delete_claim("default", "c")
    assert sim_node.unprepare(ref) == {ref.uid: None}, "unprepare works from local state"
    assert sim_node.unprepare(ref) == {ref.uid: None}
    never = ClaimRef("default", "never", "00000000-0000-0000-0000-000000000000")
    assert sim_node.unprepare(never) == {never.uid: None}


def test_share_id_is_passed_through(sim_node: SimulatedNode) -> None:
    sim_node.start()
    ref = sim_node.claim("c", [("gpu", "gpu-0")], share_ids={"gpu-0": "5c3f0e4a-1b2c-4d5e-8f90-a1b2c3d4e5f6"})
    assert sim_node.prepare_ok(ref).devices[0].share_id == "5c3f0e4a-1b2c-4d5e-8f90-a1b2c3d4e5f6"


def test_every_per_claim_error_is_that_claims_alone(sim_node: SimulatedNode) -> None:
    sim_node.start()
    good = sim_node.claim("good", [("gpu", "gpu-0")])
    missing = ClaimRef("default", "missing", "11111111-1111-1111-1111-111111111111")
    replaced = sim_node.claim("replaced", [("gpu", "gpu-2")])
    replaced_old = ClaimRef("default", "replaced", "22222222-2222-2222-2222-222222222222")
    unallocated = sim_node.claim("unallocated", [], allocated=False)
    unknown = sim_node.claim("unknown", [("gpu", "gpu-7")])
    other_pool = sim_node.claim("other-pool", [("gpu", "gpu-0")], pool="node-b")
    bad_config = sim_node.claim("bad-config", [("gpu", "gpu-1-mig-3g40gb-0")], configs=[
        {"source": "FromClaim", "requests": [], "opaque": {"driver": "gpu.tessera.dev", "parameters": {
            "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "MigDeviceConfig", "sharng": {}}}}])
    out_of_range = sim_node.claim("out-of-range", [("gpu", "gpu-2")], configs=[
        gpu_config(strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 150})])
    wrong_api = sim_node.claim("wrong-api", [("gpu", "gpu-2")], configs=[
        {"source": "FromClaim", "requests": [], "opaque": {"driver": "gpu.tessera.dev", "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}}}])

    answers = sim_node.prepare(good, missing, replaced_old, unallocated, unknown, other_pool, bad_config,
                               out_of_range, wrong_api)
    assert answers[good.uid].error is None
    assert "not found" in (answers[missing.uid].error or "")
    replaced_error = answers[replaced_old.uid].error or ""
    assert "replaced" in replaced_error and replaced.uid in replaced_error
    assert "not allocated" in (answers[unallocated.uid].error or "")
    assert "gpu-7" in (answers[unknown.uid].error or "") and "not published" in (answers[unknown.uid].error or "")
    assert "node-b" in (answers[other_pool.uid].error or "")
    assert "sharng" in (answers[bad_config.uid].error or "")
    assert "defaultActiveThreadPercentage" in (answers[out_of_range.uid].error or "")
    assert "1 to 100" in (answers[out_of_range.uid].error or "")
    assert "gpu.tessera.dev/v1alpha1" in (answers[wrong_api.uid].error or "")
    assert sim_node.cdi_files() == [f"k8s.gpu.tessera.dev-claim_{good.uid}.json"], "failed claims leave no CDI file"
    assert list(sim_node.checkpoint()["claims"]) == [good.uid], "failed claims leave no checkpoint entry"


def test_a_device_already_prepared_for_another_claim_is_refused(sim_node: SimulatedNode) -> None:
    sim_node.start()
    first = sim_node.claim("first", [("gpu", "gpu-0")])
    second = sim_node.claim("second", [("gpu", "gpu-0")])
    sim_node.prepare_ok(first)
    error = sim_node.prepare(second)[second.uid].error or ""
    assert "already prepared for claim default/first" in error


def test_concurrent_calls_for_different_claims(sim_node: SimulatedNode) -> None:
    sim_node.start()
    devices = ["gpu-0", "gpu-2", "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6"]
    refs = [sim_node.claim(f"c{i}", [("r", d)]) for i, d in enumerate(devices)]
    errors: list[str] = []

    def cycle(ref: ClaimRef) -> None:
        for _ in range(5):
            answer = sim_node.prepare(ref)[ref.uid]
            if answer.error:
                errors.append(answer.error)
            if sim_node.unprepare(ref)[ref.uid] is not None:
                errors.append("unprepare failed")

    threads = [threading.Thread(target=cycle, args=(r,)) for r in refs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert sim_node.cdi_files() == []
    assert sim_node.checkpoint()["claims"] == {}


def test_a_regenerated_toolkit_spec_is_used_for_new_claims(sim_node: SimulatedNode) -> None:
    import yaml

    from tests.support.node import wait_until

    sim_node.start()
    before = sim_node.claim("before", [("gpu", "gpu-0")])
    sim_node.prepare_ok(before)
    toolkit = sim_node.host / "etc" / "cdi" / "nvidia.yaml"
    spec = load_yaml(toolkit.read_text())
    spec["containerEdits"]["env"].append("UPGRADED_DRIVER=1")  # as after a driver upgrade
    fresh = toolkit.with_name("nvidia.yaml.new")
    fresh.write_text(yaml.safe_dump(spec))
    fresh.replace(toolkit)
    wait_until(lambda: any("Toolkit CDI spec changed" in str(e.get("msg")) for e in sim_node.log()),
               what="the driver to notice the regenerated spec")
    after = sim_node.claim("after", [("gpu", "gpu-2")])
    sim_node.prepare_ok(after)
    assert "UPGRADED_DRIVER=1" in json.loads(sim_node.cdi_spec(after.uid).read_text())["containerEdits"]["env"]
    assert "UPGRADED_DRIVER=1" not in json.loads(sim_node.cdi_spec(before.uid).read_text())["containerEdits"]["env"]
