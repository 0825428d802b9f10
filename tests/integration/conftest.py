from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.node import SimulatedNode


@pytest.fixture
def node() -> Iterator[SimulatedNode]:
    """The demo layout (gpu-0 H100 whole, gpu-1 H100 with three MIG devices, gpu-2 L4), no sharing plan."""
    n = SimulatedNode("demo")
    try:
        yield n
    finally:
        n.close()
