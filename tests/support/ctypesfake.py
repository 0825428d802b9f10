"""Stand-ins for the ctypes structures pynvml returns, for fakes of NVML in unit tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Struct:
    """A ctypes-struct stand-in with arbitrary fields."""

    values: dict[str, Any]

    def __getattr__(self, name: str) -> Any:
        try:
            return self.values[name]
        except KeyError:
            raise AttributeError(name) from None
