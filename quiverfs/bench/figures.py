"""The benchmarks' figures: matplotlib drawing to PNG files, never to a display."""
from __future__ import annotations

from types import ModuleType
from typing import Any

DPI = 120


def pyplot() -> ModuleType:
    """matplotlib's pyplot on the file-only Agg backend (imported on first use)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    return plt


def save(fig: Any, out: str) -> None:
    """Lay ``fig`` out, write it to ``out`` as a PNG, and free it."""
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
    pyplot().close(fig)
