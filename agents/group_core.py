"""Critic-free agents' pieces as small pure functions, each with its own analytic test.

A batch holds B = num_prompts * G completions, the G completions of a prompt in consecutive rows. Sequence
tensors are (B,); per-token tensors are (B, T) with ``mask`` 1 on the tokens that count in the loss.
References: Shao et al. 2024 (GRPO); Liu et al. 2025 (Dr. GRPO: no std scaling, constant normaliser);
Yu et al. 2025 (DAPO: clip-higher, token-level normalisation); Kool et al. 2019 and Ahmadian et al. 2024
(RLOO's leave-one-out baseline). ``loss_type`` names follow TRL's ``GRPOTrainer``; the k3 estimator of the
KL is :func:`textgym.agents.ppo_core.k3_kl`, shared with LMPPO.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor

SCALE_REWARDS = ("group", "batch", "none")
LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo")
STD_EPS = 1e-4  # added to the std, as TRL does, so a group of equal rewards gives 0, never NaN


def _std(x: Tensor, dim: int | None = None) -> Tensor:
    """Standard deviation with Bessel's correction; 0 for a single element."""
    n = x.numel() if dim is None else x.shape[dim]
    if n < 2:
        return torch.zeros_like(x.mean() if dim is None else x.mean(dim))
    return x.std() if dim is None else x.std(dim)


def group_advantages(rewards: Tensor, group_size: int, scale: str = "group") -> tuple[Tensor, Tensor]:
    """GRPO's advantages: each reward minus its group's mean, divided by a std (``scale``):
    ``"group"`` the group's std, ``"batch"`` the whole batch's std, ``"none"`` no scaling (Dr. GRPO).

    Returns ``(advantages (B,), group_std (B,))``; the group std (whatever ``scale``) tells which groups had
    no reward variance (``frac_reward_zero_std``)."""
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, not {scale!r}.")
    # float64, and exactly 0 for a group of equal rewards: a float32 mean of eight 77.7s is a few ulps off
    # 77.7, and divided by std + 1e-4 that gave every completion of the group an advantage of -0.076
    x = rewards.double()
    grouped = x.view(-1, group_size)  # (num_prompts, G)
    equal = grouped.max(1, keepdim=True).values == grouped.min(1, keepdim=True).values
    centred = torch.where(equal, 0.0, grouped - grouped.mean(1, keepdim=True)).reshape(-1)
    group_std = _std(grouped, 1).repeat_interleave(group_size)
    if scale == "group":
        advantages = centred / (group_std + STD_EPS)
    elif scale == "batch":
        advantages = centred / (_std(x) + STD_EPS)
    else:
        advantages = centred
    return advantages.to(rewards.dtype), group_std.to(rewards.dtype)


def zero_std_share(rewards: Tensor, group_size: int) -> float:
    """The share of groups whose rewards are all equal (``frac_reward_zero_std``): no learning signal."""
    grouped = rewards.view(-1, group_size)
    return float((grouped.max(1).values == grouped.min(1).values).double().mean())


def leave_one_out_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """RLOO: each reward minus the mean of the other G - 1 rewards of its group (needs G >= 2)."""
    if group_size < 2:  # no other reward to take the mean of: a division by zero, NaN advantages
        raise ValueError(f"leave_one_out_advantages needs a group_size of at least 2, not {group_size}.")
    grouped = rewards.double().view(-1, group_size)  # float64, as group_advantages
    baseline = (grouped.sum(1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - baseline).reshape(-1).to(rewards.dtype)


def normalize(x: Tensor) -> Tensor:
    """(x - mean) / (std + eps) over the batch (in float64; 0 where every x is equal, as in
    :func:`group_advantages`, without reading the comparison on the host)."""
    d = x.double()
    centred = torch.where(d.max() == d.min(), 0.0, d - d.mean())
    return (centred / (_std(d) + STD_EPS)).to(x.dtype)


def clipped_surrogate(
    log_ratio: Tensor, advantages: Tensor, epsilon: float, epsilon_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token clipped surrogate ``-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)`` with a sequence's
    advantage on each of its tokens (clip-higher when epsilon_high > epsilon, DAPO).

    Args:
        log_ratio: (B, T) log pi - log pi_old per token.
        advantages: (B,) one per sequence.
    Returns:
        ``(per_token_loss (B, T), low_clipped (B, T), high_clipped (B, T))``: where the ratio was clipped
        below (with a negative advantage) or above (with a positive one).
    """
    ratio = log_ratio.exp()
    adv = advantages.unsqueeze(-1)  # (B, 1)
    clipped = ratio.clamp(1 - epsilon, 1 + epsilon_high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    low = (ratio < 1 - epsilon) & (adv < 0)
    high = (ratio > 1 + epsilon_high) & (adv > 0)
    return loss, low, high


def aggregate_loss(
    per_token_loss: Tensor,
    mask: Tensor,
    loss_type: str,
    max_completion_length: int,
    num_sequences: int | None = None,
    num_tokens: Tensor | float | None = None,
) -> Tensor:
    """Reduce a (B, T) per-token loss to a scalar, as ``loss_type`` says:

    - ``"grpo"``: mean over each sequence's tokens, then mean over sequences (length-biased);
    - ``"dr_grpo"``: sum over tokens / (sequences x ``max_completion_length``), a constant normaliser;
    - ``"dapo"``: sum over tokens / all tokens of the optimizer step's batch;
    - ``"bnpo"``: sum over tokens / the tokens of this (micro-)batch.

    ``num_sequences`` and ``num_tokens`` are the optimizer step's totals when this is one micro-batch of
    it (default: this batch's own), so micro-batches accumulate to the loss of the whole step.
    """
    mask = mask.to(per_token_loss.dtype)
    total = (per_token_loss * mask).sum()
    n_seq = per_token_loss.shape[0] if num_sequences is None else num_sequences
    if loss_type == "grpo":
        per_sequence = (per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_sequence.sum() / n_seq
    if loss_type == "dr_grpo":
        return total / (n_seq * max_completion_length)
    if loss_type == "dapo":
        tokens = mask.sum() if num_tokens is None else torch.as_tensor(num_tokens, dtype=total.dtype)
        return total / tokens.clamp(min=1)
    if loss_type == "bnpo":
        return total / mask.sum().clamp(min=1)
    raise ValueError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, not {loss_type!r}.")


def sequence_clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    mask: Tensor,
    advantages: Tensor,
    epsilon: float,
    epsilon_high: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """RLOO's update treats a whole completion as one action: the ratio is ``exp(sum_t log pi - log pi_old)``
    over the sequence's tokens. Returns ``(loss (B,), low_clipped (B,), high_clipped (B,))``."""
    log_ratio = ((logprobs - old_logprobs) * mask).sum(-1)  # (B,)
    loss, low, high = clipped_surrogate(log_ratio.unsqueeze(-1), advantages, epsilon, epsilon_high)
    return loss.squeeze(-1), low.squeeze(-1), high.squeeze(-1)
