"""Claims written by a hostile tenant, within the API server's own limits, against the claim decoding path.

The API server lets a claim carry 32 configs of up to 10 KiB of opaque ``parameters`` each, naming up to
32 requests of up to 63 characters (shared/reference/resource-api.md 2.3, its "Other limits"). Whatever a config
holds, the claim's error must stay a short message: it is built in the driver process (which serves every
claim on the node), logged, and sent to the kubelet, whose gRPC client takes at most 4 MiB per answer.
"""

from __future__ import annotations

import itertools
import json
import string
from typing import Any

import pytest

from driver.gpu.claimconfig.api import API_VERSION, ConfigError, parse_config
from driver.gpu.claimconfig.choices import DeviceKind
from driver.gpu.claimconfig.precedence import resolve_configs
from driver.kubeletplugin.claimmodel import DeviceAllocationConfiguration, DeviceRequestAllocationResult

DRIVER = "gpu.tessera.dev"
OPAQUE_PARAMETERS_MAX_BYTES = 10 * 1024
CONFIGS_MAX = 32
REQUESTS = [f"r{i:02d}-{'x' * 59}" for i in range(32)]  # 63 characters each: the longest DNS label
# Far more than any real problem list needs, far less than the ~100 MB the hostile claim produced.
ERROR_MAX_BYTES = 32 * 1024


def unknown_fields_config(size: int = OPAQUE_PARAMETERS_MAX_BYTES) -> dict[str, Any]:
    """A GpuConfig with as many unknown two-letter fields as fit in ``size`` bytes of JSON."""
    params: dict[str, Any] = {"apiVersion": API_VERSION, "kind": "GpuConfig"}
    used = len(json.dumps(params, separators=(",", ":")))
    for pair in itertools.product(string.ascii_letters, repeat=2):
        used += len(f',"{"".join(pair)}":0')
        if used > size:
            break
        params["".join(pair)] = 0
    return params


def hostile_configs() -> list[DeviceAllocationConfiguration]:
    entry = {"source": "FromClaim", "requests": REQUESTS,
             "opaque": {"driver": DRIVER, "parameters": unknown_fields_config()}}
    return [DeviceAllocationConfiguration.model_validate(entry) for _ in range(CONFIGS_MAX)]


def test_the_hostile_config_is_within_the_api_servers_limits() -> None:
    params = unknown_fields_config()
    assert len(json.dumps(params, separators=(",", ":"))) <= OPAQUE_PARAMETERS_MAX_BYTES
    assert len(params) > 1000


def test_one_config_full_of_unknown_fields_lists_a_few_and_counts_the_rest() -> None:
    params = unknown_fields_config()
    with pytest.raises(ConfigError) as caught:
        parse_config(params)
    lines = str(caught.value).splitlines()
    assert len(lines) <= 11, f"{len(lines)} lines for one config"
    assert lines[0] == 'GpuConfig: unknown field "aa" (known fields: apiVersion, kind, sharing)'
    assert lines[-1] == f"... and {len(params) - 2 - 10} more not shown"


def test_a_claim_of_hostile_configs_gets_a_short_error() -> None:
    result = DeviceRequestAllocationResult.model_validate(
        {"request": REQUESTS[0], "driver": DRIVER, "pool": "node-a", "device": "gpu-0"})
    with pytest.raises(ConfigError) as caught:
        resolve_configs(hostile_configs(), [result], lambda r: DeviceKind.GPU, whole_gpu_class=DRIVER)
    message = str(caught.value)
    assert len(message.encode()) <= ERROR_MAX_BYTES, f"the claim's error is {len(message.encode())} bytes"
    assert message.startswith(f"claim config #1 (requests: [{REQUESTS[0]}, ")
    assert 'GpuConfig: unknown field "aa"' in message.splitlines()[0]
    assert message.splitlines()[-1].startswith("... and ")


@pytest.mark.parametrize("field", ["apiVersion", "kind"])
def test_a_long_api_version_or_kind_is_not_echoed_whole(field: str) -> None:
    params = {"apiVersion": API_VERSION, "kind": "GpuConfig", field: "x" * (OPAQUE_PARAMETERS_MAX_BYTES - 100)}
    with pytest.raises(ConfigError) as caught:
        parse_config(params)
    assert len(str(caught.value)) < 1024, str(caught.value)[:200]


def test_a_long_unknown_field_name_is_not_echoed_whole() -> None:
    params = {"apiVersion": API_VERSION, "kind": "GpuConfig", "y" * (OPAQUE_PARAMETERS_MAX_BYTES - 100): 0}
    with pytest.raises(ConfigError) as caught:
        parse_config(params)
    assert len(str(caught.value)) < 1024, str(caught.value)[:200]
