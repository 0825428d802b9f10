"""Fixtures shared by several unit test files."""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from driver.gpu.discovery.inventory import NodeInventory
from driver.kubeletplugin.telemetry import Telemetry
from driver.simulation.apiserver import FakeApiServer
from driver.simulation.discovery import SimulatedDiscovery
from tests.support.kubeletplugin import DRIVER, NODE, Dirs
from tests.support.statenode import StateNode


@pytest.fixture
def spans() -> InMemorySpanExporter:
    """Every span the ``telemetry`` fixture records."""
    return InMemorySpanExporter()


@pytest.fixture
def telemetry(spans: InMemorySpanExporter) -> Iterator[Telemetry]:
    """Telemetry with metric prefix and scope ``tessera``, its spans going to ``spans``."""
    telemetry = Telemetry("tessera-test", "tessera")
    telemetry.add_span_processor(SimpleSpanProcessor(spans))
    yield telemetry
    telemetry.shutdown()


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    """An API server double of Kubernetes 1.36, empty."""
    fake = FakeApiServer(minor_version=36)
    fake.start()
    yield fake
    fake.stop()


@pytest.fixture
def node_apiserver() -> Iterator[FakeApiServer]:
    """An API server double of Kubernetes 1.36 that knows the Node ``tests.support.kubeletplugin.NODE``."""
    fake = FakeApiServer(minor_version=36)
    fake.start()
    fake.add_node(NODE)
    yield fake
    fake.stop()


@pytest.fixture
def dirs() -> Iterator[Dirs]:
    """Fresh socket directories, short enough for Unix socket paths (pytest's tmp_path can be too long)."""
    root = Path(tempfile.mkdtemp(dir="/tmp", prefix="kp-"))
    try:
        yield Dirs(registrar=root / "registry", plugin=root / "plugins" / DRIVER)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def state_node(tmp_path: Path) -> StateNode:
    """A simulated node for DeviceState (``tests.support.statenode``): demo layout, recording fakes."""
    return StateNode(tmp_path)


@pytest.fixture(scope="module")
def demo() -> NodeInventory:
    """The ``demo`` layout's inventory: minor 0 H100 whole; minor 1 H100 with MIG 3g.40gb@0, 2g.20gb@4,
    1g.10gb@6; minor 2 L4 whole."""
    return SimulatedDiscovery("demo", "node-a").discover()


@pytest.fixture(scope="module")
def default_objects() -> list[dict[str, Any]]:
    """The Helm chart rendered with its default values, one dict per Kubernetes object."""
    from deploy.render import render_objects  # helm_python: only the deploy tests pay for the import

    return render_objects()


@pytest.fixture(autouse=True)
def restore_root_logger() -> Iterator[logging.Logger]:
    """Every test leaves the root logger as it found it: ``python -m driver``'s ``main`` (run in-process
    by some tests) configures it, and a root left at CRITICAL would hide records from ``caplog`` in
    whatever test runs next in the same worker."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield root
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
