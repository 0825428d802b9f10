"""What the node has: GPUs and MIG devices through NVML (or the simulation), SM counts through CUDA."""
