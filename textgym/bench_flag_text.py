"""The wording of the bench's flags in both reports: each flag raised, the curve checks that ran and raised
none, and the checks that did not run, so that a missing flag is never read as a check passed."""

from __future__ import annotations

from collections.abc import Sequence

from textgym.bench_flags import has_curve, lacks_errors
from textgym.bench_numbers import is_missing, md_escape, md_text, plural
from textgym.bench_results import BenchResults
from textgym.eval_settings import REWARD


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
        f"**{md_text(who)}**: {md_escape(md_text(message))} ({where})"
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
        named = ", ".join(f"`{md_text(m)}` (on {plural(n, 'run')})" for m, n in partial.items())
        lines.append(
            f"The curve checks that read {named} did not run there: those runs trained before the metric was "
            f"added or changed, so their held-out curves lack it (their final evaluations were recomputed; the "
            f"checks on the other metrics ran)."
        )
    unmeasured = [
        d
        for d in results.designs
        if all(is_missing(e["metrics"].get(REWARD)) for e in results.evals if e["design"] == d)
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
        return any(not is_missing(row.get(metric)) for c in curves for row in c)

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
