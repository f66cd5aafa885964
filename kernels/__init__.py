"""Kernel sources, installed as `edgemoe.kernels` (see pyproject.toml). Each has a
pure-PyTorch reference in edgemoe/cuda that the tests check it against."""
