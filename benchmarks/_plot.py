"""matplotlib for the benchmarks' PNGs, headless; None (and a line saying so) when the
``bench`` extra is not installed, so a benchmark still prints its table and JSON."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot")
        return None
    return plt
