"""Device health: what NVML (or the simulation) reports of each GPU and MIG device, and per-claim usage."""
