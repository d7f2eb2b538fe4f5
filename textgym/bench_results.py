"""The results of a finished bench: read every run's evaluation and curves, compute the summary, the paired
comparisons and the flags, and write the output files (``results.jsonl``, ``summary.csv``,
``comparisons.csv``, the plots, ``report.md`` and ``report.html``)."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from textgym.bench_flags import group_flags, has_curve, run_flags
from textgym.bench_stats import compare, mean_ci
from textgym.eval_settings import BUILTIN_METRICS, REWARD, metric_ranges
from textgym.evaluation import jsonable

STAGING = ".outputs.tmp"  # where write_outputs writes before it moves the files in
SUMMARY_COLUMNS = [
    "agent", "design", "metric", "n", "seeds", "mean", "ci_low", "ci_high", "rank", "agent_rank",
]  # fmt: skip
COMPARISON_COLUMNS = [
    "scope", "within", "metric", "a", "b", "n", "diff", "ci_low", "ci_high", "d_z", "p", "p_holm", "better",
    "seeds_needed", "better_by_chain", "infinite", "unmeasured",
]  # fmt: skip


@dataclass
class BenchResults:
    """Everything the reports and plots show, computed once."""

    spec: Mapping[str, Any]
    jobs: list[Any]
    evals: list[dict[str, Any]]  # one eval.json per run, in job order
    agents: list[str]
    designs: list[str]
    metrics: list[str]  # reward, the gold metrics, the built-in ones
    gold: list[str]
    ranges: dict[str, tuple[float, float]]
    rows: list[dict[str, Any]] = field(default_factory=list)  # results.jsonl
    summary: list[dict[str, Any]] = field(default_factory=list)
    comparisons: list[dict[str, Any]] = field(default_factory=list)
    training: dict[str, list[dict[str, float]]] = field(default_factory=dict)  # run_id -> metrics.csv rows
    curves: dict[str, list[dict[str, float]]] = field(default_factory=dict)  # run_id -> eval.csv rows
    flags: dict[tuple[str, str], list[dict[str, Any]]] = field(default_factory=dict)
    stale_curves: list[str] = field(default_factory=list)  # runs whose curves used other eval settings
    # runs whose curves lack some of the metrics (added or changed since they trained) -> those metrics
    partial_curves: dict[str, list[str]] = field(default_factory=dict)
    failed: dict[str, dict[str, str]] = field(default_factory=dict)  # run_id -> its error and log
    left_out: tuple[list[str], list[str]] = ([], [])  # the designs and agents left out for them

    def direction(self, metric: str, scope: str) -> str | None:
        """Which way is better when comparing ``"designs"`` (under one agent) or ``"agents"`` (under one
        design). ``reward`` is each design's own training total: comparable between agents, not designs."""
        if metric == REWARD:
            return "higher" if scope == "agents" else None
        if metric in BUILTIN_METRICS:
            return BUILTIN_METRICS[metric].direction
        return "higher"

    def values(self, agent: str, design: str, metric: str) -> dict[int, float]:
        """seed -> value of one (agent, design) on ``metric`` (NaN where it was not measured)."""
        return {
            r["seed"]: r["value"]
            for r in self.rows
            if r["agent"] == agent and r["design"] == design and r["metric"] == metric
        }

    def cell(self, agent: str, design: str, metric: str) -> dict[str, Any] | None:
        for row in self.summary:
            if (row["agent"], row["design"], row["metric"]) == (agent, design, metric):
                return row
        return None


