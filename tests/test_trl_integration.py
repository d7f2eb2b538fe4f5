"""textgym stacks as TRL reward functions, called exactly as TRL's GRPOTrainer calls them (TRL itself is not
installed): keyword arguments prompts, completions, completion_ids, every dataset column, trainer_state."""

import math
from types import SimpleNamespace

import numpy as np
import pytest

from textgym import FunctionReward, RewardStack, Sample, build_reward_stack
from textgym.errors import ConfigError, RewardError
from textgym.integrations.trl import reward_funcs, reward_weights, samples_from_trl, total_reward_func
from textgym.reward_checks import TimeoutReward
from textgym.reward_functions import trl_columns

SAMPLES = [
    Sample("What is 2 + 3?", "5", completion_ids=(20, 2), meta={"reference": "5", "topic": "sums"}),
    Sample("What is 2 + 3?", "six", completion_ids=(31, 32, 2), meta={"reference": "5", "topic": "sums"}),
    Sample("Say hi.", "Hi there, friend", completion_ids=(40, 41, 42, 43, 2), meta={"topic": "chat"}),
]


def correct(prompts, completions, completion_ids=None, reference=None, **kwargs):
    return [None if ref is None else float(c == ref) for c, ref in zip(completions, reference)]


def n_tokens(samples):
    return [float(len(s.completion_ids)) for s in samples]


def trl_call(func, samples, **extra):
    """Call ``func`` the way TRL does: keywords only, dataset columns and trainer_state alongside."""
    columns = trl_columns(samples)
    return func(
        prompts=columns.pop("prompts"),
        completions=columns.pop("completions"),
        completion_ids=columns.pop("completion_ids"),
        trainer_state=SimpleNamespace(global_step=0, max_steps=10),
        **columns,
        **extra,
    )


def trl_sum(funcs, weights, samples):
    """TRL's sum: rewards_per_func with None as NaN, times reward_weights, nansum over functions."""
    per_func = np.array(
        [[np.nan if v is None else v for v in trl_call(f, samples)] for f in funcs], dtype=float
    )
    return np.nansum(per_func.T * np.array(weights), axis=1)


def test_one_function_per_component_named_after_it_with_none_passed_through():
    stack = build_reward_stack([(correct, 2.0), "length_penalty weight=0.5 target=2", (n_tokens, 0.0)])
    funcs = reward_funcs(stack)
    assert [f.__name__ for f in funcs] == ["correct", "length_penalty", "n_tokens"]
    assert reward_weights(stack) == [2.0, 0.5, 0.0]
    assert trl_call(funcs[0], SAMPLES) == [1.0, 0.0, None]
    assert trl_call(funcs[2], SAMPLES) == [2.0, 3.0, 5.0]


def test_round_trip_stack_to_trl_functions_gives_the_same_totals():
    stack = build_reward_stack(
        [
            (correct, 2.0),
            {"name": "length_penalty", "weight": 0.5, "target": 2},
            (n_tokens, 0.0),
            {"name": "match", "weight": -1.0, "mode": "contains"},
        ],
    )
    total, _ = stack.score(SAMPLES[:2])
    # by hand: correct 1, 0; length_penalty (1 and 2 tokens of text vs target 2) -0.5, 0; match 1, 0
    np.testing.assert_allclose(total, [2 * 1 + 0.5 * -0.5 - 1, 0.0])
    np.testing.assert_allclose(trl_sum(reward_funcs(stack), reward_weights(stack), SAMPLES[:2]), total)
    # and with a not-applicable row: match needs a reference, so only the reference-free components there
    stack = build_reward_stack([(correct, 2.0), {"name": "length_penalty", "weight": 0.5, "target": 2}])
    np.testing.assert_allclose(
        trl_sum(reward_funcs(stack), reward_weights(stack), SAMPLES), stack.score(SAMPLES)[0]
    )


def test_metadata_columns_reach_plugins_and_an_empty_cell_is_a_null():
    stack = build_reward_stack([{"name": "match"}])  # match reads meta["reference"]
    (func,) = reward_funcs(stack)
    scores = func(prompts=["q", "q"], completions=["5", "5"], reference=["5", "4"], trainer_state=object())
    assert scores == [1.0, 0.0]
    samples = samples_from_trl(["q"], ["c"], [[1, 2]], {"reference": [None], "topic": ["t"], "scalar": 3})
    assert samples[0].meta == {"reference": None, "topic": "t"} and samples[0].completion_ids == (1, 2)
    # a dataset's empty cell is a prompt file's null: the reference does not apply, as inside textgym (it was
    # left out of the metadata, and match stopped TRL's training with "prompt 'b' has no 'reference'")
    scores = func(prompts=["a", "b"], completions=["5", "5"], reference=["5", None], trainer_state=object())
    assert scores == [1.0, None]
    assert list(stack.score([Sample("b", "5", meta={"reference": None})])[1]["match"]) == [pytest.approx(math.nan, nan_ok=True)]  # fmt: skip
    with pytest.raises(RewardError, match="prompt 'a' has no 'reference' in its metadata"):
        func(prompts=["a"], completions=["5"], trainer_state=object())  # the dataset has no such column


