"""One device of a prepared claim, as the kubelet stores it: the pydantic half of a prepare's result.

Its own module so that :mod:`driver.kubeletplugin.calls`, on the registration path, can name it in
``PrepareResult`` without importing pydantic or the rest of the driver contract.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class PreparedDevice(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    request_names: list[str]
    pool_name: str
    device_name: str
    cdi_device_ids: list[str]
    share_id: str | None = None
