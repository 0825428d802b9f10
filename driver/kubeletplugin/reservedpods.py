"""Who will use a claim: the pods in its ``status.reservedFor``, judged so that any doubt refuses. Pure.

The kubelet runs a pod with a claim only if the claim's ``reservedFor`` names that pod **by UID**
(the entry's name is not compared). A driver that admits only some pods must therefore know
every consumer: an entry that is not a core Pod (``apiGroup: ""``, ``resource: pods``; a
Deployment, a Job, or ``apiGroup: core``, which is no API group) hides the pods that would use the
claim, and a pod read by the entry's name that carries another UID is not the pod the kubelet
would run. Each is refused, as is a claim reserved for no pod at all. A pod that is gone (404)
cannot run and is skipped; if every pod is gone, none can use the claim and it is refused too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from driver.kubeletplugin.podsecurity import Violation, pod_name, shown, violations
from driver.kubeletplugin.podspec import Pod

# (namespace, name, uid) of a pod a claim is reserved for.
PodRef = tuple[str, str, str]


class PodsUnreadable(Exception):
    """The pods of a claim could not be read; the message says why and what to do."""


class PodReader(Protocol):
    """Reads pods by namespace and name within ``timeout_s``."""

    def read_pods(self, refs: Sequence[PodRef], timeout_s: float) -> list[Pod | None]:
        """One answer per ref, in order: the pod under that name (whatever its UID), None if it is gone; or
        raise :class:`PodsUnreadable`."""
        ...


@dataclass(frozen=True)
class Consumer:
    """One ``status.reservedFor`` entry."""

    api_group: str
    resource: str
    name: str
    uid: str

    @property
    def is_pod(self) -> bool:
        return self.api_group == "" and self.resource == "pods"


@dataclass(frozen=True)
class Unknown:
    """A consumer whose pods cannot be judged; one line, and what to do."""

    line: str
    fix: str

    def describe(self) -> str:
        return self.line


Finding = Violation | Unknown


@dataclass(frozen=True)
class ReservedPods:
    """The consumers of a claim, as read at prepare.

    ``pods``: read by name and carrying the UID the claim names. ``unknown``: consumers that cannot
    be judged. ``skipped``: one line per reserved pod that is gone.
    """

    pods: tuple[Pod, ...] = ()
    unknown: tuple[Unknown, ...] = ()
    skipped: tuple[str, ...] = ()

    def findings(self) -> list[Finding]:
        """Why the claim may not be used by pods that must not reach host root; empty: it may."""
        found: list[Finding] = list(self.unknown)
        if not self.pods and not self.unknown:
            found.append(Unknown(
                "every pod the claim is reserved for is gone (" + ", ".join(self.skipped) + "), so none can use it"
                if self.skipped else "the claim is reserved for no pod (status.reservedFor is empty)",
                "reserve the claim for the pod that uses it"))
        found.extend(v for pod in self.pods for v in violations(pod))
        return found


def judge_consumers(namespace: str, consumers: Sequence[Consumer], read: Sequence[Pod | None]) -> ReservedPods:
    """``consumers`` with ``read``, the answers for its pod entries in order, sorted into a :class:`ReservedPods`."""
    pods: list[Pod] = []
    unknown: list[Unknown] = []
    skipped: list[str] = []
    answers = iter(read)
    for index, consumer in enumerate(consumers):
        entry = f"status.reservedFor[{index}]"
        if not consumer.is_pod:
            unknown.append(Unknown(
                f"{entry} names {shown(consumer.resource)} {shown(consumer.name)} of API group "
                f"{shown(consumer.api_group)}, not a Pod (API group \"\", resource \"pods\"), so the pods that "
                "would use the claim cannot be checked",
                "reserve the claim for the pods that use it, not for another object"))
            continue
        pod = next(answers)
        ref = pod_name(namespace, consumer.name)
        if pod is None:
            skipped.append(f"pod {ref}")
        elif pod.metadata.uid != consumer.uid:
            unknown.append(Unknown(
                f"{entry} names pod {ref} with uid {shown(consumer.uid)}, but pod {ref} has uid "
                f"{shown(pod.metadata.uid)}; the kubelet matches pods by uid, so the pod that would use the "
                "claim cannot be checked",
                "let status.reservedFor name each pod with its own uid"))
        else:
            pods.append(pod)
    return ReservedPods(tuple(pods), tuple(unknown), tuple(skipped))
