"""``python -m driver inspect``: what is prepared on this node, read from the checkpoint and CDI dir.

Read-only and lock-free, so it is safe to run (``kubectl exec``) next to a busy driver.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import cdi
from driver import nodelayout
from driver.config import Settings
from driver.gpu.claimcdi.edits import CdiNames
from driver.gpu.claimstatus import STATUS_FILE, render_lines
from driver.gpu.claimstatus import add_to_inspect as add_status_to_inspect
from driver.gpu.discovery.inventory import ComputeMode
from driver.gpu.health.report import HEALTH_FILE, render_health
from driver.gpu.health.report import add_to_inspect as add_health_to_inspect
from driver.gpu.health.usagereport import USAGE_FILE, render_usage
from driver.gpu.health.usagereport import add_to_inspect as add_usage_to_inspect
from driver.gpu.mps.hostclient import MpsHostLauncher
from driver.gpu.mps.identity import foreign_processes
from driver.gpu.mps.launch import DaemonLauncher
from driver.gpu.mps.locallauncher import LocalLauncher
from driver.gpu.mps.model import MpsDaemonRecord
from driver.gpu.mps.proc import is_same_process
from driver.gpu.published.planuse import PLAN_USE_FILE, render_plan
from driver.gpu.published.planuse import add_to_inspect as add_plan_to_inspect
from driver.gpu.record.checkpoint import Checkpoint, CheckpointStore, ClaimRecord, PreparedDeviceRecord
from driver.units import GIB


def collect(settings: Settings) -> dict[str, Any]:
    checkpoint_path = settings.state_dir / "checkpoint.json"
    report: dict[str, Any] = {"driver": settings.driver_name, "checkpoint": str(checkpoint_path),
                              "cdi_root": str(settings.cdi_root), "claims": [], "mps_daemons": [],
                              "mps_daemons_run_by": mps_daemons_run_by(settings), "compute_modes": [],
                              "orphan_cdi_specs": [], "notes": [], "problems": []}
    try:
        cp = CheckpointStore(checkpoint_path).peek()
    except (ValueError, OSError) as exc:
        report["problems"].append(f"checkpoint {checkpoint_path} cannot be read ({exc}); the driver sets it aside "
                                  "and rebuilds its state from the CDI specs at its next start")
        return report
    if cp is None:
        report["notes"].append("no checkpoint: nothing has been prepared on this node yet")
        return report
    report["boot_id"] = cp.boot_id
    for record in sorted(cp.claims.values(), key=lambda r: (r.namespace, r.name)):
        report["claims"].append(claim := _claim_entry(record, settings.cdi_root / record.cdi_spec_file, cp))
        if not claim["cdi_spec_present"] and claim["phase"] == "PrepareCompleted":
            report["problems"].append(f"claim {record.uid}: CDI spec {claim['cdi_spec']} is missing (the driver "
                                      "re-creates it at start; restart the plugin pod if containers fail to start)")
    for daemon_id, daemon in sorted(cp.mps_daemons.items()):
        report["mps_daemons"].append(entry := _daemon_entry(daemon_id, daemon, cp))
        report["problems"].extend(_daemon_problems(entry))
    add_foreign_processes(report, settings, cp)
    report["compute_modes"] = recorded_compute_modes(cp)
    known = {r.cdi_spec_file for r in cp.claims.values()}
    report["orphan_cdi_specs"] = [str(path) for path in cdi.list_specs(
        settings.cdi_root, CdiNames(settings.driver_name).spec_prefix) if path.name not in known]
    if cp.plan_timeslices:
        report["plan_timeslices"] = dict(cp.plan_timeslices)
    return report


def _claim_entry(record: ClaimRecord, spec_path: Path, cp: Checkpoint) -> dict[str, Any]:
    return {
        "claim": f"{record.namespace}/{record.name}", "uid": record.uid, "phase": record.phase.value,
        "updated": record.updated_at,
        "devices": [{"device": d.device.device_name, "kind": d.kind, "gpu": d.gpu_uuid, "mig": d.mig_uuid,
                     "requests": d.device.request_names, "cdi_ids": d.device.cdi_device_ids,
                     "share_id": d.device.share_id, "mps_daemon": d.mps_daemon_id,
                     "consumed": _consumed(d), "admin_access": d.admin_access,
                     "dynamic_mig": _dynamic_mig(d)} for d in record.devices],
        "cdi_spec": str(spec_path), "cdi_spec_present": spec_path.exists(),
        "timeslice": record.timeslice.model_dump() if record.timeslice else None,
        "exclusive_gpus": list(record.exclusive_gpus),
        "mps_clients": record.mps_clients, "mps_enforcement": record.mps_enforcement,
        "mps_limits_unconfirmed": sorted(d for d in record.mps_daemon_ids if d in cp.mps_limits_unconfirmed),
    }


def _daemon_entry(daemon_id: str, daemon: MpsDaemonRecord, cp: Checkpoint) -> dict[str, Any]:
    users = [r.uid for r in cp.claims_using(daemon_id)]
    return {"id": daemon_id, "pid": daemon.pid, "pid_alive": is_same_process(daemon.pid, daemon.process_start_time),
            "gpus": daemon.spec.gpu_uuids, "active_thread_percentage": daemon.spec.active_thread_percentage,
            "pinned_memory_limits": daemon.spec.pinned_memory_limits,
            "pipe_dir": str(daemon.pipe_dir), "log_dir": str(daemon.log_dir), "claims": users,
            "limits_unconfirmed": cp.mps_limits_unconfirmed.get(daemon_id)}


def _daemon_problems(entry: dict[str, Any]) -> list[str]:
    problems, users = [], len(entry["claims"])
    if entry["limits_unconfirmed"] is not None:
        problems.append(f"MPS daemon {entry['id']}: its limits cannot be confirmed ({entry['limits_unconfirmed']}); "
                        f"a client holds its control socket, so they may have been changed for {users} claim(s)")
    if users and not entry["pid_alive"]:
        problems.append(f"MPS daemon {entry['id']} (pid {entry['pid']}) is not running and {users} claim(s) use it: "
                        "their MPS clients fail until the driver restarts it (at its next rescan, if the plugin is "
                        "running)")
    return problems


def _consumed(dev: PreparedDeviceRecord) -> dict[str, Any] | None:
    """What a consumable share took of its GPU, as the checkpoint recorded it at prepare."""
    if dev.consumed_memory_bytes is None or dev.consumed_multiprocessors is None:
        return None
    memory = dev.consumed_memory_bytes
    shown = f"{memory // GIB}Gi" if memory % GIB == 0 else f"{memory} bytes"
    return {"memory": shown, "memory_bytes": memory, "multiprocessors": dev.consumed_multiprocessors}


def _dynamic_mig(dev: PreparedDeviceRecord) -> dict[str, Any] | None:
    """The MIG instance Tessera created (or is creating) for a dynamic MIG device, as the checkpoint records it."""
    intent = dev.dynamic_mig
    if intent is None:
        return None
    state = "created" if dev.mig_gi_id is not None else "being created" if intent.create_started else "planned"
    return {"gpu": dev.gpu_uuid, "gpu_minor": dev.gpu_minor, "profile": intent.profile,
            "placement_start": intent.placement_start, "placement_size": intent.memory_slices,
            "gi_id": dev.mig_gi_id, "ci_id": dev.mig_ci_id, "mig_uuid": dev.mig_uuid, "state": state}


def add_foreign_processes(report: dict[str, Any], settings: Settings, cp: Checkpoint | None) -> None:
    """Processes that look like MPS daemons of this driver (its pipe directories in their environment)
    but that it did not start: the driver ignores them; an operator wants to know who runs them."""
    recorded = {} if cp is None else {i: (d.pid, d.process_start_time) for i, d in cp.mps_daemons.items()}
    found = foreign_processes(settings.state_dir / "mps", recorded, mps_launcher(settings))
    report["foreign_mps_processes"] = [{"pid": f.pid, "uid": f.uid, "euid": f.euid, "daemon_id": f.daemon_id,
                                        "pipe_dir": str(f.pipe_dir)} for f in found]
    if found:
        pids = ", ".join(str(f.pid) for f in found[:10]) + (", ..." if len(found) > 10 else "")
        report["problems"].append(
            f"{len(found)} foreign process(es) name a Tessera MPS pipe directory (pid {pids}): they look like MPS "
            "daemons but this driver did not start them; it ignores them. Find out who runs them (a tenant?)")


def mps_launcher(settings: Settings) -> DaemonLauncher:
    """The launcher the plugin with these settings uses, to tell its daemons from look-alikes."""
    if settings.mps_host_socket is not None:
        return MpsHostLauncher(settings.mps_host_socket)
    return LocalLauncher(settings.driver_root)


def mps_daemons_run_by(settings: Settings) -> str:
    """Where this node's MPS daemons run, as the plugin with these settings starts them."""
    if settings.mps_host_socket is not None:
        return MpsHostLauncher(settings.mps_host_socket).describe()
    return (f"child processes of the plugin process (they stop with it: in a pod, with the plugin container), "
            f"binaries from driver root {settings.driver_root}")


