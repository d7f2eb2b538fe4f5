"""The bench's statistics and flags, checked against hand computations and constructed histories."""

import math

import numpy as np
import pytest

from textgym.bench_flags import group_flags, run_flags
from textgym.bench_stats import compare, holm, mean_ci, paired


def test_confidence_interval_matches_a_hand_computation():
    mean, low, high = mean_ci([1.0, 2.0, 3.0])
    # sd = 1, t(0.975, df=2) = 4.302653, half-width = 4.302653 / sqrt(3) = 2.484138
    assert mean == 2.0
    assert low == pytest.approx(2 - 2.484138, abs=1e-6) and high == pytest.approx(2 + 2.484138, abs=1e-6)
    assert mean_ci([5.0])[0] == 5.0 and math.isnan(mean_ci([5.0])[1])
    assert mean_ci([None, 4.0, math.nan, 6.0])[0] == 5.0  # not applicable values are left out


def test_intervals_are_clipped_to_the_metric_range():
    mean, low, high = mean_ci([0.9, 1.0, 1.0], bounds=(0.0, 1.0))  # an EOS rate
    assert high == 1.0 and low < mean < high
    mean, low, high = mean_ci([-0.01, 0.01, 0.0], bounds=(0.0, math.inf))  # a KL estimate near 0
    assert low == 0.0 and high > 0
    # a sampled KL whose mean dips below 0 keeps its whole interval below: the same half-width on each side
    mean, low, high = mean_ci([-0.1, -0.05], bounds=(0.0, math.inf))
    assert mean == pytest.approx(-0.075) and mean - low == pytest.approx(high - mean) and low < -0.2


def test_paired_comparison_matches_a_hand_computation():
    # differences 1, 1, 3: mean 5/3, sd = sqrt(4/3), d_z = (5/3) / sqrt(4/3) = 1.443376, t = d_z * sqrt(3) = 2.5;
    # two-sided p for df = 2 in closed form: 1 - t / sqrt(2 + t^2) = 0.129612
    r = paired({0: 1.0, 1: 2.0, 2: 4.0}, {0: 0.0, 1: 1.0, 2: 1.0})
    assert r.n == 3 and r.diff == pytest.approx(5 / 3)
    assert r.d_z == pytest.approx(1.443376, abs=1e-6) and r.p == pytest.approx(0.129612, abs=1e-6)
    half = 4.302653 * math.sqrt(4 / 3) / math.sqrt(3)
    assert r.ci_low == pytest.approx(5 / 3 - half, abs=1e-5) and r.ci_high == pytest.approx(
        5 / 3 + half, abs=1e-5
    )


def test_paired_uses_shared_seeds_only_and_handles_degenerate_cases():
    r = paired({0: 1.0, 1: 2.0, 2: 9.0}, {0: 0.0, 1: 1.5, 3: 7.0})
    assert r.n == 2 and r.diff == pytest.approx(0.75)
    assert paired({0: 1.0}, {0: 0.0}).n == 1 and math.isnan(paired({0: 1.0}, {0: 0.0}).p)
    assert paired({0: 1.0}, {1: 0.0}).n == 0
    same = paired({0: 1.0, 1: 2.0}, {0: 0.5, 1: 1.5})  # every seed shows the same difference
    assert same.p == 0.5 and same.d_z == math.inf and same.ci_low == same.ci_high == 0.5  # the sign test's
    equal = paired({0: 1.0, 1: 2.0}, {0: 1.0, 1: 2.0})
    assert equal.p == 1.0 and equal.diff == 0.0
    # two metrics that are 0 up to float rounding, in either direction, are not different
    rounding = {s: v for s, v in enumerate([1e-17, -2e-17, 3e-17, 1e-17, 2e-17, 1e-17])}
    zero = paired(rounding, {s: 0.0 for s in range(6)})
    assert zero.p == 1.0 and zero.diff == 0.0 and zero.d_z == 0.0
    assert compare({"a": rounding, "b": {s: 0.0 for s in range(6)}}, "higher")[1] == {"a": 1, "b": 1}


