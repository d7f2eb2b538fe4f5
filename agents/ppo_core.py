"""The PPO-for-language-models pieces as small pure functions, each with its own analytic test.

Tensors are (B, T): B sequences, T response positions; ``mask`` is 1 on real response tokens (EOS included)
and 0 on every position after EOS, so nothing after the end of a response reaches a loss or a statistic.
References: Ziegler et al. 2019 (per-token KL penalty, adaptive KL controller); Schulman et al. 2016 (GAE);
Huang et al. 2024, "The N Implementation Details of RLHF with PPO" (whitening, value clipping, masking).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    n = mask.sum()
    if unbiased and n > 1:
        var = var * n / (n - 1)  # Bessel's correction, as TRL does
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the masked entries. ``shift_mean=False`` keeps the mean: reward whitening
    must not shift rewards, or the sign of "end the episode now" changes (N implementation details, #5)."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(x.dtype)


def logprobs_from_logits(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log p(token) from (B, T, V) logits at sampling ``temperature``. The temperature divides the logits
    before log-softmax everywhere (rollout, reference, training): otherwise the PPO ratio is not 1 before
    the first update and the KL penalty measures the wrong distribution."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, T, V)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B, T)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0) -> Tensor:
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, T, V)
    return -(logp.exp() * logp).sum(-1)  # (B, T)


def k3_kl(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate ``exp(d) - d - 1`` with ``d = ref - logp``: unbiased, >= 0.

    As ``expm1(d) - d``: where the policy is near its reference (d ~ 1e-3, early in training) the KL is ~d^2/2
    = 5e-7, which ``exp(d) - d - 1`` in float32 gets to within 6e-8 at best, often below 0. Here the error
    is below 1e-6 * |d| (tests/test_ppo_core.py), and the estimate never below 0."""
    d = ref_logprobs - logprobs
    return torch.expm1(d) - d


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token KL(policy || reference) estimate from the sampled tokens' log-probs (Schulman's k1/k3)."""
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k3":
        return k3_kl(logprobs, ref_logprobs)
    raise ValueError(f"kl estimator must be 'k1' or 'k3', not {estimator!r}.")


def per_token_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[Tensor, Tensor]:
    """Rewards (B, T): ``-kl_coef * KL_t`` on every response token, plus the sequence's score (B,) on its
    last real token. Returns ``(rewards, kl)``, both zero after EOS."""
    kl = kl_penalty(logprobs, ref_logprobs, estimator) * mask
    rewards = -kl_coef * kl
    last = (mask.sum(1) - 1).clamp(min=0).long()  # (B,) index of the last real token
    rewards[torch.arange(len(scores)), last] += scores
    return rewards * mask, kl


def turn_rewards_at(
    action_mask: Tensor, turn_rewards: list[list[float]], turn_tokens: list[list[int]]
) -> Tensor:
    """(B, T): each agent turn's reward on the turn's last agent token, 0 elsewhere. ``turn_tokens[b]`` holds
    the token count of each of episode ``b``'s agent turns, in order: they take the agent positions of
    ``action_mask`` in turn (its runs of 1 cannot tell two turns apart when the reply between them wrote no
    token). ``turn_rewards[b]`` holds one reward per turn the environment answered (a turn cut at the token
    budget has none)."""
    placed = torch.zeros(action_mask.shape, dtype=torch.float32)
    agent = action_mask.bool().cpu()
    for b, (rewards, lengths) in enumerate(zip(turn_rewards, turn_tokens, strict=True)):
        if not rewards:
            continue
        cols = agent[b].nonzero().squeeze(1)
        ends = torch.tensor(lengths, dtype=torch.long).cumsum(0)[: len(rewards)] - 1
        if len(rewards) > len(lengths) or sum(lengths) != len(cols):
            raise ValueError(
                f"episode {b} has {len(rewards)} turn rewards and agent turns of {list(lengths)} tokens, but "
                f"{len(cols)} agent tokens in its action mask: its info['turns'] is not of this batch."
            )
        placed[b, cols[ends]] = torch.tensor(rewards, dtype=torch.float32)
    return placed


def agent_first_order(action_mask: Tensor) -> Tensor:
    """A per-row permutation (B, T) that moves each row's agent positions to the front, in order, and the
    rest behind them: ``x.gather(1, order)`` compacts a row's agent tokens into ``[0, n)`` and
    ``torch.zeros_like(x).scatter(1, order, y)`` puts them back. In a multi-turn episode the environment's
    tokens sit between the agent's turns; GAE and the score on the last token run over the compacted rows, so
    the value after an agent turn is the value of the agent's next token, not of an environment token. Without
    environment tokens the order is the identity."""
    T = action_mask.shape[1]
    key = (action_mask == 0).to(torch.int64) * T + torch.arange(T, device=action_mask.device)  # (B, T)
    return key.argsort(dim=1)


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over response tokens. Returns ``(advantages, returns)``.

    The value after the last real token is 0 (the episode ended), so masked positions contribute nothing.
    """
    mask = mask.to(values.dtype)
    values, rewards = values * mask, rewards * mask
    advantages = torch.zeros_like(values)
    last_gae = torch.zeros_like(values[:, 0])
    T = values.shape[1]
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(values[:, 0])
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last_gae = (delta + gamma * lam * last_gae) * mask[:, t]
        advantages[:, t] = last_gae
    return advantages, (advantages + values) * mask


def policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, clip_range: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Clipped surrogate. Returns ``(loss, clipfrac, approx_kl)``; approx_kl is the k3 estimate of
    KL(old || new), which SB3 and cleanrl compute for early stopping (TRL logs 0.5 * log(ratio)^2)."""
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_range, 1 + clip_range)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    clipfrac = masked_mean((clipped > unclipped).float(), mask)
    approx_kl = masked_mean((ratio - 1) - log_ratio, mask)
    return loss, clipfrac, approx_kl


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_range_vf: float | None
) -> tuple[Tensor, Tensor]:
    """0.5 * max((v - R)^2, (clip(v, old ± eps) - R)^2), masked mean. Returns ``(loss, clipfrac)``."""
    unclipped = (values - returns) ** 2
    if clip_range_vf is None:
        return 0.5 * masked_mean(unclipped, mask), torch.zeros((), dtype=values.dtype)
    clipped_values = old_values + (values - old_values).clamp(-clip_range_vf, clip_range_vf)
    clipped = (clipped_values - returns) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), mask)
    return loss, masked_mean((clipped > unclipped).float(), mask)


@dataclass
class AdaptiveKLController:
    """Ziegler et al. 2019, section 2.2: ``kl_coef *= 1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon``."""

    kl_coef: float = 0.05
    target: float = 6.0
    horizon: int = 10_000

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1, -0.2), 0.2)
        self.kl_coef *= 1 + error * n_steps / self.horizon


@dataclass
class FixedKLController:
    kl_coef: float = 0.05

    def update(self, current_kl: float, n_steps: int) -> None:
        pass