def recorded_compute_modes(cp: Checkpoint) -> list[dict[str, Any]]:
    """Each GPU whose compute mode the driver changed or holds: EXCLUSIVE_PROCESS while claims' MPS
    daemons serve it, and the mode it goes back to when the last of them stops."""
    holders: dict[str, list[str]] = {}
    for record in cp.claims.values():
        for uuid in record.exclusive_gpus:
            holders.setdefault(uuid, []).append(record.uid)
    return [{"gpu": uuid, "mode": ComputeMode.EXCLUSIVE_PROCESS.value if uuid in holders else None,
             "restore_to": previous.value if (previous := cp.compute_modes.get(uuid)) else None,
             "claims": sorted(holders.get(uuid, []))}
            for uuid in sorted(set(holders) | set(cp.compute_modes))]


def _render_compute_mode(entry: dict[str, Any]) -> str:
    restore = entry["restore_to"] or "unknown (not recorded)"
    if entry["mode"] is None:
        return f"{entry['gpu']}: compute mode to be restored to {restore} (no MPS daemon serves it any more)"
    return (f"{entry['gpu']}: compute mode {entry['mode']} for MPS, held by {len(entry['claims'])} claim(s); "
            f"restored to {restore} when the last one is unprepared")


def render_text(report: dict[str, Any]) -> str:
    return "\n".join([
        *_render_header(report),
        *(line for claim in report["claims"] for line in _render_claim(claim)),
        *(_render_compute_mode(entry) for entry in report.get("compute_modes", [])),
        *_render_daemons(report),
        *render_plan(report),
        *(line for gpu in report.get("gpus", []) for line in _render_gpu(gpu)),
        *_render_foreign(report.get("foreign_mps_processes", [])),
        *render_health(report),
        *render_usage(report),
        *_render_findings(report),
    ])


