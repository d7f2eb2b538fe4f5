import math

import numpy as np
import pytest

import textgym
from textgym import FunctionReward, RewardStack, Sample, build_reward_stack, make_reward
from textgym.errors import ConfigError, PluginArgumentError, RewardError, UnknownNameError
from textgym.rewards import parse_reward_spec

SAMPLES = [Sample("p", "good"), Sample("p", "bad day"), Sample("p", "")]


def const(value):
    return lambda samples: [value] * len(samples)


def fixed(name, values):
    """A reward named ``name`` that returns ``values`` whatever the samples."""
    return FunctionReward(name, lambda samples: values if isinstance(values, np.ndarray) else list(values))


def test_stack_total_is_weighted_sum_and_components_are_raw():
    a = FunctionReward("a", lambda ss: [len(s.completion) for s in ss])
    b = FunctionReward("b", const(2.0))
    total, components = RewardStack([(a, 0.5), (b, -1.0)]).score(SAMPLES)
    np.testing.assert_allclose(components["a"], [4, 7, 0])
    np.testing.assert_allclose(components["b"], [2, 2, 2])
    np.testing.assert_allclose(total, [0.5 * 4 - 2, 0.5 * 7 - 2, -2])


def test_weight_zero_is_logged_but_does_not_count():
    stack = RewardStack([(FunctionReward("a", const(1.0)), 1.0), (FunctionReward("m", const(100.0)), 0)])
    total, components = stack.score(SAMPLES)
    np.testing.assert_allclose(total, [1, 1, 1])
    np.testing.assert_allclose(components["m"], [100, 100, 100])


def test_same_reward_twice_gets_distinct_component_names():
    stack = build_reward_stack(["length_penalty target=4", "length_penalty target=8"])
    assert stack.names == ["length_penalty", "length_penalty_2"]


def test_a_plugin_that_fails_to_build_is_named_in_one_line(register):
    """Its RuntimeError (a judge it cannot reach) went up raw: a traceback that named no reward."""

    class Plugin:
        @staticmethod
        @textgym.hookimpl
        def register_rewards(register):
            def judge():
                raise RuntimeError("the judge is down")

            register("judge", judge)

    register(Plugin(), "judge-plugin")
    with pytest.raises(
        RewardError, match=r"^reward plugin 'judge' could not be built: RuntimeError: the judge is down$"
    ):
        make_reward("judge")


def test_a_plugins_own_reward_error_names_the_plugin_in_a_stack():
    """match and similarity raise RewardErrors of their own (a prompt without a reference): re-raised as
    they were, they did not say which reward of the stack failed."""
    for name in ("match", "similarity"):
        stack = build_reward_stack([{"name": "length_penalty", "target": 2, "unit": "words"}, name])
        with pytest.raises(RewardError, match=f"^reward plugin '{name}': prompt 'q' has no 'reference'"):
            stack.score([Sample("q", "5")])
    regex = build_reward_stack([{"name": "match", "mode": "regex"}])
    with pytest.raises(
        RewardError, match=r"^reward plugin 'match': prompt 'q': its 'reference' '\(\[' is not"
    ):
        regex.score([Sample("q", "5", meta={"reference": "(["})])


@pytest.mark.parametrize(
    ("output", "match"),
    [
        (lambda ss: [1.0], "returned 1 scores for 3 samples"),
        (lambda ss: [1.0, float("nan"), 0.0], r"returned nan for sample 1"),
        (lambda ss: [1.0, 0.0, math.inf], r"returned inf for sample 2"),
        (lambda ss: "abc", "one float per sample"),
        (lambda ss: None, "one float per sample"),
        (lambda ss: [[1.0, 2.0]] * 3, "one float per sample"),
    ],
)
def test_bad_plugin_output_is_an_error_naming_the_plugin(output, match):
    stack = RewardStack([(FunctionReward("broken", output), 1.0)])
    with pytest.raises(RewardError, match="reward plugin 'broken'") as err:
        stack.score(SAMPLES)
    assert err.match(match)


