"""``GRPO``: group-relative policy optimisation (Shao et al. 2024) with the loss variants of its successors.

Each prompt gets ``num_generations`` completions; a completion's advantage is its score minus its group's
mean, scaled by ``scale_rewards``; every token of the completion carries that advantage into a clipped
surrogate (clip-higher with ``epsilon_high``), plus ``beta`` times the k3 KL to the reference, reduced as
``loss_type`` says. Hyperparameters keep the names of TRL's ``GRPOTrainer``; ``max_completion_length`` is the
env's ``max_new_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from textgym.agents.group import GroupAgent, GroupBatch, GroupConfig
from textgym.agents.group_core import (
    LOSS_TYPES,
    SCALE_REWARDS,
    aggregate_loss,
    clipped_surrogate,
    group_advantages,
    zero_std_share,
)
from textgym.agents.ppo_core import k3_kl
from textgym.errors import ConfigError


@dataclass
class GRPOConfig(GroupConfig):
    learning_rate: float = 1e-6
    """AdamW learning rate (TRL's default)."""
    scale_rewards: str = "group"
    """Divide the centred rewards by the group's std ("group"), the batch's ("batch", PPO-lite) or not at
    all ("none", Dr. GRPO)."""
    loss_type: str = "dapo"
    """"grpo" (mean per sequence, then over sequences), "dr_grpo" (sum / (sequences x max length)), "dapo"
    (mean over all tokens of the optimizer step), "bnpo" (mean over the tokens of each micro-batch)."""

    def __post_init__(self) -> None:
        if isinstance(self.scale_rewards, bool):  # TRL takes true for "group" and false for "none"
            raise ConfigError(
                f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, not {str(self.scale_rewards).lower()}: "
                f"TRL's {str(self.scale_rewards).lower()} is {'group' if self.scale_rewards else 'none'!r} here."
            )
        super().__post_init__()
        if self.scale_rewards not in SCALE_REWARDS:
            raise ConfigError(
                f"scale_rewards must be one of {', '.join(SCALE_REWARDS)}, not {self.scale_rewards!r}."
            )
        if self.loss_type not in LOSS_TYPES:
            raise ConfigError(f"loss_type must be one of {', '.join(LOSS_TYPES)}, not {self.loss_type!r}.")


class GRPO(GroupAgent):
    """GRPO for a causal language model on a :class:`~textgym.envs.TextGenVectorEnv`.

    Args: as :class:`~textgym.agents.base.LMAgent`; hyperparameters are the fields of :class:`GRPOConfig`.
    """

    config_class = GRPOConfig
    name = "grpo"

    def advantages(
        self, scores: torch.Tensor, kl: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        advantages, _ = group_advantages(scores, self.group_size, self.config.scale_rewards)
        # as TRL: of the scores the advantages are computed from (after score shaping)
        return advantages, {"frac_reward_zero_std": zero_std_share(scores, self.group_size)}

    def loss(
        self, mb: GroupBatch, logprobs: torch.Tensor, totals: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        c = self.config
        mask = mb.loss_mask.to(logprobs.device).float()
        per_token, low, high = clipped_surrogate(
            logprobs - mb.logprobs.to(logprobs.device),
            mb.advantages.to(logprobs.device),
            c.epsilon,
            c.clip_high,
        )
        stats = {}
        if c.beta:
            ref = mb.ref_logprobs.to(logprobs.device)  # 0 past a completion's end, where the policy's
            # log-prob of the pad token may be below -88.7 and exp(ref - logp) overflow: there d = 0 instead
            kl = k3_kl(torch.where(mask.bool(), logprobs, ref), ref)
            per_token = per_token + c.beta * kl
            stats["kl_k3_per_token"] = ((kl.detach() * mask).sum(), mask.sum())
        loss = aggregate_loss(
            per_token,
            mask,
            c.loss_type,
            totals["max_completion_length"],
            num_sequences=totals["num_sequences"],
            num_tokens=totals["num_tokens"],
        )
        if c.loss_type == "bnpo":  # each micro-batch's own token mean, averaged over the step's micro-batches
            loss = loss / totals["num_micro_batches"]
        else:  # a global normaliser: x world size, as data-parallel training averages the processes' gradients
            loss = loss * totals["world"]
        tokens, counted = mask.sum(), mask.bool()
        stats["clip_ratio/low_mean"] = ((low & counted).sum(), tokens)
        stats["clip_ratio/high_mean"] = ((high & counted).sum(), tokens)
        stats["clip_ratio/region_mean"] = (((low | high) & counted).sum(), tokens)
        return loss, stats
