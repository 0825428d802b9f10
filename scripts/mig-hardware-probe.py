#!/usr/bin/env python3
"""CHANGES MIG INSTANCES (opt-in): what a GPU in MIG mode says about dynamic instances, as JSON on stdout.

``scripts/gpu-machine-check.sh`` runs it only where the operator allows MIG changes
(``TESSERA_ALLOW_MIG_CHANGES=1``). It never changes a MIG mode and never touches a GPU that holds any
MIG instance (someone's); on the first GPU in MIG mode without instances it:

1. reads field 230 (``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``) and the supported event mask, before any instance;
2. notes the NVIDIA device nodes in /dev, as a privileged container started now would copy them;
3. creates the smallest profile at its first placement through Tessera's own NVML partitioner and records its
   GI/CI ids, MIG UUID, the capability files' minors, and whether the host's ``/dev/nvidia-caps`` got the nodes;
4. with the instance there: remapped rows of the parent GPU (nvml.h: NOT_SUPPORTED with MIG instances) and
   field 230 again;
5. runs the CUDA probe (``driver/gpu/discovery/cudaprobe.py``) restricted to the instance in a mount namespace
   whose /dev is a tmpfs holding only the nodes of step 2 (the MPS host's copy): once as it is, once after
   Tessera made the instance's capability nodes there (``driver/gpu/host/capnodes.py``);
6. destroys it and creates the same profile at the same placement again: are the GI/CI ids and the MIG UUID
   the same (docs/sharing.md, "Whose MIG instance")?
7. destroys it, and checks the GPU holds no instance, as it was found.

Whatever it created is destroyed on the way out, error or not. Run from the repository root, as root:

    python scripts/mig-hardware-probe.py > mig-hardware.json
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RECOVERY_ACTION_FIELD = 230  # nvml.h NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (absent from older nvidia-ml-py)
CAPS = Path("/proc/driver/nvidia/capabilities")
DEV_COPY_NAMES = ("null", "zero", "full", "random", "urandom")  # what a process needs besides NVIDIA's


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def field_230(nvml: Any, handle: Any) -> dict[str, Any]:
    try:
        [value] = nvml.nvmlDeviceGetFieldValues(handle, [RECOVERY_ACTION_FIELD])
    except Exception as exc:
        return {"error": _error(exc)}
    return {"nvmlReturn": int(value.nvmlReturn), "valueType": int(value.valueType),
            "value": int(value.value.uiVal) if int(value.nvmlReturn) == 0 else None}


def event_mask(nvml: Any, handle: Any) -> dict[str, Any]:
    try:
        mask = int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
    except Exception as exc:
        return {"error": _error(exc)}
    # nvml.h: nvmlEventTypeGpuRecoveryAction 0x8000, nvmlEventTypeGpuUnavailableError 0x4000.
    return {"mask": hex(mask), "recovery_action_0x8000": bool(mask & 0x8000),
            "gpu_unavailable_0x4000": bool(mask & 0x4000)}


def remapped_rows(nvml: Any, handle: Any) -> dict[str, Any]:
    try:
        corrected, uncorrected, pending, failed = nvml.nvmlDeviceGetRemappedRows(handle)
    except Exception as exc:
        return {"error": _error(exc), "nvml_code": getattr(exc, "value", None)}
    return {"corrected": corrected, "uncorrected": uncorrected, "pending": bool(pending), "failed": bool(failed)}


def nvidia_nodes() -> list[dict[str, Any]]:
    """The device nodes a privileged container started now would get in its /dev copy."""
    names = [*DEV_COPY_NAMES, *(p.name for p in Path("/dev").glob("nvidia*") if not p.is_dir()),
             *(f"nvidia-caps/{p.name}" for p in Path("/dev/nvidia-caps").glob("nvidia-cap*"))]
    nodes = []
    for name in names:
        try:
            info = os.lstat(f"/dev/{name}")
        except OSError:
            continue
        if stat.S_ISCHR(info.st_mode):
            nodes.append({"name": name, "mode": info.st_mode, "rdev": info.st_rdev})
    return nodes


def capability_minors(gpu_minor: int, gi_id: int, ci_id: int) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for access in (f"gpu{gpu_minor}/mig/gi{gi_id}/access", f"gpu{gpu_minor}/mig/gi{gi_id}/ci{ci_id}/access"):
        try:
            text = (CAPS / access).read_text()
        except OSError as exc:
            found[access] = {"error": _error(exc)}
            continue
        minor = next((line.split(":")[1].strip() for line in text.splitlines() if line.startswith("DeviceFileMinor")),
                     None)
        node = Path(f"/dev/nvidia-caps/nvidia-cap{minor}")
        found[access] = {"minor": minor, "host_node_exists": node.exists()}
    return found


def cuda_in_dev_copy(snapshot: Path, mig_uuid: str, libcuda: str, capabilities: list[str]) -> dict[str, Any]:
    """The CUDA probe on the MIG device in a private mount namespace whose /dev holds only ``snapshot``'s nodes
    (plus, with ``capabilities``, the ones Tessera makes)."""
    inner = [sys.executable, str(Path(__file__).resolve()), "--in-dev-copy", str(snapshot), libcuda, *capabilities]
    argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
            'mount -t tmpfs -o mode=755,nosuid tessera-dev /dev && exec "$@"', "tessera-dev", *inner]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": mig_uuid}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    except Exception as exc:
        return {"error": _error(exc)}
    return {"exit": done.returncode, "stdout": done.stdout.strip()[-2000:], "stderr": done.stderr.strip()[-2000:]}


def in_dev_copy(snapshot: Path, libcuda: str, capabilities: list[str]) -> int:
    """Inside the namespace: /dev from the snapshot, the capability nodes if asked, then the CUDA probe."""
    from driver.gpu.discovery.cudaprobe import main as probe
    from driver.gpu.host.capnodes import ensure_nodes

    for node in json.loads(snapshot.read_text()):
        path = Path("/dev") / node["name"]
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mknod(path, node["mode"], node["rdev"])
    if capabilities:
        print(json.dumps({"made": ensure_nodes(Path("/"), Path("/"), capabilities)}), flush=True)
    return probe(["sm-counts", "--libcuda", libcuda])


def probe_gpu(nvml: Any, partitioner: Any, gpu: Any, snapshot: Path, libcuda: str | None) -> dict[str, Any]:
    from driver.gpu.host.capnodes import instance_capabilities

    handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
    report: dict[str, Any] = {"gpu": gpu.uuid, "name": gpu.product_name, "minor": gpu.minor,
                              "field_230_before": field_230(nvml, handle), "event_mask": event_mask(nvml, handle)}
    profile = min((p for p in gpu.mig_profiles if "+" not in p.name and p.placement_starts),
                  key=lambda p: (p.memory_slices, p.compute_slices))
    start = profile.placement_starts[0]
    report["profile"], report["placement"] = profile.name, start
    made: list[Any] = []
    try:
        snapshot.write_text(json.dumps(nvidia_nodes()))
        first = partitioner.create(gpu.uuid, profile, start)
        made.append(first)
        report["first"] = {"gi": first.gi_id, "ci": first.ci_id, "uuid": first.uuid,
                           "capabilities": capability_minors(gpu.minor, first.gi_id, first.ci_id)}
        report["remapped_rows_with_instance"] = remapped_rows(nvml, handle)
        report["field_230_with_instance"] = field_230(nvml, handle)
        if libcuda is not None:
            caps = instance_capabilities(gpu.minor, first.gi_id, first.ci_id)
            report["cuda_in_mps_host_dev_copy"] = cuda_in_dev_copy(snapshot, first.uuid, libcuda, [])
            report["cuda_after_tessera_made_the_nodes"] = cuda_in_dev_copy(snapshot, first.uuid, libcuda, caps)
        partitioner.destroy(gpu.uuid, first.gi_id, first.ci_id)
        made.remove(first)
        again = partitioner.create(gpu.uuid, profile, start)
        made.append(again)
        report["again"] = {"gi": again.gi_id, "ci": again.ci_id, "uuid": again.uuid}
        report["same_ids"] = (again.gi_id, again.ci_id) == (first.gi_id, first.ci_id)
        report["same_uuid"] = again.uuid == first.uuid
        report["uuid_version_nibbles"] = [u.removeprefix("MIG-")[14] for u in (first.uuid, again.uuid)]
    except Exception as exc:
        report["error"] = _error(exc)
    finally:
        for instance in made:
            try:
                partitioner.destroy(gpu.uuid, instance.gi_id, instance.ci_id)
            except Exception as exc:
                report.setdefault("cleanup_errors", []).append(_error(exc))
        try:
            report["left_on_gpu"] = [m.model_dump() for m in (*partitioner.instances(gpu.uuid),
                                                              *partitioner.bare_gpu_instances(gpu.uuid))]
        except Exception as exc:
            report["left_on_gpu"] = _error(exc)
    return report


def main(argv: list[str]) -> int:
    if argv[:1] == ["--in-dev-copy"]:
        return in_dev_copy(Path(argv[1]), argv[2], argv[3:])
    import pynvml

    from driver.gpu.discovery.cudarun import find_libcuda
    from driver.gpu.discovery.nvml import NvmlDiscovery
    from driver.gpu.runtime.nvmlmig import NvmlMigPartitioner

    try:
        inventory = NvmlDiscovery(driver_root=Path("/")).discover()
    except Exception as exc:
        print(json.dumps({"error": _error(exc)}))
        return 1
    candidates = [g for g in inventory.gpus if g.mig_enabled and not g.mig_instances and g.mig_profiles]
    result: dict[str, Any] = {"driver": inventory.driver_version,
                              "mig_gpus": [(g.uuid, g.mig_enabled, len(g.mig_instances)) for g in inventory.gpus]}
    if not candidates:
        result["skipped"] = "no GPU in MIG mode without MIG instances (MIG mode is never changed here)"
        print(json.dumps(result, indent=1))
        return 0
    libcuda = find_libcuda(Path("/"))
    partitioner = NvmlMigPartitioner(pynvml)
    pynvml.nvmlInit()
    try:
        with tempfile.TemporaryDirectory(prefix="tessera-mig-probe-") as work:
            result["probe"] = probe_gpu(pynvml, partitioner, candidates[0], Path(work) / "dev-nodes.json",
                                        str(libcuda) if libcuda else None)
    finally:
        partitioner.close()
        pynvml.nvmlShutdown()
    print(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
