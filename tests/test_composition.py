"""Composition rules of the reward stack, each against totals computed by hand: not-applicable scores,
normalize-then-sum, gates, weight schedules, functions as rewards (files, modules, TRL's signature), and the
errors for bad designs."""

import math
import os
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import gymnasium
import numpy as np
import pytest

import textgym
from textgym import FunctionReward, RewardStack, Sample, build_reward_stack
from textgym.composition import WeightSchedule, describe_stack, standardize
from textgym.errors import ConfigError, PluginArgumentError, RewardError
from textgym.reward_functions import resolve_fn_paths
from textgym.rewards import check_reward_specs

DOCS = Path(__file__).parents[1] / "docs"
SAMPLES = [Sample("p", "a"), Sample("p", "bb"), Sample("p", "ccc"), Sample("p", "dddd")]


def fixed(name, values):
    """A reward named ``name`` that returns ``values`` (None = not applicable) whatever the samples."""
    return FunctionReward(name, lambda samples: values if isinstance(values, np.ndarray) else list(values))


# -- not applicable (None) -------------------------------------------------------------------------
def test_none_is_left_out_of_the_total_and_is_nan_in_components():
    a = fixed("a", [1.0, None, 3.0, None])
    b = fixed("b", [10.0, 20.0, None, None])
    metric = fixed("m", [None, 5.0, None, 7.0])
    total, components = RewardStack([(a, 2.0), (b, 0.5), (metric, 0.0)]).score(SAMPLES)
    # sample 0: 2*1 + 0.5*10; 1: 0.5*20; 2: 2*3; 3: every weighted component is None -> 0
    np.testing.assert_allclose(total, [7.0, 10.0, 6.0, 0.0])
    np.testing.assert_array_equal(np.isnan(components["a"]), [False, True, False, True])
    np.testing.assert_array_equal(components["m"], [np.nan, 5.0, np.nan, 7.0])
    # the component's own statistics leave not-applicable samples out
    assert np.nanmean(components["a"]) == 2.0 and np.nanstd(components["a"]) == 1.0


def test_all_none_rows_total_zero():
    stack = RewardStack([(fixed("a", [None] * 4), 1.0), (fixed("b", [None] * 4), -3.0)])
    total, components = stack.score(SAMPLES)
    np.testing.assert_array_equal(total, [0.0, 0.0, 0.0, 0.0])
    assert np.isnan(components["a"]).all()


# -- normalize_then_sum ----------------------------------------------------------------------------
def test_normalize_then_sum_by_hand_with_constant_and_not_applicable_components():
    length = FunctionReward("length", lambda ss: [float(len(s.completion)) for s in ss])  # 1, 2, 3, 4
    constant = fixed("constant", [0.5, 0.5, 0.5, 0.5])  # std 0 -> contributes 0
    right = fixed("right", [1.0, None, 0.0, None])  # mean 0.5, std 0.5 -> +1, None, -1, None
    metric = fixed("metric", [100.0, 0.0, 0.0, 0.0])  # weight 0: never counts
    stack = RewardStack(
        [(length, 1.0), (constant, 3.0), (right, 2.0), (metric, 0.0)], aggregate="normalize_then_sum"
    )
    total, components = stack.score(SAMPLES)
    z = (np.array([1, 2, 3, 4]) - 2.5) / math.sqrt(1.25)  # population std of 1..4 is sqrt(1.25)
    np.testing.assert_allclose(total, z + 2 * np.array([1.0, 0.0, -1.0, 0.0]))
    np.testing.assert_allclose(components["length"], [1, 2, 3, 4])  # components stay raw


def test_normalize_then_sum_depends_on_the_batch_and_a_lone_sample_gets_zero():
    length = FunctionReward("length", lambda ss: [float(len(s.completion)) for s in ss])
    stack = RewardStack([(length, 1.0)], aggregate="normalize_then_sum")
    assert stack.score(SAMPLES[:1])[0].tolist() == [0.0]
    np.testing.assert_allclose(stack.score(SAMPLES[:2])[0], [-1.0, 1.0])