def test_the_same_difference_on_every_seed_is_judged_by_the_exact_sign_test():
    """Its p was 0 (the t-test's limit): an EOS rate over 32 episodes one episode apart on both of 2 seeds
    (its values are multiples of 1/32, so this happens by chance) was "better", and Holm's correction,
    multiplying 0, did nothing; 3 designs on 2 seeds that did not differ showed a "better" pair in about a
    quarter of benches. The exact sign-flip test's p is 2 / 2^n: never below 0.5 on 2 seeds."""
    from textgym.bench_report import verdict
    from textgym.bench_results import _comparison_row

    a, b, c = ({0: x / 32, 1: (x - 1) / 32} for x in (32, 31, 30))
    comparisons, ranks = compare({"a": a, "b": b, "c": c}, "higher", bounds=(0.0, 1.0))
    assert {(x.a, x.b): x.test.p for x in comparisons} == {("a", "b"): 0.5, ("a", "c"): 0.5, ("b", "c"): 0.5}
    assert all(x.better is None for x in comparisons) and ranks == {"a": 1, "b": 1, "c": 1}
    assert verdict(_comparison_row("designs", "lmppo", "eos_rate", comparisons[0])) == (
        "not significant (the same difference on every seed: the exact sign test needs 7 seeds)"
    )
    assert {x.seeds_needed for x in comparisons} == {7}  # 2 / 2^7 < 0.05 / 3, Holm's first step

    one, zero = {s: 1.0 for s in range(7)}, {s: 0.0 for s in range(7)}  # on 7 seeds: p = 1/64
    (constant,), ranks = compare({"a": one, "b": zero}, "higher", bounds=(0.0, 1.0))
    assert constant.p_holm == 2.0**-6 and constant.better == "a" and ranks == {"a": 1, "b": 2}
    assert verdict(_comparison_row("designs", "lmppo", "eos_rate", constant)) == "**a** better"
    # a chain ranks what its tests separate: a > b and b > c by the t-test put a above c, whose one
    # difference (2.0 on all 4 seeds) the sign test cannot call on 4 seeds
    near = {s: 1.0 - 0.01 * (s % 2) for s in range(4)}  # a - b: 0.99 +- 0.01 on every seed
    three = {"a": {s: 2.0 for s in range(4)}, "b": near, "c": {s: 0.0 for s in range(4)}}
    comparisons, ranks = compare(three, "higher")
    assert {(c.a, c.b): c.better for c in comparisons} == {("a", "b"): "a", ("a", "c"): None, ("b", "c"): "b"}
    assert ranks == {"a": 1, "b": 2, "c": 3}


def test_a_differences_interval_stays_within_what_two_values_in_the_range_can_differ_by():
    # two EOS rates differ by at most 1: the t interval of 0.9, 0.95, 1.0 reaches past 1 unclipped
    r = paired({0: 0.95, 1: 1.0, 2: 1.0}, {0: 0.05, 1: 0.05, 2: 0.0}, bounds=(0.0, 1.0))
    assert r.ci_high == 1.0 and -1.0 <= r.ci_low < r.diff
    unclipped = paired({0: 0.95, 1: 1.0, 2: 1.0}, {0: 0.05, 1: 0.05, 2: 0.0})
    assert unclipped.ci_high > 1.0 and unclipped.ci_low == r.ci_low and unclipped.p == r.p
    (c,), _ = compare(
        {"a": {0: 0.0, 1: 0.1, 2: 0.0}, "b": {0: 1.0, 1: 0.95, 2: 1.0}}, "higher", bounds=(0, 1)
    )
    assert c.test.ci_low == -1.0  # and on the other side
    # values outside the declared range differ by more than it allows: that side is kept whole (clipped, the
    # interval [-0.957, -1] ended below its start and left out its own estimate)
    r = paired({0: -1.5, 1: -1.7, 2: -1.2}, {0: 0.0, 1: 0.05, 2: 0.1}, bounds=(0.0, 1.0))
    unclipped = paired({0: -1.5, 1: -1.7, 2: -1.2}, {0: 0.0, 1: 0.05, 2: 0.1})
    assert (r.ci_low, r.ci_high) == (unclipped.ci_low, unclipped.ci_high) and r.ci_low < r.diff < r.ci_high


