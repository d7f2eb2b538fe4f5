"""``report.html`` of ``textgym bench``: one self-contained page (plots embedded as data URIs, no scripts, no
external resources) with the summary tables, rankings and paired comparisons, flags, every plot, each
design's curves and the samples side by side per design with every component's score."""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from textgym.bench_flag_text import flag_items, no_flags_text, quiet_checks_text, unchecked_lines
from textgym.bench_numbers import fmt, fmt_cell, fmt_interval, fmt_p
from textgym.bench_report import (
    NOTHING_MEASURED,
    STATS_TEXT,
    comparisons,
    failed_items,
    failed_text,
    few_episode_warnings,
    metric_note,
    range_warnings,
    rankable,
    ranking,
    ranking_text,
    reward_note,
    sample_prompts,
    setup_text,
    verdict,
)
from textgym.bench_results import BenchResults
from textgym.composition import describe_stack

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1400px; padding: 0 1em; color: #222; }
h1, h2, h3 { font-weight: 600; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: .6em 0 1.2em; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: .3em .55em; vertical-align: top; text-align: left; }
th { background: #f3f3f3; } td.num { font-variant-numeric: tabular-nums; white-space: nowrap; }
.rank { display: inline-block; min-width: 1.4em; padding: 0 .3em; border-radius: .6em; background: #e8eef8;
        font-size: 11px; text-align: center; margin-left: .3em; }
.rank.r1 { background: #cde8cd; } .note { color: #666; font-size: 12px; }
.flag { color: #8a3b00; } img { max-width: 100%; border: 1px solid #eee; margin: .4em 0; }
pre { white-space: pre-wrap; margin: 0 0 .3em; font: 12px/1.35 ui-monospace, monospace; }
.scores { color: #555; font-size: 11px; } .better { font-weight: 600; }
"""


def write_html(path: Path, results: BenchResults, figures: Mapping[str, Any]) -> None:
    e = html.escape
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>Reward-design benchmark</title><style>{CSS}</style></head><body>",
        "<h1>Reward-design benchmark</h1>",
        f"<p>{_md(setup_text(results))}</p>"
        if results.jobs  # else every design failed: nothing is measured
        else f"<p>No design had all its runs finish: {e(NOTHING_MEASURED)}</p>",
    ]
    if failed := failed_text(results):
        parts += [f'<h2>Failed runs</h2><p class="flag">{_md(failed)}</p><ul>']
        parts += [
            f"<li><code>{e(run)}</code>: {e(error)} (log: <code>{e(log)}</code>)</li>"
            for run, error, log in failed_items(results)
        ]
        parts += ["</ul>"]
    if not results.jobs:
        path.write_text("\n".join([*parts, "</body></html>"]), encoding="utf-8")
        return
    parts += [
        f'<p class="note">{e(STATS_TEXT)}</p>',
        *(f"<p>{_md(warning)}</p>" for warning in range_warnings(results) + few_episode_warnings(results)),
        "<h2>Designs</h2><ul>",
        *[
            f"<li><b>{e(d['name'])}</b>: {e(describe_stack(d['rewards']))}</li>"
            for d in results.spec["designs"]
        ],
        "</ul><h2>Flags</h2>",
    ]
    flags, unchecked = flag_items(results), unchecked_lines(results)
    if flags:  # the message names metrics by their labels: user text, escaped (not read as markup)
        items = [
            f'<li class="flag"><b>{e(who)}</b>: {e(message)} ({e(where)})</li>'
            for who, message, where in flags
        ]
        parts += ["<ul>", *items, "</ul>"]
        if quiet := quiet_checks_text(results):
            parts.append(f"<p>{e(quiet)}</p>")
    else:
        parts.append(f"<p>{e(no_flags_text(unchecked))}</p>")
    parts += [f"<p>{_md(line)}</p>" for line in unchecked]
    for agent in results.agents:
        title = f"Designs under agent {agent}" if len(results.agents) > 1 else "Results"
        parts += [
            f"<h2>{e(title)}</h2>",
            _table(results, [(agent, d, d) for d in results.designs], "design", "rank"),
            f"<p>{_md(note)}</p>" if (note := reward_note(results)) else "",
        ]
        parts += _rankings(results, "designs", agent)
    if len(results.agents) > 1:
        for design in results.designs:
            parts += [
                f"<h2>Agents under design {e(design)}</h2>",
                _table(results, [(a, design, a) for a in results.agents], "agent", "agent_rank"),
            ]
            parts += _rankings(results, "agents", design)
    parts.append("<h2>Plots</h2>")
    captions = {
        "training_curves": "Training reward (each design's own total) against generated tokens; thin: each seed, "
        "thick: the mean.",
        "eval_curves": "Held-out metrics during training.",
        "overoptimization": "Gold and proxy against sqrt(KL to the reference) (Gao, Schulman and Hilton, 2022).",
        "metric_bars": "Final evaluation metrics with 95% intervals.",
    }
    for name, caption in captions.items():
        if figures.get(name):
            parts += [
                f"<h3>{e(name.replace('_', ' '))}</h3>",
                _img(figures[name], caption),
                f'<p class="note">{e(caption)}</p>',
            ]
    parts.append("<h2>Each design's curves</h2>")
    for design, fig in figures.get("designs", {}).items():
        parts += [f"<h3>{e(design)}</h3>", _img(fig, f"curves of {design}")]
    parts += _samples(results)
    parts.append("</body></html>")
    path.write_text("\n".join(parts), encoding="utf-8")


def _md(text: str) -> str:
    """The markdown of the shared wording (``**bold**``, ```code```) as HTML, everything else escaped."""
    pieces = html.escape(text).split("**")
    text = "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(pieces))
    pieces = text.split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(pieces))


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt)}">'


def _table(results: BenchResults, groups: list[tuple[str, str, str]], what: str, rank_key: str) -> str:
    e = html.escape
    head = "".join(
        f"<th>{e(m if m != 'length' else 'length (tokens, EOS incl.)')}</th>" for m in results.metrics
    )
    rows = [f"<table><thead><tr><th>{e(what)}</th>{head}</tr></thead><tbody>"]
    for agent, design, label in groups:
        cells = []
        for metric in results.metrics:
            cell = results.cell(agent, design, metric)
            rank = cell.get(rank_key) if cell else None
            badge = f'<span class="rank r{rank}">{rank}</span>' if rank is not None else ""
            cells.append(f'<td class="num">{e(fmt_cell(cell))}{badge}</td>')
        rows.append(f"<tr><th>{e(label)}</th>{''.join(cells)}</tr>")
    rows.append("</tbody></table>")
    return "".join(rows)


def _rankings(results: BenchResults, scope: str, within: str) -> list[str]:
    if not rankable(results, scope):
        return []
    e = html.escape
    items, pairs = [], []
    for metric in results.metrics:
        if results.direction(metric, scope) is None or not ranking(results, metric, scope, within):
            continue
        items.append(
            f"<li><b>{e(metric)}</b> ({e(metric_note(results, metric, scope))}): "
            f"{e(ranking_text(results, metric, scope, within))}</li>"
        )
        for c in comparisons(results, scope, within, metric):
            if c["better"] is None:
                said = e(verdict(c))
            else:
                said = f'<span class="better">{e(c["better"])}</span> better'
            pairs.append(
                f"<tr><td>{e(metric)}</td><td>{e(c['a'])} − {e(c['b'])}</td>"
                f'<td class="num">{fmt_interval(c["diff"], c["ci_low"], c["ci_high"])}</td>'
                f'<td class="num">{fmt(c["d_z"], 2)}</td><td class="num">{fmt_p(c["p_holm"])}</td>'
                f'<td class="num">{c["n"]}</td><td>{said}</td></tr>'
            )
    out = ["<p>Rankings (rank badges in the table):</p><ul>", *items, "</ul>"]
    if pairs:
        out += [
            "<details><summary>Paired comparisons</summary><table><thead><tr><th>metric</th><th>pair</th>"
            "<th>difference [95% CI, unadjusted]</th><th>d_z</th><th>p (Holm)</th><th>seeds</th><th>verdict</th></tr></thead>"
            "<tbody>",
            *pairs,
            "</tbody></table></details>",
        ]
    return out


def _samples(results: BenchResults) -> list[str]:
    """For the first seed: one table per agent, one row per held-out prompt, one column per design."""
    e = html.escape
    seed = results.spec["bench"]["seeds"][0]
    out = [f"<h2>Samples side by side (seed {seed}, the first {sample_prompts(results)})</h2>"]
    for agent in results.agents:
        by_design = {
            ev["design"]: ev["samples"] for ev in results.evals if ev["agent"] == agent and ev["seed"] == seed
        }
        n = max((len(s) for s in by_design.values()), default=0)
        if not n:
            continue
        if len(results.agents) > 1:
            out.append(f"<h3>{e(agent)}</h3>")
        head = "".join(f"<th>{e(d)}</th>" for d in results.designs)
        rows = [f"<table><thead><tr><th>prompt</th>{head}</tr></thead><tbody>"]
        for i in range(n):
            first = next((s[i] for s in by_design.values() if len(s) > i), None)
            prompt = first["prompt"] if first else ""
            cells = []
            for design in results.designs:
                samples = by_design.get(design, [])
                if len(samples) <= i:
                    cells.append("<td></td>")
                    continue
                s = samples[i]
                scores = "<br>".join(f"{e(k)}: {fmt(v)}" for k, v in s["components"].items())
                cells.append(
                    f'<td><pre>{e(s["completion"])}</pre><div class="scores">finish: {e(s["finish_reason"])}, '
                    f"tokens: {s['num_tokens']}, reward: {fmt(s['reward'])}"
                    + (f", kl: {fmt(s['kl'])}" if s.get("kl") is not None else "")
                    + f"<br>{scores}</div></td>"
                )
            rows.append(f"<tr><td><pre>{e(prompt)}</pre></td>{''.join(cells)}</tr>")
        rows.append("</tbody></table>")
        out.append("".join(rows))
    return out