def collect(out: Path, spec: Mapping[str, Any], jobs: Sequence[Any]) -> BenchResults:
    from textgym.bench_records import EVAL_FILE, INDEX_FILE
    from textgym.diagnostics import EVAL_CSV, read_rows

    gold = [m["label"] for m in spec["metric_rewards"]]
    ranges = metric_ranges(spec["metric_rewards"], spec["builtin"])
    max_new_tokens = spec["base"]["env"].get(
        "max_new_tokens", registered(spec["base"]["env"]["id"], "max_new_tokens")
    )
    if "length" in ranges and isinstance(max_new_tokens, int):
        ranges["length"] = (0.0, float(max_new_tokens))
    index_file = out / INDEX_FILE
    index = json.loads(index_file.read_text(encoding="utf-8")).get("runs", {}) if index_file.is_file() else {}
    results = BenchResults(
        spec=spec,
        jobs=list(jobs),
        evals=[json.loads((job.run_dir / EVAL_FILE).read_text(encoding="utf-8")) for job in jobs],
        agents=[a["label"] for a in spec["agents"]],
        designs=[d["name"] for d in spec["designs"]],
        metrics=[REWARD, *gold, *spec["builtin"]],
        gold=gold,
        ranges=ranges,
    )
    for job, e in zip(jobs, results.evals):
        for metric in results.metrics:
            value = e["metrics"].get(metric)
            results.rows.append(
                {
                    "agent": e["agent"],
                    "design": e["design"],
                    "seed": e["seed"],
                    "metric": metric,
                    "value": math.nan if value is None else float(value),
                }
            )
        results.training[job.run_id] = _read_csv(job.run_dir / "metrics.csv")
        if (job.run_dir / EVAL_CSV).is_file():
            recorded = index.get(job.run_id, {})
            if recorded.get("curves_hash") == job.curves_hash:
                results.curves[job.run_id] = read_rows(job.run_dir / EVAL_CSV)
            elif (kept := kept_columns(recorded.get("curve_parts"), job.curve_parts)) is not None:
                # the metric list changed: the unchanged metrics' columns stay
                columns, missing = kept
                rows = read_rows(job.run_dir / EVAL_CSV)
                results.curves[job.run_id] = [
                    {k: v for k, v in r.items() if _base(k) in columns} for r in rows
                ]
                if missing and has_curve(rows):  # (a run with no curve at all is counted as such)
                    results.partial_curves[job.run_id] = missing
            else:  # measured during training with other evaluation settings
                results.stale_curves.append(job.run_id)
    _summarize(results)
    per_group: dict[tuple[str, str], dict[int, list[dict[str, Any]]]] = {}
    curved: dict[tuple[str, str], dict[int, set[str]]] = {}  # the seeds whose curve checks ran -> columns
    for job, e in zip(jobs, results.evals):
        curve = results.curves.get(job.run_id, [])
        per_group.setdefault((e["agent"], e["design"]), {})[e["seed"]] = run_flags(
            curve, e.get("components", {}), gold
        )
        if has_curve(curve):
            curved.setdefault((e["agent"], e["design"]), {})[e["seed"]] = {k for row in curve for k in row}
    results.flags = {key: group_flags(seeds, curved.get(key, {})) for key, seeds in per_group.items()}
    return results


def kept_columns(
    recorded: Mapping[str, Any] | None, planned: Mapping[str, Any] | None
) -> tuple[set[str], list[str]] | None:
    """For a curve measured with other settings than the plan's (both :func:`textgym.bench_plan.curve_parts`):
    the columns that measure what the plan measures (``iteration``, ``timesteps``, the ``reward`` and each
    metric whose digest did not change), and the plan's metrics it lacks; None when what every column
    shares changed (other prompts, episodes or seed), or either side has no parts (a record from before
    parts were kept)."""
    if not recorded or not planned or recorded.get("base") != planned["base"]:
        return None
    old = recorded.get("metrics", {})
    same = [label for label, digest in planned["metrics"].items() if old.get(label) == digest]
    builtin = [name for name in planned["builtin"] if name in recorded.get("builtin", [])]
    missing = [label for label in planned["metrics"] if label not in same]
    missing += [name for name in planned["builtin"] if name not in builtin]
    return {"iteration", "timesteps", REWARD, *same, *builtin}, missing


def _base(column: str) -> str:
    """A curve column's metric: ``x`` for ``x``, ``x_se`` and ``x_n``."""
    for suffix in ("_se", "_n"):
        if column.endswith(suffix):
            return column[: -len(suffix)]
    return column


def registered(env_id: str, key: str) -> Any:
    """An env's registered default of setting ``key`` (None when unknown)."""
    import gymnasium

    try:
        return gymnasium.spec(env_id).kwargs.get(key)
    except gymnasium.error.Error:
        return None


def _read_csv(path: Path) -> list[dict[str, float]]:
    if not path.is_file():
        return []
    with path.open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return [{k: _float(v) for k, v in row.items()} for row in rows]


