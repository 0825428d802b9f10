"""Fixtures every test gets."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _umask_kept() -> Iterator[None]:
    """``python -m driver``'s main() sets the process umask (0077) for the driver; a test that calls it in-process
    must not leave it on the worker, where every file later tests create would be unreadable by other UIDs."""
    mask = os.umask(0o022)
    os.umask(mask)
    yield
    os.umask(mask)