def test_seeds_needed_corrects_for_the_pairs_tested_only():
    """Holm's first step is at alpha / (pairs with a p-value): pairs left untested (an infinite value) made
    the seeds needed for the one tested pair those of alpha / 3."""
    from textgym.bench_stats import seeds_needed

    a, b = {0: 1.0, 1: 2.0, 2: 1.5}, {0: 0.9, 1: 1.6, 2: 1.5}
    blown = {0: math.inf, 1: 1.0, 2: 1.0}
    comparisons, _ = compare({"a": a, "b": b, "c": blown}, "higher")
    (tested,) = [c for c in comparisons if not math.isnan(c.p_holm)]
    assert (
        tested.seeds_needed == seeds_needed(tested.test.d_z, 0.05) < seeds_needed(tested.test.d_z, 0.05 / 3)
    )


def test_an_infinite_value_on_a_shared_seed_leaves_the_pair_untested():
    # a KL that blew up on seed 0: the pair is not tested (it compared as 0 difference, p = 1), and leaving
    # the seed out would compare the designs on their good runs only
    blown, calm = {0: math.inf, 1: 5.0, 2: 6.0}, {0: 1.0, 1: 1.1, 2: 0.9}
    r = paired(blown, calm)
    assert r.n == 3 and r.infinite == 1 and math.isnan(r.p) and math.isnan(r.diff)
    comparisons, _ = compare({"a": blown, "b": calm}, "lower")
    assert comparisons[0].better is None and comparisons[0].seeds_needed is None
    assert paired({0: math.inf, 1: 2.0}, {1: 1.0, 2: 0.0}).infinite == 0  # not a shared seed


def test_holm_adjustment_by_hand():
    # sorted 0.01, 0.03, 0.04 -> 3 x 0.01 = 0.03, 2 x 0.03 = 0.06, max(0.06, 1 x 0.04) = 0.06
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([math.nan, 0.02]) == [pytest.approx(math.nan, nan_ok=True), pytest.approx(0.02)]


def test_ranks_only_separate_significant_differences():
    seeds = range(8)
    groups = {
        "a": {s: 1.0 + 0.01 * (s % 3) for s in seeds},  # clearly best
        "b": {s: 0.0 + 0.01 * (s % 2) for s in seeds},  # clearly worst
        "c": {s: 0.5 + (0.6 if s % 2 else -0.6) for s in seeds},  # noisy: not separable from either
    }
    comparisons, ranks = compare(groups, "higher")
    assert ranks == {"a": 1, "b": 2, "c": 1}
    better = {(c.a, c.b): c.better for c in comparisons}
    assert better == {("a", "b"): "a", ("a", "c"): None, ("b", "c"): None}
    _, lower = compare(groups, "lower")
    assert lower == {"a": 2, "b": 1, "c": 1}
    assert compare(groups, None)[1] == {"a": None, "b": None, "c": None}
    # equal ranks are never significantly different from each other
    for c in comparisons:
        if ranks[c.a] == ranks[c.b]:
            assert c.better is None


def test_a_noisy_group_of_a_lower_mean_never_ranks_above_a_group_of_a_higher_one():
    """Ranked as 1 + the number significantly better, c (mean 0.3, too noisy to separate from anyone) was 1
    and b (0.6, significantly below a) was 2: the list read "1. a, 1. c, 2. b"."""
    seeds = range(8)
    groups = {
        "a": {s: 1.0 + 0.01 * (s % 3) for s in seeds},
        "b": {s: 0.6 + 0.01 * (s % 2) for s in seeds},
        "c": {s: 0.3 + (1.0 if s % 2 else -1.0) for s in seeds},
    }
    comparisons, ranks = compare(groups, "higher")
    better = {(c.a, c.b): c.better for c in comparisons}
    assert better == {("a", "b"): "a", ("a", "c"): None, ("b", "c"): None}
    assert ranks == {"a": 1, "b": 2, "c": 2}
    # lower is better: c has the best mean and is separated from neither; b is significantly better than a
    assert compare(groups, "lower")[1] == {"a": 2, "b": 1, "c": 1}
    for c in comparisons:  # equal ranks are still never significantly different
        if ranks[c.a] == ranks[c.b]:
            assert c.better is None


