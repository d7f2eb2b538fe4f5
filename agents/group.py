"""What the critic-free agents (GRPO, RLOO) share on top of :class:`~textgym.agents.base.LMAgent`: groups of
``num_generations`` completions per prompt, a sequence-level advantage per completion, and an update of
``num_iterations`` passes over the batch in ``steps_per_generation`` optimizer steps each.

A subclass says how advantages come from the scores (:meth:`GroupAgent.advantages`) and what the loss of a
micro-batch is (:meth:`GroupAgent.loss`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from textgym.agents.base import LMAgent
from textgym.agents.lm_config import LMAgentConfig, check_number, check_positive_int
from textgym.agents.rollout_batch import RolloutBatch
from textgym.config import iteration_seed
from textgym.errors import ConfigError, user_stacklevel


@dataclass
class GroupConfig(LMAgentConfig):
    num_generations: int = 8
    """Completions per prompt (G): the group an advantage is relative to. num_envs must be a multiple."""
    beta: float = 0.0
    """KL coefficient (0: no reference model is loaded at all)."""
    epsilon: float = 0.2
    """Lower clipping bound of the importance ratio: 1 - epsilon."""
    epsilon_high: float | None = None
    """Upper clipping bound: 1 + epsilon_high (None: epsilon). Above epsilon = DAPO's clip-higher."""
    num_iterations: int = 1
    """Passes over each batch (mu in the GRPO paper); beyond 1 the importance ratio matters."""
    steps_per_generation: int = 1
    """Optimizer steps per pass: the batch is split into this many minibatches of whole sequences (their
    sizes differ by one at most where it does not divide the batch). At most the batch's episodes."""
    mask_truncated_completions: bool = False
    """Leave completions cut at max_new_tokens (no EOS) out of the loss (DAPO)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_iterations", "steps_per_generation"):
            check_positive_int(name, getattr(self, name))
        g = self.num_generations
        if isinstance(g, bool) or not isinstance(g, int) or g < 2:
            raise ConfigError(
                f"num_generations must be an integer >= 2 (a group needs a baseline from other completions of "
                f"its prompt), not {g!r}."
            )
        if not isinstance(self.beta, (int, float)) or not 0 <= self.beta < math.inf:
            raise ConfigError(f"beta must be a number >= 0, not {self.beta!r}.")
        if not isinstance(self.epsilon, (int, float)) or not 0 < self.epsilon < 1:
            raise ConfigError(f"epsilon must be in (0, 1), not {self.epsilon!r}.")
        # None stays None, and follows epsilon: a load that overrides epsilon moves both bounds
        check_number("epsilon_high", self.epsilon_high, none_ok=True)
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ConfigError(
                f"epsilon_high must be >= epsilon ({self.epsilon}) (clip-higher widens the upper bound), "
                f"not {self.epsilon_high!r}."
            )

    @property
    def clip_high(self) -> float:
        """The upper clipping bound's epsilon: ``epsilon_high``, or ``epsilon`` where it is unset."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


@dataclass
class GroupBatch(RolloutBatch):
    """A :class:`RolloutBatch` with one advantage per completion and the loss mask."""

    advantages: torch.Tensor | None = None  # (N,)
    loss_mask: torch.Tensor | None = None  # (N, T): action_mask, without truncated completions if asked


