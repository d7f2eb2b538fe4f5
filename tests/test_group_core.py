"""Hand-computed checks of the critic-free agents' math (agents/group_core.py)."""

import math

import pytest
import torch

from textgym.agents.group_core import (
    STD_EPS,
    aggregate_loss,
    clipped_surrogate,
    group_advantages,
    leave_one_out_advantages,
    normalize,
    sequence_clipped_surrogate,
    zero_std_share,
)

T = torch.tensor
REWARDS = T([1.0, 2.0, 3.0, 3.0, 3.0, 3.0])  # two groups of 3: [1, 2, 3] (mean 2, std 1) and [3, 3, 3]


def close(a, b):
    torch.testing.assert_close(a, T(b) if not isinstance(b, torch.Tensor) else b, atol=1e-6, rtol=1e-6)


def test_group_scaling_divides_by_each_groups_std():
    advantages, std = group_advantages(REWARDS, 3, "group")
    close(advantages, [-1 / (1 + STD_EPS), 0.0, 1 / (1 + STD_EPS), 0.0, 0.0, 0.0])
    close(std, [1.0, 1.0, 1.0, 0.0, 0.0, 0.0])


def test_batch_scaling_divides_by_the_batch_std():
    # batch mean 2.5; squared deviations 2.25 + 5 * 0.25 = 3.5; unbiased variance 3.5 / 5 = 0.7
    advantages, _ = group_advantages(REWARDS, 3, "batch")
    close(advantages, T([-1.0, 0.0, 1.0, 0.0, 0.0, 0.0]) / (math.sqrt(0.7) + STD_EPS))


def test_no_scaling_only_centres_each_group():
    advantages, std = group_advantages(REWARDS, 3, "none")
    close(advantages, [-1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    assert std[3:].eq(0).all()  # still reported: frac_reward_zero_std needs it


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_group_of_equal_rewards_gives_zero_advantages_never_nan(scale):
    advantages, _ = group_advantages(T([0.5, 0.5, 0.5, 0.5]), 2, scale)
    assert advantages.eq(0).all()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_group_of_equal_float32_rewards_gives_exactly_zero_advantages(scale):
    """A float32 mean of eight 77.7s is a few ulps off 77.7: divided by std + 1e-4, every completion of the
    group got the same advantage, up to 0.37 for rewards near 1000."""
    rewards = torch.cat([torch.full((8,), 77.7), torch.full((8,), 1000.1), torch.arange(8.0)])
    advantages, _ = group_advantages(rewards, 8, scale)
    assert advantages.dtype == torch.float32 and advantages[:16].eq(0).all() and advantages[16:].ne(0).all()
    assert normalize(torch.full((8,), 77.7)).eq(0).all()
    assert zero_std_share(rewards, 8) == pytest.approx(2 / 3)


def test_leave_one_out_baseline_is_the_mean_of_the_others():
    # [1, 2, 3]: baselines (2+3)/2, (1+3)/2, (1+2)/2; [4, 0]: baselines 0 and 4
    close(leave_one_out_advantages(T([1.0, 2.0, 3.0]), 3), [-1.5, 0.0, 1.5])
    close(leave_one_out_advantages(T([4.0, 0.0, 1.0, 1.0]), 2), [4.0, -4.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="group_size of at least 2, not 1"):
        leave_one_out_advantages(T([1.0, 2.0]), 1)  # the mean of no other reward: NaN advantages


def test_normalize_standardises_over_the_batch():
    close(normalize(T([1.0, 3.0])), T([-1.0, 1.0]) / (math.sqrt(2) + STD_EPS))


def test_clipped_surrogate_with_clip_higher():
    ratios = T([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]])
    loss, low, high = clipped_surrogate(ratios.log(), T([1.0, -1.0]), epsilon=0.2, epsilon_high=0.28)
    # A = +1: -min(r, clip(r, 0.8, 1.28)) = -0.5, -1, -1.28; A = -1: -min(-r, -clip(r)) = 0.8, 1, 1.5
    close(loss, [[-0.5, -1.0, -1.28], [0.8, 1.0, 1.5]])
    assert low.tolist() == [[False, False, False], [True, False, False]]  # below 1 - eps with A < 0
    assert high.tolist() == [[False, False, True], [False, False, False]]  # above 1 + eps_high with A > 0


LOSS = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = T([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # tokens 1, 2 | 4 count; 7 in all over 3 tokens


@pytest.mark.parametrize(
    ("loss_type", "expected"),
    [
        ("grpo", (1.5 + 4.0) / 2),  # per-sequence means 1.5 and 4, then their mean
        ("dr_grpo", 7 / (2 * 3)),  # sum / (sequences x max_completion_length 3)
        ("dapo", 7 / 3),  # sum / tokens of the step
        ("bnpo", 7 / 3),  # sum / tokens of this batch
    ],
)
def test_each_loss_aggregation(loss_type, expected):
    close(aggregate_loss(LOSS, MASK, loss_type, max_completion_length=3), expected)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batches_accumulate_to_the_whole_steps_loss(loss_type):
    whole = aggregate_loss(LOSS, MASK, loss_type, 3)
    parts = sum(
        aggregate_loss(LOSS[i : i + 1], MASK[i : i + 1], loss_type, 3, num_sequences=2, num_tokens=MASK.sum())
        for i in range(2)
    )
    close(parts, whole)


def test_dapo_normalises_by_the_steps_tokens_and_bnpo_by_its_own():
    close(aggregate_loss(LOSS, MASK, "dapo", 3, num_tokens=10), 0.7)
    close(aggregate_loss(LOSS, MASK, "bnpo", 3, num_tokens=10), 7 / 3)


def test_unknown_loss_type_lists_the_valid_ones():
    with pytest.raises(ValueError, match="grpo, dr_grpo, dapo, bnpo"):
        aggregate_loss(LOSS, MASK, "ppo", 3)


def test_sequence_ratio_is_over_the_completions_tokens():
    # log-ratios 0.05 + 0.05 over the two real tokens (the masked 9.0 does not count): ratio e^0.1, inside
    # the clip range; counting the 9.0 would clip it at 1.2
    logprobs, old = T([[0.05, 0.05, 9.0], [0.0, 0.0, 0.0]]), torch.zeros(2, 3)
    loss, low, high = sequence_clipped_surrogate(logprobs, old, MASK, T([1.0, -2.0]), 0.2, 0.2)
    close(loss, [-math.exp(0.1), 2.0])  # unclipped with A = 1; ratio 1 with A = -2
    assert high.tolist() == [False, False] and low.tolist() == [False, False]
    # a ratio past 1 + epsilon_high is clipped, and flagged
    loss, _, high = sequence_clipped_surrogate(
        T([[0.1, 0.2, 9.0], [0.0, 0.0, 0.0]]), old, MASK, T([1.0, -2.0]), 0.2, 0.2
    )
    close(loss, [-1.2, 2.0])
    assert high.tolist() == [True, False]