def test_conversational_prompts_and_completions_become_text():
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    completion = [{"role": "assistant", "content": "5"}]
    (sample,) = samples_from_trl([prompt], [completion])
    assert (sample.prompt, sample.completion) == ("What is 2 + 3?", "5")


def test_a_tool_calling_completion_is_a_multi_turn_sample_scored_on_its_last_answer():
    """With tools TRL passes a completion of several messages; the answer is the last assistant message, the
    tool's output is a turn of the environment's (not part of the answer)."""
    completion = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "add", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "29"},
        {"role": "assistant", "content": [{"type": "text", "text": "29"}]},
    ]
    (sample,) = samples_from_trl(["What is 14 + 15?"], [completion])
    assert sample.completion == "29"
    assert [(t.role, t.text) for t in sample.turns] == [
        ("assistant", ""),
        ("tool", "29"),
        ("assistant", "29"),
    ]
    (match,) = reward_funcs(build_reward_stack([{"name": "match"}]))
    assert match(prompts=["What is 14 + 15?"], completions=[completion], reference=["29"]) == [1.0]


def test_the_whole_stack_is_textgyms_total_everywhere_a_gates_penalty_included():
    """TRL takes a completion every function returned None for as unscorable (advantage 0): a completion no
    weighted component applies to gets textgym's own total instead, so that a gate on a metric-only component
    still charges it."""
    func = total_reward_func(build_reward_stack([(correct, 2.0)]))
    assert trl_call(func, SAMPLES) == [2.0, 0.0, 0.0]  # the third sample has no reference: nothing applies
    gated = {"components": [(correct, 2.0), (n_tokens, 0.0)],
             "gates": [{"component": "n_tokens", "max": 4.0, "action": "cap", "cap": -1.0}]}  # fmt: skip
    func = total_reward_func(build_reward_stack(gated))
    # the third: no reference, and 5 tokens fail the gate: -1 as inside textgym (None would have lost it)
    assert trl_call(func, SAMPLES) == [2.0, 0.0, -1.0]
    assert build_reward_stack(gated).score(SAMPLES)[0].tolist() == [2.0, 0.0, -1.0]


def test_errors_name_the_component_and_the_bad_call():
    stringly = FunctionReward("stringly", lambda samples: ["1.0"] * len(samples))
    (func,) = reward_funcs(RewardStack([(stringly, 1.0)]))
    with pytest.raises(RewardError, match="reward plugin 'stringly' returned the string '1.0'"):
        func(prompts=["p"], completions=["c"])
    with pytest.raises(ConfigError, match="got 2 prompts for 1 completions"):
        func(prompts=["p", "q"], completions=["c"])


def test_schedules_need_a_frozen_progress_for_trl_weights():
    stack = build_reward_stack([(correct, {"start": 1.0, "end": 0.0}), (n_tokens, 0.1)])
    with pytest.raises(ConfigError, match=r"components \['correct'\] have weight schedules"):
        reward_weights(stack)
    assert reward_weights(stack, p=0.25) == [0.75, 0.1]


def test_gated_stacks_export_as_one_function_that_follows_trainer_state():
    stack = build_reward_stack(
        {
            "components": [(n_tokens, {"start": 1.0, "end": 0.0}), (correct, 0.0)],
            "gates": [{"component": "correct", "min": 1.0}],
        }
    )
    with pytest.raises(ConfigError, match="use total_reward_func"):
        reward_funcs(stack)
    func = total_reward_func(stack)
    assert func.__name__ == "textgym_total"
    # trainer_state at step 0 of 10: weight 1; sample 1 fails the gate (correct = 0); sample 2 is not applicable
    assert trl_call(func, SAMPLES) == [2.0, 0.0, 5.0]
    columns = trl_columns(SAMPLES)
    state = SimpleNamespace(global_step=5, max_steps=10)  # halfway: weight 0.5
    assert func(trainer_state=state, **columns) == [1.0, 0.0, 2.5]
    assert stack.progress == 0.5


