"""``report.md`` of ``textgym bench``, and the wording both reports share (rankings, verdicts, notes); how
numbers are written is :mod:`textgym.bench_numbers`."""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from textgym.bench_flag_text import flag_lines, no_flags_text, quiet_checks_text, unchecked_lines
from textgym.bench_numbers import (
    fmt,
    fmt_cell,
    fmt_interval,
    fmt_p,
    is_missing,
    md_escape,
    md_text,
    named,
    plural,
)
from textgym.bench_results import BenchResults, registered
from textgym.bench_stats import ALPHA
from textgym.composition import describe_stack
from textgym.eval_settings import BUILTIN_METRICS, REWARD
from textgym.formatting import one_line


# -- shared wording ------------------------------------------------------------------------------------
def metric_note(results: BenchResults, metric: str, scope: str) -> str:
    direction = results.direction(metric, scope)
    if metric == REWARD and scope == "designs":
        return f"each design's own training total on the {sample_prompts(results)}: not comparable between designs"
    if direction is None:
        return BUILTIN_METRICS[metric].doc + ": not ranked" if metric in BUILTIN_METRICS else "not ranked"
    return f"{direction} is better"


def reward_note(results: BenchResults) -> str | None:
    """Under a table of designs: what its ``reward`` column is (each design's own proxy), beside the gold
    metrics that can be compared."""
    if REWARD not in results.metrics or not rankable(results, "designs"):
        return None
    return f"`{REWARD}`: {metric_note(results, REWARD, 'designs')}; the other columns are measured alike for all."


def ranking(
    results: BenchResults, metric: str, scope: str, within: str
) -> list[tuple[int | None, str, float]]:
    """(rank, group, mean) in rank order, then mean order, for one metric within one agent or design; the
    groups with a value that no test compared with another come last, with rank None."""
    key = "rank" if scope == "designs" else "agent_rank"
    if scope == "designs":
        cells = [(results.cell(within, d, metric), d) for d in results.designs]
    else:
        cells = [(results.cell(a, within, metric), a) for a in results.agents]
    direction = results.direction(metric, scope)
    sign = -1 if direction == "higher" else 1
    rows = [(c[key], name, c["mean"]) for c, name in cells if c and not is_missing(c["mean"])]
    return sorted(
        rows,
        key=lambda r: (math.inf if r[0] is None else r[0], sign * r[2] if not math.isnan(r[2]) else math.inf),
    )


def ranking_text(results: BenchResults, metric: str, scope: str, within: str) -> str:
    rows = ranking(results, metric, scope, within)
    text = ", ".join(f"{rank}. {name} ({fmt(mean)})" for rank, name, mean in rows if rank is not None)
    ranks = [r for r, _, _ in rows if r is not None]
    unranked = [f"{name} ({fmt(mean)})" for rank, name, mean in rows if rank is None]
    if unranked and ranks:
        text += f"; not ranked (no test compared it with another): {', '.join(unranked)}"
    elif unranked:
        text = f"not ranked: {', '.join(unranked)}"
    tested = any(_tested(c) for c in comparisons(results, scope, within, metric))
    if len(rows) > 1 and not tested:
        text += " — not tested: no pair has 2 shared seeds, each measured and finite for both"
    elif len(ranks) > 1 and len(set(ranks)) == 1:
        text += " — no pair is significantly different"
    elif len(set(ranks)) < len(ranks):
        text += " — equal ranks are not significantly different"
    return text


def comparisons(results: BenchResults, scope: str, within: str, metric: str) -> list[Mapping[str, Any]]:
    return [
        c for c in results.comparisons if (c["scope"], c["within"], c["metric"]) == (scope, within, metric)
    ]


def _tested(c: Mapping[str, Any]) -> bool:
    return c["n"] >= 2 and not c.get("infinite") and not c.get("unmeasured")


def verdict(c: Mapping[str, Any]) -> str:
    said = _verdict(c)
    if c["better"] is None and c.get("better_by_chain"):  # (the report's ranks put one above the other)
        said += f"; {c['better_by_chain']} ranks above through a chain of significant differences"
    return said


def _verdict(c: Mapping[str, Any]) -> str:
    if c.get("infinite"):
        return f"not tested ({c['infinite']} of {c['n']} shared seeds have an infinite value)"
    if c.get("unmeasured"):
        return (
            f"not tested ({c['unmeasured']} shared seed(s) measured for one and not the other: the others "
            f"would compare good runs only)"
        )
    if c["n"] < 2:
        return f"not tested (n = {c['n']} shared seeds)"
    if c["better"] is None:  # ("on its own" where a chain ranks one above the other: verdict() names it)
        return (
            "not significant on its own" if c.get("better_by_chain") else "not significant"
        ) + needed_text(c)
    return f"**{c['better']}** better"


