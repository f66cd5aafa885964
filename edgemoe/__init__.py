"""edgemoe: run Mixture-of-Experts models whose experts stay on disk."""

__version__ = "0.1.0"
__all__ = ["load", "generate", "stream_generate"]


def __getattr__(name):
    """Import the MLX entry points on first use, so that the MLX-free parts (the
    pack, reader, store, cache policies, and the CUDA backend) import without MLX."""
    if name == "load":
        from .model.loader import load

        return load
    if name in ("generate", "stream_generate"):
        from .model import generation

        return getattr(generation, name)
    raise AttributeError(f"module 'edgemoe' has no attribute {name!r}")
