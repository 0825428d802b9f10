"""Pod readers for tests that prepare claims without an API server (DeviceState directly)."""

from __future__ import annotations

from collections.abc import Sequence

from driver.kubeletplugin.podspec import Pod
from driver.kubeletplugin.reservedpods import PodRef

# A pod that passes clients: nonRoot: Pod Security "baseline", a non-root user and group, no escalation.
NON_ROOT_SPEC = {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000},
                 "containers": [{"name": "main", "securityContext": {"allowPrivilegeEscalation": False}}]}


class NonRootPods:
    """Every reserved pod exists and runs as a non-root user and group that cannot become root."""

    def read_pods(self, refs: Sequence[PodRef], timeout_s: float) -> list[Pod | None]:
        return [Pod.model_validate({"metadata": {"namespace": ns, "name": name, "uid": uid}, "spec": NON_ROOT_SPEC})
                for ns, name, uid in refs]