class GroupAgent(LMAgent):
    """Base of the group-relative agents; see the module docstring."""

    config_class = GroupConfig
    minibatch_knob = "steps_per_generation"

    @property
    def uses_reference(self) -> bool:
        return self.config.beta != 0

    @property
    def group_size(self) -> int:
        return self.config.num_generations

    def advantages(
        self, scores: torch.Tensor, kl: torch.Tensor | None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """One advantage per completion (N,) from the scores and, with a reference, the KL per completion,
        over the whole batch of every process (as TRL computes them on gathered rewards); and statistics."""
        raise NotImplementedError

    def loss(
        self, mb: GroupBatch, logprobs: torch.Tensor, totals: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """The loss of micro-batch ``mb`` (its share of the optimizer step's, see ``totals``) and statistics
        as (sum, count) pairs, averaged over the update. Keep them tensors (``x.sum()``, not ``float(...)``):
        they are read once, when the update ends, not once per micro-batch (each read waits for the GPU)."""
        raise NotImplementedError

    def collect_rollouts(self) -> GroupBatch:
        batch, _ = self.generate()
        return self.process(batch)

    def process(self, batch: RolloutBatch) -> GroupBatch:
        """Advantages and the loss mask for ``batch`` (this process's rows; statistics such as a batch std
        are over every process's rows)."""
        d = self.dist
        kl = None
        if batch.ref_logprobs is not None:
            mask = batch.action_mask  # the agent's tokens (a multi-turn episode's replies are not actions)
            kl = d.gather(((batch.logprobs - batch.ref_logprobs) * mask).sum(1))  # (N_all,) k1
        advantages, stats = self.advantages(d.gather(batch.scores), kl)
        n = len(batch)
        advantages = advantages[d.rank * n : (d.rank + 1) * n]  # this process's rows
        loss_mask = batch.action_mask.clone()  # environment tokens are not actions
        if self.config.mask_truncated_completions:
            loss_mask[batch.truncated] = 0
        fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(RolloutBatch)}
        b = GroupBatch(**fields, advantages=advantages, loss_mask=loss_mask)
        b.stats.update(stats)
        self._warn_if_flat(stats.get("frac_reward_zero_std"))
        return b

    FLAT_ITERATIONS = 3  # iterations in a row without a reward difference in any group before a warning

    def _warn_if_flat(self, zero_std_share: float | None) -> None:
        """Warn once when no group's completions have told apart for FLAT_ITERATIONS iterations in a row:
        every advantage is 0, so the reward teaches nothing (a logged 1.0 is easy to miss). The iterations
        before this one are the history's (a loaded agent's too)."""
        n = self.FLAT_ITERATIONS
        shares = [h.get("frac_reward_zero_std") for h in self.history[-n:]] + [zero_std_share]
        # on the iteration that makes n in a row: the one before them told groups apart, or there was none
        if shares[-n:] == [1.0] * n and (len(shares) == n or shares[-n - 1] != 1.0) and self.dist.is_main:
            warnings.warn(
                f"{self.name}: in each of the last {self.FLAT_ITERATIONS} iterations, every group of "
                f"{self.group_size} completions of a prompt got equal rewards (frac_reward_zero_std = 1), so "
                f"{self._flat_advantages()} Give a reward that tells completions "
                f"apart (partial credit rather than all-or-nothing), or raise num_generations or the "
                f"temperature.",
                stacklevel=user_stacklevel(),
            )

    def _flat_advantages(self) -> str:
        """What equal rewards in every group leave of the advantages (the flat-reward warning's words)."""
        return "every advantage was 0 and the reward taught nothing."

    def train(self, batch: GroupBatch) -> dict[str, float]:
        c = self.config
        n = len(batch)
        generator = torch.Generator().manual_seed(iteration_seed(self.seed, self.iteration))
        # statistics stay tensors on the device until the update ends: no host read per micro-batch
        sums: dict[str, list[torch.Tensor | float]] = {}

        def add(name: str, total: torch.Tensor | float, count: torch.Tensor | float) -> None:
            acc = sums.setdefault(name, [0.0, 0.0])
            acc[0] = acc[0] + total
            acc[1] = acc[1] + count

        # one optimizer step on the batch: the policy is the one that sampled it, and the ratio is exactly 1
        # with the update's own log-probs (TRL's rule). The rollout's agree only up to rounding: on a GPU a
        # kernel for another batch shape rounds otherwise, and RLOO's sequence ratio sums that over tokens
        on_policy = c.num_iterations == 1 and c.steps_per_generation == 1
        for _ in range(c.num_iterations):
            for mb_inds in torch.randperm(n, generator=generator).tensor_split(c.steps_per_generation):
                self.optimizer.zero_grad()
                micros = mb_inds.split(c.micro_batch_size or len(mb_inds))
                totals = {  # the optimizer step's totals over every process, for global normalisers
                    "num_sequences": int(self.dist.sum(len(mb_inds))),
                    "num_tokens": self.dist.sum(batch.loss_mask[mb_inds].sum()).float(),
                    "num_micro_batches": len(micros),
                    "max_completion_length": batch.response_ids.shape[1],
                    "world": self.dist.world,
                }
                for k, micro_inds in enumerate(micros):
                    mb = batch.select(micro_inds)
                    with self.accumulating(last=k == len(micros) - 1):
                        logprobs, entropy, _ = self.policy_logprobs(mb)
                        if on_policy:
                            mb.logprobs = logprobs.detach()
                        loss, stats = self.loss(mb, logprobs, totals)
                        self.backward(loss)
                    # over the tokens in the loss, as TRL (mask_truncated_completions leaves some out)
                    mask = mb.loss_mask.to(entropy.device).float()
                    add("entropy", (entropy.detach() * mask).sum(), mask.sum())
                    add("loss", loss.detach(), k == len(micros) - 1)  # per step: its micro-batches' sum
                    for name, (total, count) in stats.items():
                        add(name, total, count)
                self.optimizer_step()
        totals = {name: (float(self.dist.sum(t)), float(self.dist.sum(c))) for name, (t, c) in sums.items()}
        return {name: t / c if c else math.nan for name, (t, c) in totals.items()}
