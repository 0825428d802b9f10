"""CUDA MPS control daemons: their models, launch (locally or through the MPS host), control commands and identity."""
