"""Fixtures shared by the unit tests of the kubelet-plugin layer."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from driver.kubeletplugin.telemetry import Telemetry
from driver.simulation.apiserver import FakeApiServer
from tests.support.kubeletplugin import DRIVER, NODE, Dirs


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