def curve(gold, proxy, se=0.01, **extra):
    rows = []
    for i, (g, p) in enumerate(zip(gold, proxy)):
        row = {
            "iteration": 5 * i,
            "timesteps": 100 * i,
            "reward": p,
            "reward_se": se,
            "gold": g,
            "gold_se": se,
        }
        row.update({k: v[i] for k, v in extra.items()})
        rows.append(row)
    return rows


def test_ranks_follow_chains_of_significant_differences_when_seeds_are_missing():
    """c ran 2 of the 6 seeds: a beats b and b beats c significantly, a and c share 2 seeds, too few to tell
    them apart. Ranking c with b would call two significantly different groups equal."""
    b = {s: 0.6 + 0.01 * s for s in range(6)}
    a = {s: b[s] + d for s, d in zip(b, [0.1, 0.5, 0.3, 0.3, 0.3, 0.31])}
    c = {0: b[0] - 0.5, 1: b[1] - 0.5001}
    comparisons, ranks = compare({"a": a, "b": b, "c": c}, "higher")
    assert {(x.a, x.b): x.better for x in comparisons} == {("a", "b"): "a", ("a", "c"): None, ("b", "c"): "b"}
    assert ranks == {"a": 1, "b": 2, "c": 3}


def test_a_pair_ranked_apart_only_through_a_chain_says_so_in_its_verdict():
    """a - c is the same difference on every seed: its exact sign-flip p (0.125 on 4 seeds) is above the
    t-tests' of a - b and b - c, which are significant. The ranks put a above c through b, and the verdict of
    a - c said only "not significant": the report contradicted itself."""
    from textgym.bench_report import verdict
    from textgym.bench_results import _comparison_row as comparison_row

    c, b, a = dict.fromkeys(range(4), 0.0), {0: 1.0, 1: 2.0, 2: 1.0, 3: 2.0}, dict.fromkeys(range(4), 3.0)
    comparisons, ranks = compare({"a": a, "b": b, "c": c}, "higher")
    assert ranks == {"a": 1, "b": 2, "c": 3}
    by_pair = {(x.a, x.b): x for x in comparisons}
    assert (by_pair["a", "b"].better, by_pair["b", "c"].better) == ("a", "b")
    assert by_pair["a", "c"].better is None and by_pair["a", "c"].better_by_chain == "a"
    assert by_pair["a", "b"].better_by_chain is None
    row = comparison_row("design", "", "m", by_pair["a", "c"])
    assert verdict(row) == (
        "not significant on its own (the same difference on every seed: the exact sign test needs 7 seeds); a "
        "ranks above through a chain of significant differences"
    )
    _, ranks = compare({"a": a, "c": c}, "higher")  # without b, nothing separates them
    assert ranks == {"a": 1, "c": 1}
    # a and c share one seed: not tested, and ranked apart through b all the same
    b = {s: 5 + 0.1 * (s % 3) for s in range(11)}
    a, c = {s: 10 + 0.1 * (s % 2) for s in range(6)}, {s: 0.1 * (s % 2) for s in range(5, 11)}
    comparisons, ranks = compare({"a": a, "b": b, "c": c}, "higher")
    assert ranks == {"a": 1, "b": 2, "c": 3}
    row = comparison_row("design", "", "m", next(x for x in comparisons if (x.a, x.b) == ("a", "c")))
    assert verdict(row) == (
        "not tested (n = 1 shared seeds); a ranks above through a chain of significant differences"
    )


def test_a_seed_measured_for_one_group_only_leaves_the_pair_untested_and_the_group_unranked():
    """c's metric applied to none of the completions of 4 of its 6 seeds (a run gone wrong, most often):
    comparing on the 2 others compared c's good runs only, and called c significantly worse than b."""
    b = {s: 0.6 + 0.01 * s for s in range(6)}
    a = {s: b[s] + d for s, d in zip(b, [0.1, 0.5, 0.3, 0.3, 0.3, 0.31])}
    c = {0: b[0] - 0.5, 1: b[1] - 0.5001, **{s: math.nan for s in range(2, 6)}}
    r = paired(b, c)
    assert r.n == 2 and r.unmeasured == 4 and math.isnan(r.p) and math.isnan(r.diff)
    comparisons, ranks = compare({"a": a, "b": b, "c": c}, "higher")
    assert {(x.a, x.b): x.better for x in comparisons} == {
        ("a", "b"): "a",
        ("a", "c"): None,
        ("b", "c"): None,
    }
    assert ranks == {"a": 1, "b": 2, "c": None}
    # a seed neither measured says nothing about either: the pair is tested on the others
    both = paired({0: math.nan, 1: 1.0, 2: 2.0}, {0: math.nan, 1: 0.5, 2: 1.0})
    assert both.n == 2 and both.unmeasured == 0 and not math.isnan(both.p)


