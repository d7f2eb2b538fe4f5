"""``RLOO``: REINFORCE with a leave-one-out baseline (Kool et al. 2019; Ahmadian et al. 2024).

Each prompt gets ``num_generations`` completions. A completion's reward is its score minus ``beta`` times its
KL to the reference (summed over its tokens, in the reward, not in the loss); its advantage is that reward
minus the mean reward of the other completions of its prompt. The whole completion is one action: the
importance ratio is taken over the sequence and clipped. Hyperparameters keep the names of TRL's
``RLOOTrainer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from textgym.agents.group import GroupAgent, GroupBatch, GroupConfig
from textgym.agents.group_core import (
    leave_one_out_advantages,
    normalize,
    sequence_clipped_surrogate,
    zero_std_share,
)


@dataclass
class RLOOConfig(GroupConfig):
    learning_rate: float = 1e-6
    """AdamW learning rate (TRL's default)."""
    num_generations: int = 2
    """Completions per prompt (TRL's default is 2: the smallest group with a leave-one-out baseline)."""
    beta: float = 0.05
    """Coefficient of the sequence-level KL penalty in the reward (0: no reference model is loaded)."""
    normalize_advantages: bool = False
    """Standardise the advantages over the batch."""


class RLOO(GroupAgent):
    """RLOO for a causal language model on a :class:`~textgym.envs.TextGenVectorEnv`.

    Args: as :class:`~textgym.agents.base.LMAgent`; hyperparameters are the fields of :class:`RLOOConfig`.
    """

    config_class = RLOOConfig
    name = "rloo"

    def advantages(
        self, scores: torch.Tensor, kl: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        c = self.config
        rewards = scores
        stats = {}
        if c.beta:
            rewards = rewards - c.beta * kl  # the KL per completion (k1 over its agent tokens) in the reward
            stats["rlhf_reward"] = float(rewards.mean())
        # of the scores, before the KL penalty (TRL's is after it): it says whether the reward told a group's
        # completions apart. At the start the policy is its reference and the KL is float noise, which made
        # groups the reward never told apart count as told apart (and the flat-reward warning never came)
        stats["frac_reward_zero_std"] = zero_std_share(scores, self.group_size)
        advantages = leave_one_out_advantages(rewards, self.group_size)
        if c.normalize_advantages:
            advantages = normalize(advantages)
        return advantages, stats

    def _flat_advantages(self) -> str:
        if not self.config.beta:
            return super()._flat_advantages()
        return (
            f"the reward taught nothing: the advantages came from the KL penalty alone (beta = "
            f"{self.config.beta}), which only pulls the policy toward its reference."
        )

    def loss(
        self, mb: GroupBatch, logprobs: torch.Tensor, totals: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        c = self.config
        device = logprobs.device
        mask = mb.loss_mask.to(device).float()
        per_sequence, low, high = sequence_clipped_surrogate(
            logprobs, mb.logprobs.to(device), mask, mb.advantages.to(device), c.epsilon, c.clip_high
        )
        counted = mask.sum(-1) > 0  # a masked (truncated) completion takes no part
        loss = (per_sequence * counted).sum() / totals["num_sequences"] * totals["world"]
        n = counted.sum()
        stats = {
            "clip_ratio/low_mean": ((low & counted).sum(), n),
            "clip_ratio/high_mean": ((high & counted).sum(), n),
            "clip_ratio/region_mean": (((low | high) & counted).sum(), n),
        }
        return loss, stats
