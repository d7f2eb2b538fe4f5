"""The typed containers between an LM agent's stages: a batch of episodes, and running score moments."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from textgym.agents.ppo_core import masked_mean


@dataclass
class RunningMoments:
    """Running mean and variance of scores (Chan et al.'s parallel update), for ``score_norm``.

    ``var`` is the population variance of every score so far; ``std`` is the sample standard deviation
    (Bessel's correction, as TRL's ``RunningMoments``), which the first batches would otherwise understate.
    """

    count: float = 0.0
    mean: float = 0.0
    var: float = 1.0

    def update(self, x: torch.Tensor) -> None:
        n, mean, var = x.numel(), float(x.mean()), float(x.var(unbiased=False)) if x.numel() > 1 else 0.0
        total = self.count + n
        delta = mean - self.mean
        m2 = self.var * self.count + var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var, self.count = m2 / total, total

    @property
    def std(self) -> float:
        return math.sqrt(self.var * self.count / (self.count - 1)) if self.count > 1 and self.var > 0 else 1.0


@dataclass
class RolloutBatch:
    """One iteration's episodes: N rows (one per sub-env), T response positions.

    ``response_mask`` is 1 on the episode's tokens after the prompt (EOS included) and 0 after the episode
    ended: the attention mask of the response. ``action_mask`` is 1 on the agent's tokens only: in a
    multi-turn episode the environment's replies sit between the agent's turns and are observations, not
    actions, so the losses, the KL and the value targets use ``action_mask``. Without a responder both are
    equal. Subclasses add what their update needs (values, advantages, ...); :meth:`select` slices every
    tensor.
    """

    query_ids: torch.Tensor  # (N, P) left-padded prompts
    query_mask: torch.Tensor  # (N, P)
    response_ids: torch.Tensor  # (N, T)
    response_mask: torch.Tensor  # (N, T)
    logprobs: torch.Tensor  # (N, T) log p(token) at sampling time and temperature, 0 after the end
    ref_logprobs: torch.Tensor | None  # (N, T) under the reference, when the agent has one
    scores: torch.Tensor  # (N,) the training score: reward-stack total after score shaping
    raw_scores: torch.Tensor  # (N,) the reward-stack total
    truncated: torch.Tensor  # (N,) bool: cut at max_new_tokens without EOS
    action_mask: torch.Tensor | None = None  # (N, T) 1 on agent tokens; None: response_mask
    episodes: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)  # rollout-stage statistics

    def __post_init__(self) -> None:
        if self.action_mask is None and self.response_mask is not None:
            self.action_mask = self.response_mask

    def __len__(self) -> int:
        return len(self.response_ids)

    @classmethod
    def from_rollout(cls, r: Any) -> RolloutBatch:
        """A batch from :func:`textgym.sampling.rollout`'s result; ``scores`` are the raw totals until an
        agent shapes them."""
        raw = torch.as_tensor(np.asarray(r.scores, dtype=np.float64), dtype=torch.float32)
        return cls(
            query_ids=r.query_ids,
            query_mask=r.query_mask,
            response_ids=r.response_ids,
            response_mask=r.response_mask,
            logprobs=r.logprobs,
            ref_logprobs=None,
            scores=raw.clone(),
            raw_scores=raw,
            truncated=torch.tensor([e["finish_reason"] == "length" for e in r.infos], dtype=torch.bool),
            action_mask=getattr(r, "action_mask", None),
            episodes=r.infos,
        )

    def select(self, index: torch.Tensor) -> RolloutBatch:
        """The rows ``index`` of every tensor (episodes and stats are not carried)."""
        values = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            values[f.name] = value[index] if isinstance(value, torch.Tensor) else None
        values.update(episodes=[], stats={})
        return type(self)(**values)


def masked_token_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean of ``x`` over the masked positions, as a float (for statistics)."""
    return float(masked_mean(x.detach().float(), mask.float()))