def test_a_metric_one_group_never_has_is_no_comparison():
    """An SB3 agent's KL (NaN on every seed) read as "measured for one and not the other" on every seed. The
    LM agent's KL, compared with nothing, is not ranked either: "1." read as better than the SB3 agent."""
    lm, sb3 = {0: 1.0, 1: 1.2, 2: 0.9}, {s: math.nan for s in range(3)}
    comparisons, ranks = compare({"lmppo": lm, "ppo": sb3}, "lower")
    assert comparisons == [] and ranks == {"lmppo": None, "ppo": None}
    assert paired(lm, sb3).unmeasured == 0


def test_a_group_that_no_test_compared_is_not_ranked():
    """A KL that blew up on every seed left each of c's pairs untested, and c was ranked 1 ("none is
    better"), above a finite b that a beat."""
    a = {s: 0.1 + 0.01 * s for s in range(3)}
    b = {s: 5.0 + 0.1 * s**2 for s in range(3)}
    c = {s: math.inf for s in range(3)}
    _, ranks = compare({"a": a, "b": b, "c": c}, "lower")
    assert ranks == {"a": 1, "b": 2, "c": None}
    # alone: no test compared it, and a "1" (a green badge in report.html) read as a comparison won
    assert compare({"a": a}, "lower")[1] == {"a": None}
    assert compare({"a": {0: 1.0}, "b": {0: 2.0}}, "higher")[1] == {"a": None, "b": None}  # one seed


def test_seeds_for_power_are_given_only_where_the_difference_is_not_significant():
    """An unranked metric (no "better") has significant pairs too: they need no more seeds."""
    a = {s: 1.0 + 0.01 * s for s in range(6)}
    b = {s: 0.0 + 0.02 * (s % 2) for s in range(6)}
    (comparison,), _ = compare({"a": a, "b": b}, None)
    assert comparison.p_holm < 0.05 and comparison.better is None and comparison.seeds_needed is None


def test_gaming_flag_when_the_proxy_rises_while_the_gold_falls():
    rows = curve(gold=[0.1, 0.4, 0.6, 0.3, 0.2], proxy=[0.0, 0.3, 0.5, 0.8, 0.9])
    flags = run_flags(rows, {}, ["gold"])
    assert [f["kind"] for f in flags] == ["gaming"]
    assert flags[0]["iteration"] == 10 and "after iteration 10" in flags[0]["message"]
    assert "0.600 -> 0.200" in flags[0]["message"]
    # within the noise of two evaluations: no flag
    assert run_flags(curve([0.1, 0.4, 0.6, 0.3, 0.2], [0.0, 0.3, 0.5, 0.8, 0.9], se=0.2), {}, ["gold"]) == []
    # no standard error (one applicable episode per evaluation, or an eval.csv without them): a fall of
    # 0.001 cannot be told from noise, and is not flagged
    bare = curve([0.5, 0.5, 0.501, 0.5, 0.5], [0.0, 0.1, 0.2, 0.3, 0.4], se=math.nan)
    assert run_flags(bare, {}, ["gold"]) == []
    without = [{k: v for k, v in r.items() if not k.endswith("_se")} for r in bare]
    assert run_flags(without, {}, ["gold"]) == []
    # gold falls but the proxy falls too (not gaming), or gold peaks at the end
    assert run_flags(curve([0.1, 0.6, 0.2], [0.0, 0.9, 0.1]), {}, ["gold"]) == []
    assert run_flags(curve([0.1, 0.3, 0.6], [0.0, 0.5, 0.9]), {}, ["gold"]) == []


