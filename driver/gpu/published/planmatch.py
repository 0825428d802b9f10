"""What a sharing-plan entry applies to (``match``): GPUs by minor, UUID, product name glob, or all; or,
with ``migProfile``, the MIG instances of that profile glob on GPUs in MIG mode (narrowed by at most
one GPU selector)."""

from __future__ import annotations

import fnmatch

from pydantic import BaseModel, ConfigDict, Field, model_validator

from driver.gpu.discovery.inventory import GpuInfo, MigInstance


class Match(BaseModel):
    """Which GPUs an entry applies to: exactly one GPU selector; or which MIG instances: ``migProfile``
    and at most one GPU selector (none: the instances of every GPU in MIG mode)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    minor: int | None = None
    uuid: str | None = None
    product: str | None = None  # shell-style glob on the product name, e.g. "NVIDIA A100*"
    match_all: bool | None = Field(default=None, alias="all")
    # Shell-style glob on the MIG profile name as nvidia-smi writes it ("1g.10gb", "1g.10gb+me", "*").
    migProfile: str | None = None

    @model_validator(mode="after")
    def _selectors_given(self) -> Match:
        given = [name for name, value in self._selectors().items() if value is not None]
        if self.migProfile is not None:
            if not self.migProfile:
                raise ValueError('migProfile must not be empty; "*" matches every MIG instance')
            if len(given) > 1:
                raise ValueError(f"with migProfile set at most one of minor, uuid, product, all: true "
                                 f"(got {', '.join(given)})")
        elif len(given) != 1:
            raise ValueError(f"set exactly one of minor, uuid, product, all: true, or migProfile "
                             f"(got {', '.join(given) or 'none'})")
        if self.match_all is False:
            raise ValueError("all: false matches nothing; use all: true, or another selector")
        return self

    def _selectors(self) -> dict[str, object]:
        return {"minor": self.minor, "uuid": self.uuid, "product": self.product, "all": self.match_all}

    @property
    def for_instances(self) -> bool:
        """Whether the entry applies to MIG instances rather than to GPUs."""
        return self.migProfile is not None

    @property
    def names_one_gpu(self) -> bool:
        """Whether the selector picks a GPU by minor or UUID rather than a family of them (product, all)."""
        return self.minor is not None or self.uuid is not None

    def matches(self, gpu: GpuInfo) -> bool:
        """Whether the GPU selector takes ``gpu`` (no GPU selector, as a ``migProfile`` entry may have: every GPU)."""
        if self.minor is not None:
            return gpu.minor == self.minor
        if self.uuid is not None:
            return gpu.uuid == self.uuid
        if self.product is not None:
            return fnmatch.fnmatchcase(gpu.product_name, self.product)
        return bool(self.match_all) or self.migProfile is not None

    def matches_instance(self, gpu: GpuInfo, instance: MigInstance) -> bool:
        """Whether this ``migProfile`` entry takes ``instance`` of ``gpu`` (never, for a GPU entry)."""
        return (self.migProfile is not None and gpu.mig_enabled and self.matches(gpu)
                and fnmatch.fnmatchcase(instance.profile, self.migProfile))

    def describe(self) -> str:
        parts = [f"{name}: {value}" for name, value in self._selectors().items() if value is not None]
        if self.migProfile is not None:
            parts.append(f"migProfile: {self.migProfile}")
        return ", ".join(parts)
