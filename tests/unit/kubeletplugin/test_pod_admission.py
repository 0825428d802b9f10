"""Which pods a ``clients: nonRoot`` share admits: Pod Security "baseline", no root user or group, for every container.

Each row changes one field of a pod that passes and names the field and the rule the refusal must
give (docs/sharing.md "Tenants", the admission table).
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest

from driver.kubeletplugin.podsecurity import violations
from driver.kubeletplugin.podspec import Pod
from driver.kubeletplugin.reservedpods import Consumer, judge_consumers

CLEAN_POD_SC = {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000}
CLEAN_SC = {"allowPrivilegeEscalation": False}
BASELINE = 'Pod Security "baseline"'
RESTRICTED = 'Pod Security "restricted"'
GROUPS = "clients: nonRoot (no group root)"


def clean_spec() -> dict[str, Any]:
    return {"securityContext": dict(CLEAN_POD_SC),
            "volumes": [{"name": "scratch", "emptyDir": {}}],
            "initContainers": [{"name": "setup", "securityContext": dict(CLEAN_SC)}],
            "containers": [{"name": "main", "securityContext": dict(CLEAN_SC),
                            "ports": [{"containerPort": 8080}], "volumeMounts": [{"name": "scratch"}]}],
            "ephemeralContainers": [{"name": "debug", "securityContext": dict(CLEAN_SC)}]}


def make_pod(spec: dict[str, Any], annotations: dict[str, str] | None = None, name: str = "p") -> Pod:
    return Pod.model_validate({"metadata": {"name": name, "namespace": "ns", "uid": "u",
                                            "annotations": annotations or {}}, "spec": spec})


def lines(spec: dict[str, Any], annotations: dict[str, str] | None = None) -> list[str]:
    return [v.describe() for v in violations(make_pod(spec, annotations))]


def with_field(path: str, value: Any) -> dict[str, Any]:
    """The clean spec with ``value`` set at ``path`` (dots; ``[i]`` indexes a list)."""
    spec = clean_spec()
    node: Any = spec
    *parents, last = path.split(".")
    for part in parents:
        key, _, index = part.partition("[")
        node = node.setdefault(key, {}) if not index else node[key][int(index.rstrip("]"))]
    node[last] = value
    return spec


def test_a_pod_that_meets_baseline_and_runs_as_a_non_root_user_and_group_is_admitted() -> None:
    assert lines(clean_spec()) == []
    spec = clean_spec()
    spec["securityContext"] |= {"seccompProfile": {"type": "RuntimeDefault"}, "appArmorProfile": {"type": "Localhost"},
                                "seLinuxOptions": {"type": "container_t", "level": "s0:c1,c2"},
                                "sysctls": [{"name": "net.ipv4.ping_group_range", "value": "0 0"}],
                                "supplementalGroups": [1000, 2000], "fsGroup": 1000}
    spec["containers"][0]["securityContext"] |= {"capabilities": {"add": ["NET_BIND_SERVICE", "CHOWN"],
                                                                   "drop": ["ALL"]}, "procMount": "Default"}
    assert lines(spec, {"container.apparmor.security.beta.kubernetes.io/main": "localhost/tenant"}) == []


# (field set on the clean pod, value, where the refusal points, the start of what it says)
RULES = [
    ("hostNetwork", True, "pod ns/p", f"spec.hostNetwork: true is not allowed by {BASELINE}"),
    ("hostPID", True, "pod ns/p", f"spec.hostPID: true is not allowed by {BASELINE}"),
    ("hostIPC", True, "pod ns/p", f"spec.hostIPC: true is not allowed by {BASELINE}"),
    ("volumes[0].hostPath", {"path": "/"}, 'pod ns/p container "main"',
     f"spec.volumes[0].hostPath is not allowed by {BASELINE}"),
    ("containers[0].securityContext.privileged", True, 'pod ns/p container "main"',
     f"spec.containers[0].securityContext.privileged: true is not allowed by {BASELINE}"),
    ("containers[0].securityContext.capabilities", {"add": ["SYS_ADMIN"]}, 'pod ns/p container "main"',
     f'spec.containers[0].securityContext.capabilities.add[0] "SYS_ADMIN" is not allowed by {BASELINE}'),
    ("initContainers[0].securityContext.capabilities", {"add": ["ALL"]}, 'pod ns/p init container "setup"',
     f'spec.initContainers[0].securityContext.capabilities.add[0] "ALL" is not allowed by {BASELINE}'),
    ("containers[0].securityContext.capabilities", {"add": ["cap_chown"]}, 'pod ns/p container "main"',
     f'spec.containers[0].securityContext.capabilities.add[0] "cap_chown" is not allowed by {BASELINE}'),
    ("containers[0].ports", [{"containerPort": 80, "hostPort": 80}], 'pod ns/p container "main"',
     f"spec.containers[0].ports[0].hostPort: 80 is not allowed by {BASELINE}"),
    ("containers[0].securityContext.procMount", "Unmasked", 'pod ns/p container "main"',
     f'spec.containers[0].securityContext.procMount: "Unmasked" is not allowed by {BASELINE}'),
    ("securityContext.seccompProfile", {"type": "Unconfined"}, "pod ns/p",
     f'spec.securityContext.seccompProfile.type: "Unconfined" is not allowed by {BASELINE}'),
    ("ephemeralContainers[0].securityContext.seccompProfile", {"type": "Unconfined"},
     'pod ns/p ephemeral container "debug"',
     f'spec.ephemeralContainers[0].securityContext.seccompProfile.type: "Unconfined" is not allowed by {BASELINE}'),
    ("containers[0].securityContext.seccompProfile", {"type": "Everything"}, 'pod ns/p container "main"',
     f'spec.containers[0].securityContext.seccompProfile.type: "Everything" is not allowed by {BASELINE}'),
    ("securityContext.appArmorProfile", {"type": "Unconfined"}, "pod ns/p",
     f'spec.securityContext.appArmorProfile.type: "Unconfined" is not allowed by {BASELINE}'),
    ("containers[0].securityContext.appArmorProfile", {"type": "Unconfined"}, 'pod ns/p container "main"',
     f'spec.containers[0].securityContext.appArmorProfile.type: "Unconfined" is not allowed by {BASELINE}'),
    ("securityContext.seLinuxOptions", {"type": "spc_t"}, "pod ns/p",
     f'spec.securityContext.seLinuxOptions.type: "spc_t" is not allowed by {BASELINE}'),
    ("containers[0].securityContext.seLinuxOptions", {"user": "system_u"}, 'pod ns/p container "main"',
     f'spec.containers[0].securityContext.seLinuxOptions.user: "system_u" is not allowed by {BASELINE}'),
    ("containers[0].securityContext.seLinuxOptions", {"role": "sysadm_r"}, 'pod ns/p container "main"',
     f'spec.containers[0].securityContext.seLinuxOptions.role: "sysadm_r" is not allowed by {BASELINE}'),
    ("securityContext.sysctls", [{"name": "kernel.msgmax", "value": "1"}], "pod ns/p",
     f'spec.securityContext.sysctls[0].name "kernel.msgmax" is not allowed by {BASELINE}'),
    ("securityContext.windowsOptions", {"hostProcess": True}, "pod ns/p",
     f"spec.securityContext.windowsOptions.hostProcess: true is not allowed by {BASELINE}"),
    ("containers[0].securityContext.windowsOptions", {"hostProcess": True}, 'pod ns/p container "main"',
     f"spec.containers[0].securityContext.windowsOptions.hostProcess: true is not allowed by {BASELINE}"),
    ("containers[0].securityContext.allowPrivilegeEscalation", True, 'pod ns/p container "main"',
     f"spec.containers[0].securityContext.allowPrivilegeEscalation is true; {RESTRICTED} requires false"),
    ("initContainers[0].securityContext", {}, 'pod ns/p init container "setup"',
     f"spec.initContainers[0].securityContext.allowPrivilegeEscalation is not set; {RESTRICTED} requires false"),
    ("securityContext.runAsNonRoot", False, 'pod ns/p init container "setup"',
     f"spec.initContainers[0].securityContext.runAsNonRoot is not true here or in spec.securityContext; "
     f"{RESTRICTED} requires true"),
    ("containers[0].securityContext.runAsNonRoot", False, 'pod ns/p container "main"',
     f"spec.containers[0].securityContext.runAsNonRoot is false; {RESTRICTED} requires true"),
    ("securityContext.runAsUser", 0, "pod ns/p", f"spec.securityContext.runAsUser: 0 is not allowed by {RESTRICTED}"),
    ("ephemeralContainers[0].securityContext.runAsUser", 0, 'pod ns/p ephemeral container "debug"',
     f"spec.ephemeralContainers[0].securityContext.runAsUser: 0 is not allowed by {RESTRICTED}"),
    ("securityContext.runAsGroup", 0, "pod ns/p", f"spec.securityContext.runAsGroup: 0 is not allowed by {GROUPS}"),
    ("containers[0].securityContext.runAsGroup", 0, 'pod ns/p container "main"',
     f"spec.containers[0].securityContext.runAsGroup: 0 is not allowed by {GROUPS}"),
    ("securityContext.supplementalGroups", [1000, 0], "pod ns/p",
     f"spec.securityContext.supplementalGroups[1]: 0 is not allowed by {GROUPS}"),
    ("securityContext.fsGroup", 0, "pod ns/p", f"spec.securityContext.fsGroup: 0 is not allowed by {GROUPS}"),
    ("containers[0].securityContext.capabilities", {"add": ["SETUID"]}, 'pod ns/p container "main"',
     'spec.containers[0].securityContext.capabilities.add[0] "SETUID" is not allowed by clients: nonRoot'),
    ("containers[0].securityContext.capabilities", {"add": ["SETGID"]}, 'pod ns/p container "main"',
     'spec.containers[0].securityContext.capabilities.add[0] "SETGID" is not allowed by clients: nonRoot'),
]


@pytest.mark.parametrize(("path", "value", "where", "says"), RULES, ids=[f"{r[0]}={r[1]}" for r in RULES])
def test_each_rule_refuses_its_field_and_names_pod_container_field_and_rule(
        path: str, value: Any, where: str, says: str) -> None:
    found = lines(with_field(path, value))
    assert len(found) >= 1, found
    assert found[0].startswith(f"{where}: {says} ("), found
    assert all("\n" not in line for line in found)


def test_the_refusal_of_a_host_path_says_why_and_which_path() -> None:
    spec = clean_spec()
    spec["volumes"].append({"name": "sock", "hostPath": {"path": "/run/containerd/containerd.sock"}})
    spec["containers"][0]["volumeMounts"].append({"name": "sock"})
    [found] = violations(make_pod(spec, name="evil"))
    assert found.describe() == (
        'pod ns/evil container "main": spec.volumes[1].hostPath is not allowed by Pod Security "baseline" (a host '
        'path can reach host root; this one is "/run/containerd/containerd.sock")')
    assert found.fix == 'use another volume type than hostPath for volume "sock"'


def test_an_apparmor_annotation_other_than_runtime_default_or_localhost_is_refused() -> None:
    key = "container.apparmor.security.beta.kubernetes.io/main"
    assert lines(clean_spec(), {key: "runtime/default"}) == []
    assert lines(clean_spec(), {key: "unconfined"}) == [
        f'pod ns/p container "main": metadata.annotations["{key}"]: "unconfined" is not allowed by {BASELINE} (only '
        "runtime/default or localhost/<profile> keeps an AppArmor profile)"]


def test_every_safe_sysctl_and_baseline_capability_passes() -> None:
    spec = with_field("securityContext.sysctls", [{"name": n, "value": "1"} for n in (
        "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem")])
    spec["containers"][0]["securityContext"]["capabilities"] = {"add": [
        "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE", "SETFCAP",
        "SETPCAP", "SYS_CHROOT"]}
    assert lines(spec) == []


# --- pod level against container level ---------------------------------------------------------------


def test_the_container_level_wins_for_the_settings_that_must_be_true_or_set() -> None:
    spec = clean_spec()
    spec["securityContext"] = {"runAsUser": 1000}
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        spec[kind][0]["securityContext"] |= {"runAsNonRoot": True, "runAsGroup": 3000}
    assert lines(spec) == [], "runAsNonRoot and runAsGroup set on every container, none on the pod"
    spec["containers"][0]["securityContext"]["runAsNonRoot"] = False
    spec["securityContext"]["runAsNonRoot"] = True
    assert [line.split(":")[1].strip() for line in lines(spec)] == [
        "spec.containers[0].securityContext.runAsNonRoot is false; Pod Security \"restricted\" requires true (without "
        "it the image's user decides, and that may be root)"]


def test_a_forbidden_value_at_either_level_is_refused_even_where_the_other_overrides_it() -> None:
    spec = with_field("securityContext.runAsUser", 0)
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        spec[kind][0]["securityContext"]["runAsUser"] = 1000
    assert [line.split(": ", 1)[1] for line in lines(spec)] == [
        f"spec.securityContext.runAsUser: 0 is not allowed by {RESTRICTED} (it runs as root)"]
    spec = with_field("securityContext.seccompProfile", {"type": "Unconfined"})
    spec["containers"][0]["securityContext"]["seccompProfile"] = {"type": "RuntimeDefault"}
    assert len(lines(spec)) == 1


def test_a_user_namespace_relaxes_the_user_and_group_rules_but_not_baseline() -> None:
    spec: dict[str, Any] = {"hostUsers": False, "securityContext": {"runAsUser": 0, "runAsGroup": 0},
                            "containers": [{"name": "main", "securityContext": {"capabilities": {"add": ["SETUID"]}}}]}
    assert lines(spec) == []
    spec["containers"][0]["securityContext"]["privileged"] = True
    spec["hostPID"] = True
    assert [line.split(": ")[1] for line in lines(spec)] == [
        "spec.hostPID", "spec.containers[0].securityContext.privileged"]
    spec = clean_spec() | {"hostUsers": True}
    spec["securityContext"].pop("runAsGroup")
    assert len(lines(spec)) == 3, "hostUsers: true is the host's user namespace"


def test_an_unset_group_is_refused_because_the_image_would_decide() -> None:
    spec = clean_spec()
    spec["securityContext"].pop("runAsGroup")
    found = lines(spec)
    assert [f.split(":")[0] for f in found] == [
        'pod ns/p init container "setup"', 'pod ns/p container "main"', 'pod ns/p ephemeral container "debug"']
    assert found[1] == (
        'pod ns/p container "main": spec.containers[0].securityContext.runAsGroup is not set here or in '
        f"spec.securityContext; {GROUPS} requires a non-zero one (without it the image decides, and a user missing "
        "from its /etc/passwd gets group 0)")


def test_a_pod_with_no_security_settings_is_refused_for_each_container_kind() -> None:
    spec = {"initContainers": [{"name": "i"}], "containers": [{"name": "c"}], "ephemeralContainers": [{"name": "e"}]}
    kinds = [line.split(":")[0] for line in lines(spec)]
    assert kinds == ['pod ns/p init container "i"'] * 3 + ['pod ns/p container "c"'] * 3 + [
        'pod ns/p ephemeral container "e"'] * 3


def test_values_echoed_in_a_refusal_are_escaped_to_one_line_and_cut() -> None:
    spec = with_field("securityContext.sysctls", [{"name": "kernel.\n" + "x" * 500, "value": "1"}])
    spec["containers"][0]["name"] = "main\nFAKE: ok"
    [line] = lines(spec)
    assert "\n" not in line
    assert '"kernel.\\nxxx' in line and 'x"... is not allowed' in line
    assert len(line) < 400
    spec = with_field("volumes[0].hostPath", {"path": "/\u2028" + "y" * 300})
    spec["containers"][0]["name"] = "main\nFAKE: ok"
    [line] = lines(spec)
    assert 'container "main\\nFAKE: ok"' in line and '"/\\u2028yyy' in line and "\u2028" not in line


def test_pod_fields_are_read_strictly() -> None:
    with pytest.raises(ValueError, match="runAsUser"):
        make_pod(with_field("containers[0].securityContext.runAsUser", "0"))
    with pytest.raises(ValueError, match="hostPID"):
        make_pod(with_field("hostPID", "true"))


# --- who the claim is reserved for ---------------------------------------------------------------------


def pod_entry(name: str, uid: str) -> Consumer:
    return Consumer("", "pods", name, uid)


def clean_pod(name: str, uid: str) -> Pod:
    return Pod.model_validate({"metadata": {"name": name, "namespace": "ns", "uid": uid}, "spec": clean_spec()})


def describe(consumers: list[Consumer], read: list[Pod | None]) -> list[str]:
    return [f.describe() for f in judge_consumers("ns", consumers, read).findings()]


def test_a_claim_reserved_for_no_pod_is_refused() -> None:
    assert describe([], []) == ["the claim is reserved for no pod (status.reservedFor is empty)"]


@pytest.mark.parametrize(("group", "resource"), [("apps", "deployments"), ("batch", "jobs"), ("core", "pods"),
                                                 ("", "Pod"), ("", "pods/status")])
def test_a_consumer_that_is_not_a_core_pod_is_refused_even_beside_a_clean_pod(group: str, resource: str) -> None:
    found = describe([pod_entry("ok", "uid-ok"), Consumer(group, resource, "web", "uid-web")],
                     [clean_pod("ok", "uid-ok")])
    assert found == [f'status.reservedFor[1] names "{resource}" "web" of API group "{group}", not a Pod (API group '
                     '"", resource "pods"), so the pods that would use the claim cannot be checked']


def test_a_pod_read_by_name_under_another_uid_is_refused() -> None:
    found = describe([pod_entry("benign", "uid-evil")], [clean_pod("benign", "uid-benign")])
    assert found == ['status.reservedFor[0] names pod ns/benign with uid "uid-evil", but pod ns/benign has uid '
                     '"uid-benign"; the kubelet matches pods by uid, so the pod that would use the claim cannot be '
                     "checked"]


def test_a_gone_pod_is_skipped_but_a_claim_whose_pods_are_all_gone_is_refused() -> None:
    assert describe([pod_entry("gone", "g"), pod_entry("ok", "o")], [None, clean_pod("ok", "o")]) == []
    reserved = judge_consumers("ns", [pod_entry("gone", "g"), pod_entry("ok", "o")], [None, clean_pod("ok", "o")])
    assert reserved.skipped == ("pod ns/gone",)
    assert describe([pod_entry("gone", "g")], [None]) == [
        "every pod the claim is reserved for is gone (pod ns/gone), so none can use it"]


def test_every_reserved_pod_is_judged() -> None:
    root = copy.deepcopy(clean_spec())
    root["hostIPC"] = True
    second = Pod.model_validate({"metadata": {"name": "b", "namespace": "ns", "uid": "b"}, "spec": root})
    found = describe([pod_entry("a", "a"), pod_entry("b", "b")], [clean_pod("a", "a"), second])
    assert [f.split(":")[0] for f in found] == ["pod ns/b"]


# A call, a module file, a snake_case name, or one of this driver's class names.
INTERNAL = re.compile(r"[A-Za-z_]\w*\(|\.py\b|\b[a-z]+_[a-z_]+\b|Violation|ReservedPods|Pod\.")


def test_no_refusal_names_an_internal_function_module_or_class() -> None:
    assert INTERNAL.search("adopt it with ensure_running()"), "the scan finds what it looks for"
    found = [line for path, value, _, _ in RULES for line in lines(with_field(path, value))]
    found += describe([], []) + describe([Consumer("apps", "deployments", "w", "w")], [])
    found += describe([pod_entry("benign", "evil")], [clean_pod("benign", "benign")])
    found += describe([pod_entry("gone", "g")], [None])
    fixes = [v.fix for path, value, _, _ in RULES for v in violations(make_pod(with_field(path, value)))]
    for text in found + fixes:
        outside_quotes = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
        assert not INTERNAL.search(outside_quotes), text