def test_with_the_eos_token_a_completion_cut_at_the_token_limit_scores_as_textgym_scores_it():
    """TRL's completion_ids hold the EOS only where a completion ended on it; TRL passes no finish reason.
    length_penalty charges a cut completion and counts all its tokens, as it does inside textgym."""
    stack = build_reward_stack([{"name": "length_penalty", "target": 4}])
    cut = Sample("p", "a b c d e f", completion_ids=(5, 6, 7, 8, 9, 10), finish_reason="length")
    stopped = Sample("p", "a b c d", completion_ids=(5, 6, 7, 8, 2), finish_reason="stop")
    inside = stack.score([cut, stopped])[0].tolist()
    assert inside == [-1.5, 0.0]  # 2 tokens over a target of 4, and the missing EOS
    for exported in (total_reward_func(stack, eos_token_id=2), reward_funcs(stack, eos_token_id=2)[0]):
        assert trl_call(exported, [cut, stopped]) == inside
    assert trl_call(total_reward_func(stack), [cut, stopped])[0] == -0.25  # no EOS id: every one "stopped"


def test_several_eos_ids_as_a_models_generation_config_gives_them_mark_completions_that_stopped():
    """Llama 3's and Qwen2.5's generation_config.eos_token_id is a list: compared as one id, every
    completion counted as cut, and length_penalty charged each the missing-EOS penalty."""
    stack = build_reward_stack([{"name": "length_penalty", "target": 4}])
    cut = Sample("p", "a b c d e f", completion_ids=(5, 6, 7, 8, 9, 10), finish_reason="length")
    stopped = Sample("p", "a b c d", completion_ids=(5, 6, 7, 8, 2), finish_reason="stop")
    inside = stack.score([cut, stopped])[0].tolist()
    for eos in ([2, 7], (np.int64(7), np.int64(2))):
        exported = (total_reward_func(stack, eos_token_id=eos), reward_funcs(stack, eos_token_id=eos)[0])
        for func in exported:
            assert trl_call(func, [cut, stopped]) == inside
    for bad in ("2", [], [2.0], True):
        with pytest.raises(ConfigError, match="eos_token_id must be a token id or a list of them"):
            reward_funcs(stack, eos_token_id=bad)


def test_trl_functions_in_an_exported_stack_get_trls_own_arguments():
    """Exported back to TRL, a TRL-style function of the stack got trainer_state=None and the completions as
    text, so one that shapes by step or reads conversational messages (as TRL's own rewards do:
    ``completion[0]["content"]``) failed; a reward with a timeout runs in a thread, which gets them too."""
    seen = {}

    def shaped(prompts, completions, completion_ids=None, trainer_state=None, log_metric=None, **kwargs):
        seen["state"], seen["log_metric"], seen["prompt"] = trainer_state, log_metric, prompts[0]
        return [float(len(c[0]["content"])) * (1 + trainer_state.global_step) for c in completions]

    state, log = SimpleNamespace(global_step=2, max_steps=10), print
    prompts = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]] * 2
    completions = [[{"role": "assistant", "content": "Hey"}], [{"role": "assistant", "content": "Hello!"}]]
    timed = TimeoutReward(FunctionReward("shaped", shaped), 10)
    for stack in (
        build_reward_stack([shaped, {"name": "length_penalty", "weight": 0.0, "target": 4}]),
        RewardStack([(timed, 1)]),
    ):
        given = dict(prompts=prompts, completions=completions, completion_ids=[[5, 2], [6, 7, 2]])
        assert reward_funcs(stack)[0](**given, trainer_state=state, log_metric=log) == [9.0, 18.0]
        assert seen == {"state": state, "log_metric": log, "prompt": prompts[0]}  # the system turn kept
        assert total_reward_func(stack)(**given, trainer_state=state, log_metric=log) == [9.0, 18.0]
    # in textgym's own training (no TRL call): text, and no trainer state
    with pytest.raises(RewardError, match="shaped.*raised TypeError"):
        build_reward_stack([shaped]).score(SAMPLES)
    assert seen["state"] is None and seen["prompt"] == SAMPLES[0].prompt


def test_an_async_reward_function_is_refused_when_the_stack_is_built():
    """Called, it returned a coroutine (and a never-awaited warning), which failed only at the first batch."""

    async def judged(prompts, completions, **kwargs):
        return [1.0 for _ in completions]

    # the way out is given in the function's own signature (it was textgym's, for a TRL-style function)
    with pytest.raises(ConfigError, match=r"reward function 'judged' is async \(async def\).* e.g. def "
                                          r"judged\(prompts, completions, \*\*kwargs\): return asyncio.run"):  # fmt: skip
        build_reward_stack([judged])