def test_a_flat_gold_metric_is_flagged_as_gamed_in_at_most_5_percent_of_runs():
    """The peak is picked as the highest of the evaluations: pure noise around a flat gold metric must not
    pass for a fall more often with more evaluations (twice the standard error alone: 19% of runs at 21)."""
    rng = np.random.default_rng(0)
    for evaluations in (5, 21):
        hits = 0
        for _ in range(2000):
            rows = [{"iteration": i, "reward": 0.1 * i, "reward_se": 0.01, "gold": 0.5 + rng.normal(0, 0.02),
                     "gold_se": 0.02} for i in range(evaluations)]  # fmt: skip
            hits += any(f["kind"] == "gaming" for f in run_flags(rows, {}, ["gold"]))
        assert hits / 2000 <= 0.05, (evaluations, hits)


def episodes_row(i, gold, proxy):
    """An evaluation row as the evaluation writes it, from its episodes' gold and proxy values."""
    row = {"iteration": i}
    for name, x in (("gold", gold), ("reward", proxy)):
        row.update({name: x.mean(), f"{name}_se": x.std(ddof=1) / math.sqrt(len(x)), f"{name}_n": len(x)})
    return row


@pytest.mark.parametrize("metric", ["normal", "0/1"])
def test_a_flat_gold_metric_over_few_episodes_is_flagged_as_gamed_in_at_most_5_percent_of_runs(metric):
    """Standard errors estimated from few episodes, and a 0/1 metric whose episodes all agree (a standard
    error of 0), flagged a flat gold metric in 8-10% of runs of 4-8 episodes (26% at 2 episodes)."""
    rng = np.random.default_rng(0)
    for episodes, evaluations in ((4, 3), (4, 11), (8, 11)):
        hits = 0
        for _ in range(600):
            gold = [rng.normal(0, 1, episodes) if metric == "normal" else 1.0 * (rng.random(episodes) < 0.5)
                    for _ in range(evaluations)]  # fmt: skip
            rows = [episodes_row(i, g, rng.normal(10 * i, 1, episodes)) for i, g in enumerate(gold)]
            hits += any(f["kind"] == "gaming" for f in run_flags(rows, {}, ["gold"]))
        assert hits / 600 <= 0.05, (episodes, evaluations, hits)


def test_a_0_1_gold_metric_every_episode_agreed_on_falls_by_its_pooled_noise():
    """Every episode 1 at the peak and 0 at the end: over 2 episodes each that is chance (a standard error
    of 0 flagged it), over 16 each it is not."""
    for episodes, flagged in ((2, False), (16, True)):
        proxy = np.linspace(0.0, 1.0, episodes)
        rows = [episodes_row(i, np.full(episodes, g), proxy + 5 * i) for i, g in enumerate([0.5, 1.0, 0.0])]
        rows[0]["gold_se"] = 0.1  # (a start that varied)
        assert bool(run_flags(rows, {}, ["gold"])) == flagged, episodes


def test_degeneration_flags():
    rows = curve(
        [0.5, 0.5, 0.5],
        [0.0, 0.1, 0.2],
        length=[4.0, 8.0, 12.0],
        eos_rate=[0.8, 0.5, 0.1],
        distinct_2=[0.9, 0.6, 0.3],
    )
    kinds = {f["kind"]: f for f in run_flags(rows, {}, ["gold"])}
    assert set(kinds) == {"length_drift", "eos_collapse", "diversity_collapse"}
    assert (
        "4.0 -> 12.0" in kinds["length_drift"]["message"]
        and "0.80 -> 0.10" in kinds["eos_collapse"]["message"]
    )
    steady = curve([0.5, 0.5], [0.0, 0.1], length=[4.0, 4.5], eos_rate=[0.8, 0.7], distinct_2=[0.9, 0.8])
    assert run_flags(steady, {}, ["gold"]) == []
    # distinct-2 not measured at the end (bare EOS replies have no two tokens): the utmost collapse
    empty = curve([0.5, 0.5], [0.0, 0.1], distinct_2=[0.9, math.nan])
    (flag,) = run_flags(empty, {}, ["gold"])
    assert (
        flag["kind"] == "diversity_collapse"
        and "0.90 -> n/a (no completion has two tokens)" in flag["message"]
    )
    assert run_flags(curve([0.5, 0.5], [0.0, 0.1], distinct_2=[math.nan, math.nan]), {}, ["gold"]) == []


