"""Cluster diagnostics behind `tensorwatch-otel nettest` and `tensorwatch-otel doctor`.

`nettest` checks multi-rank communication under torchrun; `doctor` checks the CUDA toolkit,
host compiler and architecture settings used to build CUDA extensions. Nothing is imported here.
"""
