"""``inspect``'s text: every section of a report, in order, as an operator reads it."""

from __future__ import annotations

from typing import Any

from driver.commands.inspect import render_text

GPU0 = "GPU-0"
MIG = "MIG-1"


def _full_report() -> dict[str, Any]:
    return {
        "driver": "gpu.tessera.dev", "checkpoint": "/state/checkpoint.json", "cdi_root": "/cdi",
        "node_driver": {"device_root": "/host/dev", "driver_libraries": "/host/usr/lib"},
        "claims": [
            {"claim": "team-a/train", "uid": "u1", "phase": "PrepareCompleted", "cdi_spec": "/cdi/u1.json",
             "cdi_spec_present": True, "mps_clients": "uid 1000", "mps_enforcement": "hold",
             "mps_limits_unconfirmed": ["claim-u1-0"], "timeslice": {"interval": "Long", "gpu_uuids": [GPU0, "GPU-2"]},
             "status_devices": [{"device": "gpu-0", "conditions": [{"type": "Ready", "status": "True"}],
                                 "data": {"b": 1, "a": "x"}}],
             "devices": [
                 {"device": "gpu-0-mig-1g10gb-0", "kind": "mig", "requests": ["gpu", "more"], "gpu": GPU0, "mig": MIG,
                  "mps_daemon": "claim-u1-0", "share_id": "s-1", "consumed": {"memory": "10Gi", "multiprocessors": 33},
                  "admin_access": True, "cdi_ids": ["k8s.gpu.tessera.dev/claim=u1-a", "k8s.gpu.tessera.dev/claim=u1-b"],
                  "dynamic_mig": {"gi_id": 3, "ci_id": 0, "mig_uuid": MIG, "state": "created", "profile": "1g.10gb",
                                  "placement_start": 4, "placement_size": 2, "gpu_minor": 0}},
                 {"device": "gpu-1-mig-2g20gb-0", "kind": "mig", "requests": [], "gpu": "GPU-1", "mig": None,
                  "mps_daemon": None, "share_id": None, "consumed": None, "admin_access": False, "cdi_ids": [],
                  "dynamic_mig": {"gi_id": None, "ci_id": None, "mig_uuid": None, "state": "planned",
                                  "profile": "2g.20gb", "placement_start": 0, "placement_size": 4, "gpu_minor": 1}},
             ]},
            {"claim": "team-b/idle", "uid": "u2", "phase": "PrepareStarted", "cdi_spec": "/cdi/u2.json",
             "cdi_spec_present": False, "mps_clients": None, "timeslice": None,
             "devices": [{"device": "gpu-2", "kind": "gpu", "requests": ["gpu"], "gpu": "GPU-2", "mig": None,
                          "mps_daemon": None, "share_id": None, "cdi_ids": ["k8s.gpu.tessera.dev/claim=u2-gpu-2"]}]},
            {"claim": "team-c/mps", "uid": "u3", "phase": "PrepareCompleted", "cdi_spec": "/cdi/u3.json",
             "cdi_spec_present": True, "mps_clients": "any", "mps_enforcement": "advisory",
             "mps_limits_unconfirmed": [], "timeslice": None, "devices": []},
        ],
        "compute_modes": [{"gpu": GPU0, "mode": "EXCLUSIVE_PROCESS", "restore_to": "DEFAULT", "claims": ["u1"]},
                          {"gpu": "GPU-1", "mode": None, "restore_to": None, "claims": []}],
        "mps_daemons_run_by": "child processes",
        "mps_daemons": [
            {"id": "claim-u1-0", "pid": 42, "pid_alive": True, "gpus": [GPU0, "GPU-1"], "active_thread_percentage": 40,
             "pinned_memory_limits": {GPU0: 3 << 30, "GPU-1": (5 << 20) + 7}, "pipe_dir": "/mps/p", "log_dir": "/mps/l",
             "claims": ["u1"], "limits_unconfirmed": "a client holds the socket"},
            {"id": "plan-000000000000", "pid": 43, "pid_alive": False, "gpus": ["GPU-2"],
             "active_thread_percentage": None, "pinned_memory_limits": {}, "pipe_dir": "/mps/p2", "log_dir": "/mps/l2",
             "claims": [], "limits_unconfirmed": None},
        ],
        "gpus": [
            {"minor": 0, "uuid": GPU0, "product": "NVIDIA H100", "mig_enabled": True, "multiprocessors": 132,
             "multiprocessors_missing": None,
             "mig_instances": [{"profile": "1g.10gb", "placement_start": 4, "gi_id": 3, "ci_id": 0, "uuid": MIG,
                                "claim": "team-a/train"},
                               {"profile": "3g.40gb", "placement_start": 0, "gi_id": 1, "ci_id": 0, "uuid": "MIG-2",
                                "claim": None}]},
            {"minor": 1, "uuid": "GPU-1", "product": "NVIDIA A100", "mig_enabled": False, "multiprocessors": 108,
             "multiprocessors_missing": None, "mig_instances": []},
            {"minor": 2, "uuid": "GPU-2", "product": "NVIDIA L4", "mig_enabled": False, "multiprocessors": None,
             "multiprocessors_missing": "nvmlDeviceGetAttributes not supported"},
            {"minor": 3, "uuid": "GPU-3", "product": "NVIDIA T4", "mig_enabled": False, "multiprocessors": None,
             "multiprocessors_missing": None},
        ],
        "foreign_mps_processes": [{"pid": 7, "uid": 1000, "euid": 0, "daemon_id": "plan-000000000000",
                                   "pipe_dir": "/mps/plan-000000000000/pipe"}],
        "device_health": {"gpu-0": {"health": "Healthy", "message": ""},
                          "gpu-1": {"health": "Unhealthy", "message": "Xid 79"}},
        "orphan_cdi_specs": ["/cdi/orphan.json"],
        "notes": ["a note"],
        "problems": ["first problem", "second problem"],
    }


