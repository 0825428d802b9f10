"""What goes into a prepared claim's CDI spec, and where on the host it comes from.

Per device: the GPU's ``/dev/nvidiaN`` (checked to exist, so a fresh node without device nodes
fails the claim clearly instead of producing a container without a GPU; with a ``hostPath``
when the node lives under the GPU Operator's driver root, not in the host's ``/dev``), the MIG access
capability nodes read from ``/proc``, MPS client environment and mounts (none for an admin-access
device, which gets its nodes only), and annotations that let a person (and a checkpoint rebuild)
tell which claim and device a spec belongs to. Per
claim: the control device nodes and the NVIDIA Container Toolkit's common edits.

Every name derives from the driver name, so two installations under different driver names
never read, write or clean up each other's specs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import cdi
from driver.gpu.claimcdi import assemble
from driver.gpu.claimcdi.kernelmemory import hook_edits
from driver.gpu.claimcdi.toolkit import ToolkitEdits
from driver.gpu.claimconfig.choices import SHARE_KINDS, DeviceKind
from driver.gpu.errors import PrepareError
from driver.gpu.host.hostfs import (
    MIG_MONITOR,
    NODE_ROOT,
    DeviceRoot,
    control_device_paths,
    find_device_root,
    mig_capability_nodes,
    mig_driver_capability_node,
)
from driver.gpu.mps.model import MpsDaemonRecord, client_edits
from driver.gpu.published.sharelayout import GpuForm
from driver.gpu.record.checkpoint import ClaimRecord, PreparedDeviceRecord

CDI_CLASS = "claim"
MPS_CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"


@dataclass(frozen=True)
class CdiNames:
    """CDI kind, file names and annotation keys of one driver installation."""

    driver_name: str  # e.g. gpu.tessera.dev -> kind k8s.gpu.tessera.dev/claim

    @property
    def vendor(self) -> str:
        return f"k8s.{self.driver_name}"

    @property
    def kind(self) -> str:
        return f"{self.vendor}/{CDI_CLASS}"

    @property
    def spec_prefix(self) -> str:
        return f"{self.vendor}-{CDI_CLASS}_"

    def annotation(self, key: str) -> str:
        return f"{self.driver_name}/{key}"

    def spec_file_name(self, claim_uid: str) -> str:
        return cdi.transient_spec_name(self.vendor, CDI_CLASS, claim_uid)

    def device_id(self, claim_uid: str, device_name: str) -> str:
        return f"{self.kind}={assemble.cdi_device_name(claim_uid, device_name)}"


@dataclass(frozen=True)
class CdiSources:
    names: CdiNames
    host_root: Path  # where the host's /dev and /proc are visible
    toolkit: ToolkitEdits
    mps_shm_dir: Path | None
    driver_root: Path | None = None  # where this process sees the driver root; None: the driver is on the host
    driver_root_on_host: PurePosixPath = NODE_ROOT  # the same root's path on the node

    def device_root(self) -> DeviceRoot:
        if self.driver_root is None:
            return DeviceRoot(self.host_root, NODE_ROOT, "host")
        return find_device_root(self.host_root, self.driver_root, self.driver_root_on_host)


def device_edits(src: CdiSources, dev: PreparedDeviceRecord, daemons: Mapping[str, MpsDaemonRecord],
                 shares: GpuForm | None, root: DeviceRoot, mig_gpu: bool = False) -> assemble.DeviceEdits:
    """``mig_gpu``: the device's GPU is in MIG mode (an admin-access device then gets the monitor capability)."""
    gpu_node = f"/dev/nvidia{dev.gpu_minor}"
    if not root.exists(gpu_node):
        raise PrepareError(
            f"device node {gpu_node} for {dev.device.device_name} does not exist in {root.describe()}; the NVIDIA "
            "driver has not created it yet (run nvidia-smi or nvidia-modprobe where the driver runs), then the "
            "kubelet retries")
    nodes: list[dict[str, object]] = [root.node(gpu_node)]
    if dev.mig_gi_id is not None and dev.mig_ci_id is not None:
        # A MIG device, static or created for the claim (dynamic MIG: the whole device of such a GPU too, its
        # full-size instance). Written fully specified (type, major, minor) so the runtime need not find the
        # node on the host; /proc is the kernel's, the same for a host-installed and a containerised driver.
        for cap in mig_capability_nodes(src.host_root, dev.gpu_minor, dev.mig_gi_id, dev.mig_ci_id):
            nodes.append(root.node(cap.path, type="c", major=cap.major, minor=cap.minor, fileMode=cap.file_mode))
    if dev.admin_access and mig_gpu:
        # Monitoring a MIG-mode GPU: without mig/monitor, nvidia-smi in the pod cannot list its MIG devices.
        cap = mig_driver_capability_node(src.host_root, MIG_MONITOR)
        nodes.append(root.node(cap.path, type="c", major=cap.major, minor=cap.minor, fileMode=cap.file_mode))
    env: list[str] = []
    mounts: list[dict[str, object]] = []
    names = src.names
    # Enough to rebuild the checkpoint entry from this file if the checkpoint is ever lost.
    annotations = {names.annotation("device"): dev.device.device_name, names.annotation("kind"): dev.kind,
                   names.annotation("gpu-uuid"): dev.gpu_uuid, names.annotation("gpu-minor"): str(dev.gpu_minor),
                   names.annotation("request"): ",".join(dev.device.request_names)}
    if dev.device.share_id:
        annotations[names.annotation("share-id")] = dev.device.share_id
    if dev.admin_access:
        annotations[names.annotation("admin-access")] = "true"
    if dev.consumed_memory_bytes is not None and dev.consumed_multiprocessors is not None:
        annotations[names.annotation("consumed")] = f"{dev.consumed_memory_bytes},{dev.consumed_multiprocessors}"
    if dev.mig_uuid is not None and dev.mig_gi_id is not None and dev.mig_ci_id is not None:
        annotations[names.annotation("mig-uuid")] = dev.mig_uuid
        annotations[names.annotation("mig-instance")] = f"{dev.mig_gi_id}/{dev.mig_ci_id}"
    if dev.dynamic_mig is not None:  # the instance is the claim's: a rebuilt checkpoint must know to destroy it
        annotations[names.annotation("dynamic-mig")] = dev.dynamic_mig.model_dump_json()
    if shares is not None:
        annotations[names.annotation("shares")] = shares.model_dump_json()
    if dev.mps_daemon_id is not None:
        daemon = daemons.get(dev.mps_daemon_id)
        if daemon is None:
            # Its unprepare stops the daemon and forgets it first, and a failure later in that unprepare (NVML
            # refusing to destroy a MIG instance) leaves the claim recorded without it: its retried unprepare ends it.
            raise PrepareError(
                f"device {dev.device.device_name!r}: its MPS daemon {dev.mps_daemon_id} is no longer recorded (the "
                "claim's unprepare had begun); the kubelet's retried unprepare finishes it")
        edits = client_edits(daemon, MPS_CONTAINER_PIPE_DIR, src.mps_shm_dir)
        env.extend(edits.env)
        mounts.extend(m.model_dump(mode="json", by_alias=True, exclude_defaults=True) for m in edits.mounts)
        annotations[names.annotation("mps-daemon")] = dev.mps_daemon_id
        # What the daemon was started with: a checkpoint rebuilt from the specs can adopt it again (claim/rebuild.py).
        annotations[names.annotation("mps-daemon-spec")] = daemon.spec.model_dump_json()
    hooks: list[dict[str, object]] = []
    policy = shares.consumable if shares is not None else None
    if dev.kind == DeviceKind.CONSUMABLE and policy is not None and policy.memory_limit_hook \
            and dev.consumed_memory_bytes:
        # The claim's memory as the hard limit of its containers' cgroups (MPS v3 memory partitioning).
        hook, hook_env = hook_edits(policy.memory_limit_hook, str(src.driver_root_on_host), dev.gpu_uuid,
                                    dev.consumed_memory_bytes)
        hooks.append(hook)
        env.extend(hook_env)
    return assemble.DeviceEdits(dev.device.device_name, nodes, env, mounts, annotations, hooks)


