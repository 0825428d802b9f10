"""The install and debugging commands in README.md and docs/operations.md match what the deployment creates.

They are run against a cluster, which the tests do not have; what they name (the pod label, the
container, the image string the manifest is rewritten with, the namespace label) is checked against
deploy/manifests/tessera.yaml, which tests/unit/test_deploy.py keeps equal to the chart's rendering.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from cdi.yamlload import load_yaml_documents

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "docs" / "operations.md"]
MANIFEST = ROOT / "deploy" / "manifests" / "tessera.yaml"


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return [doc for doc in load_yaml_documents(MANIFEST.read_text()) if doc]


def shell_blocks(path: Path) -> str:
    """The commands of the doc's bash blocks, comment lines left out."""
    blocks = re.findall(r"```bash\n(.*?)```", path.read_text(), re.DOTALL)
    return "\n".join(line for block in blocks for line in block.splitlines() if not line.lstrip().startswith("#"))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_exec_commands_select_the_plugin_pod_and_container(doc: Path, objects: list[dict[str, Any]]) -> None:
    commands = shell_blocks(doc)
    selectors = set(re.findall(r"get pods -l (\S+)", commands))
    containers = set(re.findall(r"exec \$POD -c (\S+) --", commands))
    assert selectors and containers, "the doc shows how to pick a node's plugin pod"
    plugin = next(o for o in objects if o["kind"] == "DaemonSet"
                  and o["metadata"]["labels"].get("app.kubernetes.io/component") == "kubelet-plugin")
    labels = plugin["spec"]["template"]["metadata"]["labels"]
    for selector in selectors:
        wanted = dict(term.split("=", 1) for term in selector.split(","))
        assert wanted.items() <= labels.items(), f"{selector} does not select the plugin pods ({labels})"
    names = {c["name"] for c in plugin["spec"]["template"]["spec"]["containers"]}
    assert containers <= names
    used = set(re.findall(r"kubectl -n (\S+) (?:get pods|exec|logs)", commands))
    assert used == {plugin["metadata"]["namespace"]}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_manifest_image_rewrite_matches_the_manifest(doc: Path, objects: list[dict[str, Any]]) -> None:
    rewrite = re.search(r'sed "s#([^#]+)#[^#]+#" deploy/manifests/tessera\.yaml', shell_blocks(doc))
    assert rewrite is not None
    images = {c["image"] for o in objects if o["kind"] == "DaemonSet"
              for c in [*o["spec"]["template"]["spec"].get("initContainers", []),
                        *o["spec"]["template"]["spec"]["containers"]]}
    assert images == {rewrite.group(1)}, "every container's image is the one the command replaces"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_the_helm_install_labels_the_namespace_for_privileged_pods(doc: Path, objects: list[dict[str, Any]]) -> None:
    commands = shell_blocks(doc)
    namespace = next(o for o in objects if o["kind"] == "Namespace")
    label = "pod-security.kubernetes.io/enforce=privileged"
    assert f"kubectl label --overwrite namespace {namespace['metadata']['name']} {label}" in commands
    assert "--create-namespace" not in commands, "helm would create it without the label"
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    install = commands.index("helm install")
    assert commands.index(label) < install, "labelled before the pods are created"