def _render_header(report: dict[str, Any]) -> list[str]:
    lines = [f"driver {report['driver']}  checkpoint {report['checkpoint']}  cdi {report['cdi_root']}"]
    if "node_driver" in report:
        node = report["node_driver"]
        lines.append(f"device nodes from {node['device_root']}; driver libraries {node['driver_libraries']}")
    return [*lines, f"{len(report['claims'])} prepared claim(s)"]


def _render_claim(claim: dict[str, Any]) -> list[str]:
    present = "present" if claim["cdi_spec_present"] else "MISSING"
    lines = [f"- {claim['claim']}  uid={claim['uid']}  {claim['phase']}",
             f"    cdi spec ({present}): {claim['cdi_spec']}",
             *(line for dev in claim["devices"] for line in _render_device(dev))]
    if claim.get("mps_clients"):
        # Who the claim's MPS daemon admitted at prepare, and so how its limits hold (docs/sharing.md, "Tenants").
        unconfirmed = (", UNCONFIRMED (a client holds the daemon's control socket)"
                       if claim.get("mps_limits_unconfirmed") else "")
        lines.append(f"    mps clients {claim['mps_clients']}: limits {claim['mps_enforcement']}{unconfirmed}")
    if ts := claim["timeslice"]:
        lines.append(f"    time slice {ts['interval']} on {', '.join(ts['gpu_uuids'])}")
    return [*lines, *render_lines(claim)]


def _render_device(dev: dict[str, Any]) -> list[str]:
    consumed = dev.get("consumed")
    extra = "".join((
        f" mig={dev['mig']}" if dev["mig"] else "",
        f" mps-daemon={dev['mps_daemon']}" if dev["mps_daemon"] else "",
        f" share-id={dev['share_id']}" if dev["share_id"] else "",
        f" consumed={consumed['memory']},{consumed['multiprocessors']} SMs" if consumed else "",
        # Shared with the claims that hold the device: nothing set up for it, nothing limits it.
        " admin-access (shared for monitoring: no MPS, no limits)" if dev.get("admin_access") else ""))
    lines = [f"    {dev['device']:<28} {dev['kind']:<9} requests={','.join(dev['requests']) or '*'} "
             f"gpu={dev['gpu']}{extra}"]
    if (made := dev.get("dynamic_mig")) is not None:
        ids = f"GI {made['gi_id']} CI {made['ci_id']} {made['mig_uuid']}" if made["gi_id"] is not None else ""
        lines.append(f"      MIG instance {made['state']} by Tessera: {made['profile']} at placement "
                     f"{made['placement_start']} (memory slices {made['placement_start']}-"
                     f"{made['placement_start'] + made['placement_size'] - 1}) on GPU {made['gpu_minor']} "
                     f"{ids}".rstrip())
    return [*lines, *(f"      cdi: {cdi_id}" for cdi_id in dev["cdi_ids"])]


def _render_daemons(report: dict[str, Any]) -> list[str]:
    lines = [f"MPS daemons run as: {report['mps_daemons_run_by']}"] if "mps_daemons_run_by" in report else []
    if daemons := report["mps_daemons"]:
        lines.append(f"{len(daemons)} MPS control daemon(s)")
    for d in daemons:
        alive = "running" if d["pid_alive"] else "NOT RUNNING"
        threads = f"{d['active_thread_percentage']}%" if d["active_thread_percentage"] else "default"
        pinned = ", ".join(f"{uuid}={limit // 2**20}MiB" for uuid, limit in d["pinned_memory_limits"].items())
        lines += [f"- {d['id']} pid={d['pid']} ({alive}) claims={len(d['claims'])}",
                  f"    gpus={','.join(d['gpus'])} threads={threads} pinned-memory={pinned or 'default'}",
                  f"    pipe={d['pipe_dir']} log={d['log_dir']}"]
        if d.get("limits_unconfirmed"):
            lines.append(f"    limits UNCONFIRMED {d['limits_unconfirmed']}")
    return lines


