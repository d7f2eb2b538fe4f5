"""The plots of ``textgym bench``. Every curve shows each seed (thin) and the mean over seeds (thick)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from textgym.bench_results import BenchResults
from textgym.eval_settings import REWARD
from textgym.plotting import fit, pyplot, save_figure

LINESTYLES = ["-", "--", ":", "-."]


def plot_all(out: Path, results: BenchResults) -> dict[str, Any]:
    """Write every figure; returns ``{name: path}`` (None for a figure with nothing to show) and
    ``"designs": {design: path}`` (each design's curves, for the HTML report)."""
    figures: dict[str, Any] = {
        "training_curves": _save(out / "training_curves.png", training_curves(results)),
        "eval_curves": _save(out / "eval_curves.png", eval_curves(results)) if results.curves else None,
        "overoptimization": _save(out / "overoptimization.png", overoptimization(results))
        if _has_kl_curves(results)
        else None,
        "metric_bars": _save(out / "metric_bars.png", metric_bars(results)),
    }
    (out / "curves").mkdir(exist_ok=True)
    figures["designs"] = {
        d: _save(out / "curves" / f"{d}.png", design_curves(results, d)) for d in results.designs
    }
    return figures


def _save(path: Path, fig: Any) -> Path:
    return save_figure(fig, path, dpi=90)


def _style(results: BenchResults) -> tuple[dict[str, str], dict[str, str]]:
    colors = {d: f"C{i % 10}" for i, d in enumerate(results.designs)}
    styles = {a: LINESTYLES[i % len(LINESTYLES)] for i, a in enumerate(results.agents)}
    return colors, styles


def _label(results: BenchResults, agent: str, design: str) -> str:
    return f"{design} · {agent}" if len(results.agents) > 1 else design


def _seed_lines(
    ax: Any, runs: Sequence[tuple[Sequence[float], Sequence[float]]], color: str, style: str, label: str
) -> None:
    """Each run thin, and their mean thick on a common x grid (up to the shortest run's end), then to the
    mean of the runs' last points: the runs end at different token counts (a batch overshoots the budget),
    and their final values, which the report's tables average, are the line's end."""
    runs = [(np.asarray(x, float), np.asarray(y, float)) for x, y in runs if len(x)]
    for x, y in runs:  # a run of one iteration is one point: a line alone would draw nothing
        ax.plot(x, y, color=color, ls=style, lw=0.8, alpha=0.35, marker="o" if len(x) == 1 else None)
    if not runs:
        return
    end = min(x[-1] for x, _ in runs)
    start = max(x[0] for x, _ in runs)
    if len(runs) == 1:
        x, y = runs[0]
        ax.plot(x, y, color=color, ls=style, lw=2.2, label=label, marker="o" if len(x) == 1 else None)
    elif end > start:
        grid = np.linspace(start, end, 60)
        mean = np.mean([np.interp(grid, x, y) for x, y in runs], axis=0)
        last_x, last_y = np.mean([x[-1] for x, _ in runs]), np.mean([y[-1] for _, y in runs])
        if last_x > grid[-1]:
            grid, mean = np.append(grid, last_x), np.append(mean, last_y)
        ax.plot(grid, mean, color=color, ls=style, lw=2.2, label=label)
    elif end == start:  # the runs meet at one point only (runs of one iteration): their mean there
        mean = np.mean([np.interp(start, x, y) for x, y in runs])
        ax.plot([start], [mean], color=color, ls=style, lw=2.2, label=label, marker="o")
    else:  # no span shared by all: no mean to draw, only the label
        ax.plot([], [], color=color, ls=style, lw=2.2, label=label)


def training_curves(results: BenchResults) -> Any:
    """Each agent's training reward (the reward-stack total of its batches) against generated tokens: one
    panel per agent, or, with one design and several agents, the agents side by side on one panel."""
    plt = pyplot()
    colors, _ = _style(results)
    if len(results.designs) == 1 and len(results.agents) > 1:
        design = results.designs[0]
        palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        flat = standardised(results, design)
        for i, agent in enumerate(results.agents):
            if not flat:
                _seed_lines(ax, _training_runs(results, agent, design), palette[i % len(palette)], "-", agent)
        ax.set_title(
            f"training reward ({design}): standardised per batch (normalize_then_sum), not drawn"
            if flat
            else f"training reward ({design}), by agent"
        )
        ax.set_xlabel("generated tokens")
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=8)
        fit(fig)
        return fig
    n = len(results.agents)
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 3.8), squeeze=False)
    left_out = [d for d in results.designs if standardised(results, d)]
    for ax, agent in zip(axes[0], results.agents):
        for design in results.designs:
            if design not in left_out:
                _seed_lines(ax, _training_runs(results, agent, design), colors[design], "-", design)
        title = (
            f"{agent}: training reward (each design's own)"
            if n > 1
            else "training reward (each design's own)"
        )
        if left_out:
            title += f"\nnot drawn, standardised per batch (normalize_then_sum): {', '.join(left_out)}"
        ax.set_title(title, fontsize=9 if left_out else None)
        ax.set_xlabel("generated tokens")
        ax.grid(alpha=0.3)
        _legend(ax, fontsize=8)
    fit(fig)
    return fig


