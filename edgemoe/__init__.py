"""edgemoe: run Mixture-of-Experts models whose experts stay on disk."""

from .generation import generate, stream_generate
from .loader import load

__version__ = "0.1.0"
__all__ = ["load", "generate", "stream_generate"]
