"""Statistics of ``textgym bench``: means with confidence intervals clipped to a metric's range, paired
comparisons over shared seeds with effect sizes, and rankings that only separate what is significant.

Runs of two designs (or two agents) with the same seed share their initial weights, their first rollouts and
the held-out prompts, so their difference is measured per seed (a paired test), which removes the
seed-to-seed variation both share.

- :func:`paired` compares two groups over their shared seeds: the mean difference with a Student-t
  interval, the paired t-test's two-sided p-value, and Cohen's d_z (the mean difference over the standard
  deviation of the differences).
- :func:`compare` runs every pairwise test within a metric and corrects the p-values for the number of
  pairs (Holm, 1979). Its ranks follow the means and step down only where a test separates: a group ranks
  below every group significantly better than it, directly or through a chain (a > b > c: a is above c,
  and the comparison of a and c, where not significant itself, names the chain),
  and never above a group with a better mean (except where missing seeds make a group of a lower mean
  significantly better than one of a higher mean: both cannot hold, and the test decides), so two groups
  that share a rank are never significantly different from each other.
  A group that no test compared with another (one seed, or an infinite or missing value on every pair's
  shared seeds) is not ranked.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

ALPHA = 0.05


def mean_ci(
    values: Sequence[float | None],
    confidence: float = 0.95,
    bounds: tuple[float, float] = (-math.inf, math.inf),
) -> tuple[float, float, float]:
    """Mean and the two-sided Student-t confidence interval of the mean, clipped to ``bounds`` (the
    metric's range: an EOS rate's interval never leaves [0, 1]). NaN bounds for fewer than two values."""
    from scipy import stats

    x = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=float)
    if len(x) == 0:
        return math.nan, math.nan, math.nan
    mean = float(x.mean())
    if len(x) < 2 or not np.isfinite(x).all():  # an infinite value has no interval around it
        return mean, math.nan, math.nan
    half = float(stats.t.ppf((1 + confidence) / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
    low, high = bounds
    # Clipped to the range. A mean outside it (a sampled KL estimate can dip below 0) keeps that side whole:
    # clipping there would put the interval's end at the mean and hide how far the values spread.
    return (
        mean,
        mean - half if mean < low else max(mean - half, low),
        mean + half if mean > high else min(mean + half, high),
    )


@dataclass(frozen=True)
class Paired:
    """``a`` minus ``b`` over their shared seeds."""

    n: int  # shared seeds where both have a value
    diff: float  # mean difference a - b
    ci_low: float  # 95% Student-t interval of the mean difference (NaN for n < 2)
    ci_high: float
    d_z: float  # Cohen's d_z: diff / sd(differences); +-inf when every seed shows the same difference
    p: float  # two-sided paired t-test (NaN for n < 2)
    infinite: int = 0  # shared seeds where a value is infinite: then nothing is tested (all NaN)
    unmeasured: int = 0  # shared seeds where one has a value and the other none: nothing is tested either


def paired(
    a: Mapping[int, float],
    b: Mapping[int, float],
    confidence: float = 0.95,
    bounds: tuple[float, float] = (-math.inf, math.inf),
) -> Paired:
    """The paired comparison of ``a`` and ``b`` (seed -> value) over the seeds both have a value for. The
    interval is clipped to what a difference of two values in ``bounds`` (the metric's range) can be:
    ``[low - high, high - low]``, [-1, 1] for two rates.

    When every shared seed shows exactly the same difference, the t-test has no spread to go by (its p would
    be 0): p is then the exact sign-flip test's, 2 / 2^n (0.5 on 2 seeds, 0.03 on 6), and the interval has
    width 0. A metric measured on a few episodes (a rate over 32 takes multiples of 1/32) shows the same
    difference on a few seeds often by chance; a p of 0 made every such pair "significant". Differences
    within float rounding of the values (1e-12 of their size, at least 1e-12) are none: two metrics that
    are both 0 up to rounding never differ significantly.

    An infinite value on a shared seed (a KL that blew up) leaves the pair untested: its difference is
    infinite or undefined, and leaving that seed out would compare the designs on their good runs only. So
    does a shared seed that one of them measured and the other did not (a metric that applied to none of a
    run's completions, a distinct-2 of empty completions): it too is most often a run that went wrong.
    """
    from scipy import stats

    shared = [s for s in a if s in b]
    # a metric one group never has (an SB3 agent's KL, a normalize_then_sum proxy) is no comparison at all
    both = any(_measured(a[s]) for s in shared) and any(_measured(b[s]) for s in shared)
    unmeasured = sum(1 for s in shared if _measured(a[s]) != _measured(b[s])) if both else 0
    seeds = [s for s in shared if _measured(a[s]) and _measured(b[s])]
    infinite = sum(1 for s in seeds if math.isinf(a[s]) or math.isinf(b[s]))
    if infinite or unmeasured:
        nan = math.nan
        return Paired(len(seeds), nan, nan, nan, nan, nan, infinite, unmeasured)
    d = np.array([a[s] - b[s] for s in seeds], dtype=float)
    n = len(d)
    if n == 0:
        return Paired(0, math.nan, math.nan, math.nan, math.nan, math.nan)
    scale = max(1.0, *(abs(x[s]) for x in (a, b) for s in seeds))
    if float(np.abs(d).max()) <= 1e-12 * scale:  # rounding, whatever its signs: no difference
        d = np.zeros_like(d)
    diff = float(d.mean())
    if n < 2:
        return Paired(1, diff, math.nan, math.nan, math.nan, math.nan)
    sd = float(d.std(ddof=1))
    if sd <= 1e-12 * scale:  # the same difference on every seed, up to the values' float rounding
        if diff == 0:
            return Paired(n, 0.0, 0.0, 0.0, 0.0, 1.0)
        # the exact sign-flip test: all n differences of one sign, as likely as 2 of the 2^n sign patterns
        return Paired(n, diff, diff, diff, math.copysign(math.inf, diff), 2.0 ** (1 - n))
    se = sd / math.sqrt(n)
    half = float(stats.t.ppf((1 + confidence) / 2, n - 1)) * se
    p = float(2 * stats.t.sf(abs(diff / se), n - 1))
    widest = bounds[1] - bounds[0]
    # Clipped to the widest difference the range allows; a difference past it (values outside the declared
    # range) keeps that side whole, as mean_ci does: clipping there put the interval's end on the wrong side
    low = diff - half if diff < -widest else max(diff - half, -widest)
    high = diff + half if diff > widest else min(diff + half, widest)
    return Paired(n, diff, low, high, diff / sd, p)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment of ``pvalues`` (NaN stays NaN and does not count as a test)."""
    index = [i for i, p in enumerate(pvalues) if not math.isnan(p)]
    order = sorted(index, key=lambda i: pvalues[i])
    m = len(order)
    adjusted = [math.nan] * len(pvalues)
    running = 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (m - k) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def seeds_needed(d_z: float, alpha: float = ALPHA, power: float = 0.8, most: int = 10_000) -> int | None:
    """Seeds a two-sided paired t-test at level ``alpha`` needs to detect an effect of size ``d_z`` with
    probability ``power`` (the noncentral t distribution). None for no effect, or beyond ``most``. The d_z
    observed on a few seeds is a rough estimate: read the answer as an order of magnitude. For the same
    difference on every seed (``d_z`` infinite), the seeds the exact sign test needs: 2 / 2^n below ``alpha``."""
    from scipy import stats

    if math.isinf(d_z):
        return math.floor(1 + math.log2(1 / alpha)) + 1
    if math.isnan(d_z) or d_z == 0:
        return None
    n = 2
    while n <= most:
        df, shift = n - 1, abs(d_z) * math.sqrt(n)
        critical = stats.t.ppf(1 - alpha / 2, df)
        # the wrong-sign tail: negligible, and NaN in scipy's noncentral t once the shift is large (d_z
        # above ~5 at 3 seeds), which would skip every n with enough power
        wrong_sign = float(stats.nct.cdf(-critical, df, shift))
        if stats.nct.sf(critical, df, shift) + (0.0 if math.isnan(wrong_sign) else wrong_sign) >= power:
            return n
        n = n + 1 if n < 64 else int(n * 1.1)
    return None


@dataclass(frozen=True)
class Comparison:
    """One pair of groups on one metric: ``a`` against ``b``, and which is better if significant."""

    a: str
    b: str
    test: Paired
    p_holm: float
    better: str | None  # the significantly better group, None when the difference is not significant
    seeds_needed: int | None = None  # when not significant: seeds for 80% power at the observed d_z
    # when not significant itself: the group that ranks above the other through a chain of significant
    # differences (a > b and b > c, where a - c alone is not)
    better_by_chain: str | None = None


def compare(
    groups: Mapping[str, Mapping[int, float]],
    direction: str | None,
    alpha: float = ALPHA,
    bounds: tuple[float, float] = (-math.inf, math.inf),
) -> tuple[list[Comparison], dict[str, int | None]]:
    """Every pair of ``groups`` (name -> seed -> value) compared, p-values Holm-corrected over the pairs,
    and each group's rank: below every group significantly better (directly or through a chain), and never
    above a group of a better mean where the tests allow it (see the module docstring; None when
    ``direction`` is None or the group has no value or no test). ``bounds``: the metric's range."""
    names = list(groups)
    tests = [(a, b, paired(groups[a], groups[b], bounds=bounds)) for a, b in itertools.combinations(names, 2)]
    tests = [t for t in tests if t[2].n > 0 or t[2].unmeasured]  # none shared: e.g. KL of an SB3 agent
    adjusted = holm([t.p for _, _, t in tests])
    m = sum(1 for p in adjusted if not math.isnan(p))  # Holm's m: the pairs that have a p-value
    comparisons = []
    for (a, b, test), p in zip(tests, adjusted):
        better = None
        if direction and not math.isnan(p) and p < alpha and test.diff != 0:
            a_higher = test.diff > 0
            better = a if a_higher == (direction == "higher") else b
        needed = None
        if not p < alpha and test.n >= 2:  # Holm's first step tests at alpha / (number of pairs tested)
            needed = seeds_needed(test.d_z, alpha / max(m, 1))
        comparisons.append(Comparison(a, b, test, p, better, needed))
    above = _above(names, comparisons)
    comparisons = [
        c if c.better is not None else dataclasses.replace(c, better_by_chain=_chained(c, above))
        for c in comparisons
    ]
    tested = {name for c in comparisons if not math.isnan(c.p_holm) for name in (c.a, c.b)}
    valued = [name for name in names if any(_measured(v) for v in groups[name].values())]
    # a group that no test compared with another is not ranked: "1" would read as "none is better" (the one
    # group with a value, where the others have none: an SB3 agent's KL)
    ranked = [name for name in names if direction and name in valued and name in tested]
    ranks: dict[str, int | None] = {name: None for name in names}
    sign = -1.0 if direction == "higher" else 1.0
    mean = {name: float(np.mean([v for v in groups[name].values() if _measured(v)])) for name in ranked}
    # Best mean first, a group after every group significantly better than it (with missing seeds, one can
    # have the lower mean). Each ranks below those better than it and never above a group before it: ranks
    # follow the means, and step down only where a test separates (equal ranks are never significantly
    # different). "1 + the number significantly better" alone put a noisy design of the lowest mean at 1,
    # above a better-measured one of a higher mean at 2.
    last, left = 1, sorted(ranked, key=lambda name: (math.isnan(mean[name]), sign * mean[name]))
    while left:
        name = next((g for g in left if all(ranks[b] is not None for b in above[g] & set(ranked))), left[0])
        left.remove(name)
        better = [ranks[b] for b in above[name] if ranks.get(b) is not None]
        last = ranks[name] = max(last, 1 + max(better, default=0))
    return comparisons, ranks


def _above(names: Sequence[str], comparisons: Sequence[Comparison]) -> dict[str, set[str]]:
    """For each group, the groups better than it: significantly, or through a chain of significant
    differences (a > b and b > c puts a above c where a - c alone is not significant). Where all three pairs
    are t-tested on the same seeds the chain adds nothing: the paired t statistic of a - c is at least the
    smaller of those of a - b and b - c. It does where a and c share too few seeds, and where a - c is the
    same difference on every seed: the exact sign-flip test's p (2 / 2^n) can be above the t-tests' of the
    two noisier steps."""
    above: dict[str, set[str]] = {name: set() for name in names}
    for c in comparisons:
        if c.better is not None:
            above[c.b if c.better == c.a else c.a].add(c.better)
    changed = True
    while changed:
        changed = False
        for name in names:
            reached = set().union(*(above[x] for x in above[name])) - above[name]
            if reached:
                above[name] |= reached
                changed = True
    return above


def _chained(c: Comparison, above: Mapping[str, set[str]]) -> str | None:
    """The group of the pair ``c`` that a chain of significant differences puts above the other, or None."""
    return c.a if c.a in above[c.b] else c.b if c.b in above[c.a] else None


def _measured(value: float | None) -> bool:
    """Not None and not NaN (an infinite value is measured: it is a value that blew up)."""
    return value is not None and not math.isnan(value)
