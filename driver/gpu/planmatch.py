"""Which GPUs a sharing-plan entry applies to (``match``): by minor, UUID, product name glob, or all."""

from __future__ import annotations

import fnmatch

from pydantic import BaseModel, ConfigDict, Field, model_validator

from driver.gpu.discovery.inventory import GpuInfo


class Match(BaseModel):
    """Which GPUs an entry applies to: exactly one selector."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    minor: int | None = None
    uuid: str | None = None
    product: str | None = None  # shell-style glob on the product name, e.g. "NVIDIA A100*"
    match_all: bool | None = Field(default=None, alias="all")

    @model_validator(mode="after")
    def _exactly_one(self) -> Match:
        given = [name for name, value in self._selectors().items() if value is not None]
        if len(given) != 1:
            raise ValueError(f"set exactly one of minor, uuid, product, all: true (got {', '.join(given) or 'none'})")
        if self.match_all is False:
            raise ValueError("all: false matches nothing; use all: true, or another selector")
        return self

    def _selectors(self) -> dict[str, object]:
        return {"minor": self.minor, "uuid": self.uuid, "product": self.product, "all": self.match_all}

    def matches(self, gpu: GpuInfo) -> bool:
        if self.minor is not None:
            return gpu.minor == self.minor
        if self.uuid is not None:
            return gpu.uuid == self.uuid
        if self.product is not None:
            return fnmatch.fnmatchcase(gpu.product_name, self.product)
        return bool(self.match_all)

    def describe(self) -> str:
        return next(f"{name}: {value}" for name, value in self._selectors().items() if value is not None)