def test_a_report_with_every_section_renders_each_line_in_order() -> None:
    assert render_text(_full_report()).splitlines() == [
        "driver gpu.tessera.dev  checkpoint /state/checkpoint.json  cdi /cdi",
        "device nodes from /host/dev; driver libraries /host/usr/lib",
        "3 prepared claim(s)",
        "- team-a/train  uid=u1  PrepareCompleted",
        "    cdi spec (present): /cdi/u1.json",
        "    gpu-0-mig-1g10gb-0           mig       requests=gpu,more gpu=GPU-0 mig=MIG-1 mps-daemon=claim-u1-0"
        " share-id=s-1 consumed=10Gi,33 SMs admin-access (shared for monitoring: no MPS, no limits)",
        "      MIG instance created by Tessera: 1g.10gb at placement 4 (memory slices 4-5) on GPU 0 GI 3 CI 0 MIG-1",
        "      cdi: k8s.gpu.tessera.dev/claim=u1-a",
        "      cdi: k8s.gpu.tessera.dev/claim=u1-b",
        "    gpu-1-mig-2g20gb-0           mig       requests=* gpu=GPU-1",
        "      MIG instance planned by Tessera: 2g.20gb at placement 0 (memory slices 0-3) on GPU 1",
        "    mps clients uid 1000: limits hold, UNCONFIRMED (a client holds the daemon's control socket)",
        "    time slice Long on GPU-0, GPU-2",
        '    status.devices gpu-0: Ready=True {"a":"x","b":1}',
        "- team-b/idle  uid=u2  PrepareStarted",
        "    cdi spec (MISSING): /cdi/u2.json",
        "    gpu-2                        gpu       requests=gpu gpu=GPU-2",
        "      cdi: k8s.gpu.tessera.dev/claim=u2-gpu-2",
        "- team-c/mps  uid=u3  PrepareCompleted",
        "    cdi spec (present): /cdi/u3.json",
        "    mps clients any: limits advisory",
        "GPU-0: compute mode EXCLUSIVE_PROCESS for MPS, held by 1 claim(s); restored to DEFAULT when the last one"
        " is unprepared",
        "GPU-1: compute mode to be restored to unknown (not recorded) (no MPS daemon serves it any more)",
        "MPS daemons run as: child processes",
        "2 MPS control daemon(s)",
        "- claim-u1-0 pid=42 (running) claims=1",
        "    gpus=GPU-0,GPU-1 threads=40% pinned-memory=GPU-0=3072MiB, GPU-1=5MiB",
        "    pipe=/mps/p log=/mps/l",
        "    limits UNCONFIRMED a client holds the socket",
        "- plan-000000000000 pid=43 (NOT RUNNING) claims=0",
        "    gpus=GPU-2 threads=default pinned-memory=default",
        "    pipe=/mps/p2 log=/mps/l2",
        "sharing plan: not known (the driver has not written one: not started yet, or an older version)",
        "GPU 0 GPU-0 NVIDIA H100: MIG enabled (SM counts per MIG device)",
        "    MIG 1g.10gb at placement 4: GI 3 CI 0 MIG-1 (created by Tessera for claim team-a/train)",
        "    MIG 3g.40gb at placement 0: GI 1 CI 0 MIG-2 (not created by Tessera)",
        "GPU 1 GPU-1 NVIDIA A100: 108 SMs",
        "GPU 2 GPU-2 NVIDIA L4: SM count not published: nvmlDeviceGetAttributes not supported",
        "GPU 3 GPU-3 NVIDIA T4: SM count not published: unknown",
        "1 foreign process(es) naming a Tessera pipe directory (not started by this driver; ignored by it)",
        "- pid=7 uid=1000 euid=0 daemon dir plan-000000000000 (pipe /mps/plan-000000000000/pipe)",
        "device health: 1 healthy, 1 not",
        "- gpu-1: Unhealthy Xid 79",
        "orphan CDI spec (no checkpoint entry; removed at next driver start): /cdi/orphan.json",
        "note: a note",
        "PROBLEM: first problem",
        "PROBLEM: second problem",
    ]


def test_a_report_with_nothing_in_it_says_so_in_three_lines() -> None:
    report: dict[str, Any] = {"driver": "d", "checkpoint": "/c", "cdi_root": "/cdi", "claims": [], "mps_daemons": [],
                              "orphan_cdi_specs": [], "problems": []}
    assert render_text(report).splitlines() == [
        "driver d  checkpoint /c  cdi /cdi",
        "0 prepared claim(s)",
        "sharing plan: not known (the driver has not written one: not started yet, or an older version)",
    ]
