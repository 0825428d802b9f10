"""``python -m driver demo --health``: the option, the GPU it fails, its devices, and the metrics port it reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.commands.demo.args import parse_options
from driver.commands.demo.health import devices_of, failing_gpu, http_port
from driver.gpu.discovery.inventory import NodeInventory
from driver.simulation.discovery import available_layouts

LAYOUTS = available_layouts()


def test_health_is_off_by_default_and_on_with_the_flag() -> None:
    assert parse_options(["--example", "mig-by-profile.yaml"], LAYOUTS).health is False
    assert parse_options(["--health", "--example", "mig-by-profile.yaml"], LAYOUTS).health is True


def test_health_flag_takes_no_value() -> None:
    with pytest.raises(SystemExit) as exited:
        parse_options(["--health=yes"], LAYOUTS)
    assert exited.value.code == 2


def test_the_demo_fails_its_shared_gpu_and_every_device_using_it(demo: NodeInventory) -> None:
    gpu = failing_gpu(demo)
    assert gpu.minor == 2 and not gpu.mig_enabled  # the last GPU without MIG: the one the demo shares
    names = ["gpu-0", "gpu-1-mig-1g10gb-6", "gpu-2-mps-0", "gpu-2-mps-1", "gpu-20", "gpu-2"]
    assert devices_of(names, 2) == ["gpu-2-mps-0", "gpu-2-mps-1", "gpu-2"]


def test_metrics_port_comes_from_the_driver_started_line(tmp_path: Path) -> None:
    log = tmp_path / "driver.log"
    log.write_text('2026-11-23T17:00:00Z INFO    driver.commands.run.app: driver started driver="gpu.tessera.dev" '
                   'http_port=38211 dra_socket="/x"\n')
    assert http_port(log, timeout=1) == 38211
    log.write_text("2026-11-23T17:00:00Z INFO    driver.commands.run.app: registering\n")
    with pytest.raises(TimeoutError, match="driver started"):
        http_port(log, timeout=0.2)