def needed_text(c: Mapping[str, Any]) -> str:
    n = c.get("seeds_needed")
    if n is None or n <= c["n"]:
        return ""
    if math.isinf(c.get("d_z", math.nan)):  # the same difference on every seed: the sign test's count
        return f" (the same difference on every seed: the exact sign test needs {n} seeds)"
    return f" (~{n} seeds for 80% power at this effect, at Holm's level)"


def setup_text(results: BenchResults) -> str:
    spec = results.spec
    bench, base = spec["bench"], spec["base"]
    agents = ", ".join(f"`{a['label']}`" for a in spec["agents"])
    if held_out(results):
        episodes = f"{bench['eval_episodes']} held-out episodes (`{bench['eval_prompts']}`"
    elif bench["eval_prompts"]:  # the training source named again
        episodes = (
            f"{bench['eval_episodes']} episodes of the training prompts, not held out (eval_prompts "
            f"`{bench['eval_prompts']}` is the source the runs train on"
        )
    else:  # without eval_prompts the evaluation reuses the training prompts
        episodes = f"{bench['eval_episodes']} episodes of the training prompts, not held out (no eval_prompts"
    return (
        f"{plural(len(results.designs), 'design')} x {plural(len(results.agents), 'agent')} ({agents}) x "
        f"{plural(len(bench['seeds']), 'seed')} (seeds {bench['seeds']}) on `{base['env']['id']}`, "
        f"{base['run']['total_timesteps']} generated tokens per run (a run ends with the iteration that reaches "
        f"them). Every run is evaluated on the same "
        f"{episodes}; same prompts and sampling seed)"
        + _curve_spacing(results.curves)
        + "."
        + (
            f" The held-out curves of {len(results.stale_curves)} runs are not shown: they were measured during "
            f"training with other evaluation settings (their final evaluations were recomputed)."
            if results.stale_curves
            else ""
        )
    )


def failed_text(results: BenchResults) -> str | None:
    """What the runs that failed left out of the report (None when every run finished); the runs follow it
    (:func:`failed_items`)."""
    if not results.failed:
        return None
    designs, agents = results.left_out
    said = named(designs, agents, lambda name: f"`{name}`")
    return (
        f"**{plural(len(results.failed), 'run')} failed**, so this report leaves out {' and '.join(said)}: "
        f"{'an agent' if agents else 'a design'} is reported only when all its runs finished (its finished runs "
        f"alone would compare the ones that went well). Fix what failed and run the bench again. The failed "
        f"runs, with their errors and logs:"
    )


NOTHING_MEASURED = "this report has no results, and the bench wrote no tables or plots."


def failed_items(results: BenchResults) -> list[tuple[str, str, str]]:
    """Each failed run as (run, its error on one line, its log)."""
    return [(run_id, one_line(f["error"], 600), f["log"]) for run_id, f in results.failed.items()]


def range_warnings(results: BenchResults) -> list[str]:
    """A line per metric whose declared ``range`` some run's value falls outside: its intervals are clipped
    to that range, so a range that is wrong would otherwise go unseen."""
    lines = []
    for metric in results.spec["metric_rewards"]:
        if "range" not in metric:
            continue
        low, high = metric["range"]
        label = metric["label"]
        outside = [r for r in results.rows if r["metric"] == label and not low <= r["value"] <= high
                   and not math.isnan(r["value"])]  # fmt: skip
        if outside:
            lines.append(
                f"**Warning**: `{md_text(label)}` measured {fmt(min(r['value'] for r in outside))} to "
                f"{fmt(max(r['value'] for r in outside))} on {plural(len(outside), 'run')}, outside its declared "
                f"range [{low:g}, {high:g}]: its intervals are clipped to that range; check the range."
            )
    return lines


FEW_EPISODES = 8  # a final value that is a mean over fewer of a run's evaluation episodes is said to be so


def few_episode_warnings(results: BenchResults) -> list[str]:
    """A line per group and metric whose final value, on some run, is a mean over fewer than
    ``FEW_EPISODES`` evaluation episodes (a metric that applies to few completions): its cell reads like one
    over every episode."""
    few: dict[tuple[str, str, str], list[int]] = {}
    for e in results.evals:
        for metric, n in (e.get("counts") or {}).items():
            if metric in results.metrics and isinstance(n, int) and 0 < n < FEW_EPISODES:
                few.setdefault((e["agent"], e["design"], metric), []).append(n)
    lines = []
    for (agent, design, metric), counts in few.items():
        who = f"{design} ({agent})" if len(results.agents) > 1 else design
        runs = sum(1 for e in results.evals if (e["agent"], e["design"]) == (agent, design))
        lines.append(
            f"**Note**: `{md_text(metric)}` of {md_text(who)} rests on few episodes: on {len(counts)} of "
            f"{plural(runs, 'run')} its final value is a mean over fewer than {FEW_EPISODES} evaluation episodes "
            f"(the ones it applied to; fewest: {min(counts)}). Read its cells and comparisons with that in mind."
        )
    return lines


