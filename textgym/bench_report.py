"""The report and plots of ``textgym bench``."""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from textgym.composition import describe_stack


def _fmt(row: Mapping[str, Any]) -> str:
    if math.isnan(row["ci_low"]):
        return f"{row['mean']:.3f}"
    return f"{row['mean']:.3f} [{row['ci_low']:.3f}, {row['ci_high']:.3f}]"


def write_report(
    path: Path,
    spec: Mapping[str, Any],
    summary: Sequence[Mapping[str, Any]],
    directions: Mapping[str, str | None],
    evals: Sequence[Mapping[str, Any]],
) -> None:
    bench, base = spec["bench"], spec["base"]
    designs = [d["name"] for d in spec["designs"]]
    metrics = list(directions)
    cell = {(r["design"], r["metric"]): r for r in summary}
    lines = [
        "# Reward-design benchmark",
        "",
        f"{len(designs)} designs x {len(bench['seeds'])} seeds (seeds {bench['seeds']}); agent "
        f"`{base['agent']['name']}` on `{base['env']['id']}`, {base['run']['total_timesteps']} generated tokens per "
        f"run; every run evaluated on the same {bench['eval_episodes']} held-out prompts "
        f"(`{bench['eval_prompts'] or base['env'].get('prompts', 'the training prompts')}`).",
        "",
        "Each cell: mean over seeds [95% confidence interval, Student t]. Higher is better for reward metrics, "
        "`distinct_2` and `eos_rate`; lower for `kl`; `length` (generated tokens) is not ranked.",
        "",
        "## Designs",
        "",
    ]
    for design in spec["designs"]:
        lines.append(f"- **{design['name']}**: {describe_stack(design['rewards'])}")
    lines += [
        "",
        "## Results",
        "",
        "| design | " + " | ".join(metrics) + " |",
        "|---" * (len(metrics) + 1) + "|",
    ]
    for design in designs:
        row = [_fmt(cell[(design, m)]) if (design, m) in cell else "" for m in metrics]
        lines.append(f"| {design} | " + " | ".join(row) + " |")
    lines += ["", "## Rankings", ""]
    for metric, direction in directions.items():
        if not direction:
            continue
        ranked = sorted((r for r in summary if r["metric"] == metric and r["rank"]), key=lambda r: r["rank"])
        order = ", ".join(f"{r['rank']}. {r['design']} ({r['mean']:.3f})" for r in ranked)
        lines.append(f"- **{metric}** ({direction} is better): {order}")
    seed = bench["seeds"][0]
    lines += ["", f"## Samples (seed {seed}, the first held-out prompts)", ""]
    for e in evals:
        if e["seed"] != seed:
            continue
        lines += [
            f"### {e['design']}",
            "",
            "| prompt | completion | finish | metric scores |",
            "|---|---|---|---|",
        ]
        for s in e["samples"]:
            completion = " ".join(s["completion"].split()).replace("|", "\\|")
            prompt = " ".join(s["prompt"].split()).replace("|", "\\|")
            lines.append(f"| {prompt[:60]} | {completion[:120]} | {s['finish_reason']} | "
                         + ", ".join(f"{k} {v:.3f}" for k, v in s["reward_components"].items()) + " |")  # fmt: skip
        lines.append("")
    lines += [
        "## Files",
        "",
        "`results.jsonl` (one row per run and metric), `summary.csv` (this table), `training_curves.png`, "
        "`metrics_vs_kl.png`, `metric_bars.png`, and `runs/<design>-seed<seed>/` (each run's directory, as "
        "`textgym train` writes it, plus `eval.json`).",
        "",
    ]
    path.write_text("\n".join(lines), encoding="utf-8")


def plot_all(
    out: Path,
    spec: Mapping[str, Any],
    summary: Sequence[Mapping[str, Any]],
    results: Sequence[Mapping[str, Any]],
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    designs = [d["name"] for d in spec["designs"]]
    colors = {d: f"C{i}" for i, d in enumerate(designs)}

    # Training curves: the mean episode score per iteration, averaged over seeds.
    fig, ax = plt.subplots(figsize=(6, 4))
    for design in designs:
        curves = []
        for seed in spec["bench"]["seeds"]:
            with (out / "runs" / f"{design}-seed{seed}" / "metrics.csv").open() as f:
                rows = list(csv.DictReader(f))
            key = "reward"
            curves.append([(float(r["timesteps"]), float(r[key])) for r in rows])
        n = min(len(c) for c in curves)
        x = np.mean([[p[0] for p in c[:n]] for c in curves], axis=0)
        y = np.mean([[p[1] for p in c[:n]] for c in curves], axis=0)
        ax.plot(x, y, label=design, color=colors[design])
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("training score (the design's own reward)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "training_curves.png", dpi=100)
    plt.close(fig)

    metrics = list(dict.fromkeys(r["metric"] for r in summary))
    by_run: dict[tuple[str, int], dict[str, float]] = {}
    for r in results:
        by_run.setdefault((r["design"], r["seed"]), {})[r["metric"]] = r["value"]
    others = [m for m in metrics if m != "kl"]

    # Each metric against the KL to the reference, one point per run.
    fig, axes = plt.subplots(1, len(others), figsize=(4 * len(others), 3.5), squeeze=False)
    has_kl = any(not math.isnan(v.get("kl", math.nan)) for v in by_run.values())
    for ax, metric in zip(axes[0], others):
        for (design, _), values in by_run.items():
            if has_kl:
                ax.scatter(values.get("kl", math.nan), values[metric], color=colors[design], label=design)
        ax.set_title(metric)
        ax.set_xlabel("KL to the reference" if has_kl else "KL not available for this agent")
        ax.grid(alpha=0.3)
    handles = {design: plt.Line2D([], [], marker="o", ls="", color=colors[design]) for design in designs}
    fig.legend(handles.values(), handles.keys(), loc="upper right")
    fig.tight_layout()
    fig.savefig(out / "metrics_vs_kl.png", dpi=100)
    plt.close(fig)

    # Per-metric bars with 95% confidence intervals.
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.5), squeeze=False)
    cell = {(r["design"], r["metric"]): r for r in summary}
    for ax, metric in zip(axes[0], metrics):
        means = [cell[(d, metric)]["mean"] for d in designs]
        errors = [
            0.0
            if math.isnan(cell[(d, metric)]["ci_low"])
            else cell[(d, metric)]["mean"] - cell[(d, metric)]["ci_low"]
            for d in designs
        ]
        ax.bar(range(len(designs)), means, yerr=errors, capsize=4, color=[colors[d] for d in designs])
        ax.set_xticks(range(len(designs)), designs, rotation=30, ha="right")
        ax.set_title(metric)
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out / "metric_bars.png", dpi=100)
    plt.close(fig)
