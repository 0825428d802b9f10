"""Which pods cannot reach host root: Pod Security "baseline", and no root user or group. Pure.

A driver that lets several claims share one node-side service (a daemon that takes control
commands from root only, for example) admits only pods that cannot act as host root.
:func:`violations` names, for one pod, every field that breaks the rule, as the user wrote it (or
left it), why it matters, and what to set. The rule is one users already know
(kubernetes.io "Pod Security Standards"):

* the whole ``baseline`` profile: no hostProcess, host namespaces, privileged containers,
  capabilities beyond baseline's list, hostPath volumes, host ports, AppArmor or SELinux
  overrides, ``procMount`` other than Default, ``Unconfined`` seccomp, unsafe sysctls;
* ``restricted``'s user rules: ``runAsNonRoot: true`` (container, else pod), no ``runAsUser: 0``
  anywhere, ``allowPrivilegeEscalation: false`` (a set-user-ID root program in the image would
  otherwise make a non-root process root);
* no group root: a non-zero ``runAsGroup`` (container, else pod: without one the image decides,
  and runtimes give a UID missing from the image's ``/etc/passwd`` GID 0), no GID 0 in
  ``runAsGroup``, ``supplementalGroups`` or ``fsGroup``, and no added ``SETUID`` / ``SETGID``
  (baseline allows both; either lets a process make itself root or group root).

``spec.hostUsers: false`` (a user namespace) maps UID and GID 0 to unprivileged host IDs, so the
user and group rules do not apply there (as Pod Security relaxes its user rules for such pods);
baseline does. Init, regular and ephemeral containers are all judged: each has its own
securityContext, and where both levels set a field the container's wins (Kubernetes API
reference). A forbidden value is refused at either level even where the other overrides it, as
Pod Security does.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from driver.kubeletplugin.podspec import Container, Pod, PodSecurityContext, SecurityContext, TypedProfile

ContainerKind = Literal["initContainer", "container", "ephemeralContainer"]

BASELINE = 'Pod Security "baseline"'
RESTRICTED = 'Pod Security "restricted"'
NO_GROUP_ROOT = "clients: nonRoot (no group root)"
NO_ROOT_IDS = "clients: nonRoot (no way to root user or group)"

# Pod Security "baseline": the capabilities a container may add (exact names, as the profile lists them).
BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE", "SETFCAP",
    "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"})
# Baseline's capabilities that make a process root or group root: setuid(0), setgid(0).
ROOT_ID_CAPABILITIES = ("SETUID", "SETGID")
# Pod Security "baseline": the safe sysctls (kubernetes.io "Using sysctls in a Kubernetes Cluster").
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"})
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
# seccompProfile.type and appArmorProfile.type: unset, RuntimeDefault or Localhost (not Unconfined).
PROFILE_TYPES = frozenset({"", "RuntimeDefault", "Localhost"})
APPARMOR_ANNOTATION = "container.apparmor.security.beta.kubernetes.io/"

_KIND_WORDS = {"initContainer": "init container", "container": "container",
               "ephemeralContainer": "ephemeral container"}
_FIELD_LISTS = {"initContainer": "initContainers", "container": "containers",
                "ephemeralContainer": "ephemeralContainers"}
_ROOT_ID = {"SETUID": "root", "SETGID": "group root"}
_GROUP_ROOT = "group root can open the root group's files and sockets"
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,252}")


def shown(value: str, limit: int = 80) -> str:
    """``value`` quoted and escaped to one printable line, cut after ``limit`` characters."""
    return json.dumps(value[:limit]) + ("..." if len(value) > limit else "")


@dataclass(frozen=True)
class Violation:
    """One field of one pod that breaks the rule: where, the field and the rule, why, and what to set."""

    pod: str  # namespace/name, escaped where needed
    kind: ContainerKind | None  # None: a pod-level field no container owns
    container: str
    statement: str  # 'spec.hostPID: true is not allowed by Pod Security "baseline"'
    why: str
    fix: str

    def describe(self) -> str:
        """``pod ns/name container "main": <field> <rule> (<why>)``, one line."""
        where = f" {_KIND_WORDS[self.kind]} {shown(self.container)}" if self.kind is not None else ""
        return f"pod {self.pod}{where}: {self.statement} ({self.why})"


def pod_name(namespace: str, name: str) -> str:
    """``namespace/name`` as a user reads it; escaped if the server sent anything but a plain name."""
    text = f"{namespace}/{name}"
    return text if _PLAIN.fullmatch(text) else shown(text)


def violations(pod: Pod) -> list[Violation]:
    """Every field of ``pod`` that breaks the rule: pod-level fields first, then each container in spec order."""
    return [*_pod_fields(pod), *(v for kind, index, c in _containers(pod) for v in _container(pod, kind, index, c))]


def _containers(pod: Pod) -> Iterator[tuple[ContainerKind, int, Container]]:
    spec = pod.spec
    groups: tuple[tuple[ContainerKind, list[Container]], ...] = (
        ("initContainer", spec.init_containers), ("container", spec.containers),
        ("ephemeralContainer", spec.ephemeral_containers))
    for kind, containers in groups:
        for index, container in enumerate(containers):
            yield kind, index, container


def _pod_fields(pod: Pod) -> Iterator[Violation]:
    spec = pod.spec
    sc = spec.security_context or PodSecurityContext()
    name = pod_name(pod.metadata.namespace, pod.metadata.name)

    def at_pod(statement: str, why: str, fix: str) -> Violation:
        return Violation(name, None, "", statement, why, fix)

    namespaces = (("hostNetwork", spec.host_network, "the host's network namespace: its local sockets and ports"),
                  ("hostPID", spec.host_pid, "the host's processes, to see and signal"),
                  ("hostIPC", spec.host_ipc, "the host's IPC namespace and its shared memory"))
    for field, value, what in namespaces:
        if value:
            yield at_pod(f"spec.{field}: true is not allowed by {BASELINE}", f"it shares {what}",
                         f"remove spec.{field}")
    for index, volume in enumerate(spec.volumes):
        if volume.host_path is not None:
            owner = next(((k, c.name) for k, _, c in _containers(pod)
                          if any(m.name == volume.name for m in c.volume_mounts)), None)
            yield Violation(name, owner[0] if owner else None, owner[1] if owner else "",
                            f"spec.volumes[{index}].hostPath is not allowed by {BASELINE}",
                            f"a host path can reach host root; this one is {shown(volume.host_path.path)}",
                            f"use another volume type than hostPath for volume {shown(volume.name)}")
    yield from (at_pod(s, w, f) for s, w, f in _shared_fields("spec.securityContext", sc))
    for index, sysctl in enumerate(sc.sysctls):
        if sysctl.name not in SAFE_SYSCTLS:
            yield at_pod(f"spec.securityContext.sysctls[{index}].name {shown(sysctl.name)} is not allowed by "
                         f"{BASELINE}", "only the safe sysctls are namespaced and isolated from other pods",
                         "remove the sysctl or have the node's own configuration set it")
    for key, profile in pod.metadata.annotations.items():
        if key.startswith(APPARMOR_ANNOTATION) and profile != "runtime/default" and not profile.startswith(
                "localhost/"):
            annotated = key.removeprefix(APPARMOR_ANNOTATION)
            annotated_kind = next((k for k, _, c in _containers(pod) if c.name == annotated), None)
            yield Violation(name, annotated_kind, annotated if annotated_kind else "",
                            f"metadata.annotations[{shown(key)}]: {shown(profile)} is not allowed by {BASELINE}",
                            "only runtime/default or localhost/<profile> keeps an AppArmor profile",
                            "remove the annotation or set runtime/default")
    if spec.host_users is False:
        return
    if sc.run_as_user == 0:
        yield at_pod(f"spec.securityContext.runAsUser: 0 is not allowed by {RESTRICTED}", "it runs as root",
                     "set a non-zero runAsUser")
    groups = (("runAsGroup", sc.run_as_group), ("fsGroup", sc.fs_group),
              *((f"supplementalGroups[{i}]", g) for i, g in enumerate(sc.supplemental_groups)))
    for field, gid in groups:
        if gid == 0:
            yield at_pod(f"spec.securityContext.{field}: 0 is not allowed by {NO_GROUP_ROOT}", _GROUP_ROOT,
                         f"set a non-zero {field.split('[')[0]}")


def _container(pod: Pod, kind: ContainerKind, index: int, container: Container) -> Iterator[Violation]:
    sc = container.security_context or SecurityContext()
    pod_sc = pod.spec.security_context or PodSecurityContext()
    path = f"spec.{_FIELD_LISTS[kind]}[{index}]"
    name = pod_name(pod.metadata.namespace, pod.metadata.name)

    def at(statement: str, why: str, fix: str) -> Violation:
        return Violation(name, kind, container.name, statement, why, fix)

    if sc.privileged:
        yield at(f"{path}.securityContext.privileged: true is not allowed by {BASELINE}",
                 "a privileged container is root on the host", "remove securityContext.privileged")
    added = sc.capabilities.add if sc.capabilities else []
    for cap_index, cap in enumerate(added):
        if cap not in BASELINE_CAPABILITIES:
            yield at(f"{path}.securityContext.capabilities.add[{cap_index}] {shown(cap)} is not allowed by "
                     f"{BASELINE}", "only baseline's capabilities keep a container from the host's power",
                     f"remove {shown(cap)} from securityContext.capabilities.add")
    for port_index, port in enumerate(container.ports):
        if port.host_port:
            yield at(f"{path}.ports[{port_index}].hostPort: {port.host_port} is not allowed by {BASELINE}",
                     "it binds a port on the host's network", "remove hostPort")
    if sc.proc_mount not in (None, "Default"):
        yield at(f"{path}.securityContext.procMount: {shown(sc.proc_mount)} is not allowed by {BASELINE}",
                 "an unmasked /proc shows the host's kernel settings", "remove procMount or set Default")
    yield from (at(s, w, f) for s, w, f in _shared_fields(f"{path}.securityContext", sc))
    if pod.spec.host_users is False:
        return
    if sc.run_as_user == 0:
        yield at(f"{path}.securityContext.runAsUser: 0 is not allowed by {RESTRICTED}", "it runs as root",
                 "set a non-zero runAsUser")
    non_root = sc.run_as_non_root if sc.run_as_non_root is not None else pod_sc.run_as_non_root
    if non_root is not True:
        where = "is false" if sc.run_as_non_root is False else "is not true here or in spec.securityContext"
        yield at(f"{path}.securityContext.runAsNonRoot {where}; {RESTRICTED} requires true",
                 "without it the image's user decides, and that may be root",
                 "set securityContext.runAsNonRoot: true on the pod or container")
    for cap_index, cap in enumerate(added):
        if cap in ROOT_ID_CAPABILITIES:
            yield at(f"{path}.securityContext.capabilities.add[{cap_index}] {shown(cap)} is not allowed by "
                     f"{NO_ROOT_IDS}", f"with {cap} a process can make itself {_ROOT_ID[cap]}",
                     f"remove {cap} from securityContext.capabilities.add")
    if sc.allow_privilege_escalation is not False:
        shown_value = "true" if sc.allow_privilege_escalation else "not set"
        yield at(f"{path}.securityContext.allowPrivilegeEscalation is {shown_value}; {RESTRICTED} requires false",
                 "a set-user-ID root program in the image would make the process root",
                 "set securityContext.allowPrivilegeEscalation: false on the container")
    group = sc.run_as_group if sc.run_as_group is not None else pod_sc.run_as_group
    if sc.run_as_group == 0:
        yield at(f"{path}.securityContext.runAsGroup: 0 is not allowed by {NO_GROUP_ROOT}",
                 _GROUP_ROOT, "set a non-zero runAsGroup")
    elif group is None:
        yield at(f"{path}.securityContext.runAsGroup is not set here or in spec.securityContext; "
                 f"{NO_GROUP_ROOT} requires a non-zero one",
                 "without it the image decides, and a user missing from its /etc/passwd gets group 0",
                 "set securityContext.runAsGroup: <non-zero> on the pod or container")


def _shared_fields(path: str, sc: SecurityContext | PodSecurityContext) -> Iterator[tuple[str, str, str]]:
    """(statement, why, fix) for the baseline fields both levels have: seccomp, AppArmor, SELinux, hostProcess."""
    seccomp = _profile_type(sc.seccomp_profile)
    if seccomp not in PROFILE_TYPES:
        yield (f"{path}.seccompProfile.type: {shown(seccomp)} is not allowed by {BASELINE}",
               "without a seccomp filter every system call of the host's kernel is open",
               "set seccompProfile.type: RuntimeDefault or remove it")
    apparmor = _profile_type(sc.app_armor_profile)
    if apparmor not in PROFILE_TYPES:
        yield (f"{path}.appArmorProfile.type: {shown(apparmor)} is not allowed by {BASELINE}",
               "only RuntimeDefault or Localhost keeps an AppArmor profile",
               "set appArmorProfile.type: RuntimeDefault or remove it")
    selinux = sc.se_linux_options
    if selinux is not None:
        if selinux.type not in SELINUX_TYPES:
            yield (f"{path}.seLinuxOptions.type: {shown(selinux.type)} is not allowed by {BASELINE}",
                   "only the container types keep SELinux's confinement", "remove seLinuxOptions.type")
        for field, value in (("user", selinux.user), ("role", selinux.role)):
            if value:
                yield (f"{path}.seLinuxOptions.{field}: {shown(value)} is not allowed by {BASELINE}",
                       "a custom SELinux user or role can leave the container's confinement",
                       f"remove seLinuxOptions.{field}")
    if sc.windows_options is not None and sc.windows_options.host_process:
        yield (f"{path}.windowsOptions.hostProcess: true is not allowed by {BASELINE}",
               "a host process container runs on the host itself", "remove windowsOptions.hostProcess")


def _profile_type(profile: TypedProfile | None) -> str:
    return profile.type if profile is not None else ""