def test_standardize_treats_rounding_noise_as_constant():
    np.testing.assert_array_equal(standardize(np.array([0.1, 0.1, 0.1])), [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(standardize(np.array([np.nan, 0.3, np.nan])), [np.nan, 0.0, np.nan])
    assert np.isnan(standardize(np.array([np.nan, np.nan]))).all()
    np.testing.assert_array_equal(standardize(np.array([0.1 + 0.2, 0.3, 0.3])), [0.0, 0.0, 0.0])
    noise = standardize(np.array([0.1 + 0.2 - 0.3, 0.0, 0.0, 0.3 - 0.1 - 0.2]))  # rounding noise around 0
    np.testing.assert_array_equal(noise, [0.0, 0.0, 0.0, 0.0])


def test_standardize_does_not_overflow_on_large_scores():
    """The mean and std of 1e308s overflowed: the z-scores became NaN (nansum then dropped the component) or
    0, silently."""
    z = [-math.sqrt(1.5), 0.0, math.sqrt(1.5)]
    for scale in (1e-6, 1.0, 1e200, 1e307):
        np.testing.assert_allclose(standardize(np.array([0.0, 1.0, 2.0]) * scale), z)
    np.testing.assert_allclose(standardize(np.array([1e308, 1e308, -1e308])), [2**-0.5, 2**-0.5, -(2**0.5)])


def test_combine_recomputes_totals_from_gathered_components():
    stack = RewardStack(
        [(fixed("a", [0.0] * 4), 1.0), (fixed("b", [0.0] * 4), 1.0)], aggregate="normalize_then_sum"
    )
    total = stack.combine({"a": [1.0, 3.0, np.nan], "b": [5.0, 5.0, 5.0]})
    np.testing.assert_allclose(total, [-1.0, 1.0, 0.0])
    with pytest.raises(RewardError, match=r"components \['b'\] are missing"):
        stack.combine({"a": [1.0]})


# -- gates -----------------------------------------------------------------------------------------
def test_gate_zero_and_cap_by_hand():
    helpful = fixed("helpful", [2.0, 1.0, 3.0, -4.0])
    safety = fixed("safety", [0.0, -0.9, None, -0.6])  # weight 0: a metric and a gate
    zero = RewardStack([(helpful, 1.0), (safety, 0.0)], gates=[{"component": "safety", "min": -0.5}])
    np.testing.assert_allclose(zero.score(SAMPLES)[0], [2.0, 0.0, 3.0, 0.0])  # None never fails
    cap = RewardStack(
        [(helpful, 1.0), (safety, 0.0)],
        gates=[{"component": "safety", "min": -0.5, "action": "cap", "cap": 0.5}],
    )
    np.testing.assert_allclose(cap.score(SAMPLES)[0], [2.0, 0.5, 3.0, -4.0])  # min(total, cap)


def test_gate_with_max_gates_apply_in_order_and_after_normalization():
    a = fixed("a", [1.0, 2.0, 3.0, 4.0])
    # zeroing after normalisation puts a failing sample at the batch's mean, which can raise it: said once
    with pytest.warns(UserWarning, match="a failing sample below the mean gains from failing"):
        stack = RewardStack(
            [(a, 1.0)],
            aggregate="normalize_then_sum",
            gates=[
                {"component": "a", "max": 3.5, "action": "cap", "cap": -5.0},  # sample 3 capped to -5
                {"component": "a", "min": 1.5},  # then sample 0 zeroed: -1.34 -> 0
            ],
        )
    z = (np.array([1, 2, 3, 4]) - 2.5) / math.sqrt(1.25)
    np.testing.assert_allclose(stack.score(SAMPLES)[0], [0.0, z[1], z[2], -5.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a cap, or a zero under a plain sum, says nothing
        RewardStack([(a, 1.0)], aggregate="normalize_then_sum", gates=[{"component": "a", "min": 1.5,
                    "action": "cap", "cap": -3.0}])  # fmt: skip
        RewardStack([(a, 1.0)], gates=[{"component": "a", "min": 1.5}])


@pytest.mark.parametrize(
    ("gate", "match"),
    [
        (
            {"component": "saftey", "min": 0},
            "gate on unknown component 'saftey'. The stack's components are: ",
        ),
        ({"component": "safety"}, "needs min and/or max"),
        ({"component": "safety", "min": 1, "max": 0}, "min = 1 is above max = 0"),
        ({"component": "safety", "min": math.inf}, "min = inf fails every score"),  # every total was 0
        ({"component": "safety", "max": -math.inf}, "max = -inf fails every score"),
        ({"component": "safety", "min": 0, "action": "clip"}, "action 'clip' is not one of 'zero', 'cap'"),
        ({"component": "safety", "min": 0, "cap": 1.0}, "cap only applies with action = 'cap'"),
        ({"component": "safety", "min": 0, "mn": 1}, "unknown key"),
    ],
)
def test_bad_gates_are_errors_naming_what_to_fix(gate, match):
    specs = {"components": ["length_penalty target=4", {"name": "safety", "weight": 0}], "gates": [gate]}
    with pytest.raises(ConfigError, match=re.escape(match)) as err:
        check_reward_specs(specs)
    assert gate["component"] != "saftey" or "'length_penalty', 'safety'" in str(err.value)
    with pytest.raises(ConfigError, match=re.escape(match)):
        RewardStack([(fixed("a", [1.0] * 4), 1.0), (fixed("safety", [0.0] * 4), 0.0)], gates=[gate])


def const_one(samples):
    return [1.0] * len(samples)


# -- weight schedules ------------------------------------------------------------------------------
def test_linear_schedule_over_the_whole_run_and_set_progress():
    stack = RewardStack([(fixed("a", [1.0] * 4), {"start": 1.0, "end": 0.2}), (fixed("b", [10.0] * 4), 0.0)])
    assert stack.weights_at(0.0)["a"] == 1.0
    assert stack.weights_at(0.5)["a"] == pytest.approx(0.6)
    assert stack.weights_at(1.0)["a"] == pytest.approx(0.2)
    assert stack.score(SAMPLES)[0][0] == 1.0  # progress starts at 0
    stack.set_progress(0.25)
    assert stack.weights == {"a": pytest.approx(0.8), "b": 0.0}
    assert stack.score(SAMPLES)[0][0] == pytest.approx(0.8)


def test_windowed_and_cosine_schedules_by_hand():
    linear = WeightSchedule(start=2.0, end=0.0, from_=0.2, to=0.6)
    assert [linear(p) for p in (0.0, 0.2, 0.3, 0.4, 0.6, 0.9)] == pytest.approx(
        [2.0, 2.0, 1.5, 1.0, 0.0, 0.0]
    )
    cosine = WeightSchedule(start=0.0, end=1.0, shape="cosine")
    # (1 - cos(pi t)) / 2 at t = 0.25, 0.5, 0.75
    assert [cosine(p) for p in (0.25, 0.5, 0.75)] == pytest.approx(
        [(1 - math.sqrt(0.5)) / 2, 0.5, (1 + math.sqrt(0.5)) / 2]
    )
    stack = build_reward_stack(
        [{"name": "length_penalty", "target": 4, "weight": {"start": 0.0, "end": 1.0, "from": 0.5}}]
    )
    assert stack.weights_at(0.4) == {"length_penalty": 0.0} and stack.weights_at(0.75) == {
        "length_penalty": 0.5
    }


@pytest.mark.parametrize(
    ("weight", "match"),
    [
        ({"start": 1.0, "end": 0.0, "to": 1.5}, "to = 1.5 is outside the run"),
        ({"start": 1.0, "end": 0.0, "from": -0.1}, "from = -0.1 is outside the run"),
        ({"start": 1.0, "end": 0.0, "from": 0.8, "to": 0.2}, "from = 0.8 must come before to = 0.2"),
        ({"start": 1.0, "end": 0.0, "from": 0.5, "to": 0.5}, "must come before"),
        ({"start": 1.0}, "needs both start and end"),
        ({"start": 1.0, "end": 0.0, "shape": "step"}, "shape 'step' is not one of 'linear', 'cosine'"),
        ({"start": 1.0, "end": 0.0, "form": 0.1}, "unknown key(s) 'form'"),
        ("0.5", "weight is the string '0.5': give a number (no quotes)"),
        (True, "weight True must be a finite number"),
    ],
)
def test_schedules_outside_the_run_and_bad_weights_are_errors(weight, match):
    spec = [{"name": "length_penalty", "target": 4, "weight": weight}]
    with pytest.raises(ConfigError, match=re.escape(match)):
        check_reward_specs(spec)
    with pytest.raises(ConfigError, match=re.escape(match)):
        build_reward_stack(spec)


def test_progress_outside_zero_one_is_an_error():
    stack = build_reward_stack(["length_penalty target=4"])
    with pytest.raises(ValueError, match=r"p = 1.5 must be a number in \[0, 1\]"):
        stack.set_progress(1.5)


# -- metric-only stacks ----------------------------------------------------------------------------
def test_a_stack_of_metrics_only_is_an_error_unless_allowed():
    specs = [
        {"name": "length_penalty", "target": 4, "weight": 0},
        {"name": "match", "weight": {"start": 0, "end": 0}},
    ]
    with pytest.raises(ConfigError, match="every component .* has weight 0.*nothing to train on"):
        build_reward_stack(specs)
    with pytest.raises(ConfigError, match="nothing to train on"):
        check_reward_specs({"components": specs}, where="design 'x'")
    assert build_reward_stack(specs, allow_all_metrics=True).is_metrics_only
    check_reward_specs(specs, allow_all_metrics=True)
    # a metric with a gate is still only a metric; a scheduled weight that is ever non-zero trains
    assert RewardStack([(fixed("m", [0.0]), 0.0)]).is_metrics_only  # the bench's metric stacks
    assert not build_reward_stack([{"name": "match", "weight": {"start": 0, "end": 1}}]).is_metrics_only


# -- functions as rewards --------------------------------------------------------------------------
REWARDS_FILE = """
def brevity(samples, limit=3):
    return [float(len(s.completion) <= limit) for s in samples]


def trl_style(prompts, completions, completion_ids=None, reference=None, **kwargs):
    return [None if ref is None else float(c == ref) for c, ref in zip(completions, reference)]


def wrong_count(prompts, completions, **kwargs):
    return [1.0]


def _helper():
    pass


class NotAFunction:
    pass
"""


@pytest.fixture
def rewards_dir(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "my_rewards.py").write_text(REWARDS_FILE)
    return tmp_path


def test_fn_from_a_relative_file_with_fixed_kwargs_and_a_display_name(rewards_dir):
    stack = build_reward_stack(
        [
            {"fn": "sub/my_rewards.py:brevity", "limit": 2},
            {"fn": "sub/my_rewards.py:brevity", "name": "short", "weight": 0.5},
        ],
        base_dir=rewards_dir,
    )
    assert stack.names == ["brevity", "short"]
    total, components = stack.score(SAMPLES)
    np.testing.assert_allclose(components["brevity"], [1, 1, 0, 0])
    np.testing.assert_allclose(total, [1.5, 1.5, 0.5, 0.0])


def test_fn_from_a_module(rewards_dir, monkeypatch):
    monkeypatch.syspath_prepend(str(rewards_dir / "sub"))
    stack = build_reward_stack([{"fn": "my_rewards:brevity", "weight": 2.0}])
    np.testing.assert_allclose(stack.score(SAMPLES)[0], [2, 2, 2, 0])


def test_fn_relative_paths_resolve_against_base_dir_not_the_cwd(rewards_dir, tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.mktemp("elsewhere"))
    with pytest.raises(ConfigError, match="does not exist.*relative paths resolve against"):
        check_reward_specs([{"fn": "sub/my_rewards.py:brevity"}])
    check_reward_specs([{"fn": "sub/my_rewards.py:brevity"}], base_dir=rewards_dir)
    absolute = resolve_fn_paths({"components": [{"fn": "sub/my_rewards.py:brevity"}]}, rewards_dir)
    assert absolute["components"][0]["fn"] == f"{rewards_dir / 'sub' / 'my_rewards.py'}:brevity"
    check_reward_specs(absolute)
    # the string form too (it stayed relative to the working directory), as a table; others stay strings
    specs = resolve_fn_paths(
        ["fn=sub/my_rewards.py:brevity weight=0.5", "length_penalty target=3"], rewards_dir
    )
    assert specs == [
        {"fn": f"{rewards_dir / 'sub' / 'my_rewards.py'}:brevity", "weight": 0.5},
        "length_penalty target=3",
    ]
    check_reward_specs(specs)


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        ("sub/missing.py:brevity", "file '.*missing.py' does not exist"),
        (
            "sub/my_rewards.py:brevty",
            "file 'sub/my_rewards.py' has no 'brevty'. Functions defined there: brevity, trl_style, wrong_count",
        ),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz'"),
        ("json:no_such_function", "module 'json' has no 'no_such_function'"),
        ("sub/my_rewards.py", "must look like 'path/to/file.py:function' or 'module:function'"),
        ("sub/my_rewards.py:NotAFunction", "is a class, not a function"),
    ],
)
def test_fn_that_does_not_exist_is_an_error_naming_it(rewards_dir, fn, match):
    with pytest.raises(ConfigError, match=match):
        check_reward_specs([{"fn": fn}], where="design 'd'", base_dir=rewards_dir)
    with pytest.raises(ConfigError, match="design 'd'"):
        check_reward_specs([{"fn": fn}], where="design 'd'", base_dir=rewards_dir)


def test_fn_fixed_arguments_are_checked_against_the_signature(rewards_dir):
    with pytest.raises(
        PluginArgumentError,
        match="reward function 'brevity' got unknown argument.*'limt'. Did you mean 'limit'. Valid arguments: limit",
    ):
        check_reward_specs([{"fn": "sub/my_rewards.py:brevity", "limt": 2}], base_dir=rewards_dir)
    with pytest.raises(PluginArgumentError, match="'completions' is filled in by textgym"):
        check_reward_specs([{"fn": "sub/my_rewards.py:trl_style", "completions": []}], base_dir=rewards_dir)


def test_trl_style_function_gets_lists_metadata_columns_and_completion_ids():
    seen = {}

    def scorer(prompts, completions, completion_ids=None, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, **kwargs)
        return [float(len(c)) if ref else None for c, ref in zip(completions, kwargs["reference"])]

    samples = [
        # a dataset's own completion column is not a keyword, as TRL leaves it out
        Sample(
            "q1", "ab", completion_ids=(7, 8, 2), meta={"reference": "ab", "topic": "x", "completion": "z"}
        ),
        Sample("q2", "abc", completion_ids=(9,), meta={"reference": None}),
        Sample("q3", "abcd", meta={"topic": "y"}),
    ]
    total, components = build_reward_stack([(scorer, 0.5)]).score(samples)
    assert callable(seen.pop("log_metric")) and callable(seen.pop("log_extra"))  # as TRL passes them
    assert seen == {
        "prompts": ["q1", "q2", "q3"],
        "completions": ["ab", "abc", "abcd"],
        "completion_ids": [[7, 8, 2], [9], []],
        "reference": ["ab", None, None],
        "topic": ["x", None, "y"],
        "trainer_state": None,  # TRL passes its trainer's state; there is none
    }
    np.testing.assert_allclose(total, [1.0, 0.0, 0.0])
    assert np.isnan(components["scorer"][1:]).all()


MIXED = [1, 0.5, None, 2**70, "s", True, 7]  # log_extra values of every kind one column may hold


def test_trl_style_functions_log_metrics_and_columns_into_the_run_as_trl_lets_them(tmp_path):
    """TRL passes log_metric and log_extra to every reward function: a function that called them failed with
    a KeyError, and one that named them got a column of None."""
    import json

    from lm_helpers import char_llama, make_env

    from textgym.agents.ppo import LMPPO
    from textgym.reward_functions import function_reward

    logged = []  # one value a call: the batches of episodes that end on one step

    def scored(prompts, completions, log_metric, log_extra, **kwargs):
        logged.append(sum(c.count("a") for c in completions) / len(completions))
        log_metric("share_a", logged[-1])
        log_extra("first", [c[:1] for c in completions])
        return [float(len(c)) for c in completions]

    env = make_env(4, rewards=RewardStack([(function_reward(scored), 1.0)]))
    agent = LMPPO(char_llama(), env, seed=0, verbose=0)
    agent.learn(1)
    completions = [e["completion"] for e in agent.last_episodes]
    assert len(logged) > 1 and agent.history[-1]["rewards/scored/share_a"] == pytest.approx(np.mean(logged))
    assert [e["reward_extras"] for e in agent.last_episodes] == [{"scored/first": c[:1]} for c in completions]
    json.dumps(agent.last_episodes)  # samples.jsonl holds them
    # a stack called outside an episode takes the calls (and drops what they log); bad calls name the function
    stack = build_reward_stack([(scored, 1.0)])
    assert stack.score([Sample("q", "ab")])[0].tolist() == [2.0]
    for call, message in [
        (
            "log_extra('x', [1, 2])",
            r"log_extra\('x', ...\) got '\[1, 2\]'; give a list of one value per completion \(1\)",
        ),
        (
            "log_extra('x', [object()])",
            r"log_extra\('x', ...\) got a object .*a string, a finite number, a bool or None",
        ),
        # samples.jsonl would hold NaN, which is no JSON
        ("log_extra('x', [float('nan')])", r"log_extra\('x', ...\) got a float \('nan'\); .*a finite number"),
        ("log_metric('mean', 1.0)", r"log_metric\('mean', ...\) needs a name .*rewards/bad/mean and /std"),
        # read as the mean of a component "bad/acc" by the headlines and plots
        (
            "log_metric('acc/std', 1.0)",
            r"log_metric\('acc/std', ...\) needs a name \(a non-empty string that does not end in",
        ),
        ("log_metric('m', float('nan'))", r"log_metric\('m', nan\): the value must be a finite number"),
    ]:
        namespace = {}
        exec(
            f"def bad(completions, log_metric, log_extra, **kwargs):\n    {call}\n    return [0.0]", namespace
        )
        with pytest.raises(RewardError, match=r"^reward function 'bad' \(.*\): " + message):
            build_reward_stack([(namespace["bad"], 1.0)]).score([Sample("q", "a")])


def test_log_extra_values_of_one_step_keep_their_own_types_in_the_vector_envs_info():
    """Gymnasium's info arrays took a column's type from its first sub-env's value: after a 1, 0.5 became 0,
    True stayed True for a 7, and a None after a number failed the step with a bare TypeError."""
    from lm_helpers import CHARS, make_env

    from textgym.reward_functions import function_reward

    def mixed(completions, log_extra, **kwargs):
        log_extra("v", MIXED[: len(completions)])
        return [0.0] * len(completions)

    env = make_env(len(MIXED), rewards=RewardStack([(function_reward(mixed), 1.0)]))
    env.reset(seed=0)
    *_, info = env.step(np.full(len(MIXED), CHARS.eos_token_id))  # every episode ends on this step
    assert [dict(extras) for extras in info["reward_extras"]] == [{"mixed/v": v} for v in MIXED]
    # the same through Gymnasium's own vectorization of the single env: each copy scores its own episode,
    # copy k in the k-th call
    calls = []

    def one_each(completions, log_extra, **kwargs):
        calls.append(1)
        log_extra("v", [MIXED[len(calls) - 1]])
        return [0.0]

    sync = gymnasium.make_vec("textgym/Copy-v0", num_envs=len(MIXED), vectorization_mode="sync",
                              rewards=RewardStack([(function_reward(one_each, name="mixed"), 1.0)]))  # fmt: skip
    sync.reset(seed=0)
    *_, info = sync.step(np.full(len(MIXED), CHARS.eos_token_id))
    assert [dict(extras) for extras in info["reward_extras"]] == [{"mixed/v": v} for v in MIXED]
    # Stable-Baselines3's per-env infos hold each as a dict, as a single env's does
    from textgym.sb3 import make_vec_env

    vec = make_vec_env(
        "textgym/Copy-v0", n_envs=len(MIXED), rewards=RewardStack([(function_reward(mixed), 1.0)])
    )
    vec.reset()
    vec.step_async(np.full(len(MIXED), vec.get_attr("eos_token_id")[0]))
    *_, infos = vec.step_wait()
    assert [i["reward_extras"] for i in infos] == [{"mixed/v": v} for v in MIXED]


def test_a_plugins_own_reward_error_is_named_whatever_its_text():
    """A RewardError whose text began with "reward " was taken as textgym's own, already named."""

    def strict(samples):
        raise RewardError("reward model weights missing")

    with pytest.raises(RewardError, match=r"^reward function 'strict' \(.*\): reward model weights missing"):
        build_reward_stack([(strict, 1.0)]).score([Sample("q", "a")])


def test_trl_style_function_without_kwargs_gets_only_what_it_names():
    def scorer(completions, topic):
        return [float(t == "x") for t in topic]

    stack = build_reward_stack([scorer])
    assert stack.score([Sample("q", "c", meta={"topic": "x", "other": 1})])[0].tolist() == [1.0]


def test_trls_documented_reward_function_forms_load_as_they_are():
    def ids_only(completion_ids, **kwargs):  # TRL's GRPO docs, example 1: was called as fn(samples)
        return [float(len(ids)) for ids in completion_ids]

    def only_kwargs(**kwargs):
        return [float(len(c)) for c in kwargs["completions"]]

    def curriculum(completions, trainer_state, **kwargs):  # TRL always passes trainer_state
        assert trainer_state is None
        return [1.0 for _ in completions]

    def ground_truth(completions, ground_truth, **kwargs):  # a column every TRL batch has
        return [None if g is None else float(c == g) for c, g in zip(completions, ground_truth)]

    samples = [
        Sample("q", "ab", completion_ids=(1, 2, 3), meta={"ground_truth": "ab"}),
        Sample("q", "x", completion_ids=(4,)),
    ]
    _, components = build_reward_stack([ids_only, only_kwargs, curriculum, ground_truth]).score(samples)
    assert components["ids_only"].tolist() == [3.0, 1.0] and components["only_kwargs"].tolist() == [2.0, 1.0]
    assert components["curriculum"].tolist() == [1.0, 1.0]
    assert components["ground_truth"][0] == 1.0 and np.isnan(components["ground_truth"][1])
    # a batch where no sample has the column gets it all None: it was a TypeError on such batches only
    assert np.isnan(build_reward_stack([ground_truth]).score([samples[1]])[1]["ground_truth"]).all()


def test_plain_callables_are_rewards_named_from_their_function():
    def shout(samples):
        return [float(s.completion.isupper()) for s in samples]

    stack = build_reward_stack([shout, (const_one, 0.25)])
    assert stack.names == ["shout", "const_one"]
    np.testing.assert_allclose(stack.score([Sample("p", "HI"), Sample("p", "hi")])[0], [1.25, 0.25])


def test_trl_style_function_returning_the_wrong_count_names_the_function(rewards_dir):
    stack = build_reward_stack([{"fn": "sub/my_rewards.py:wrong_count"}], base_dir=rewards_dir)
    with pytest.raises(
        RewardError,
        match=r"reward function 'wrong_count' \(sub/my_rewards.py:wrong_count\) returned 1 scores for 4 samples",
    ):
        stack.score(SAMPLES)


def test_fn_spec_strings_and_the_reward_decorator_take_trl_style_functions():
    assert textgym.rewards.parse_reward_spec("fn=my.py:f weight=0.5") == {"fn": "my.py:f", "weight": 0.5}

    @textgym.reward("trl_shaped")
    def trl_shaped(prompts, completions, bonus=1.0, **kwargs):
        return [bonus * len(c) for c in completions]

    try:
        stack = build_reward_stack(["trl_shaped bonus=2"])
        assert stack.score([Sample("p", "abc")])[0].tolist() == [6.0]
    finally:
        textgym.plugin_manager.unregister_plugin(f"{__file__}::trl_shaped")


# -- the table form, TOML, and the bench -----------------------------------------------------------
def test_toml_train_config_table_form_builds(rewards_dir):
    config = tomllib.loads(
        """
[env.rewards]
aggregate = "normalize_then_sum"
components = [
  { fn = "sub/my_rewards.py:brevity", limit = 2 },
  { name = "length_penalty", target = 4, weight = { start = 1.0, end = 0.0, from = 0.5, shape = "cosine" } },
]
gates = [{ component = "brevity", min = 0.5, action = "cap", cap = -1.0 }]
"""
    )
    stack = build_reward_stack(config["env"]["rewards"], base_dir=rewards_dir)
    assert stack.aggregate == "normalize_then_sum" and stack.names == ["brevity", "length_penalty"]
    assert len(stack.gates) == 1 and stack.gates[0].cap == -1.0
    assert "cosine" in repr(stack)


def test_table_form_errors():
    with pytest.raises(ConfigError, match="unknown key.*'agregate'.*Keys: aggregate, components, gates"):
        check_reward_specs({"components": ["length_penalty target=4"], "agregate": "sum"})
    with pytest.raises(ConfigError, match="aggregate = 'mean' is not one of 'sum', 'normalize_then_sum'"):
        check_reward_specs({"components": ["length_penalty target=4"], "aggregate": "mean"})
    with pytest.raises(ConfigError, match="needs components"):
        check_reward_specs({"aggregate": "sum"})


def test_bench_designs_accept_the_table_form_and_fn_relative_to_the_designs_file(rewards_dir, monkeypatch):
    from textgym.bench import load_designs

    (rewards_dir / "designs.toml").write_text(
        """
[env]
id = "textgym/Copy-v0"

[agent]
policy = "tiny-char-llama"

[[designs]]
name = "plain"
rewards = [{ name = "match", partial = true }, { name = "length_penalty", weight = 0.5, target = 3 }]

[[designs]]
name = "composed"

[designs.rewards]
aggregate = "normalize_then_sum"
components = [{ fn = "sub/my_rewards.py:brevity", weight = { start = 1.0, end = 0.5 } }, { name = "match", weight = 0 }]
gates = [{ component = "match", min = 0.5 }]
"""
    )
    monkeypatch.chdir(rewards_dir / "sub")
    spec = load_designs(rewards_dir / "designs.toml")
    composed = spec["designs"][1]["rewards"]
    assert composed["components"][0]["fn"] == f"{rewards_dir / 'sub' / 'my_rewards.py'}:brevity"
    assert (
        describe_stack(spec["designs"][0]["rewards"]) == "match x1 partial=True, length_penalty x0.5 target=3"
    )
    assert describe_stack(composed).startswith("normalize_then_sum of brevity x[1->0.5], match x0")
    assert describe_stack(composed).endswith("gates: match outside [0.5, inf] -> 0")
    bad = (
        (rewards_dir / "designs.toml")
        .read_text()
        .replace("min = 0.5", 'min = 0.5 }, { component = "sefety", max = 1')
    )
    (rewards_dir / "bad.toml").write_text(bad)
    with pytest.raises(ConfigError, match="design 'composed': gate on unknown component 'sefety'"):
        load_designs(rewards_dir / "bad.toml")


# -- the guide -------------------------------------------------------------------------------------
def test_rewards_guide_snippets_run_in_order(tmp_path):
    """docs/rewards.md: a python block starting with ``# name.py`` is a file; the others run in order in its
    directory, and every TOML block's reward stack (plugins.md's too) passes the checks."""
    blocks = re.findall(r"```(python|toml)\n(.*?)```", (DOCS / "rewards.md").read_text(), flags=re.S)
    code, tomls = [], []
    for lang, block in blocks:
        file = re.fullmatch(r"# (\w+\.py)", block.splitlines()[0])
        if lang == "python" and file:
            (tmp_path / file.group(1)).write_text(block)
        else:
            (code if lang == "python" else tomls).append(block)
    assert len(code) >= 5 and len(tomls) >= 2
    (tmp_path / "guide.py").write_text("\n".join(code))
    result = subprocess.run(
        [sys.executable, "guide.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=os.environ,
    )
    assert result.returncode == 0, result.stderr
    assert "[ 0.658 -0.447 -1.553  1.342]" in result.stdout and "[ 2. -1.  3.]" in result.stdout
    tomls += re.findall(r"```toml\n(\[env\.rewards\].*?)```", (DOCS / "plugins.md").read_text(), flags=re.S)
    for block in tomls:
        data = tomllib.loads(block)
        stacks = [data["env"]["rewards"]] if "env" in data else [d["rewards"] for d in data["designs"]]
        for stack in stacks:
            check_reward_specs(stack, base_dir=tmp_path)


def test_a_reward_that_hangs_is_bounded_by_its_timeout(tmp_path):
    import time

    from textgym.errors import ConfigError, RewardError

    (tmp_path / "slow.py").write_text(
        "import time\n\ndef stuck(samples):\n    time.sleep(30)\n    return [1.0] * len(samples)\n"
    )
    stack = textgym.build_reward_stack([{"fn": f"{tmp_path / 'slow.py'}:stuck", "timeout": 0.2}])
    start = time.perf_counter()
    with pytest.raises(RewardError, match=r"reward 'stuck' did not return within its timeout of 0.2 s"):
        stack.score([textgym.Sample("p", "c")])
    assert time.perf_counter() - start < 5
    fast = textgym.build_reward_stack(["length_penalty target=4 timeout=5"])
    assert fast.score([textgym.Sample("p", "abcd", completion_ids=(1, 2, 3, 4))])[0].shape == (1,)
    with pytest.raises(ConfigError, match="timeout must be a number of seconds > 0, not -1"):
        textgym.build_reward_stack([{"name": "length_penalty", "timeout": -1}])


def test_a_plugin_with_a_timeout_argument_of_its_own_gets_the_specs_timeout(tmp_path):
    """textgym took a spec's timeout as its own call limit for every reward: math's timeout=2 left math's at 5
    and moved it into a thread (where its own timeout is off), a judge's timeout=5 stayed 30, and math's
    documented timeout=0 (off) was refused."""
    from textgym.reward_checks import TimeoutReward

    for spec in ("math timeout=2", {"name": "math", "timeout": 0}):
        (reward, _), *_ = textgym.build_reward_stack([spec]).rewards
        assert not isinstance(reward, TimeoutReward) and reward.timeout == (2 if isinstance(spec, str) else 0)
    (tmp_path / "judge.py").write_text(
        "def judge(samples, timeout=30):\n    return [float(timeout)] * len(samples)\n"
    )
    stack = textgym.build_reward_stack([{"fn": f"{tmp_path / 'judge.py'}:judge", "timeout": 5}])
    assert stack.score([textgym.Sample("p", "c")])[0].tolist() == [5.0]
    # a reward without one: textgym's limit on its calls, as before
    (reward, _), *_ = textgym.build_reward_stack(["length_penalty target=4 timeout=5"]).rewards
    assert isinstance(reward, TimeoutReward) and reward.seconds == 5


def test_fn_may_be_the_function_itself_in_python():
    """{"fn": func, "weight": w} (the table form with a function, as (func, w) takes it) was refused: fn had
    to be a string."""
    import gymnasium

    def brevity(samples, limit=2):
        return [float(len(s.completion) <= limit) for s in samples]

    stack = build_reward_stack([{"fn": brevity, "weight": 0.5, "limit": 3}, {"fn": brevity, "name": "short"}])
    assert stack.names == ["brevity", "short"]
    np.testing.assert_allclose(stack.score(SAMPLES)[1]["brevity"], brevity(SAMPLES, limit=3))
    env = gymnasium.make_vec("textgym/Copy-v0", num_envs=2, vectorization_mode="vector_entry_point",
                             rewards=[{"fn": brevity, "weight": 2.0}])  # fmt: skip
    assert env.reward_stack.names == ["brevity"] and env.reward_stack.weights == {"brevity": 2.0}