STATS_TEXT = (
    f"Each cell: mean over seeds [95% Student-t interval, clipped to the metric's range], and (n of N "
    f"seeds) where the metric was not measured on every seed. The interval is the spread over training seeds: "
    f"every run is evaluated on the same episodes (prompts and sampling seed), so it does not cover the noise "
    f"of that one evaluation sample. Comparisons are "
    f"paired over shared seeds (same seed = same initial weights and evaluation episodes; for one agent, the "
    f"same first rollouts): the "
    f"mean difference with its 95% interval, Cohen's d_z (mean difference / sd of the differences) and the "
    f"paired t-test's p-value, Holm-corrected over the pairs of each metric (the interval is not: it can "
    f"exclude 0 where the corrected p is above {ALPHA}). A group ranks below every group significantly better "
    f"(p < {ALPHA}), directly or through a chain (a > b > c puts a above c, and a verdict says so where a - c alone "
    f"is not significant), and never above a group with a "
    f"better mean (unless missing seeds make a lower mean significantly better): equal ranks are not "
    f"significantly different; a group that no test compared with another is not ranked."
)


# -- report.md -----------------------------------------------------------------------------------------
def write_report(path: Path, results: BenchResults, figures: Mapping[str, Any]) -> None:
    if not results.jobs:  # every design failed: nothing is measured
        lines = [
            "# Reward-design benchmark",
            "",
            f"No design had all its runs finish: {NOTHING_MEASURED}",
            "",
        ]
    else:
        lines = ["# Reward-design benchmark", "", setup_text(results), ""]
    if failed := failed_text(results):
        lines += ["## Failed runs", "", md_text(failed), ""]
        lines += [
            f"- `{run}`: {md_escape(md_text(error))} (log: `{log}`)"
            for run, error, log in failed_items(results)
        ]
        lines += [""]
    if not results.jobs:
        path.write_text("\n".join(lines), encoding="utf-8")
        return
    lines += [STATS_TEXT, ""]
    lines += [
        line for warning in range_warnings(results) + few_episode_warnings(results) for line in (warning, "")
    ]
    lines += ["## Designs", ""]
    for design in results.spec["designs"]:
        lines.append(f"- **{md_text(design['name'])}**: {md_text(describe_stack(design['rewards']))}")
    lines += ["", "## Flags", ""]
    flags = flag_lines(results)
    unchecked = unchecked_lines(results)
    lines += [f"- {line}" for line in flags] or [no_flags_text(unchecked)]
    lines += ["", quiet] if (quiet := quiet_checks_text(results)) else []
    lines += ["", *map(md_text, unchecked)] if unchecked else []
    for agent in results.agents:
        heading = f"## Designs under agent `{agent}`" if len(results.agents) > 1 else "## Results"
        lines += ["", heading, "", *_table(results, [(agent, d, d) for d in results.designs], "design"), ""]
        lines += [reward_note(results), ""] if reward_note(results) else []
        lines += _rankings_and_pairs(results, "designs", agent)
    if len(results.agents) > 1:
        for design in results.designs:
            lines += ["", f"## Agents under design `{design}`", ""]
            lines += [*_table(results, [(a, design, a) for a in results.agents], "agent"), ""]
            lines += _rankings_and_pairs(results, "agents", design)
    lines += ["", "## Plots", ""]
    for name in ("training_curves", "eval_curves", "overoptimization", "metric_bars"):
        if figures.get(name):
            lines.append(f"![{name}]({Path(figures[name]).name})")
    lines += _samples(results)
    lines += [
        "",
        "## Files",
        "",
        "`results.jsonl` (one row per run and metric), `summary.csv` (the tables), `comparisons.csv` (every "
        "paired comparison), the plots, `report.html` (this report with the plots, each design's curves and "
        "the samples side by side) and `runs/` (each run's `textgym train` directory with `eval.json` and, "
        "for LM agents, `eval.csv`: the held-out curves).",
        "",
    ]
    path.write_text("\n".join(lines), encoding="utf-8")