def test_a_reward_cannot_reorder_the_samples_the_stack_and_the_episodes_share():
    """A plugin that sorted its samples in place sorted the env's list: the rewards after it scored the
    episodes in another order, and the totals went to the wrong sub-envs without a word."""
    samples = [Sample("p", "ccc"), Sample("p", "a"), Sample("p", "bb")]

    def by_length(samples):
        samples.sort(key=lambda s: len(s.completion))
        return [float(len(s.completion)) for s in samples]

    stack = RewardStack([(FunctionReward("by_length", by_length), 1.0)])
    with pytest.raises(RewardError, match=r"'by_length' raised AttributeError.*sort or change a copy"):
        stack.score(samples)
    assert [s.completion for s in samples] == ["ccc", "a", "bb"]


def test_plugin_exception_is_wrapped_with_its_name_and_where_it_was_raised():
    def boom(samples):
        raise ZeroDivisionError("oops")

    line = boom.__code__.co_firstlineno + 1  # the file and line, which the one-line error left out
    with pytest.raises(
        RewardError,
        match=rf"reward plugin 'boom' raised ZeroDivisionError \(at .*test_rewards.py:{line} in boom\): oops",
    ):
        RewardStack([(FunctionReward("boom", boom), 1.0)]).score(SAMPLES)
    # where user code raised inside a library, the user's own frame is named, not numpy's
    import numpy as np

    def reshape(samples):
        return np.ones(3).reshape(2)

    line = reshape.__code__.co_firstlineno + 1
    with pytest.raises(RewardError, match=rf"raised ValueError \(at .*test_rewards.py:{line} in reshape\)"):
        RewardStack([(FunctionReward("reshape", reshape), 1.0)]).score(SAMPLES)


def test_unknown_reward_name_lists_known_and_suggests_closest():
    with pytest.raises(UnknownNameError, match="Did you mean 'sentiment'") as err:
        make_reward("sentimnet")
    assert "length_penalty" in str(err.value) and "rm_score" in str(err.value)


def test_unknown_plugin_argument_lists_valid_ones():
    with pytest.raises(PluginArgumentError, match="'targte'") as err:
        make_reward("length_penalty", targte=3)
    assert "Valid arguments: target, min, max, unit, shape, scale, missing_eos_penalty" in str(err.value)
    # a misspelt key of the spec itself: it said only the plugin's arguments were valid
    with pytest.raises(PluginArgumentError, match=r"'wieght'. Did you mean 'weight'\? Valid arguments: target, .* \(and "
                       r"the spec's weight, timeout\)"):  # fmt: skip
        build_reward_stack([{"name": "length_penalty", "target": 3, "wieght": 1}])


def test_bad_argument_value_names_the_reward():
    with pytest.raises(PluginArgumentError, match="reward 'length_penalty': unit must be"):
        make_reward("length_penalty", target=3, unit="lines")
    # a string target failed in a comparison: "'<' not supported between instances of 'str' and 'int'"
    with pytest.raises(
        PluginArgumentError, match="reward 'length_penalty': target must be a number, not 'abc'"
    ):
        make_reward("length_penalty", target="abc")


def test_text_that_toml_could_not_parse_is_refused_where_the_parameter_is_annotated_otherwise():
    """`--reward "hedging words=maybe"` scored each letter of "maybe" as a word, and `penalty=two` failed inside
    the reward at its first batch: a value TOML cannot parse stays text."""

    def hedging(samples, words: list[str] = ("maybe",), penalty: float = 1.0, note: str = ""):
        return [-penalty * sum(w in s.completion for w in words) for s in samples]

    textgym.reward("hedging")(hedging)  # unregistered after the test (conftest.py)
    with pytest.raises(PluginArgumentError, match=r"^reward 'hedging': words must be a list, not 'maybe'\.$"):
        build_reward_stack(["hedging words=maybe"])
    with pytest.raises(
        PluginArgumentError, match=r"^reward 'hedging': penalty must be a number, not 'two'\.$"
    ):
        build_reward_stack(["hedging penalty=two"])
    stack = build_reward_stack(["hedging words=['perhaps'] penalty=2 note=hello"])
    assert stack.names == ["hedging"]
    # a factory that compares the text itself (safety checks penalty >= 0) raised "'<' not supported
    # between instances of 'str' and 'int'" before the annotation was read
    with pytest.raises(
        PluginArgumentError, match=r"^reward 'safety': penalty must be a number, not 'two'\.$"
    ):
        build_reward_stack(["safety penalty=two"])

    def scaled(samples, scale: float = "auto"):  # a word of its own: the reward's to read
        return [1.0 for _ in samples]

    textgym.reward("scaled")(scaled)
    assert build_reward_stack(["scaled scale='auto'"]).names == ["scaled"]

    def exclaim(samples, per_mark=1.0, strict=False):  # the README's, unannotated: its defaults say
        return [per_mark * s.completion.count("!") for s in samples]

    textgym.reward("exclaim")(exclaim)
    with pytest.raises(
        PluginArgumentError, match=r"^reward 'exclaim': per_mark must be a number, not 'two'\.$"
    ):
        build_reward_stack(["exclaim per_mark=two"])
    with pytest.raises(PluginArgumentError, match=r"strict must be true or false"):
        build_reward_stack(["exclaim strict=yes"])
    assert build_reward_stack(["exclaim per_mark=2 strict=true"]).names == ["exclaim"]


