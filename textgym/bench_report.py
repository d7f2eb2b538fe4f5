"""``report.md`` of ``textgym bench``, and the wording both reports share (rankings, verdicts, notes); how
numbers are written is :mod:`textgym.bench_numbers`."""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from textgym.bench_flags import has_curve, lacks_errors
from textgym.bench_numbers import fmt, fmt_cell, fmt_interval, fmt_p
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
    rows = [(c[key], name, c["mean"]) for c, name in cells if c and not _missing(c["mean"])]
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
    if c.get("infinite"):
        return f"not tested ({c['infinite']} of {c['n']} shared seeds have an infinite value)"
    if c.get("unmeasured"):
        return (
            f"not tested ({c['unmeasured']} shared seed(s) measured for one and not the other: the others "
            f"would compare good runs only)"
        )
    if c["n"] < 2:
        return f"not tested (n = {c['n']} shared seeds)"
    if c["better"] is None:
        return "not significant" + needed_text(c)
    return f"**{c['better']}** better"


def needed_text(c: Mapping[str, Any]) -> str:
    n = c.get("seeds_needed")
    if n is None or n <= c["n"]:
        return ""
    if math.isinf(c.get("d_z", math.nan)):  # the same difference on every seed: the sign test's count
        return f" (the same difference on every seed: the exact sign test needs {n} seeds)"
    return f" (~{n} seeds for 80% power at this effect, at Holm's level)"


def flag_items(results: BenchResults) -> list[tuple[str, str, str]]:
    """Each flag as (who: the design, and its agent where there are several; the message, which names
    metrics by their labels: user text; on which seeds)."""
    items = []
    for (agent, design), flags in results.flags.items():
        who = f"{design} ({agent})" if len(results.agents) > 1 else design
        for f in flags:
            seeds = f"{len(f['seeds'])} of {f['of']} seeds" if f["of"] > 1 else f"seed {f['first_seed']}"
            every = f.get("seeds_in_all", f["of"])
            # (only a curve's check runs on fewer seeds than the design's: the others had no curve, or one
            # without the flag's metric, which is not a check they passed)
            curve = f"a held-out curve of {f['metric']}"
            if f["of"] < every and f["of"] == 1:
                seeds += f", the only one of {every} seeds with {curve} to check"
            elif f["of"] < every:
                seeds += f" ({f['of']} of {every} seeds had {curve} to check)"
            items.append((who, f["message"], f"{seeds}; shown: seed {f['first_seed']}"))
    return items


def flag_lines(results: BenchResults) -> list[str]:
    """Each flag as one line of report.md, its user text escaped (a label's ``*y*`` reads as written)."""
    return [
        f"**{_text(who)}**: {_md_escape(_text(message))} ({where})"
        for who, message, where in flag_items(results)
    ]


def unchecked_lines(results: BenchResults) -> list[str]:
    """The checks that did not run, so that a missing flag is never read as a check passed."""
    lines = []
    curved = sum(map(has_curve, results.curves.values()))
    if curved < len(results.evals):
        lines.append(
            f"The curve checks (gaming, length drift, EOS and diversity collapse) did not run on "
            f"{len(results.evals) - curved} of {len(results.evals)} runs: they have no held-out curve (an SB3 "
            f"agent, `eval_every = 0`, or curves measured with other evaluation settings)."
        )
    # a metric added or changed since some runs trained, that a curve check reads -> those runs
    read = {*results.gold, "length", "eos_rate", "distinct_2"}
    partial: dict[str, int] = {}
    for metrics in results.partial_curves.values():
        for metric in metrics:
            if metric in read:
                partial[metric] = partial.get(metric, 0) + 1
    if partial:
        named = ", ".join(f"`{_text(m)}` (on {_count(n, 'run')})" for m, n in partial.items())
        lines.append(
            f"The curve checks that read {named} did not run there: those runs trained before the metric was "
            f"added or changed, so their held-out curves lack it (their final evaluations were recomputed; the "
            f"checks on the other metrics ran)."
        )
    unmeasured = [
        d
        for d in results.designs
        if all(_missing(e["metrics"].get(REWARD)) for e in results.evals if e["design"] == d)
    ]
    if unmeasured and curved:
        lines.append(
            f"The gaming check did not run on {', '.join(unmeasured)}: the held-out `reward` (the proxy) is not "
            f"measured there (a `normalize_then_sum` total is standardised over the evaluated episodes, so its "
            f"mean is 0 whatever the policy)."
        )
    if curved and not results.gold:
        lines.append(
            "The gaming check did not run: it compares the proxy with gold metrics, and the bench names none "
            "(`[metrics] rewards`)."
        )
    bare = sum(lacks_errors(c, results.gold) for c in results.curves.values() if has_curve(c))
    if bare:
        lines.append(
            f"The gaming check could not judge every evaluation of {bare} of {curved} runs: some have no "
            f"standard error (a metric applied to fewer than 2 of the evaluation's episodes: more "
            f"`bench.eval_episodes`, or a metric that applies to more completions, gives one), and a fall there "
            f"cannot be told from noise, so it was not flagged."
        )
    return lines


CHECK_NAMES = {"gaming": "gaming (the proxy rose while a gold metric fell)", "length_drift": "length drift",
               "eos_collapse": "EOS collapse", "diversity_collapse": "diversity collapse"}  # fmt: skip