def _render_gpu(gpu: dict[str, Any]) -> list[str]:
    sms = ("MIG enabled (SM counts per MIG device)" if gpu["mig_enabled"] else
           f"{gpu['multiprocessors']} SMs" if gpu["multiprocessors"] is not None else
           f"SM count not published: {gpu['multiprocessors_missing'] or 'unknown'}")
    lines = [f"GPU {gpu['minor']} {gpu['uuid']} {gpu['product']}: {sms}"]
    for mig in gpu.get("mig_instances", []):
        owner = f"created by Tessera for claim {mig['claim']}" if mig["claim"] else "not created by Tessera"
        lines.append(f"    MIG {mig['profile']} at placement {mig['placement_start']}: GI {mig['gi_id']} "
                     f"CI {mig['ci_id']} {mig['uuid']} ({owner})")
    return lines


def _render_foreign(foreign: list[dict[str, Any]]) -> list[str]:
    if not foreign:
        return []
    return [f"{len(foreign)} foreign process(es) naming a Tessera pipe directory (not started by this driver; "
            "ignored by it)",
            *(f"- pid={f['pid']} uid={f['uid']} euid={f['euid']} daemon dir {f['daemon_id']} (pipe {f['pipe_dir']})"
              for f in foreign)]


def _render_findings(report: dict[str, Any]) -> list[str]:
    return [*(f"orphan CDI spec (no checkpoint entry; removed at next driver start): {orphan}"
              for orphan in report["orphan_cdi_specs"]),
            *(f"note: {note}" for note in report.get("notes", [])),
            *(f"PROBLEM: {problem}" for problem in report["problems"])]


def discovered_gpus(settings: Settings, cp: Checkpoint | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """The GPUs discovery sees now, each with its SM count or why it has none (never silently missing), and
    its MIG instances, each with the claim Tessera created it for (dynamic MIG; from ``cp``) or none."""
    try:
        inventory = nodelayout.discover_once(settings)
    except (RuntimeError, ValueError, ImportError, OSError) as exc:
        return [], f"GPU discovery failed: {exc}"
    owners = {(d.gpu_uuid, d.mig_gi_id): f"{r.namespace}/{r.name}" for r in (cp.claims.values() if cp else ())
              for d in r.devices if d.dynamic_mig is not None and d.mig_gi_id is not None}
    return [{"minor": g.minor, "uuid": g.uuid, "product": g.product_name, "mig_enabled": g.mig_enabled,
             "multiprocessors": g.multiprocessors, "multiprocessors_missing": g.multiprocessors_missing,
             "mig_instances": [{"profile": m.profile, "placement_start": m.placement_start, "gi_id": m.gi_id,
                                "ci_id": m.ci_id, "uuid": m.uuid, "claim": owners.get((g.uuid, m.gi_id))}
                               for m in g.mig_instances]}
            for g in inventory.gpus], None


def inspect_status(settings: Settings, as_json: bool) -> tuple[int, str]:
    """(exit status, output) of ``python -m driver inspect``: 1 when the report names any problem, else 0."""
    report = build_report(settings)
    output = json.dumps(report, indent=2, default=str) if as_json else render_text(report)
    return (1 if report["problems"] else 0), output


def inspect(settings: Settings, as_json: bool) -> str:
    return inspect_status(settings, as_json)[1]


def build_report(settings: Settings) -> dict[str, Any]:
    report = collect(settings)
    if "foreign_mps_processes" not in report:  # no checkpoint to read: look-alikes are still worth showing
        add_foreign_processes(report, settings, None)
    report["node_driver"], problems = nodelayout.describe(settings)
    report["problems"].extend(problems)
    try:
        cp = CheckpointStore(settings.state_dir / "checkpoint.json").peek()
    except (ValueError, OSError):  # collect() named the problem
        cp = None
    report["gpus"], problem = discovered_gpus(settings, cp)
    if problem is not None:
        report["problems"].append(problem)
    add_health_to_inspect(report, settings.state_dir / HEALTH_FILE)
    add_usage_to_inspect(report, settings.state_dir / USAGE_FILE)
    add_plan_to_inspect(report, settings.state_dir / PLAN_USE_FILE, settings.sharing_plans)
    add_status_to_inspect(report, settings.state_dir / STATUS_FILE)
    return report
