"""Pod readers for tests that prepare claims without an API server (DeviceState directly)."""

from __future__ import annotations

from collections.abc import Sequence

from driver.kubeletplugin.podsecurity import Pod, ReservedPods

NON_ROOT_SPEC = {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000},
                 "containers": [{"name": "main", "securityContext": {"allowPrivilegeEscalation": False}}]}


class NonRootPods:
    """Every reserved pod exists and runs as a non-root user that cannot become root."""

    def read_pods(self, refs: Sequence[tuple[str, str, str]], timeout_s: float) -> ReservedPods:
        return ReservedPods(tuple(Pod.model_validate({"metadata": {"namespace": ns, "name": name, "uid": uid},
                                                      "spec": NON_ROOT_SPEC}) for ns, name, uid in refs))