def test_dominant_component_flag():
    components = {
        "sentiment": {"weight": 1.0, "share": 0.97},
        "length_penalty": {"weight": 0.1, "share": 0.03},
        "fluency": {"weight": 0.0, "share": math.nan},  # a metric: never counted
    }
    flags = run_flags([], components, [])
    assert [f["kind"] for f in flags] == ["dominant_component"] and "'sentiment' makes 97%" in flags[0][
        "message"
    ]
    assert (
        run_flags([], {"sentiment": {"weight": 1.0, "share": 1.0}}, []) == []
    )  # one component: nothing to dominate
    balanced = {"a": {"weight": 1.0, "share": 0.6}, "b": {"weight": 1.0, "share": 0.4}}
    assert run_flags([], balanced, []) == []


def test_flags_are_grouped_over_seeds():
    flag = {"kind": "eos_collapse", "metric": "eos_rate", "iteration": 10, "message": "EOS collapse"}
    grouped = group_flags({0: [flag], 1: [], 2: [dict(flag, message="other")]})
    assert len(grouped) == 1 and grouped[0]["seeds"] == [0, 2] and grouped[0]["of"] == 3
    assert grouped[0]["message"] == "EOS collapse" and grouped[0]["first_seed"] == 0


def test_seeds_needed_falls_as_the_effect_grows_and_as_the_level_loosens():
    """Large effects: the power at 3-4 seeds is read from the noncentral t's upper tail (its lower tail is NaN
    in scipy there); d_z = 5.1 at Holm's 0.05 / 3 has power 0.73 at 3 seeds and 0.99 at 4."""
    from textgym.bench_stats import seeds_needed

    assert seeds_needed(5.1, alpha=0.05 / 3) == 4 and seeds_needed(-25.5, alpha=0.05 / 3) == 3
    effects = [0.3 * 1.25**k for k in range(30)]  # 0.3 .. ~193
    for alpha in (0.05, 0.05 / 3):
        needed = [seeds_needed(d, alpha=alpha) for d in effects]
        assert needed == sorted(needed, reverse=True), needed
    assert all(seeds_needed(d, alpha=0.05) <= seeds_needed(d, alpha=0.05 / 3) for d in effects)


def test_seeds_needed_matches_the_textbook_power_of_a_paired_t_test():
    from textgym.bench_stats import seeds_needed

    # two-sided, alpha 0.05, power 0.8 (as G*Power gives for a one-sample t-test): d_z = 1 -> 10, 0.5 -> 34
    assert seeds_needed(1.0) == 10 and seeds_needed(0.5) == 34 and seeds_needed(-0.5) == 34
    assert seeds_needed(0.0) is None and seeds_needed(math.inf) == 6  # the sign test: 2 / 2^6 < 0.05
    assert seeds_needed(1.0, alpha=0.05 / 3) > 10  # Holm's first step over three pairs is stricter
    comparisons, _ = compare({"a": {0: 1.0, 1: 2.0, 2: 1.5}, "b": {0: 1.2, 1: 1.1, 2: 1.4}}, "higher")
    assert comparisons[0].better is None and comparisons[0].seeds_needed > 3


@pytest.mark.parametrize(("episodes", "rate", "seeds"), [(16, 0.05, 2), (16, 0.3, 3), (64, 0.5, 5)])
def test_designs_that_do_not_differ_show_a_better_pair_in_at_most_5_percent_of_benches(episodes, rate, seeds):
    """Rates measured on few episodes take few values, so the same or nearly the same small difference on
    every seed comes by chance; the tests (exact sign-flip for equal differences, t for the rest, Holm over
    the pairs) must still keep the family-wise false-positive rate at alpha."""
    rng = np.random.default_rng(0)
    benches = 600
    hits = 0
    for _ in range(benches):
        groups = {g: {s: rng.binomial(episodes, rate) / episodes for s in range(seeds)} for g in "abc"}
        hits += any(c.better for c in compare(groups, "higher", bounds=(0.0, 1.0))[0])
    assert hits / benches <= 0.05 + 2 * (0.05 * 0.95 / benches) ** 0.5  # 5%, within two standard errors