def _legend(ax: Any, **kwargs: Any) -> None:
    """A legend where the axes have labelled lines (every design may be left out)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def standardised(results: BenchResults, design: str) -> bool:
    """Whether ``design`` sums its components with ``normalize_then_sum``: its training reward is then ~0 in
    every batch, whatever the policy (a flat line that would read as "did not learn")."""
    from textgym.composition import stack_table

    spec = next(d for d in results.spec["designs"] if d["name"] == design)
    return stack_table(spec["rewards"])["aggregate"] == "normalize_then_sum"


def _training_runs(results: BenchResults, agent: str, design: str) -> list[tuple[list[Any], list[Any]]]:
    """(timesteps, reward) per seed of one agent and design, from the runs' metrics."""
    return [
        ([r["timesteps"] for r in rows], [r[REWARD] for r in rows])
        for job in results.jobs
        if (job.agent["label"], job.design["name"]) == (agent, design)
        for rows in [results.training.get(job.run_id, [])]
        if rows and REWARD in rows[0]
    ]


def _curve_metrics(results: BenchResults) -> list[str]:
    present = {k for rows in results.curves.values() for r in rows for k in r}
    return [m for m in results.metrics if m in present]


def _grid(n: int, width: float = 4.2, height: float = 3.2) -> tuple[Any, list[Any]]:
    plt = pyplot()
    cols = min(3, max(n, 1))
    rows = math.ceil(max(n, 1) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def eval_curves(results: BenchResults) -> Any:
    """Every held-out metric against generated tokens, for every agent and design."""
    metrics = _curve_metrics(results)
    colors, styles = _style(results)
    fig, axes = _grid(len(metrics))
    for ax, metric in zip(axes, metrics):
        for agent in results.agents:
            for design in results.designs:
                runs = [
                    ([r["timesteps"] for r in rows], [r.get(metric, math.nan) for r in rows])
                    for j in results.jobs
                    if (j.agent["label"], j.design["name"]) == (agent, design)
                    for rows in [results.curves.get(j.run_id, [])]
                ]
                _seed_lines(ax, runs, colors[design], styles[agent], _label(results, agent, design))
        ax.set_title(_title(metric))
        ax.set_xlabel("generated tokens")
        ax.grid(alpha=0.3)
    if axes:
        axes[0].legend(fontsize=7)
    fit(fig)
    return fig


def _title(metric: str) -> str:
    if metric == REWARD:
        return "reward (proxy: each design's own total)"
    if metric == "length":
        return "length (tokens, EOS included)"
    return metric


def _measured_kl(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The curve rows with a KL (an SB3 agent's have none: it has no reference)."""
    return [r for r in rows if not math.isnan(r.get("kl", math.nan))]


def _has_kl_curves(results: BenchResults) -> bool:
    return any(_measured_kl(rows) for rows in results.curves.values())


def overoptimization(results: BenchResults) -> Any:
    """Gold and proxy against sqrt(KL to the reference), as in Gao, Schulman and Hilton (2022), Fig. 1:
    one point per evaluation, one line per run, the mean over seeds thick."""
    metrics = [REWARD, *results.gold]
    colors, styles = _style(results)
    fig, axes = _grid(len(metrics))
    # KL is a sample mean of log pi - log pi_ref, so near the reference it can come out below 0. Such a
    # point is drawn left of 0 (the signed root), not at 0: a clamp would show a measured -0.3 as exactly 0.
    negative = any(r["kl"] < 0 for rows in results.curves.values() for r in _measured_kl(rows))
    for ax, metric in zip(axes, metrics):
        for agent in results.agents:
            for design in results.designs:
                runs = []
                for j in results.jobs:
                    if (j.agent["label"], j.design["name"]) != (agent, design):
                        continue
                    rows = _measured_kl(results.curves.get(j.run_id, []))
                    runs.append(
                        (
                            [math.copysign(math.sqrt(abs(r["kl"])), r["kl"]) for r in rows],
                            [r.get(metric, math.nan) for r in rows],
                        )
                    )
                color, style = colors[design], styles[agent]
                for x, y in runs:
                    ax.plot(x, y, color=color, ls=style, lw=0.8, alpha=0.35, marker=".", markersize=3)
                # a run without a current curve (stale, or never measured) has no points: the others' mean
                runs = [(x, y) for x, y in runs if len(x)]
                n = min((len(x) for x, _ in runs), default=0)
                if n:
                    mean_x = np.mean([x[:n] for x, _ in runs], axis=0)
                    with warnings.catch_warnings():  # a point no seed measured is NaN (a gap), not a warning
                        warnings.simplefilter("ignore", RuntimeWarning)
                        mean_y = np.nanmean([y[:n] for _, y in runs], axis=0)
                    ax.plot(
                        mean_x, mean_y, color=color, ls=style, lw=2.2, label=_label(results, agent, design)
                    )
        ax.set_title(
            "reward (each design's own total: the proxy)" if metric == REWARD else f"metric: {metric}"
        )
        ax.set_xlabel(  # two short lines: one long one ran into the next plot's label
            "sqrt(KL to the reference), sqrt(nats)"
            + ("\nleft of 0: sample estimates below 0, -sqrt(-KL)" if negative else ""),
            fontsize=8,
        )
        ax.grid(alpha=0.3)
    if axes:
        axes[0].legend(fontsize=7)
    fit(fig)
    return fig


def metric_bars(results: BenchResults) -> Any:
    """Per metric, one bar per (agent, design) with its 95% confidence interval (clipped to the range)."""
    colors, _ = _style(results)
    groups = [(a, d) for a in results.agents for d in results.designs]
    fig, axes = _grid(len(results.metrics), width=3.6, height=4.2)
    for ax, metric in zip(axes, results.metrics):
        means, low, high = [], [], []
        for agent, design in groups:
            cell = results.cell(agent, design, metric) or {}
            m = cell.get("mean", math.nan)
            means.append(m)
            lo, hi = cell.get("ci_low", math.nan), cell.get("ci_high", math.nan)
            # no interval (one seed) is no error bar: a bar of length 0 would read as an interval of width 0
            low.append(max(m - lo, 0.0) if math.isfinite(lo) else math.nan)
            high.append(max(hi - m, 0.0) if math.isfinite(hi) else math.nan)
        ax.bar(range(len(groups)), means, yerr=[low, high], capsize=3, color=[colors[d] for _, d in groups])
        for i, m in enumerate(means):
            if not math.isfinite(m):
                ax.text(i, 0, "n/a", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(
            range(len(groups)),
            [_label(results, a, d) for a, d in groups],
            rotation=30,
            ha="right",
            fontsize=7,
        )
        ax.set_title(_title(metric), fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    fit(fig, bottom=1.3)
    return fig


def design_curves(results: BenchResults, design: str) -> Any:
    """One design: its training reward and each held-out metric against generated tokens, every seed."""
    metrics = _curve_metrics(results)
    _, styles = _style(results)
    fig, axes = _grid(1 + len(metrics), width=3.6, height=2.8)
    for agent in results.agents:
        jobs = [j for j in results.jobs if (j.agent["label"], j.design["name"]) == (agent, design)]
        for k, ax in enumerate(axes):
            source = results.training if k == 0 else results.curves
            metric = REWARD if k == 0 else metrics[k - 1]
            if k == 0 and standardised(results, design):
                ax.set_title(
                    "training reward: standardised per batch\n(normalize_then_sum), not drawn", fontsize=8
                )
                continue
            runs = [
                ([r["timesteps"] for r in rows], [r.get(metric, math.nan) for r in rows])
                for j in jobs
                for rows in [source.get(j.run_id, [])]
                if rows
            ]
            _seed_lines(ax, runs, "C0" if k == 0 else f"C{k % 10}", styles[agent], agent)
            ax.set_title("training reward" if k == 0 else f"held-out {_title(metric)}", fontsize=9)
            ax.set_xlabel("generated tokens", fontsize=8)
            ax.grid(alpha=0.3)
    if len(results.agents) > 1 and axes:
        axes[0].legend(fontsize=7)
    fit(fig)
    return fig