def _float(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _summarize(results: BenchResults) -> None:
    agent_ranks: dict[tuple[str, str, str], int | None] = {}
    if len(results.agents) > 1:
        for design in results.designs:
            for metric in results.metrics:
                groups = {a: results.values(a, design, metric) for a in results.agents}
                bounds = results.ranges.get(metric, (-math.inf, math.inf))
                comparisons, ranks = compare(groups, results.direction(metric, "agents"), bounds=bounds)
                results.comparisons += [_comparison_row("agents", design, metric, c) for c in comparisons]
                agent_ranks.update({(a, design, metric): r for a, r in ranks.items()})
    for agent in results.agents:
        for metric in results.metrics:
            groups = {d: results.values(agent, d, metric) for d in results.designs}
            bounds = results.ranges.get(metric, (-math.inf, math.inf))
            comparisons, ranks = compare(groups, results.direction(metric, "designs"), bounds=bounds)
            if metric != REWARD:  # each design's own proxy: its differences between designs mean nothing
                results.comparisons += [_comparison_row("designs", agent, metric, c) for c in comparisons]
            for design, seeds in groups.items():
                mean, low, high = mean_ci(list(seeds.values()), bounds=bounds)
                results.summary.append(
                    {
                        "agent": agent,
                        "design": design,
                        "metric": metric,
                        "n": sum(1 for v in seeds.values() if not math.isnan(v)),  # seeds measured
                        "seeds": len(seeds),  # seeds evaluated
                        "mean": mean,
                        "ci_low": low,
                        "ci_high": high,
                        "rank": ranks[design],
                        "agent_rank": agent_ranks.get((agent, design, metric)),
                    }
                )


def _comparison_row(scope: str, within: str, metric: str, c: Any) -> dict[str, Any]:
    t = c.test
    return {
        "scope": scope,
        "within": within,
        "metric": metric,
        "a": c.a,
        "b": c.b,
        "n": t.n,
        "diff": t.diff,
        "ci_low": t.ci_low,
        "ci_high": t.ci_high,
        "d_z": t.d_z,
        "p": t.p,
        "p_holm": c.p_holm,
        "better": c.better,
        "seeds_needed": c.seeds_needed,
        "better_by_chain": c.better_by_chain,
        "infinite": t.infinite,
        "unmeasured": t.unmeasured,
    }


def write_outputs(
    out: Path,
    spec: Mapping[str, Any],
    jobs: Sequence[Any],
    failed: Mapping[str, Mapping[str, str]] | None = None,
    left_out: tuple[list[str], list[str]] = ([], []),
) -> BenchResults:
    """Collect the results of every job and write every output file; returns the results. ``spec`` and
    ``jobs`` are those of the designs and agents reported: the runs that ``failed`` (run_id -> its error and
    log) left out the designs and agents ``left_out``, which the reports name. With no job left, the
    reports name only the failed runs, and the files of an earlier report go: they would read as current."""
    from textgym.bench_plots import plot_all
    from textgym.bench_report import write_report
    from textgym.report_html import write_html

    if jobs:
        results = collect(out, spec, jobs)
    else:
        results = BenchResults(spec, [], [], [], [], [], [], {})
    results.failed, results.left_out = {k: dict(v) for k, v in (failed or {}).items()}, left_out
    # written whole into a staging directory, then moved in: a kill while the figures draw leaves the
    # previous outputs, which agree with each other, not a new summary.csv beside an old report.md
    stage = out / STAGING
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    figures: dict[str, Any] = {}
    if jobs:
        with (stage / "results.jsonl").open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(jsonable(r), allow_nan=False) + "\n" for r in results.rows)
        _write_csv(stage / "summary.csv", SUMMARY_COLUMNS, results.summary)
        _write_csv(stage / "comparisons.csv", COMPARISON_COLUMNS, results.comparisons)
        figures = plot_all(stage, results)
    write_report(stage / "report.md", results, figures)
    write_html(stage / "report.html", results, figures)
    written = sorted(
        (p.relative_to(stage) for p in stage.rglob("*") if p.is_file()),
        key=lambda p: p.name.startswith("report."),
    )  # the reports last
    for name in written:
        (out / name).parent.mkdir(exist_ok=True)
        os.replace(stage / name, out / name)
    tables = [out / name for name in ("results.jsonl", "summary.csv", "comparisons.csv")]
    for old in [*tables, *out.glob("*.png"), *out.glob("curves/*.png")]:  # of an earlier report only
        if old.exists() and old.relative_to(out) not in written:
            old.unlink()
    shutil.rmtree(stage, ignore_errors=True)
    return results


def _write_csv(path: Path, columns: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        for row in rows:
            writer.writerow(
                {
                    k: "" if v is None or (isinstance(v, float) and math.isnan(v)) else v
                    for k, v in row.items()
                }
            )
