"""The Helm chart and the plain manifest.

Every rendered object must be valid for the Kubernetes 1.34 and 1.36 API schemas (unknown fields
are errors), the DaemonSet must keep its contract with the kubelet and the plugin's flags, RBAC must
stay least-privilege, the ValidatingAdmissionPolicy must confine the plugin to its own node and
driver, and deploy/manifests/tessera.yaml must equal a fresh render.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import celpy
import helm_python
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError

from cdi.yamlload import load_yaml, load_yaml_documents
from deploy.render import CHART_DIR, DEFAULT_NAMESPACE, MANIFEST_PATH, render_manifest, render_objects

REPO_ROOT = Path(__file__).resolve().parents[2]
KUBE_VERSIONS = ("1.34", "1.36")
SHARING_PLANS = load_yaml((REPO_ROOT / "examples" / "sharing-plans.yaml").read_text())

# The non-default install the brief names, plus a kubelet root with a trailing slash and the CDI
# root on /etc/cdi to exercise path handling.
CUSTOM_VALUES: dict[str, Any] = {
    "driverName": "gpu.example.org",
    "extendedResourceName": "nvidia.com/gpu",
    "nvidiaDriverRoot": "/run/nvidia/driver",
    "validatingAdmissionPolicy": {"enabled": False},
    "sharing": {"planLabel": "example.org/gpu-plan", **SHARING_PLANS},
    "kubeletDir": "/var/lib/k0s/kubelet/",
    "cdiRoot": "/etc/cdi",
    "metrics": {"port": 9400},
    "mps": {"shmSize": "512Mi", "hostPID": False, "host": {"enabled": False}},
    "logFormat": "text",
    "simulate": "demo",
}

Obj = dict[str, Any]


@pytest.fixture(scope="module")
def custom_objects() -> list[Obj]:
    return render_objects(CUSTOM_VALUES)


def by_kind(objects: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objects if o["kind"] == kind]


def only(objects: list[Obj], kind: str) -> Obj:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def daemonset(objects: list[Obj], component: str = "kubelet-plugin") -> Obj:
    """The plugin's DaemonSet (or the MPS host's, component "mps-host")."""
    found = [o for o in by_kind(objects, "DaemonSet")
             if o["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    assert len(found) == 1, f"expected one {component} DaemonSet, got {len(found)}"
    return found[0]


def pod_spec(objects: list[Obj]) -> Obj:
    spec: Obj = daemonset(objects)["spec"]["template"]["spec"]
    return spec


def plugin_container(objects: list[Obj]) -> Obj:
    containers = pod_spec(objects)["containers"]
    assert [c["name"] for c in containers] == ["plugin"]
    container: Obj = containers[0]
    return container


def env_of(container: Obj) -> dict[str, Obj]:
    return {e["name"]: e for e in container["env"]}


def env_value(container: Obj, name: str) -> str:
    value: str = env_of(container)[name]["value"]
    return value


def mounts_by_name(container: Obj) -> dict[str, Obj]:
    return {m["name"]: m for m in container["volumeMounts"]}


def volumes_by_name(objects: list[Obj]) -> dict[str, Obj]:
    return {v["name"]: v for v in pod_spec(objects)["volumes"]}


def host_path_of_mount(objects: list[Obj], container: Obj, mount_path: str) -> str:
    """The host path a container path is backed by, following the mount that covers it."""
    volumes = volumes_by_name(objects)
    for mount in container["volumeMounts"]:
        if mount["mountPath"] == mount_path:
            path: str = volumes[mount["name"]]["hostPath"]["path"]
            return path
    raise AssertionError(f"no mount at {mount_path}")


# --- schema validity -----------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("values_name", ["default", "custom"])
def test_every_rendered_object_is_schema_valid(values_name: str, version: str) -> None:
    objects = render_objects(CUSTOM_VALUES if values_name == "custom" else None)
    assert objects
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_schema_validation_rejects_unknown_fields(default_objects: list[Obj]) -> None:
    # Guards the test above against a validator that accepts anything.
    plugin = copy.deepcopy(daemonset(default_objects))
    plugin["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["paht"] = "/healthz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(plugin, "1.34", strict=True)


def test_helm_lint_is_clean_for_the_oldest_supported_kubernetes() -> None:
    report = helm_python.lint(CHART_DIR, kube_version="v1.34.0", strict=True)
    assert report["errors"] == []
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert problems == []


def test_chart_requires_kubernetes_1_34() -> None:
    chart = load_yaml((CHART_DIR / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    assert chart["kubeVersion"] == ">=1.34.0-0"


# --- the plain manifest ----------------------------------------------------------------------------


def test_plain_manifest_equals_a_fresh_default_render() -> None:
    assert MANIFEST_PATH.read_text() == render_manifest(), (
        "deploy/manifests/tessera.yaml is stale; run: .venv/bin/python deploy/render.py"
    )


def test_plain_manifest_starts_with_a_privileged_namespace_and_says_it_is_generated() -> None:
    text = MANIFEST_PATH.read_text()
    assert text.startswith("# GENERATED")
    assert "deploy/render.py" in text.split("---", 1)[0]
    objects = [o for o in load_yaml_documents(text) if o]
    assert objects[0]["kind"] == "Namespace"
    assert objects[0]["metadata"]["name"] == DEFAULT_NAMESPACE
    assert objects[0]["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    namespaced = [o for o in objects[1:] if o["kind"] in ("ServiceAccount", "ConfigMap", "DaemonSet")]
    assert len(namespaced) == 4  # the plugin's DaemonSet and the MPS host's
    assert {o["metadata"]["namespace"] for o in namespaced} == {DEFAULT_NAMESPACE}
    for version in KUBE_VERSIONS:
        for obj in objects:
            kubernetes_validate.validate(obj, version, strict=True)


def test_plain_manifest_keeps_the_privilege_comments() -> None:
    # Operators applying the manifest without Helm read why each privilege is there.
    text = MANIFEST_PATH.read_text()
    assert "# privileged is needed because the plugin:" in text
    assert "# hostPID:" in text


# --- DaemonSet: rollout, identity, probes ----------------------------------------------------------


def test_rolling_update_surges_a_new_pod_before_removing_the_old(default_objects: list[Obj]) -> None:
    strategy = daemonset(default_objects)["spec"]["updateStrategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def test_pod_uid_and_node_name_come_from_the_downward_api(default_objects: list[Obj]) -> None:
    env = env_of(plugin_container(default_objects))
    assert env["POD_UID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.uid"}}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


@pytest.mark.parametrize("values_name", ["default", "custom"])
def test_socket_directories_have_the_same_path_inside_and_on_the_host(values_name: str) -> None:
    objects = render_objects(CUSTOM_VALUES if values_name == "custom" else None)
    container = plugin_container(objects)
    kubelet_dir = "/var/lib/k0s/kubelet" if values_name == "custom" else "/var/lib/kubelet"
    driver = env_value(container, "DRIVER_NAME")
    registrar = env_value(container, "KUBELET_REGISTRAR_DIRECTORY_PATH")
    # The plugin keeps sockets and state in <plugins-dir>/<driver-name>.
    plugin_dir = f"{env_value(container, 'KUBELET_PLUGINS_DIRECTORY_PATH')}/{driver}"
    assert registrar == f"{kubelet_dir}/plugins_registry"
    assert plugin_dir == f"{kubelet_dir}/plugins/{driver}"
    assert host_path_of_mount(objects, container, registrar) == registrar
    assert host_path_of_mount(objects, container, plugin_dir) == plugin_dir


def test_probes_call_the_plugin_http_port(default_objects: list[Obj], custom_objects: list[Obj]) -> None:
    for objects, port in ((default_objects, 8080), (custom_objects, 9400)):
        container = plugin_container(objects)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert env_value(container, "HTTP_PORT") == str(port)
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            assert ports[container[probe]["httpGet"]["port"]] == port
        annotations = daemonset(objects)["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(port)


def test_an_explicit_prometheus_port_annotation_is_kept() -> None:
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": "9999"}
    objects = render_objects({"podAnnotations": annotations})
    rendered = daemonset(objects)["spec"]["template"]["metadata"]["annotations"]
    assert rendered["prometheus.io/port"] == "9999"


def test_image_and_command_match_the_dockerfile(default_objects: list[Obj]) -> None:
    chart = load_yaml((CHART_DIR / "Chart.yaml").read_text())
    container = plugin_container(default_objects)
    assert container["image"].endswith(f":{chart['appVersion']}")
    dockerfile = (REPO_ROOT / "deploy" / "Dockerfile").read_text()
    entrypoint = re.search(r"^ENTRYPOINT (\[.*\])$", dockerfile, re.MULTILINE)
    cmd = re.search(r"^CMD (\[.*\])$", dockerfile, re.MULTILINE)
    assert entrypoint and cmd
    assert container["command"] == load_yaml(entrypoint.group(1))
    assert container["args"] == load_yaml(cmd.group(1))


def test_default_scheduling_targets_gpu_nodes(default_objects: list[Obj]) -> None:
    spec = pod_spec(default_objects)
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["priorityClassName"] == "system-node-critical"
    assert "hostNetwork" not in spec


# --- DaemonSet: host access ------------------------------------------------------------------------


def test_plugin_is_privileged_and_host_pid_follows_the_mps_value(
    default_objects: list[Obj], custom_objects: list[Obj]
) -> None:
    assert plugin_container(default_objects)["securityContext"]["privileged"] is True
    assert pod_spec(default_objects)["hostPID"] is True
    assert pod_spec(custom_objects)["hostPID"] is False


def test_a_containerised_driver_root_is_mounted_whole_and_follows_the_driver_container(
        custom_objects: list[Obj]) -> None:
    container = plugin_container(custom_objects)
    assert env_value(container, "NVIDIA_DRIVER_ROOT") == "/driver-root"
    assert env_value(container, "NVIDIA_DRIVER_ROOT_ON_HOST") == "/run/nvidia/driver"
    assert host_path_of_mount(custom_objects, container, "/driver-root") == "/run/nvidia/driver"
    mount = mounts_by_name(container)["driver-root"]
    assert mount["readOnly"] is True
    # The driver container mounts itself (dev/ included) there after the plugin may have started.
    assert mount["mountPropagation"] == "HostToContainer"


def test_a_host_driver_root_mounts_only_what_the_driver_needs(default_objects: list[Obj]) -> None:
    container = plugin_container(default_objects)
    assert env_value(container, "NVIDIA_DRIVER_ROOT") == "/driver-root"
    assert env_value(container, "NVIDIA_DRIVER_ROOT_ON_HOST") == "/"
    volumes = volumes_by_name(default_objects)
    host_paths = [volumes[m["name"]]["hostPath"]["path"] for m in container["volumeMounts"]
                  if "hostPath" in volumes[m["name"]]]
    assert "/" not in host_paths, "the whole host root must not be mounted"
    under_driver_root = {m["mountPath"]: m for m in container["volumeMounts"]
                         if m["mountPath"].startswith("/driver-root")}
    assert set(under_driver_root) == {"/driver-root/usr", "/driver-root/etc/alternatives"}
    for path, mount in under_driver_root.items():
        assert mount["readOnly"] is True
        assert volumes[mount["name"]]["hostPath"] == {"path": path.removeprefix("/driver-root"), "type": "Directory"}


def test_host_driver_dirs_are_chosen_by_the_operator() -> None:
    objects = render_objects({"hostDriverDirs": ["/usr", "/opt/nvidia"]})
    container = plugin_container(objects)
    assert host_path_of_mount(objects, container, "/driver-root/opt/nvidia") == "/opt/nvidia"
    assert "/driver-root/etc/alternatives" not in {m["mountPath"] for m in container["volumeMounts"]}
    for bad in (["/"], ["usr"], ["/usr", "/usr"], ["/usr/"]):
        with pytest.raises(helm_python.HelmError):
            render_objects({"hostDriverDirs": bad})


def test_driver_libraries_required_is_passed_to_the_plugin(default_objects: list[Obj]) -> None:
    assert env_value(plugin_container(default_objects), "DRIVER_LIBRARIES_REQUIRED") == "true"
    objects = render_objects({"driverLibraries": {"required": False}})
    assert env_value(plugin_container(objects), "DRIVER_LIBRARIES_REQUIRED") == "false"
    with pytest.raises(helm_python.HelmError):
        render_objects({"driverLibraries": {"required": "no"}})


def test_host_dev_and_proc_are_visible_under_host_root(default_objects: list[Obj]) -> None:
    container = plugin_container(default_objects)
    host_root = env_value(container, "HOST_ROOT")
    assert host_path_of_mount(default_objects, container, f"{host_root}/dev") == "/dev"
    assert host_path_of_mount(default_objects, container, f"{host_root}/proc") == "/proc"


def test_cdi_root_is_writable_and_the_toolkit_spec_directory_read_only(
    default_objects: list[Obj], custom_objects: list[Obj]
) -> None:
    container = plugin_container(default_objects)
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert env_value(container, "CDI_ROOT") == "/var/run/cdi"
    assert host_path_of_mount(default_objects, container, "/var/run/cdi") == "/var/run/cdi"
    assert not mounts["/var/run/cdi"].get("readOnly", False)
    assert mounts["/etc/cdi"]["readOnly"] is True
    # cdiRoot on /etc/cdi: one writable mount there, not two mounts on the same path.
    custom = plugin_container(custom_objects)
    etc_cdi = [m for m in custom["volumeMounts"] if m["mountPath"] == "/etc/cdi"]
    assert len(etc_cdi) == 1
    assert not etc_cdi[0].get("readOnly", False)


def test_without_the_mps_host_the_plugin_mounts_each_daemons_shm_tmpfs_itself(custom_objects: list[Obj]) -> None:
    # With the MPS host (the default) the host mounts them: tests/unit/test_deploy_mpshost.py.
    container = plugin_container(custom_objects)
    assert env_value(container, "MPS_SHM_TMPFS") == "true"
    assert env_value(container, "MPS_SHM_SIZE") == "512Mi"
    assert "initContainers" not in pod_spec(custom_objects), "no node-wide tmpfs shared by every tenant"
    assert "/dev/shm" not in {m["mountPath"] for m in container["volumeMounts"]}
    # The plugin's tmpfs mounts under its data directory must reach the node, where the runtime
    # bind-mounts them into client containers.
    data = "/var/lib/k0s/kubelet/plugins/gpu.example.org"
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == data]
    assert mount["mountPropagation"] == "Bidirectional" and container["securityContext"]["privileged"] is True


def test_simulation_is_opt_in(default_objects: list[Obj], custom_objects: list[Obj]) -> None:
    assert "TESSERA_SIMULATE" not in env_of(plugin_container(default_objects))
    assert env_value(plugin_container(custom_objects), "TESSERA_SIMULATE") == "demo"


def test_simulated_layouts_named_in_the_values_exist() -> None:
    from driver.simulation.discovery import available_layouts

    values_text = (CHART_DIR / "values.yaml").read_text()
    named = re.search(r"simulated node layout \(e\.g\. ([^)]*)\)", values_text)
    assert named is not None
    assert set(named.group(1).split(", ")) <= set(available_layouts())


# --- sharing plans ---------------------------------------------------------------------------------


def plans_file(objects: list[Obj]) -> Obj:
    container = plugin_container(objects)
    path = env_value(container, "SHARING_PLANS_FILE")
    directory, filename = path.rsplit("/", 1)
    volume = volumes_by_name(objects)[mounts_by_name(container)["sharing-plans"]["name"]]
    assert mounts_by_name(container)["sharing-plans"]["mountPath"] == directory
    (item,) = [i for i in volume["configMap"]["items"] if i["path"] == filename]
    configmap = only(objects, "ConfigMap")
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    parsed: Obj = load_yaml(configmap["data"][item["key"]])
    return parsed


def test_sharing_plans_reach_the_plugin_file(default_objects: list[Obj], custom_objects: list[Obj]) -> None:
    assert env_value(plugin_container(default_objects), "SHARING_PLANS_FILE") == "/etc/tessera/sharing-plans.yaml"
    assert plans_file(default_objects) == {"plans": {}}
    assert plans_file(custom_objects) == SHARING_PLANS
    assert env_value(plugin_container(default_objects), "SHARING_PLAN_LABEL") == "gpu.tessera.dev/sharing-plan"
    assert env_value(plugin_container(custom_objects), "SHARING_PLAN_LABEL") == "example.org/gpu-plan"


def test_the_consumable_capacity_gate_reaches_the_plans_file() -> None:
    assert plans_file(render_objects({"sharing": {"consumableCapacityGate": True}})) == {
        "plans": {}, "consumableCapacityGate": True}


def test_rendered_plans_load_in_the_plugin(tmp_path: Path, custom_objects: list[Obj]) -> None:
    sharingplan = pytest.importorskip("driver.gpu.published.sharingplan")
    path = tmp_path / "sharing-plans.yaml"
    path.write_text(only(custom_objects, "ConfigMap")["data"]["plans.yaml"])
    plans = sharingplan.load_plans(path)
    assert plans.defaultPlan == SHARING_PLANS["defaultPlan"]
    assert set(plans.plans) == set(SHARING_PLANS["plans"])


def test_changing_the_plans_does_not_roll_the_plugin_pods() -> None:
    # The plugin re-reads the mounted plans file; a rollout would restart the MPS daemons it runs.
    def pod_template(values: Mapping[str, Any] | None) -> Any:
        return daemonset(render_objects(values))["spec"]["template"]

    assert pod_template(None) == pod_template({"sharing": SHARING_PLANS})
    mounts = {m["name"]: m for m in pod_template(None)["spec"]["containers"][0]["volumeMounts"]}
    assert "subPath" not in mounts["sharing-plans"], "a subPath mount would never see ConfigMap updates"


# --- RBAC ------------------------------------------------------------------------------------------


def test_cluster_role_is_least_privilege(default_objects: list[Obj]) -> None:
    rules = only(default_objects, "ClusterRole")["rules"]
    for rule in rules:
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {field}: {rule}"
    granted = {
        (group, resource): set(rule["verbs"])
        for rule in rules
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }
    assert granted == {
        ("resource.k8s.io", "resourceslices"): {"get", "list", "watch", "create", "update", "patch", "delete"},
        ("resource.k8s.io", "resourceclaims"): {"get"},
        ("resource.k8s.io", "resourceclaims/status"): {"patch", "update"},  # status.devices by server-side apply
        # What a 1.36+ API server checks too for status.devices: only claims on the plugin's own node.
        ("resource.k8s.io", "resourceclaims/driver"): {"associated-node:update", "associated-node:patch"},
        ("", "nodes"): {"list", "watch"},  # its own Node's metadata, watched: never a GET of the whole Node
        ("", "pods"): {"get"},  # the reservedFor pods of a claim on a shared MPS daemon (tenancy check)
        ("events.k8s.io", "events"): {"create"},  # MpsLimitsReverted on the claims of a retuned daemon
    }


def test_the_granular_claim_status_rule_names_only_this_driver(default_objects: list[Obj]) -> None:
    [rule] = [r for r in only(default_objects, "ClusterRole")["rules"] if "resourceclaims/driver" in r["resources"]]
    assert rule["resourceNames"] == ["gpu.tessera.dev"]


def test_roles_bind_the_service_account_the_pods_run_as(default_objects: list[Obj]) -> None:
    account = only(default_objects, "ServiceAccount")["metadata"]
    binding = only(default_objects, "ClusterRoleBinding")
    assert pod_spec(default_objects)["serviceAccountName"] == account["name"]
    assert binding["roleRef"]["name"] == only(default_objects, "ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}
    ]


# --- DeviceClasses ---------------------------------------------------------------------------------


def device_classes(objects: list[Obj]) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in by_kind(objects, "DeviceClass")}


def test_device_class_names_derive_from_the_driver_name(default_objects: list[Obj], custom_objects: list[Obj]) -> None:
    for objects, driver in ((default_objects, "gpu.tessera.dev"), (custom_objects, "gpu.example.org")):
        classes = device_classes(objects)
        assert set(classes) == {driver, f"mig.{driver}", f"mps.{driver}", f"timeslice.{driver}",
                                f"consumable.{driver}"}
        for name, device_type in ((driver, "gpu"), (f"mig.{driver}", "mig"), (f"timeslice.{driver}", "timeslice"),
                                  (f"consumable.{driver}", "consumable")):
            (selector,) = classes[name]["spec"]["selectors"]
            assert selector["cel"]["expression"] == (
                f"device.driver == '{driver}' && device.attributes['{driver}'].type == '{device_type}'"
            )


def test_extended_resource_name_is_opt_in_and_only_on_the_whole_gpu_class(
    default_objects: list[Obj], custom_objects: list[Obj]
) -> None:
    assert all("extendedResourceName" not in c["spec"] for c in device_classes(default_objects).values())
    with_name = {n for n, c in device_classes(custom_objects).items() if "extendedResourceName" in c["spec"]}
    assert with_name == {"gpu.example.org"}
    assert device_classes(custom_objects)["gpu.example.org"]["spec"]["extendedResourceName"] == "nvidia.com/gpu"


def test_device_classes_can_be_disabled() -> None:
    objects = render_objects({"deviceClasses": {"mig": {"enabled": False}, "timeslice": {"enabled": False},
                                                "consumable": {"enabled": False}}})
    assert set(device_classes(objects)) == {"gpu.tessera.dev", "mps.gpu.tessera.dev"}


# --- NetworkPolicy ---------------------------------------------------------------------------------


def pod_templates(objects: list[Obj]) -> dict[str, dict[str, str]]:
    """Labels of every pod template, by workload name."""
    return {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"]
            for o in objects if o["kind"] in ("DaemonSet", "Deployment")}


def test_network_policy_admits_only_scrapers_to_the_http_port_of_the_plugin_pods(
    default_objects: list[Obj], custom_objects: list[Obj]
) -> None:
    for objects in (default_objects, custom_objects):
        policy = only(objects, "NetworkPolicy")["spec"]
        selected = [name for name, labels in pod_templates(objects).items()
                    if policy["podSelector"]["matchLabels"].items() <= labels.items()]
        assert selected == [daemonset(objects)["metadata"]["name"]]
        assert [c["name"] for c in pod_spec(objects)["containers"]] == ["plugin"]
        # Ingress only: the plugin must still reach the API server.
        assert policy["policyTypes"] == ["Ingress"]
        [rule] = policy["ingress"]
        http_port = plugin_container(objects)["ports"][0]["containerPort"]
        assert rule["ports"] == [{"protocol": "TCP", "port": http_port}]
        assert rule["from"] == [BY_NAME_MONITORING]
    assert plugin_container(custom_objects)["ports"][0]["containerPort"] == 9400


# The API server sets kubernetes.io/metadata.name to the namespace's name and refuses changes to it,
# so a tenant cannot put its own namespace into this selector (a pod label it can set on itself).
BY_NAME_MONITORING = {"namespaceSelector": {"matchExpressions": [
    {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring"]}]}}


def _selects_only_by_namespace_name(peer: Obj) -> bool:
    """A peer whose namespaces are picked by their immutable name; a podSelector may only narrow it."""
    selector = peer.get("namespaceSelector")
    if not selector or selector.get("matchLabels"):
        return False
    return all(e["key"] == "kubernetes.io/metadata.name" and e["operator"] == "In"
               for e in selector.get("matchExpressions", [])) and bool(selector.get("matchExpressions"))


def test_network_policy_selects_scrapers_by_the_immutable_namespace_name_label(default_objects: list[Obj]) -> None:
    [rule] = only(default_objects, "NetworkPolicy")["spec"]["ingress"]
    assert rule["from"] and all(_selects_only_by_namespace_name(p) for p in rule["from"])
    # A pod label (app.kubernetes.io/name: prometheus) in any namespace is what a tenant can set itself.
    assert all(p["namespaceSelector"] != {} for p in rule["from"])


def test_network_policy_namespaces_pods_and_peers_are_configurable_and_the_policy_optional() -> None:
    spec = only(render_objects({"metrics": {"networkPolicy": {
        "namespaces": ["monitoring", "prom"], "podSelector": {"matchLabels": {"app": "prometheus"}}}}}),
        "NetworkPolicy")["spec"]
    [peer] = spec["ingress"][0]["from"]
    assert peer["namespaceSelector"]["matchExpressions"][0]["values"] == ["monitoring", "prom"]
    assert peer["podSelector"] == {"matchLabels": {"app": "prometheus"}}
    extra = [{"ipBlock": {"cidr": "192.0.2.0/24"}}]
    spec = only(render_objects({"metrics": {"networkPolicy": {"namespaces": [], "extraPeers": extra}}}),
                "NetworkPolicy")["spec"]
    assert spec["ingress"][0]["from"] == extra
    # No namespaces and no peers: only the node (the kubelet's probes) reaches the pod.
    closed = only(render_objects({"metrics": {"networkPolicy": {"namespaces": []}}}), "NetworkPolicy")["spec"]
    assert closed["ingress"] == [] and closed["policyTypes"] == ["Ingress"]
    assert not by_kind(render_objects({"metrics": {"networkPolicy": {"enabled": False}}}), "NetworkPolicy")


# --- ValidatingAdmissionPolicy ---------------------------------------------------------------------

NODE_NAME_KEY = "authentication.kubernetes.io/node-name"


def plugin_user(objects: list[Obj]) -> str:
    account = only(objects, "ServiceAccount")["metadata"]
    return f"system:serviceaccount:{account['namespace']}:{account['name']}"


def slice_on(node: str | None, driver: str = "gpu.tessera.dev", pool: str | None = None) -> Obj:
    pool_name = pool if pool is not None else node or "shared"
    spec: Obj = {"driver": driver, "pool": {"name": pool_name, "generation": 1, "resourceSliceCount": 1}}
    if node is None:
        spec["allNodes"] = True
    else:
        spec["nodeName"] = node
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "s"}, "spec": spec}


def admit(
    policy: Obj,
    operation: str,
    *,
    user: str,
    token_node: str | None,
    new: Obj | None = None,
    old: Obj | None = None,
) -> tuple[bool, list[str]]:
    """Evaluate the policy as the API server would: (applies and allows, denial messages)."""
    extra = {NODE_NAME_KEY: [token_node]} if token_node is not None else {}
    activation: dict[str, Any] = {
        "request": {"operation": operation, "userInfo": {"username": user, "extra": extra}},
        "object": new,
        "oldObject": old,
    }
    env = celpy.Environment()

    def evaluate(expression: str) -> Any:
        context = {name: json_to_cel(value) for name, value in activation.items()}
        result = env.program(env.compile(expression)).evaluate(context)
        assert not isinstance(result, CELEvalError), f"{expression}: {result!r}"
        return result

    spec = policy["spec"]
    if not all(evaluate(c["expression"]) for c in spec["matchConditions"]):
        return True, []
    variables: dict[str, Any] = {}
    for variable in spec["variables"]:
        activation["variables"] = variables
        variables[variable["name"]] = evaluate(variable["expression"])
    activation["variables"] = variables
    denials = [
        str(evaluate(v["messageExpression"])) if "messageExpression" in v else v["message"]
        for v in spec["validations"]
        if not evaluate(v["expression"])
    ]
    return not denials, denials


@pytest.fixture(scope="module")
def policy(default_objects: list[Obj]) -> Obj:
    return only(default_objects, "ValidatingAdmissionPolicy")


def test_admission_policy_is_bound_and_optional(
    default_objects: list[Obj], custom_objects: list[Obj], policy: Obj
) -> None:
    binding = only(default_objects, "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": policy["metadata"]["name"], "validationActions": ["Deny"]}
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert not by_kind(custom_objects, "ValidatingAdmissionPolicy")
    assert not by_kind(custom_objects, "ValidatingAdmissionPolicyBinding")


def test_admission_allows_the_plugin_its_own_nodes_slices(default_objects: list[Obj], policy: Obj) -> None:
    user = plugin_user(default_objects)
    own = slice_on("node-a")
    assert admit(policy, "CREATE", user=user, token_node="node-a", new=own) == (True, [])
    assert admit(policy, "UPDATE", user=user, token_node="node-a", new=own, old=own) == (True, [])
    assert admit(policy, "DELETE", user=user, token_node="node-a", old=own) == (True, [])


def test_admission_denies_other_nodes_drivers_and_unbound_tokens(default_objects: list[Obj], policy: Obj) -> None:
    user = plugin_user(default_objects)
    other = slice_on("node-b")
    allowed, messages = admit(policy, "CREATE", user=user, token_node="node-a", new=other)
    assert not allowed
    assert messages == [
        "the kubelet plugin on node 'node-a' may only write ResourceSlices with spec.nodeName 'node-a', not 'node-b'",
        "the kubelet plugin on node 'node-a' may only write ResourceSlices with spec.pool.name 'node-a', not 'node-b'",
    ]
    # Taking over another node's slice, or deleting it, is judged on the old object.
    assert not admit(policy, "UPDATE", user=user, token_node="node-a", new=slice_on("node-a"), old=other)[0]
    allowed, messages = admit(policy, "DELETE", user=user, token_node="node-a", old=other)
    assert not allowed
    assert "node 'node-b'" in messages[0]
    assert not admit(policy, "CREATE", user=user, token_node="node-a", new=slice_on(None))[0]
    allowed, messages = admit(policy, "CREATE", user=user, token_node="node-a", new=slice_on("node-a", "x.example"))
    assert not allowed
    assert "spec.driver 'gpu.tessera.dev'" in messages[0]
    allowed, messages = admit(policy, "CREATE", user=user, token_node=None, new=slice_on("node-a"))
    assert not allowed
    assert NODE_NAME_KEY in messages[0]


def test_admission_denies_slices_in_another_nodes_pool(default_objects: list[Obj], policy: Obj) -> None:
    user = plugin_user(default_objects)
    # On its own node but in node-b's pool: the scheduler would count these devices as node-b's.
    foreign_pool = slice_on("node-a", pool="node-b")
    allowed, messages = admit(policy, "CREATE", user=user, token_node="node-a", new=foreign_pool)
    assert not allowed
    assert messages == [
        "the kubelet plugin on node 'node-a' may only write ResourceSlices with spec.pool.name 'node-a', not 'node-b'"
    ]
    assert not admit(policy, "UPDATE", user=user, token_node="node-a", new=foreign_pool, old=foreign_pool)[0]
    # Sharing the pool name's prefix is not enough.
    assert not admit(policy, "CREATE", user=user, token_node="node-a", new=slice_on("node-a", pool="node-a/x"))[0]
    # A slice without a pool is refused by the API server's own validation; the policy names it too.
    no_pool = slice_on("node-a")
    del no_pool["spec"]["pool"]
    assert not admit(policy, "CREATE", user=user, token_node="node-a", new=no_pool)[0]
    # Cleaning up a slice on its own node left in a pool of another name stays allowed.
    assert admit(policy, "DELETE", user=user, token_node="node-a", old=slice_on("node-a", pool="old-name")) == (
        True, [])


def test_admission_ignores_other_users(policy: Obj) -> None:
    assert admit(policy, "CREATE", user="system:node:node-a", token_node=None, new=slice_on("node-b")) == (True, [])


def test_admission_policy_names_the_custom_driver() -> None:
    objects = render_objects({"driverName": "gpu.example.org"})
    custom_policy = only(objects, "ValidatingAdmissionPolicy")
    user = plugin_user(objects)
    own = slice_on("node-a", "gpu.example.org")
    assert admit(custom_policy, "CREATE", user=user, token_node="node-a", new=own) == (True, [])
    assert not admit(custom_policy, "CREATE", user=user, token_node="node-a", new=slice_on("node-a"))[0]


# --- bad values ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "error", "names"),
    [
        ({"driverNam": "gpu.tessera.dev"}, helm_python.HelmValuesError, "driverNam"),
        ({"driverName": "GPU_Tessera"}, helm_python.HelmValuesError, "/driverName"),
        ({"driverName": "tessera"}, helm_python.HelmValuesError, "/driverName"),
        ({"mps": {"shmSize": "1G"}}, helm_python.HelmValuesError, "/mps/shmSize"),
        ({"mps": {"shmSize": "512Ki"}}, helm_python.HelmValuesError, "/mps/shmSize"),
        ({"logFormat": "xml"}, helm_python.HelmValuesError, "/logFormat"),
        ({"metrics": {"networkPolicy": {"extraPeers": [{}]}}}, helm_python.HelmValuesError,
         "/metrics/networkPolicy/extraPeers/0"),
        ({"metrics": {"networkPolicy": {"namespaces": ["Not_A_Name"]}}}, helm_python.HelmValuesError,
         "/metrics/networkPolicy/namespaces/0"),
        ({"metrics": {"networkPolicy": {"from": []}}}, helm_python.HelmValuesError, "from"),
        ({"metrics": {"networkPolicy": {"enable": True}}}, helm_python.HelmValuesError, "enable"),
        ({"extendedResourceName": "gpu"}, helm_python.HelmValuesError, "/extendedResourceName"),
        (
            {"sharing": {"plans": {"p": {"gpus": [{"match": {"all": True}, "mps": {"shares": 1}}]}}}},
            helm_python.HelmValuesError,
            "/sharing/plans/p/gpus/0/mps/shares",
        ),
        (
            {"sharing": {"plans": {"p": {"gpus": [{"match": {"all": True}, "whole": True, "mps": {"shares": 2}}]}}}},
            helm_python.HelmValuesError,
            "/sharing/plans/p/gpus/0",
        ),
        (
            {
                "sharing": {
                    "plans": {"p": {"gpus": [{"match": {"all": True}, "mps": {"shares": 2, "pinnedMemoryLimit": 1}}]}}
                }
            },
            helm_python.HelmValuesError,
            "/sharing/plans/p/gpus/0/mps/pinnedMemoryLimit",
        ),
        (
            {"sharing": {"plans": {"p": {"gpus": [{"match": {"minor": 0, "all": True, "migProfile": "*"},
                                                   "timeSlicing": {"shares": 2}}]}}}},
            helm_python.HelmValuesError,
            "/sharing/plans/p/gpus/0/match",
        ),
        (
            {"sharing": {"plans": {"p": {"gpus": [{"match": {"minor": 0, "all": True}, "whole": True}]}}}},
            helm_python.HelmValuesError,
            "/sharing/plans/p/gpus/0/match",
        ),
        (
            {"sharing": {"defaultPlan": "mps4", "plans": {"whole": {}}}},
            helm_python.HelmRenderError,
            "known plans: whole",
        ),
        (
            {"extendedResourceName": "nvidia.com/gpu", "deviceClasses": {"gpu": {"enabled": False}}},
            helm_python.HelmRenderError,
            "deviceClasses.gpu.enabled",
        ),
    ],
)
def test_bad_values_fail_with_the_value_named(values: Obj, error: type[Exception], names: str) -> None:
    with pytest.raises(error) as raised:
        render_objects(values)
    assert names in str(raised.value)
