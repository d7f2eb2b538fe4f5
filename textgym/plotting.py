"""Matplotlib set-up shared by the plots of ``textgym train`` diagnostics and ``textgym bench``, and the
training curves every ``textgym train`` run draws (``reward_kl.png``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path, dpi: int) -> Path:
    """Write ``fig`` to ``path`` whole or not at all (a kill mid-write left a cut PNG), and close it."""
    import os

    tmp = path.with_name(f".{path.name}.tmp")
    try:
        fig.savefig(tmp, dpi=dpi, format=path.suffix.lstrip(".") or "png")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        pyplot().close(fig)
    return path


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


def training_curves(
    path: Path, history: Sequence[dict[str, Any]], score_keys: Sequence[str], kl_key: str | None
) -> None:
    """The scores (one line each: ``["reward"]``, or each reward component's ``rewards/<name>/mean``) and,
    where any iteration logged one, the KL to the reference (summed over each completion's tokens, batch
    mean), one panel each."""
    plt = pyplot()
    steps = [row["timesteps"] for row in history]
    has_kl = kl_key is not None and any(math.isfinite(row.get(kl_key, math.nan)) for row in history)
    title = (
        "reward (mean episode score)" if list(score_keys) == ["reward"] else "reward components (raw means)"
    )
    panels = [(list(score_keys), title)] + (
        [([kl_key], "KL to the reference (nats per completion)")] if has_kl else []
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    for ax, (keys, title) in zip(axes[0], panels):
        for key in keys:
            label = key[8:-5] if key.startswith("rewards/") and key.endswith("/mean") else key
            ax.plot(steps, [row.get(key, math.nan) for row in history], marker="o", markersize=3, label=label)
        if len(keys) > 1:
            ax.legend(fontsize=8)
        ax.set_title(title)
        ax.set_xlabel("generated tokens")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, Path(path), dpi=100)