def _table(results: BenchResults, groups: Sequence[tuple[str, str, str]], what: str) -> list[str]:
    metrics = results.metrics
    header = [_cell_text(_title(m)) for m in metrics]
    lines = [f"| {what} | " + " | ".join(header) + " |", "|---" * (len(metrics) + 1) + "|"]
    for agent, design, label in groups:
        lines.append(
            f"| {_cell_text(label)} | "
            + " | ".join(fmt_cell(results.cell(agent, design, m)) for m in metrics)
            + " |"
        )
    return lines


def _title(metric: str) -> str:
    return "length (tokens, EOS incl.)" if metric == "length" else metric


def rankable(results: BenchResults, scope: str) -> bool:
    """Whether ``scope`` ("designs" or "agents") has groups to rank against each other: one design alone has
    none, and no ranking is shown for it."""
    return len(results.designs if scope == "designs" else results.agents) > 1


def _rankings_and_pairs(results: BenchResults, scope: str, within: str) -> list[str]:
    if not rankable(results, scope):
        return []
    lines = ["Rankings:", ""]
    for metric in results.metrics:
        note = metric_note(results, metric, scope)
        if results.direction(metric, scope) is None or not ranking(results, metric, scope, within):
            continue
        lines.append(
            f"- **{_cell_text(metric)}** ({note}): {md_text(ranking_text(results, metric, scope, within))}"
        )
    rows = []
    for metric in results.metrics:
        if results.direction(metric, scope) is None:
            continue
        for c in comparisons(results, scope, within, metric):
            rows.append(
                f"| {_cell_text(metric)} | {_cell_text(c['a'])} − {_cell_text(c['b'])} | {fmt_interval(c['diff'], c['ci_low'], c['ci_high'])} | "
                f"{fmt(c['d_z'], 2)} | {fmt_p(c['p_holm'])} | {c['n']} | {verdict(c)} |"
            )
    if rows:
        lines += [
            "",
            "Paired comparisons:",
            "",
            "| metric | pair | difference [95% CI, unadjusted] | d_z | p (Holm) | seeds | verdict |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    return lines


def _curve_spacing(curves: Mapping[str, list[dict[str, Any]]]) -> str:
    """How often the curves shown were measured, from their own rows: a rerun keeps curves measured under
    another ``bench.eval_every`` (or 0, which measures none), so the setting now need not say it."""
    spacing: set[int] = set()  # between evaluations before a run's last (which is at its end, wherever)
    ends: set[int] = set()  # to its last: the spacing of runs shorter than eval_every
    for rows in curves.values():
        steps = [b - a for a, b in itertools.pairwise(int(float(r["iteration"])) for r in rows)]
        spacing.update(steps[:-1])
        ends.update(steps[-1:])
    gaps = sorted(g for g in (spacing or ends) if g > 0)
    if not gaps:
        return ""
    return f", during training every {' or '.join(map(str, gaps))} iterations"


def _cell_text(text: str, width: int | None = None) -> str:
    """User text (a prompt, a completion, a metric's label) as one Markdown table cell: on one line, cut at
    ``width`` characters, and escaped, so that ``<b>``, ``&amp;``, ``**`` or a backtick in it reads as written,
    not as markup."""
    return md_escape(html.escape(one_line(text, width), quote=False))


def held_out(results: BenchResults) -> bool:
    """Whether the evaluation's prompts are other than the training ones: bench.eval_prompts is set and names
    another source than the runs train on (their env.prompts, or the env's registered default)."""
    evaluated = results.spec["bench"]["eval_prompts"]
    env = results.spec["base"]["env"]
    return bool(evaluated) and evaluated != env.get("prompts", registered(env["id"], "prompts"))


def sample_prompts(results: BenchResults) -> str:
    """What the sample tables' prompts are: held out, or the training ones."""
    return "held-out prompts" if held_out(results) else "training prompts (none held out)"


def _samples(results: BenchResults) -> list[str]:
    seed = results.spec["bench"]["seeds"][0]
    lines = ["", f"## Samples (seed {seed}, the first {sample_prompts(results)})", ""]
    for e in results.evals:
        if e["seed"] != seed or not e["samples"]:
            continue
        who = f"{e['design']} ({e['agent']})" if len(results.agents) > 1 else e["design"]
        lines += [
            f"### {who}",
            "",
            "| prompt | completion | finish | reward | scores |",
            "|---|---|---|---|---|",
        ]
        for s in e["samples"]:
            scores = ", ".join(f"{_cell_text(k)} {fmt(v)}" for k, v in s["components"].items())
            lines.append(
                f"| {_cell_text(s['prompt'], 60)} | {_cell_text(s['completion'], 120)} | {s['finish_reason']} | "
                f"{fmt(s['reward'])} | {scores} |"
            )
        lines.append("")
    return lines