def test_values_of_another_type_than_the_annotation_are_refused_too():
    """Only text was checked: in a TOML table `sharp = 2` (a bool) and `target = [0.3]` (a float) trained."""

    def vowel_ratio(samples, vowels: str = "aeiou", target: float = 0.4, sharp: bool = False):
        return [1.0 for _ in samples]

    textgym.reward("vowel_ratio")(vowel_ratio)
    for key, value, what in [
        ("sharp", 2, "true or false"),
        ("target", [0.3], "a number"),
        ("vowels", [], "a string"),
    ]:
        with pytest.raises(PluginArgumentError, match=rf"^reward 'vowel_ratio': {key} must be {what}, not "):
            build_reward_stack([{"name": "vowel_ratio", key: value}])
    assert build_reward_stack([{"name": "vowel_ratio", "target": 1, "sharp": True, "vowels": "ae"}]).names


def test_reward_spec_strings_parse_values_as_toml():
    assert parse_reward_spec("length_penalty weight=0.2 target=32 unit='words' shape=quadratic") == {
        "name": "length_penalty",
        "weight": 0.2,
        "target": 32,
        "unit": "words",
        "shape": "quadratic",
    }
    with pytest.raises(ConfigError, match="not key=value"):
        parse_reward_spec("sentiment 0.5")


def test_bad_weight_and_missing_name_are_errors():
    with pytest.raises(ConfigError, match="weight nan"):
        RewardStack([(FunctionReward("a", const(1.0)), float("nan"))])
    with pytest.raises(ConfigError, match="has no 'name'"):
        build_reward_stack([{"weight": 1.0}])
    # `--reward match=1`: a weight written as name=weight, answered with the form for it
    with pytest.raises(ConfigError, match="For the reward 'match' with a weight, write 'match weight=1'"):
        build_reward_stack([parse_reward_spec("match=1")])
    with pytest.raises(ConfigError, match=r"'module:func'\)\.$"):  # not a reward's name: no such advice
        build_reward_stack([parse_reward_spec("partial=1")])


def test_none_means_not_applicable():
    total, components = RewardStack([(fixed("a", [1.0, None, 2.0]), 1.0)]).score(SAMPLES)
    np.testing.assert_array_equal(total, [1.0, 0.0, 2.0])
    np.testing.assert_array_equal(components["a"], [1.0, np.nan, 2.0])


def test_numpy_arrays_bools_and_ints_are_scores():
    stack = RewardStack(
        [(fixed("arr", np.array([1, 2, 3])), 1.0), (fixed("flags", [True, False, np.int64(2)]), 1.0)]
    )
    np.testing.assert_allclose(stack.score(SAMPLES)[0], [2, 2, 5])


def test_torch_tensors_are_scores_in_any_dtype_and_while_they_track_gradients():
    """numpy cannot take a bf16 tensor or one that tracks gradients: both were torch tracebacks naming no
    plugin, and a reward model scoring under bf16 autocast returns the first."""
    import torch

    bf16 = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    tracked = torch.tensor([1.0, 2.0, 3.0], requires_grad=True) * 2
    stack = RewardStack(
        [(FunctionReward("bf16", lambda s: bf16), 1.0), (FunctionReward("tracked", lambda s: tracked), 1.0)]
    )
    np.testing.assert_allclose(stack.score(SAMPLES)[0], [3.0, 6.0, 9.0])