def _shares_form(dev: PreparedDeviceRecord) -> bool:
    # A share's GPU's (a MIG instance's share: the instance's) published form, the layout entry, goes into the
    # spec, so a rebuilt checkpoint publishes it the same way while the claim runs.
    # An admin-access device gets device nodes only (no MPS settings, no memory hook) and does not pin
    # its GPU's form (ClaimRecord.held_layout_keys). A dynamic MIG device's GPU keeps its DynamicMig form.
    return (dev.kind in SHARE_KINDS or dev.dynamic_mig is not None) and not dev.admin_access


def _mig_gpu(dev: PreparedDeviceRecord, form: GpuForm | None) -> bool:
    """Whether the device's GPU is in MIG mode: a MIG device (static or a placement), or the whole device of a
    dynamic MIG GPU (its form)."""
    return dev.kind == DeviceKind.MIG or dev.mig_gi_id is not None \
        or (form is not None and form.strategy == "DynamicMig")


def claim_spec_file(src: CdiSources, record: ClaimRecord, daemons: Mapping[str, MpsDaemonRecord],
                    layout: Mapping[str, GpuForm]) -> assemble.ClaimSpecFile:
    """The claim's spec and the text to write (see :func:`assemble.build_claim_spec_file`)."""
    required_problem = src.toolkit.readiness_problem
    if required_problem is not None:
        raise PrepareError(required_problem)
    root = src.device_root()
    control = control_device_paths(root.seen_at)
    if "/dev/nvidiactl" not in control:
        raise PrepareError(f"/dev/nvidiactl does not exist in {root.describe()}: the NVIDIA kernel driver is not "
                           "loaded, or the GPU Operator's driver container is not running yet (check "
                           "'lsmod | grep nvidia' and the driver installation)")
    names = src.names
    annotations = {names.annotation("driver-libraries"): src.toolkit.status[:1000]}
    if record.timeslice is not None:
        annotations[names.annotation("timeslice")] = record.timeslice.model_dump_json()
    return assemble.build_claim_spec_file(
        kind=names.kind,
        claim=assemble.ClaimIdentity(record.uid, record.namespace, record.name),
        devices=[device_edits(src, d, daemons, layout.get(d.layout_key) if _shares_form(d) else None, root,
                              _mig_gpu(d, layout.get(d.gpu_uuid)))
                 for d in record.devices],
        common_edits=src.toolkit.edits,
        control_nodes=[root.node(path) for path in control],
        annotation_prefix=names.driver_name,
        annotations=annotations,
    )
