"""Plain-text tables of episodes and the statistics they need (used by the CLI, training and the bench)."""

from __future__ import annotations

import math
import unicodedata
from collections.abc import Sequence
from typing import Any


def display_width(text: str) -> int:
    """The columns ``text`` takes in a terminal: 2 for a wide character (CJK, most emoji), 0 for a combining
    mark or an invisible format character, 1 for the others."""
    return sum(_columns(c) for c in text)


def _columns(c: str) -> int:
    if unicodedata.combining(c) or unicodedata.category(c) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(c) in ("W", "F") else 1


def shortened(text: str, width: int | None) -> str:
    """``text`` cut to ``width`` terminal columns, the last one "…" where it was cut (``None``: whole), and
    to ``4 * width`` characters (marks that take no column are characters all the same)."""
    if width is None or (display_width(text) <= width and len(text) <= 4 * width):
        return text
    out, used = [], 0
    for c in text[: 4 * width - 1]:
        if used + _columns(c) > width - 1:
            break
        out.append(c)
        used += _columns(c)
    return "".join(out) + "…"


def padded(text: str, width: int) -> str:
    """``text`` left-aligned in ``width`` terminal columns (``str.ljust`` counts characters, not columns)."""
    return text + " " * max(0, width - display_width(text))


def one_line(text: Any, width: int | None = None) -> str:
    """``text`` on one line (every run of whitespace one space), cut to ``width`` terminal columns."""
    return shortened(" ".join(str(text).split()), width)


def format_table(rows: Sequence[dict[str, Any]], prompt_width: int = 32, completion_width: int = 56) -> str:
    """A plain-text table: prompt, completion, each reward component's raw score, the weighted total (and
    their means). A component's column is as wide as its name: two names cut alike would read as one.

    A multi-turn episode shows its conversation (the agent's turns, the others' as ``[role: text]``), and its
    last column is the episode's return: the weighted total plus the rewards paid for each turn."""

    def cut(text: str, width: int) -> str:
        return padded(one_line(text, width), width)

    names = list(rows[0]["reward_components"]) if rows else []
    widths = [max(14, display_width(n)) for n in names]
    multi_turn = any(len(row.get("turns") or ()) > 1 for row in rows)
    paid = any(row.get("turn_rewards") for row in rows)
    total = "return (total + turns)" if paid else "weighted total"
    header = [
        cut("prompt", prompt_width),
        cut("conversation" if multi_turn else "completion", completion_width),
    ]
    header += [" " * (w - display_width(n)) + n for n, w in zip(names, widths)] + [total]
    rule = "-" * display_width("  ".join(header))
    lines = ["  ".join(header), rule]
    for row in rows:
        cells = [cut(row["prompt"], prompt_width), cut(conversation(row), completion_width)]
        cells += [number(row["reward_components"][n], w) for n, w in zip(names, widths)]
        lines.append("  ".join([*cells, number(row["reward"], len(total))]))
    if rows:
        means = [applicable_mean([r["reward_components"][n] for r in rows]) for n in names]
        cells = [cut("mean", prompt_width), cut("", completion_width)]
        cells += [number(m, w) for m, w in zip(means, widths)]
        lines += [rule, "  ".join([*cells, number(sum(r["reward"] for r in rows) / len(rows), len(total))])]
    return "\n".join(lines)


def conversation(row: dict[str, Any]) -> str:
    """An episode's completion, or for a multi-turn one its turns in order: the agent's as written (``""``
    where it said nothing), the environment's as ``[role: text]``."""
    from textgym.conversation import AGENT_ROLE

    turns = row.get("turns") or ()
    if len(turns) <= 1:
        return row["completion"]
    return " ".join(
        (t["text"] or '""') if t["role"] == AGENT_ROLE else f"[{t['role']}: {t['text']}]" for t in turns
    )


def number(value: float | None, width: int = 0, digits: int = 3) -> str:
    """``value`` with ``digits`` decimals, right-aligned in ``width``; a value that rounds to zero is shown as
    0, without the minus sign of a tiny negative score or KL ("-0.000"); None or NaN (a KL without a
    reference, a component that applied to nothing) as "n/a"."""
    if value is None or math.isnan(value):
        return f"{'n/a':>{width}}"
    text = f"{value:.{digits}f}"
    if text.startswith("-") and float(text) == 0:
        text = text[1:]
    return f"{text:>{width}}"


def applicable_mean(values: Sequence[float | None]) -> float:
    """The mean of the values that apply (not None, not NaN); NaN when none does."""
    kept = [v for v in values if v is not None and not math.isnan(v)]
    return sum(kept) / len(kept) if kept else math.nan


def component_keys(stats: dict[str, Any]) -> list[str]:
    """The raw per-component means an iteration logged (``rewards/<name>/mean``)."""
    return [key for key in stats if key.startswith("rewards/") and key.endswith("/mean")]


def headline_scores(stats: dict[str, Any], aggregate: str = "sum") -> dict[str, float]:
    """What a line about one iteration shows of its scores: ``{"reward": ...}``, or under
    ``normalize_then_sum``, whose total is standardised per batch (mean ~0 whatever the policy), each
    component's raw mean by name."""
    keys = component_keys(stats) if aggregate == "normalize_then_sum" else []
    return {key[8:-5]: stats[key] for key in keys} or {"reward": stats["reward"]}


class Tenths:
    """Where a progress bar is not drawn because the output is no terminal (a log file, a pipe, CI), a plain
    line at each tenth of the work, so that a long command shows it is alive: ``label: 400/4000 prompts (10%),
    <figures>, 12 s``. Silent where the bar is drawn, and where ``progress`` is False (a caller that said so)."""

    def __init__(self, bar: Any, label: str, unit: str, progress: bool | None):
        import time

        self.bar, self.label, self.unit = bar, label, unit
        self.on = progress is None and bool(bar.disable)
        self.next, self.start = 1, time.perf_counter()

    def update(self, done: int, figures: str) -> None:
        import sys
        import time

        total = self.bar.total
        if not self.on or not total or done * 10 < self.next * total:
            return
        while self.next * total <= done * 10:
            self.next += 1
        seconds = time.perf_counter() - self.start
        print(
            f"{self.label}: {done}/{total} {self.unit} ({100 * done // total}%), {figures}, {seconds:.0f} s",
            file=sys.stderr,
            flush=True,
        )
