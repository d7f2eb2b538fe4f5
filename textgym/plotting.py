"""Matplotlib set-up shared by the plots of ``textgym train`` diagnostics and ``textgym bench``."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fit(fig: Any, bottom: float = 0.6, top: float = 0.4, left: float = 0.65) -> None:
    """Margins and gaps in inches, for a grid of equal axes: ``tight_layout`` gives the same picture at twice
    the drawing time (it draws the figure once to measure it)."""
    w, h = fig.get_size_inches()
    axes = [ax for ax in fig.axes if ax.get_subplotspec() is not None]
    rows, cols = axes[0].get_subplotspec().get_geometry()[:2] if axes else (1, 1)
    gap_w, gap_h = left, bottom + top  # room for the y tick labels; for x labels and the next title
    axes_w = (w - left - 0.2 - (cols - 1) * gap_w) / cols
    axes_h = (h - bottom - top - (rows - 1) * gap_h) / rows
    fig.subplots_adjust(
        left=left / w,
        right=1 - 0.2 / w,
        bottom=bottom / h,
        top=1 - top / h,
        wspace=gap_w / max(axes_w, 0.5),
        hspace=gap_h / max(axes_h, 0.5),
    )