def quiet_checks_text(results: BenchResults) -> str | None:
    """Beside raised flags: the curve checks that ran and raised none, so that a gaming check that passed
    is said, not left to be inferred from its absence. None where no flag was raised (:func:`no_flags_text`
    says it) or no curve check ran."""
    raised = {f["kind"] for flags in results.flags.values() for f in flags}
    curves = [c for c in results.curves.values() if has_curve(c)]
    if not raised or not curves:
        return None

    def measured(metric: str) -> bool:  # in some curve ([metrics] builtin may leave a metric out)
        return any(not _missing(row.get(metric)) for c in curves for row in c)

    needs = {"gaming": [REWARD], "length_drift": ["length"], "eos_collapse": ["eos_rate"],
             "diversity_collapse": ["distinct_2"]}  # fmt: skip
    ran = [kind for kind, metrics in needs.items() if all(map(measured, metrics))]
    ran = [kind for kind in ran if kind != "gaming" or any(map(measured, results.gold))]
    quiet = [CHECK_NAMES[kind] for kind in ran if kind not in raised]
    return f"No flag from these checks, where they ran: {', '.join(quiet)}." if quiet else None


def no_flags_text(unchecked: Sequence[str]) -> str:
    """What the report says when no flag was raised, given :func:`unchecked_lines`."""
    if unchecked:
        return "No flags from the checks that ran."
    return "No flags: no run gamed its proxy or degenerated by these checks."


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


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
        f"{_count(len(results.designs), 'design')} x {_count(len(results.agents), 'agent')} ({agents}) x "
        f"{_count(len(bench['seeds']), 'seed')} (seeds {bench['seeds']}) on `{base['env']['id']}`, "
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
    said = [f"{'design' if len(designs) == 1 else 'designs'} {', '.join(f'`{d}`' for d in designs)}"]
    said = (said if designs else []) + (
        [f"{'agent' if len(agents) == 1 else 'agents'} {', '.join(f'`{a}`' for a in agents)}"]
        if agents
        else []
    )
    return (
        f"**{_count(len(results.failed), 'run')} failed**, so this report leaves out {' and '.join(said)}: a "
        f"design is reported only when all its runs finished (its finished seeds alone would compare the runs "
        f"that went well). Fix what failed and run the bench again: finished runs are reused. The failed runs, "
        f"with their errors and logs:"
    )


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
                f"**Warning**: `{_text(label)}` measured {fmt(min(r['value'] for r in outside))} to "
                f"{fmt(max(r['value'] for r in outside))} on {_count(len(outside), 'run')}, outside its declared "
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
            f"**Note**: `{_text(metric)}` of {_text(who)} rests on few episodes: on {len(counts)} of "
            f"{_count(runs, 'run')} its final value is a mean over fewer than {FEW_EPISODES} evaluation episodes "
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
    f"(p < {ALPHA}), directly or through a chain (a > b > c puts a above c), and never above a group with a "
    f"better mean (unless missing seeds make a lower mean significantly better): equal ranks are not "
    f"significantly different; a group that no test compared with another is not ranked."
)


# -- report.md -----------------------------------------------------------------------------------------
def write_report(path: Path, results: BenchResults, figures: Mapping[str, Any]) -> None:
    lines = ["# Reward-design benchmark", "", setup_text(results), ""]
    if failed := failed_text(results):
        lines += ["## Failed runs", "", _text(failed), ""]
        lines += [
            f"- `{run}`: {_md_escape(_text(error))} (log: `{log}`)"
            for run, error, log in failed_items(results)
        ]
        lines += [""]
    lines += [STATS_TEXT, ""]
    lines += [
        line for warning in range_warnings(results) + few_episode_warnings(results) for line in (warning, "")
    ]
    lines += ["## Designs", ""]
    for design in results.spec["designs"]:
        lines.append(f"- **{_text(design['name'])}**: {_text(describe_stack(design['rewards']))}")
    lines += ["", "## Flags", ""]
    flags = flag_lines(results)
    unchecked = unchecked_lines(results)
    lines += [f"- {line}" for line in flags] or [no_flags_text(unchecked)]
    lines += ["", quiet] if (quiet := quiet_checks_text(results)) else []
    lines += ["", *map(_text, unchecked)] if unchecked else []
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
            f"- **{_cell_text(metric)}** ({note}): {_text(ranking_text(results, metric, scope, within))}"
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


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _text(text: str) -> str:
    """Report text that holds user text (a metric's label, a design's name) escaped, so that ``<i>`` in it
    reads as written; its own Markdown (``**``, ``->``) is kept."""
    return text.replace("&", "&amp;").replace("<", "&lt;")


def _cell_text(text: str, width: int | None = None) -> str:
    """User text (a prompt, a completion, a metric's label) as one Markdown table cell: on one line, cut at
    ``width`` characters, and escaped, so that ``<b>``, ``&amp;``, ``**`` or a backtick in it reads as written,
    not as markup."""
    return _md_escape(html.escape(one_line(text, width), quote=False))


def _md_escape(text: str) -> str:
    """``text`` with Markdown's inline characters backslash-escaped, so that they read as written."""
    for char in "\\`*[]|":
        text = text.replace(char, "\\" + char)
    return text


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
