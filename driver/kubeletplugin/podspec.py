"""The fields of a Pod that decide what its containers can do on the host, read strictly.

A pod carries many fields no admission rule reads; they are ignored. The ones a rule reads are
typed strictly (``"0"`` is not a UID), so an object this driver cannot judge is an error, never a
default: :mod:`driver.kubeletplugin.podsecurity` judges the pod, and
:mod:`driver.kubeletplugin.reservedpods` decides which pods to judge.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _ServerObject(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True, frozen=True, strict=True)


class Capabilities(_ServerObject):
    add: list[str] = Field(default_factory=list)


class TypedProfile(_ServerObject):
    """A seccompProfile or appArmorProfile: only the type is judged."""

    type: str = ""


class SELinuxOptions(_ServerObject):
    user: str = ""
    role: str = ""
    type: str = ""
    level: str = ""


class WindowsOptions(_ServerObject):
    host_process: bool | None = Field(default=None, alias="hostProcess")


class Sysctl(_ServerObject):
    name: str
    value: str = ""


class _SharedSecurityContext(_ServerObject):
    """The fields a container's securityContext and the pod's both have."""

    run_as_user: int | None = Field(default=None, alias="runAsUser")
    run_as_group: int | None = Field(default=None, alias="runAsGroup")
    run_as_non_root: bool | None = Field(default=None, alias="runAsNonRoot")
    seccomp_profile: TypedProfile | None = Field(default=None, alias="seccompProfile")
    app_armor_profile: TypedProfile | None = Field(default=None, alias="appArmorProfile")
    se_linux_options: SELinuxOptions | None = Field(default=None, alias="seLinuxOptions")
    windows_options: WindowsOptions | None = Field(default=None, alias="windowsOptions")


class SecurityContext(_SharedSecurityContext):
    privileged: bool | None = None
    allow_privilege_escalation: bool | None = Field(default=None, alias="allowPrivilegeEscalation")
    capabilities: Capabilities | None = None
    proc_mount: str | None = Field(default=None, alias="procMount")


class PodSecurityContext(_SharedSecurityContext):
    supplemental_groups: list[int] = Field(default_factory=list, alias="supplementalGroups")
    fs_group: int | None = Field(default=None, alias="fsGroup")
    sysctls: list[Sysctl] = Field(default_factory=list)


class ContainerPort(_ServerObject):
    host_port: int | None = Field(default=None, alias="hostPort")


class VolumeMount(_ServerObject):
    name: str


class Container(_ServerObject):
    name: str
    security_context: SecurityContext | None = Field(default=None, alias="securityContext")
    ports: list[ContainerPort] = Field(default_factory=list)
    volume_mounts: list[VolumeMount] = Field(default_factory=list, alias="volumeMounts")


class HostPathSource(_ServerObject):
    path: str = ""


class Volume(_ServerObject):
    name: str
    host_path: HostPathSource | None = Field(default=None, alias="hostPath")


class PodSpec(_ServerObject):
    host_users: bool | None = Field(default=None, alias="hostUsers")
    host_network: bool | None = Field(default=None, alias="hostNetwork")
    host_pid: bool | None = Field(default=None, alias="hostPID")
    host_ipc: bool | None = Field(default=None, alias="hostIPC")
    security_context: PodSecurityContext | None = Field(default=None, alias="securityContext")
    volumes: list[Volume] = Field(default_factory=list)
    init_containers: list[Container] = Field(default_factory=list, alias="initContainers")
    containers: list[Container] = Field(default_factory=list)
    ephemeral_containers: list[Container] = Field(default_factory=list, alias="ephemeralContainers")


class PodMeta(_ServerObject):
    name: str
    namespace: str = ""
    uid: str
    annotations: dict[str, str] = Field(default_factory=dict)


class Pod(_ServerObject):
    metadata: PodMeta
    spec: PodSpec = Field(default_factory=PodSpec)

    def __str__(self) -> str:
        return f"{self.metadata.namespace}/{self.metadata.name}"
