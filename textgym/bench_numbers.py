"""How the bench's reports write numbers and user text: the decimals that tell values apart, p-values,
intervals and cells, counts, and the escaping that makes user text read as written (shared by ``report.md``
and ``report.html``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from textgym.bench_stats import ALPHA

__all__ = [
    "decimals",
    "fmt",
    "fmt_cell",
    "fmt_interval",
    "fmt_p",
    "is_missing",
    "md_escape",
    "md_text",
    "named",
    "plural",
]


def decimals(*values: float) -> int:
    """Decimals that show every finite non-zero value of ``values`` with two significant digits or more: 3,
    more for small values (0.00714 is not "0.007", nor a 95% interval of width 0.0003 "[0.007, 0.007]"), at
    most 8."""
    digits = 3
    for value in values:
        if isinstance(value, (int, float)) and math.isfinite(value) and value != 0:
            digits = max(digits, 1 - math.floor(math.log10(abs(value))))
    return min(digits, 8)


def fmt(value: float | str | None, digits: int | None = None) -> str:
    """``value`` with ``digits`` decimals (default: :func:`decimals`), "n/a" for None or NaN."""
    if isinstance(value, str):  # "inf" / "-inf", as a run's eval.json holds an infinite value
        value = float(value)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    text = f"{value:.{decimals(value) if digits is None else digits}f}"
    if float(text) == 0:  # no "-0.000", and rounding noise (1e-12) is 0.000, not 0.00000000
        return text.lstrip("-") if digits is not None else "0.000"
    return text


def fmt_p(p: float) -> str:
    """A p-value: 3 decimals, "<0.001" below (never "0.000"); near the 0.05 cut, the digits that put it on
    its side (0.0496 and 0.0500 both rounded to "0.050", one "better", the other not significant)."""
    if p < 0.001:
        return "<0.001"
    digits = 3
    while digits < 8 and round(p, digits) == ALPHA and p != ALPHA:
        digits += 1
    return fmt(p, digits)


def fmt_interval(mean: float, low: float, high: float) -> str:
    """``mean [low, high]``, all three with the decimals that tell the interval's ends apart."""
    if math.isnan(low):
        return fmt(mean)
    width = high - low  # float noise (0.8 on every seed: 7e-16) is no width to show digits for
    digits = decimals(mean, width if width > 1e-9 * max(1.0, abs(mean)) else 0.0)
    return f"{fmt(mean, digits)} [{fmt(low, digits)}, {fmt(high, digits)}]"


def fmt_cell(row: Mapping[str, Any] | None) -> str:
    """``mean [low, high]`` (the 95% interval, clipped to the metric's range), and ``(n of N seeds)`` when
    the metric was not measured on every seed evaluated."""
    if not row:
        return ""
    text = fmt_interval(row["mean"], row["ci_low"], row["ci_high"])
    if 0 < row["n"] < row.get("seeds", row["n"]):  # the seeds left out are said, not silently dropped
        text += f" ({row['n']} of {row['seeds']} seeds)"
    return text


def is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def plural(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def md_text(text: str) -> str:
    """Report text that holds user text (a metric's label, a design's name) escaped, so that ``<i>`` in it
    reads as written; its own Markdown (``**``, ``->``) is kept."""
    return text.replace("&", "&amp;").replace("<", "&lt;")


def md_escape(text: str) -> str:
    """``text`` with Markdown's inline characters backslash-escaped, so that they read as written."""
    for char in "\\`*[]|":
        text = text.replace(char, "\\" + char)
    return text


def named(designs: Sequence[str], agents: Sequence[str], quote: Callable[[str], str]) -> list[str]:
    """The designs and the agents given, each kind with its noun: ``["designs 'a', 'b'", "agent 'x'"]``
    (``quote=repr``); a kind with none is left out."""
    return [
        f"{noun}{'s' if len(names) > 1 else ''} {', '.join(map(quote, names))}"
        for noun, names in (("design", designs), ("agent", agents))
        if names
    ]
