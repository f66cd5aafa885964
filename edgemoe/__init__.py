"""edgemoe: run Mixture-of-Experts models whose experts stay on disk.

The data path, convert -> pack -> load -> router / prerouter -> slots <- reader <- cache
policy -> compute, and the module that holds each box:

    convert              edgemoe.convert
    pack                 edgemoe.format (pack, inplace: an mlx-lm checkpoint in place, source)
    load                 edgemoe.mlx_backend.loader
    router / prerouter   edgemoe.routing (modes), edgemoe.mlx_backend (gates, prerouter, ...)
    slots                edgemoe.streaming.slots (.fills, .prefetch, .memory), .store, .budget
    reader               edgemoe.streaming.reader, .reads
    cache policy         edgemoe.streaming.cache
    compute              edgemoe.streaming.calls (the protocol), edgemoe.mlx_backend.experts (MLX),
                         edgemoe.cuda (PyTorch)
    several hosts        edgemoe.distributed (each owns a share of the experts; all_sum)

Entry points (the modules at this level), run as `python -m edgemoe.X` or `edgemoe X`
(edgemoe.cli): generate, convert, server, eval, doctor, cache_prompt, verify, cache_sim,
train_prerouter, train_lora, constrained; `options` holds the flags they share, `cli` the
error boundary and the help's order, `hub` the models named by a Hugging Face hub id.
"""

import sys
import types

__version__ = "0.1.0"
__all__ = ["load", "generate", "stream_generate", "streaming_of"]


def __getattr__(name):
    """Import the MLX entry points on first use, so that the MLX-free parts (the
    pack, reader, store, cache policies, and the CUDA backend) import without MLX."""
    if name == "load":
        from .mlx_backend.loader import load

        return load
    if name in ("generate", "stream_generate"):
        from .mlx_backend import generation

        return getattr(generation, name)
    if name == "streaming_of":  # what a loaded model streams by: store, host share, routing
        from .mlx_backend.experts import streaming_of

        return streaming_of
    raise AttributeError(f"module 'edgemoe' has no attribute {name!r}")


class _Package(types.ModuleType):
    """Importing the CLI module `edgemoe.generate` would bind it over the function of
    the same name; as in mlx_lm, the package's `generate` stays the function (the module
    is in sys.modules, where `python -m` and `from edgemoe.generate import main` find it).

    The one class assignment of the package (tests/test_core.py allows it, here only): the
    import system binds a submodule on its package after running it, so neither the
    submodule nor a module `__getattr__` (PEP 562: consulted only for a missing name) can
    keep the function; mlx_lm's eager `from .generate import generate` would import MLX
    with the package, which its MLX-free parts import without."""

    def __setattr__(self, name, value):
        if name in __all__ and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