def test_a_total_that_overflows_is_an_error_not_inf():
    """Each score was finite, so each passed its check; their weighted sum was inf (or inf - inf = NaN)."""
    stack = RewardStack([(fixed("huge", [1e308, 1.0, 1.0]), 10.0), (fixed("small", [1.0, 1.0, 1.0]), 1.0)])
    with pytest.raises(RewardError, match=r"total reward of sample 0 is inf \(weighted scores .*'huge'"):
        stack.score(SAMPLES)
    opposite = RewardStack([(fixed("up", [1e308, 0, 0]), 10.0), (fixed("down", [1e308, 0, 0]), -10.0)])
    with pytest.raises(RewardError, match="total reward of sample 0 is nan"):
        opposite.score(SAMPLES)


def test_a_reward_name_starting_with_an_underscore_is_refused():
    """Gymnasium's vector infos keep `_<key>` for which sub-envs have `<key>`: the env's logs dropped a
    component named `_bonus`, logged `_x` as the mask of `x`, and normalize_then_sum raised KeyError."""

    def _bonus(samples):
        return [1.0] * len(samples)

    with pytest.raises(ConfigError, match=r"reward name '_bonus' starts with '_'.*name = 'bonus'"):
        RewardStack([(_bonus, 1.0)])
    with pytest.raises(ConfigError, match="reward name '_x' starts with '_'"):
        RewardStack([(FunctionReward("_x", _bonus), 1.0)])
    assert RewardStack([(FunctionReward("bonus", _bonus), 1.0)]).names == ["bonus"]


def test_numpy_numbers_are_weights_and_gate_bounds():
    """np.int64 and np.float32 are numbers: they were refused as "must be a finite number"."""
    stack = RewardStack(
        [(fixed("a_len", [1.0] * 3), np.int64(2))], gates=[{"component": "a_len", "min": np.float32(0.5)}]
    )
    assert stack.weights == {"a_len": 2.0}
    np.testing.assert_allclose(stack.score(SAMPLES)[0], [2.0, 2.0, 2.0])


@pytest.mark.parametrize(
    ("values", "shown"),
    [
        (["1.0", "0.0", "1.0"], "the string '1.0' for sample 0"),
        ([1.0, "True", 0.0], "the string 'True' for sample 1"),
        (np.array(["0.5", "1", "1"]), "the string '0.5' for sample 0"),
        ([1.0, 0.0, [1.0]], "list [1.0] for sample 2"),
    ],
)
def test_a_reward_returning_strings_is_rejected_not_coerced(values, shown):
    stack = RewardStack([(fixed("stringly", values), 1.0)])
    with pytest.raises(RewardError, match="reward plugin 'stringly' returned") as err:
        stack.score(SAMPLES)
    assert shown in str(err.value) and "one float per sample" in str(err.value)


@pytest.mark.parametrize(
    "spec", ["length_penalty target=3 weight=1 target=30", "length_penalty name=sentiment"]
)
def test_a_reward_spec_giving_a_key_twice_is_refused(spec):
    """The last value won without a word (a name= even replaced the reward)."""
    key = "name" if "name=" in spec else "target"
    with pytest.raises(ConfigError, match=f"{key} is given twice"):
        parse_reward_spec(spec)


def test_textgym_traceback_prints_a_failing_plugins_traceback(tmp_path, monkeypatch, capsys):
    from textgym.cli import main

    (tmp_path / "bad.py").write_text(
        "import textgym\n\n\n@textgym.reward('bad')\ndef bad(samples):\n    return [len(samples) / 0]\n"
    )
    args = ["sample", "--plugin", str(tmp_path / "bad.py"), "--model", "tiny-char-llama", "--prompts", "copy",
            "--reward", "bad", "--num", "2", "--max-new-tokens", "2"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"raised ZeroDivisionError (at {tmp_path / 'bad.py'}:6 in bad)" in err and "Traceback" not in err
    monkeypatch.setenv("TEXTGYM_TRACEBACK", "1")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert (
        "Traceback (most recent call last)" in err and f'File "{tmp_path / "bad.py"}", line 6, in bad' in err
    )
