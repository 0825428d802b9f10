"""Which containers of a pod may run as UID 0 on the host, and why: a pure function over the pod spec.

A driver that lets several claims share one node-side service (a daemon that takes control
commands from root only, for example) must know whether a claim's pods could act as host root.
:func:`host_root_containers` answers that from the fields the kubelet and the container runtime
honour, naming for each container the field that makes it root-capable and the field to set.

The rules (Kubernetes API reference, SecurityContext / PodSecurityContext; kubernetes.io "User
Namespaces"; container-level fields win over pod-level ones):

* ``spec.hostUsers: false`` runs the pod in a user namespace: UID 0 inside maps to an unprivileged
  host UID, so ``runAsUser: 0``, privilege escalation and added capabilities stay inside it. Only
  ``privileged: true`` still counts there (kept as host root: it is the one setting no rule here
  can narrow).
* Otherwise a container may run as host root when it is ``privileged``; or its effective
  ``runAsUser`` is 0 (unless ``runAsNonRoot: true``, with which the kubelet refuses to start it);
  or it has neither ``runAsNonRoot: true`` nor a non-zero ``runAsUser`` (the image's user decides,
  and many images run as root); or ``allowPrivilegeEscalation`` is not ``false`` (a set-user-ID
  root program in the image makes a non-root process root: the kernel's ``no_new_privs`` is off);
  or it adds a capability that is root's power (``SYS_ADMIN``, ``SYS_PTRACE``, ``SETUID``, ``ALL``).
  ``runAsNonRoot: true`` without ``runAsUser`` counts as non-root: the kubelet starts the container
  only if the image's user is numeric and not 0.

Init, regular and ephemeral containers are all checked: each has its own securityContext.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

ContainerKind = Literal["initContainer", "container", "ephemeralContainer"]

# Capabilities that are root's power whatever the UID: SYS_ADMIN and SYS_PTRACE (reaching other
# processes and their files), SETUID (setuid(0) itself), and ALL.
ROOT_CAPABILITIES = frozenset({"SYS_ADMIN", "SYS_PTRACE", "SETUID", "ALL"})

_SET_NON_ROOT = "set securityContext.runAsNonRoot: true or runAsUser: <non-zero> on the pod or container"


class _ServerObject(BaseModel):
    # A pod carries many fields this check does not read; ignore them, but read the ones it does strictly.
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True, strict=True)


class Capabilities(_ServerObject):
    add: list[str] = Field(default_factory=list)


class SecurityContext(_ServerObject):
    """The fields of a container's securityContext (and, for the first two, the pod's) read here."""

    run_as_user: int | None = Field(default=None, alias="runAsUser")
    run_as_non_root: bool | None = Field(default=None, alias="runAsNonRoot")
    privileged: bool | None = None
    allow_privilege_escalation: bool | None = Field(default=None, alias="allowPrivilegeEscalation")
    capabilities: Capabilities | None = None


class Container(_ServerObject):
    name: str
    security_context: SecurityContext | None = Field(default=None, alias="securityContext")


class PodSpec(_ServerObject):
    host_users: bool | None = Field(default=None, alias="hostUsers")
    security_context: SecurityContext | None = Field(default=None, alias="securityContext")
    init_containers: list[Container] = Field(default_factory=list, alias="initContainers")
    containers: list[Container] = Field(default_factory=list)
    ephemeral_containers: list[Container] = Field(default_factory=list, alias="ephemeralContainers")


class PodMeta(_ServerObject):
    name: str
    namespace: str = ""
    uid: str


class Pod(_ServerObject):
    metadata: PodMeta
    spec: PodSpec = Field(default_factory=PodSpec)

    def __str__(self) -> str:
        return f"{self.metadata.namespace}/{self.metadata.name}"


@dataclass(frozen=True)
class HostRootContainer:
    """One container that may run as host UID 0: why (the field, as the user wrote it or left it), and what to set."""

    pod: str  # namespace/name
    container: str
    kind: ContainerKind
    reason: str
    fix: str

    def describe(self) -> str:
        """``pod ns/name container "main" may run as root (<reason>)``, the start of a one-line refusal."""
        what = {"initContainer": "init container ", "container": "container ",
                "ephemeralContainer": "ephemeral container "}[self.kind]
        return f'pod {self.pod} {what}"{self.container}" may run as root ({self.reason})'


def host_root_containers(pod: Pod) -> list[HostRootContainer]:
    """Every container of ``pod`` that may run as UID 0 on the host, init containers first, in spec order."""
    spec = pod.spec
    pod_sc = spec.security_context or SecurityContext()
    user_namespace = spec.host_users is False
    found: list[HostRootContainer] = []
    groups: tuple[tuple[ContainerKind, list[Container]], ...] = (
        ("initContainer", spec.init_containers), ("container", spec.containers),
        ("ephemeralContainer", spec.ephemeral_containers))
    for kind, containers in groups:
        for container in containers:
            why = _why_root(container.security_context or SecurityContext(), pod_sc, user_namespace)
            if why is not None:
                found.append(HostRootContainer(str(pod), container.name, kind, why[0], why[1]))
    return found


def _why_root(sc: SecurityContext, pod_sc: SecurityContext, user_namespace: bool) -> tuple[str, str] | None:
    """(reason, fix) if a container with ``sc`` in a pod with ``pod_sc`` may run as host root, else None."""
    if sc.privileged:
        return "securityContext.privileged: true", "remove securityContext.privileged: true from the container"
    if user_namespace:
        return None
    user = sc.run_as_user if sc.run_as_user is not None else pod_sc.run_as_user
    non_root = sc.run_as_non_root if sc.run_as_non_root is not None else pod_sc.run_as_non_root
    if user == 0 and non_root is True:
        return None  # the kubelet refuses to start it ("container has runAsNonRoot and image will run as root")
    if user == 0:
        level = "container" if sc.run_as_user is not None else "pod"
        return f"runAsUser: 0 at {level} level", _SET_NON_ROOT.replace("runAsNonRoot: true or ", "")
    if user is None and non_root is not True:
        return "no runAsNonRoot: true or non-zero runAsUser at pod or container level", _SET_NON_ROOT
    if sc.allow_privilege_escalation is not False:
        return ("no allowPrivilegeEscalation: false, so a set-user-ID root program in its image can make it root",
                "set securityContext.allowPrivilegeEscalation: false on the container")
    added = sorted(_root_capabilities(sc.capabilities.add if sc.capabilities else []))
    if added:
        return (f"securityContext.capabilities.add has {', '.join(added)}",
                f"remove {', '.join(added)} from securityContext.capabilities.add")
    return None


def _root_capabilities(names: Sequence[str]) -> set[str]:
    # Runtimes accept both "SYS_ADMIN" and "CAP_SYS_ADMIN", in any case.
    normal = {n.upper().removeprefix("CAP_") for n in names}
    return normal & ROOT_CAPABILITIES


# ----------------------------------------------------------------------------- the pods of a claim


@dataclass(frozen=True)
class ReservedPods:
    """The pods a claim is reserved for, as read at prepare.

    ``pods``: those found with the UID the claim names. ``skipped``: one line per reserved pod that
    was not checked because it cannot run (deleted, or re-created under a new UID).
    """

    pods: tuple[Pod, ...] = ()
    skipped: tuple[str, ...] = ()

    def host_root(self) -> list[HostRootContainer]:
        return [c for pod in self.pods for c in host_root_containers(pod)]


class PodsUnreadable(Exception):
    """The pods of a claim could not be read; the message says why and what to do."""


class PodReader(Protocol):
    """Reads the pods a claim is reserved for (``(namespace, name, uid)`` each) within ``timeout_s``."""

    def read_pods(self, refs: Sequence[tuple[str, str, str]], timeout_s: float) -> ReservedPods:
        """The pods, or raise :class:`PodsUnreadable`."""
        ...

