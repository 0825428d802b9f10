"""Render the Tessera Helm chart offline, and regenerate deploy/manifests/tessera.yaml from it.

The plain manifest is for clusters without Helm: the chart rendered with default values into the
``tessera-system`` namespace, preceded by that Namespace. The tests compare it with a fresh render,
so it cannot go stale. Uses helm-python-sdk (Helm's Go SDK through ctypes; no helm binary).

    .venv/bin/python deploy/render.py          # rewrite the manifest
    .venv/bin/python deploy/render.py --check  # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import yaml

DEPLOY_DIR = Path(__file__).resolve().parent
CHART_DIR = DEPLOY_DIR / "helm" / "tessera"
MANIFEST_PATH = DEPLOY_DIR / "manifests" / "tessera.yaml"
DEFAULT_RELEASE = "tessera"
DEFAULT_NAMESPACE = "tessera-system"

# kubectl applies a file in order: namespaces and identities before what refers to them.
_KIND_ORDER = (
    "Namespace",
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "ConfigMap",
    "DeviceClass",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "DaemonSet",
)

_DOCUMENT_SEPARATOR = re.compile(r"^---[ \t]*$", re.MULTILINE)

_MANIFEST_HEADER = """\
# GENERATED FILE, do not edit. Tessera Helm chart (deploy/helm/tessera) rendered with default values
# as release "{release}" in namespace "{namespace}", for clusters without Helm:
#   kubectl apply --server-side -f deploy/manifests/tessera.yaml
# Regenerate after changing the chart:
#   .venv/bin/python deploy/render.py
"""

_NAMESPACE_DOCUMENT = """\
# The plugin runs privileged with host paths, which Pod Security Admission allows only in a
# privileged namespace.
apiVersion: v1
kind: Namespace
metadata:
  name: {namespace}
  labels:
    pod-security.kubernetes.io/enforce: privileged
"""


@dataclass(frozen=True)
class RenderedDocument:
    """One YAML document of the rendered chart: its text (comments kept) and its parsed object."""

    source: str  # chart template path, e.g. "templates/daemonset.yaml"
    text: str
    obj: dict[str, Any]


def render_documents(
    values: Mapping[str, Any] | None = None,
    *,
    release: str = DEFAULT_RELEASE,
    namespace: str = DEFAULT_NAMESPACE,
    chart_dir: Path = CHART_DIR,
) -> list[RenderedDocument]:
    """Render the chart and return its objects in apply order (NOTES.txt and empty documents dropped).

    Raises ``helm_python.HelmError`` (a subclass names the cause) when the values fail the chart's
    schema or a template's own checks.
    """
    user_values = dict(values) if values is not None else None
    with helm_python.Chart.load(chart_dir) as chart:
        # Applies values.schema.json, as an install would.
        rendered = chart.render(user_values, name=release, namespace=namespace, is_install=True)
    documents: list[RenderedDocument] = []
    for template_path in sorted(rendered):
        if template_path.endswith("NOTES.txt"):
            continue
        source = template_path.split("/", 1)[1] if "/" in template_path else template_path
        for text in _DOCUMENT_SEPARATOR.split(rendered[template_path]):
            obj = yaml.safe_load(text)
            if obj is None:
                continue
            if not isinstance(obj, dict):
                raise ValueError(f"{source}: rendered a {type(obj).__name__}, expected a Kubernetes object")
            documents.append(RenderedDocument(source=source, text=text.strip("\n") + "\n", obj=obj))
    return sorted(documents, key=_apply_order)


def render_objects(
    values: Mapping[str, Any] | None = None, *, release: str = DEFAULT_RELEASE, namespace: str = DEFAULT_NAMESPACE
) -> list[dict[str, Any]]:
    """The rendered chart's objects, parsed, in apply order."""
    return [document.obj for document in render_documents(values, release=release, namespace=namespace)]


def render_manifest(release: str = DEFAULT_RELEASE, namespace: str = DEFAULT_NAMESPACE) -> str:
    """The plain manifest: header, Namespace, then the chart rendered with default values."""
    parts = [_NAMESPACE_DOCUMENT.format(namespace=namespace)]
    for document in render_documents(release=release, namespace=namespace):
        parts.append(f"# Source: {document.source}\n{document.text}")
    return _MANIFEST_HEADER.format(release=release, namespace=namespace) + "---\n" + "---\n".join(parts)


def _apply_order(document: RenderedDocument) -> tuple[int, str]:
    kind = str(document.obj.get("kind", ""))
    rank = _KIND_ORDER.index(kind) if kind in _KIND_ORDER else len(_KIND_ORDER)
    return rank, str(document.obj.get("metadata", {}).get("name", ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the manifest is out of date")
    args = parser.parse_args(argv)
    manifest = render_manifest()
    current = MANIFEST_PATH.read_text() if MANIFEST_PATH.exists() else None
    if args.check:
        if current != manifest:
            print(f"{MANIFEST_PATH} is out of date; run: .venv/bin/python deploy/render.py", file=sys.stderr)
            return 1
        print(f"{MANIFEST_PATH} is up to date")
        return 0
    MANIFEST_PATH.parent.mkdir(parents=True, exist_ok=True)
    MANIFEST_PATH.write_text(manifest)
    print(f"wrote {MANIFEST_PATH}" if current != manifest else f"{MANIFEST_PATH} unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
