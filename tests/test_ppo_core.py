"""Analytic tests of the PPO-for-LM pieces: each would fail if its detail were wrong."""

import pytest
import torch

from textgym.agents.ppo_core import (
    AdaptiveKLController,
    entropy_from_logits,
    gae,
    k3_kl,
    kl_penalty,
    logprobs_from_logits,
    masked_whiten,
    per_token_rewards,
    policy_loss,
    value_loss,
)
from textgym.agents.rollout_batch import RunningMoments


def test_gae_with_constant_values_matches_a_hand_computation():
    # one sequence of 3 real tokens then padding; reward 1 on the last real token; V = 0.5 everywhere
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0]])  # 7.0 is after EOS and must be ignored
    values = torch.full((1, 4), 0.5)
    mask = torch.tensor([[1, 1, 1, 0]])
    gamma, lam = 0.9, 0.8
    d2 = 1.0 - 0.5  # last real token: no bootstrap after the end
    d1 = 0.0 + gamma * 0.5 - 0.5
    d0 = 0.0 + gamma * 0.5 - 0.5
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(advantages, torch.tensor([[a0, a1, a2, 0.0]]))
    torch.testing.assert_close(returns, torch.tensor([[a0 + 0.5, a1 + 0.5, a2 + 0.5, 0.0]]))


def test_gae_with_gamma_1_lambda_1_gives_reward_to_go_minus_value():
    rewards = torch.tensor([[0.1, -0.2, 2.0]])
    values = torch.tensor([[0.3, 0.4, 0.5]])
    advantages, returns = gae(rewards, values, torch.ones(1, 3), 1.0, 1.0)
    torch.testing.assert_close(returns, torch.tensor([[1.9, 1.8, 2.0]]))
    torch.testing.assert_close(advantages, returns - values)


def test_whitening_ignores_padding_and_can_keep_the_mean():
    x = torch.tensor([[1.0, 3.0, 5.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    w = masked_whiten(x, mask)  # mean 3, unbiased std 2 over the three unmasked entries
    torch.testing.assert_close(w, torch.tensor([[-1.0, 0.0, 1.0, 0.0]]), atol=1e-6, rtol=0)
    kept = masked_whiten(x, mask, shift_mean=False)  # scaled by 1/std, the mean added back
    torch.testing.assert_close(kept, torch.tensor([[2.0, 3.0, 4.0, 0.0]]), atol=1e-6, rtol=0)


def test_per_token_rewards_put_the_score_on_the_last_real_token():
    logprobs = torch.tensor([[-1.0, -2.0, -1.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -1.0], [-1.0, -3.0, -9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards, kl = per_token_rewards(torch.tensor([2.0, 5.0]), logprobs, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(kl, torch.tensor([[0.5, -1.0, 0.0], [0.0, 2.0, 0.0]]))
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.1, 2.0], [0.0, -0.2 + 5.0, 0.0]]))


def test_k3_kl_estimator_is_nonnegative_and_zero_at_equality():
    lp, ref = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-1.0, -1.0, -3.0])
    k3 = kl_penalty(lp, ref, "k3")
    r = ref - lp
    torch.testing.assert_close(k3, r.exp() - 1 - r)
    assert (k3 >= 0).all() and k3[0] == 0
    torch.testing.assert_close(k3, k3_kl(lp, ref))  # GRPO's and RLOO's is the same
    with pytest.raises(ValueError, match="'k2'"):
        kl_penalty(lp, ref, "k2")


def test_k3_kl_of_a_policy_near_its_reference_is_not_rounded_away():
    """Early in training d = ref - logp is ~1e-3 and the KL ~d^2/2 = 5e-7: float32's exp(d) - d - 1 has
    errors of 6e-8 whatever d, and many tokens came out negative. The error is now a float32 rounding of d."""
    generator = torch.Generator().manual_seed(0)
    logprobs = -torch.rand(10_000, generator=generator) * 5
    for scale in (1.0, 1e-1, 1e-2, 1e-3, 1e-4, 1e-6):
        ref = logprobs + torch.randn(10_000, generator=generator) * scale
        kl = k3_kl(logprobs, ref)
        d = (ref - logprobs).double()  # the same d, in float64
        assert (kl >= 0).all()
        assert ((kl.double() - (d.exp() - d - 1)).abs() <= 1e-6 * d.abs()).all(), scale


def test_clipped_policy_loss_against_hand_numbers():
    old = torch.zeros(1, 3)
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1
    adv = torch.tensor([[1.0, -1.0, 2.0]])
    loss, clipfrac, approx_kl = policy_loss(new, old, adv, torch.ones(1, 3), clip_range=0.2)
    # per token max(-A r, -A clip(r)): 1.5 -> max(-1.5, -1.2) = -1.2; 0.5 -> max(0.5, 0.8) = 0.8; 1.1 -> -2.2
    torch.testing.assert_close(loss, torch.tensor((-1.2 + 0.8 - 2.2) / 3))
    torch.testing.assert_close(clipfrac, torch.tensor(2 / 3))
    r = torch.tensor([1.5, 0.5, 1.1])
    torch.testing.assert_close(approx_kl, ((r - 1) - r.log()).mean())


def test_policy_loss_ignores_positions_after_eos():
    old, new = torch.zeros(1, 2), torch.tensor([[0.0, 3.0]])
    adv = torch.tensor([[1.0, 1000.0]])
    loss, clipfrac, approx_kl = policy_loss(new, old, adv, torch.tensor([[1, 0]]), 0.2)
    assert loss.item() == -1.0 and clipfrac.item() == 0.0 and approx_kl.item() == 0.0


def test_clipped_value_loss_against_hand_numbers():
    values, old, returns = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 0.0]]), torch.tensor([[2.0, 1.0]])
    loss, clipfrac = value_loss(values, old, returns, torch.ones(1, 2), clip_range_vf=0.2)
    # token 0: unclipped (1-2)^2 = 1, clipped (0.2-2)^2 = 3.24 -> 3.24; token 1: both (0-1)^2 = 1
    torch.testing.assert_close(loss, torch.tensor(0.5 * (3.24 + 1.0) / 2))
    torch.testing.assert_close(clipfrac, torch.tensor(0.5))
    plain, _ = value_loss(values, old, returns, torch.ones(1, 2), clip_range_vf=None)
    torch.testing.assert_close(plain, torch.tensor(0.5 * (1.0 + 1.0) / 2))


