"""The benchmarks' pictures: matplotlib, the `bench` extra (`pip install -e '.[bench]'`),
drawing to files."""

import sys
from pathlib import Path


def pyplot():
    """matplotlib.pyplot, drawing to files (Agg). Without matplotlib the script exits with
    one line that names what to install, and draws nothing."""
    try:
        import matplotlib
    except ImportError:
        sys.exit(f"{Path(sys.argv[0]).name}: no picture drawn: it needs matplotlib "
                 f"(pip install -e '.[bench]')")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