def test_adaptive_kl_controller_update_formula():
    ctl = AdaptiveKLController(kl_coef=0.1, target=6.0, horizon=1000)
    ctl.update(current_kl=9.0, n_steps=100)  # error clipped to +0.2
    assert ctl.kl_coef == pytest.approx(0.1 * (1 + 0.2 * 0.1))
    ctl.update(current_kl=5.4, n_steps=100)  # error -0.1
    assert ctl.kl_coef == pytest.approx(0.1 * 1.02 * (1 - 0.1 * 0.1))


def test_temperature_divides_logits_before_log_softmax():
    logits = torch.tensor([[[2.0, 0.0, -1.0]]])
    tokens = torch.tensor([[0]])
    expected = torch.log_softmax(logits / 0.7, -1)[0, 0, 0]
    torch.testing.assert_close(logprobs_from_logits(logits, tokens, 0.7)[0, 0], expected)
    p = torch.softmax(logits / 0.7, -1)
    torch.testing.assert_close(entropy_from_logits(logits, 0.7), -(p * p.log()).sum(-1))


def test_the_collective_whitening_of_one_process_is_the_single_process_whitening():
    """agents.distributed.masked_whiten sums its moments over processes (the two-process update in
    test_distributed checks the split); with one process it is ppo_core's formula, Bessel's correction and
    padding included."""
    import types

    from textgym.agents.distributed import Collective
    from textgym.agents.distributed import masked_whiten as collective_whiten

    one = Collective(types.SimpleNamespace(num_processes=1, process_index=0, is_main_process=True))
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0)) * 3 + 1
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[1, 3:] = mask[3, 1:] = 0
    for shift_mean in (True, False):
        torch.testing.assert_close(
            collective_whiten(x, mask, one, shift_mean), masked_whiten(x, mask, shift_mean=shift_mean)
        )
    x1, m1 = torch.tensor([[2.0, 7.0]]), torch.tensor([[1, 0]])  # one entry: no variance to correct
    torch.testing.assert_close(collective_whiten(x1, m1, one), masked_whiten(x1, m1))


def test_running_score_moments_keep_the_sample_std_of_every_score_so_far():
    """score_norm divided by the population std, which understates the spread of the first batches (TRL
    divides by the sample std)."""
    moments, batches = (
        RunningMoments(),
        [torch.arange(8.0), torch.tensor([3.0, -1.0, 10.0]), torch.tensor([2.0])],
    )
    moments.update(batches[0])
    assert moments.std == pytest.approx(2.449490, abs=1e-6)  # of 0..7, with Bessel's correction
    for batch in batches[1:]:
        moments.update(batch)
    every = torch.cat(batches).double()
    assert moments.mean == pytest.approx(float(every.mean())) and moments.std == pytest.approx(
        float(every.std())
    )
    assert RunningMoments().std == 1.0  # nothing seen yet: scores are only centred
