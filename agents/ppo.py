"""``LMPPO``: PPO with a causal-LM policy and a value head, stepping ``TextGenVectorEnv`` token by token.

What it adds to :class:`~textgym.agents.base.LMAgent` is the value head, GAE and the PPO losses. One
iteration, in the order the code runs (the math is in ``ppo_core``, each piece tested on its own): rollout
through the env with a KV cache, keeping each token's log-prob and the hidden state for the value head ->
reference log-probs in one forward over the finished sequences -> score shaping -> per-token KL penalty plus
score on the last token -> GAE -> whitened advantages -> PPO epochs over minibatches of whole sequences
(micro-batches with gradient accumulation) -> KL controller update.

One callback step is one PPO iteration (a batch of episodes); ``num_timesteps`` counts generated tokens,
since one token is one env step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from textgym.agents.base import LMAgent
from textgym.agents.distributed import masked_whiten
from textgym.agents.lm_config import LMAgentConfig, check_number, check_positive_int
from textgym.agents.ppo_core import (
    AdaptiveKLController,
    FixedKLController,
    agent_first_order,
    entropy_from_logits,
    gae,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    per_token_rewards,
    policy_loss,
    turn_rewards_at,
    value_loss,
)
from textgym.agents.rollout_batch import RolloutBatch, masked_token_mean
from textgym.config import iteration_seed
from textgym.conversation import AGENT_ROLE
from textgym.errors import ConfigError


@dataclass
class LMPPOConfig(LMAgentConfig):
    n_epochs: int = 4
    """PPO epochs over each batch of episodes."""
    n_minibatches: int = 1
    """Minibatches of whole sequences per epoch (one optimizer step each; their sizes differ by one at most
    where it does not divide the batch). At most the batch's episodes (num_envs)."""
    gamma: float = 1.0
    """Discount over tokens."""
    gae_lambda: float = 0.95
    """GAE lambda."""
    clip_range: float = 0.2
    """PPO ratio clipping."""
    clip_range_vf: float | None = 0.2
    """Value clipping around the rollout values (None: no clipping)."""
    vf_coef: float = 0.1
    """Weight of the value loss."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus."""
    target_kl: float | None = None
    """Stop an update's epochs early when an epoch's k3 approx-KL exceeds 1.5 x this (SB3's threshold; SB3
    checks it every minibatch)."""
    kl_coef: float = 0.05
    """Initial (or fixed) coefficient of the per-token KL penalty."""
    kl_target: float | None = None
    """With a target (nats per sequence), the coefficient adapts (Ziegler et al. 2019); None: fixed."""
    kl_horizon: int = 10_000
    """Horizon of the adaptive KL controller, in episodes."""
    kl_estimator: str = "k1"
    """"k1" (log-ratio) or "k3" (unbiased, non-negative)."""
    whiten_rewards: bool = False
    """Whiten the per-token rewards (scale only, the mean is kept)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("n_epochs", "n_minibatches"):
            check_positive_int(name, getattr(self, name))
        if self.kl_estimator not in ("k1", "k3"):
            raise ConfigError(f"kl_estimator must be 'k1' or 'k3', not {self.kl_estimator!r}.")
        check_number("clip_range", self.clip_range, above=0, inf_ok=True)  # inf: no clipping
        check_number("kl_coef", self.kl_coef, at_least=0)
        check_number("gamma", self.gamma, at_least=0, at_most=1)
        check_number("gae_lambda", self.gae_lambda, at_least=0, at_most=1)
        check_number("clip_range_vf", self.clip_range_vf, above=0, none_ok=True)
        check_number("vf_coef", self.vf_coef, at_least=0)
        check_number("ent_coef", self.ent_coef)
        check_number("target_kl", self.target_kl, above=0, none_ok=True)
        check_number("kl_target", self.kl_target, above=0, none_ok=True)
        check_positive_int("kl_horizon", self.kl_horizon)


class ValueHead(nn.Module):
    """``Linear(hidden, 1)``, zero-initialised so that early values do not add noise to the advantages."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden.to(self.linear.weight.dtype)).squeeze(-1)


@dataclass
class PPOBatch(RolloutBatch):
    """A :class:`RolloutBatch` with what the PPO update needs, all (N, T)."""

    values: torch.Tensor | None = None  # value-head outputs at rollout time
    advantages: torch.Tensor | None = None  # GAE, whitened
    returns: torch.Tensor | None = None  # GAE returns (value targets)


class LMPPO(LMAgent):
    """PPO for a causal language model on a :class:`~textgym.envs.TextGenVectorEnv`.

    Args:
        policy: a zoo name or model directory (then also the reference, reloadable from the name), or a
            causal-LM model object.
        env: a ``TextGenVectorEnv`` with ``autoreset_mode="Disabled"`` whose tokenizer matches the policy.
            Optional for inference (``predict``).
        **hyperparameters: fields of :class:`LMPPOConfig`.
    """

    config_class = LMPPOConfig
    name = "lmppo"
    minibatch_knob = "n_minibatches"

    def __init__(self, policy: Any, env: Any = None, **hyperparameters: Any):
        super().__init__(policy, env, **hyperparameters)
        c = self.config
        self.kl_ctl = (
            AdaptiveKLController(c.kl_coef, c.kl_target, c.kl_horizon)
            if c.kl_target
            else FixedKLController(c.kl_coef)
        )

    def build_modules(self, model: Any) -> dict[str, nn.Module]:
        return {"value_head": ValueHead(model.config.hidden_size)}

    @property
    def value_head(self) -> nn.Module:
        return self.modules["value_head"]

    def extra_state(self) -> dict[str, Any]:
        return {"kl_coef": self.kl_ctl.kl_coef}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        if "kl_coef" in state:  # else load(..., kl_coef=...) gave a new one
            self.kl_ctl.kl_coef = state["kl_coef"]

    def collect_rollouts(self) -> PPOBatch:
        """Generate one episode per sub-env and compute everything the update needs."""
        batch, hidden = self.generate(keep_hidden=True)
        return self.process(batch, hidden)

    def process(self, batch: RolloutBatch, hidden: torch.Tensor | None = None) -> PPOBatch:
        """Values, per-token rewards, GAE and whitened advantages for ``batch`` (this process's rows;
        whitening is over every process's). ``hidden``: the rollout's last hidden states, recomputed if None."""
        c = self.config
        mask = batch.action_mask.float()  # agent tokens: a multi-turn episode's replies are observations
        with torch.no_grad(), self.autocast():  # the values in the precision that training computes them in
            if hidden is None:
                _, hidden = self.forward(self.rollout_model, batch, hidden=True)
            values = self.unwrap(self.value_head)(hidden.to(self.device)).float().cpu() * mask
        # KL, score and GAE over each row's agent tokens compacted to the front (identity without replies)
        order = agent_first_order(mask)
        compact = lambda x: x.gather(1, order)  # noqa: E731
        turns = self.turn_rewards(batch)
        rewards, kl = per_token_rewards(
            batch.scores - turns.sum(1), compact(batch.logprobs), compact(batch.ref_logprobs), compact(mask),
            self.kl_ctl.kl_coef, c.kl_estimator,
        )  # fmt: skip
        rewards = rewards + compact(turns)
        if c.whiten_rewards:
            rewards = masked_whiten(rewards, compact(mask), self.dist, shift_mean=False)
        advantages, returns = gae(rewards, compact(values), compact(mask), c.gamma, c.gae_lambda)
        advantages, returns = (torch.zeros_like(mask).scatter(1, order, x) for x in (advantages, returns))
        fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(RolloutBatch)}
        b = PPOBatch(
            **fields, values=values, advantages=masked_whiten(advantages, mask, self.dist), returns=returns
        )
        kl_per_episode = self.dist.gather(kl.sum(1))
        scores = self.dist.gather(batch.scores)
        b.stats.update(
            {
                "objective/scores": float(self.dist.gather(batch.raw_scores).mean()),
                "objective/kl": float(kl_per_episode.mean()),
                "objective/non_score_reward": float((-self.kl_ctl.kl_coef * kl_per_episode).mean()),
                "objective/rlhf_reward": float((scores - self.kl_ctl.kl_coef * kl_per_episode).mean()),
                "objective/kl_coef": float(self.kl_ctl.kl_coef),
            }
        )
        return b

    def turn_rewards(self, batch: RolloutBatch) -> torch.Tensor:
        """(N, T): a multi-turn episode's turn rewards on the last agent token of the turn that earned each,
        scaled as its score is (``score_scale``, and the running std under ``score_norm``). :meth:`process`
        puts the rest of the shaped score on the episode's last agent token, so the score rewards of an
        episode still sum to its shaped score; only where they are earned changes (zeros: one turn)."""
        turns = [e.get("turn_rewards") or [] for e in batch.episodes]
        if not any(turns):
            return torch.zeros(batch.action_mask.shape)
        tokens = [
            [t["tokens"] for t in e.get("turns", ()) if t["role"] == AGENT_ROLE] for e in batch.episodes
        ]
        scale = self.config.score_scale / (self.score_moments.std if self.config.score_norm else 1.0)
        return turn_rewards_at(batch.action_mask, turns, tokens) * scale

    def train(self, batch: PPOBatch) -> dict[str, float]:
        """PPO epochs over minibatches of whole sequences; micro-batches accumulate gradients weighted by
        their share of the minibatch's tokens, so the result equals one forward over the minibatch."""
        c = self.config
        n = len(batch)
        generator = torch.Generator().manual_seed(iteration_seed(self.seed, self.iteration))
        # each micro-batch's token means, times its tokens: the update's statistics are means over all tokens
        logs: dict[str, list[torch.Tensor]] = {
            k: [] for k in ("pg", "vf", "clip", "vfclip", "approxkl", "approxkl_trl", "ent", "tokens")
        }
        minibatch_ratios = []  # (sum of ratios, tokens) per minibatch: val/ratio and TRL's val/ratio_var
        for _ in range(c.n_epochs):
            epoch_start = len(logs["approxkl"])  # this epoch's approx-KLs follow
            for mb_inds in torch.randperm(n, generator=generator).tensor_split(c.n_minibatches):
                self.optimizer.zero_grad()
                # the minibatch's tokens on every process: each micro-batch's loss is its share of their mean
                mb_tokens = self.dist.sum(batch.action_mask[mb_inds].sum()).clamp(min=1).float()
                micros = mb_inds.split(c.micro_batch_size or len(mb_inds))
                ratio_sum = torch.zeros(2, dtype=torch.float64, device=self.device)
                for k, micro_inds in enumerate(micros):
                    mb = batch.select(micro_inds)
                    mask = mb.action_mask.to(self.device)  # no loss on environment tokens
                    with self.accumulating(last=k == len(micros) - 1):
                        with self.autocast():
                            logits, hidden = self.forward(self.policy, mb, hidden=True)
                            values = self.value_head(hidden).float()
                        logprobs = logprobs_from_logits(
                            logits, mb.response_ids.to(self.device), c.temperature
                        )
                        old = {
                            k: getattr(mb, k).to(self.device)
                            for k in ("logprobs", "values", "advantages", "returns")
                        }
                        pg_loss, clipfrac, approx_kl = policy_loss(
                            logprobs, old["logprobs"], old["advantages"], mask, c.clip_range
                        )
                        vf_loss, vf_clipfrac = value_loss(
                            values, old["values"], old["returns"], mask, c.clip_range_vf
                        )
                        # Without an entropy bonus the entropy is only logged: keep its (N, T, V) graph out of backward.
                        with torch.set_grad_enabled(c.ent_coef != 0):
                            entropy = masked_mean(entropy_from_logits(logits, c.temperature), mask)
                        loss = pg_loss + c.vf_coef * vf_loss - c.ent_coef * entropy
                        # x world size: data-parallel training averages the processes' gradients
                        self.backward(loss * mask.sum() / mb_tokens.to(loss.device) * self.dist.world)
                    # statistics stay tensors on the device until the update ends: no host read per micro-batch
                    with torch.no_grad():
                        log_ratio = logprobs - old["logprobs"]
                        ratio_sum += torch.stack([(log_ratio.exp() * mask).sum(), mask.sum()]).double()
                        approx_kl_trl = masked_mean(0.5 * log_ratio.square(), mask)  # TRL's approxkl
                    tokens = mask.sum().double()
                    for key, value in zip(
                        ("pg", "vf", "clip", "vfclip", "approxkl", "approxkl_trl", "ent"),
                        (pg_loss, vf_loss, clipfrac, vf_clipfrac, approx_kl, approx_kl_trl, entropy),
                    ):
                        logs[key].append(value.detach().double() * tokens)
                    logs["tokens"].append(tokens)
                self.optimizer_step()
                minibatch_ratios.append(ratio_sum)
            # the epoch's approx-KL over every process's tokens: the processes stop the epochs together (one
            # host read per epoch, with a target only)
            if c.target_kl is not None:
                epoch = [torch.stack(logs[k][epoch_start:]).sum() for k in ("approxkl", "tokens")]
                kl, tokens = self.dist.sum(torch.stack(epoch)).tolist()
                if kl / max(tokens, 1.0) > 1.5 * c.target_kl:
                    break
        self.kl_ctl.update(batch.stats["objective/kl"], n * self.dist.world)
        mask = batch.action_mask.float()
        var_returns = masked_var(self.dist.gather(batch.returns), self.dist.gather(mask))
        residual = masked_var(self.dist.gather(batch.returns - batch.values), self.dist.gather(mask))
        sums = self.dist.sum(torch.stack([torch.stack(v).sum() for v in logs.values()])).tolist()
        means = {k: total / max(sums[-1], 1.0) for k, total in zip(logs, sums)}
        # val/ratio: the mean ratio over every process's tokens; TRL's val/ratio_var: the variance of the
        # minibatches' mean ratios (TRL's micro-batches'; the same without gradient accumulation)
        per_minibatch = self.dist.sum(torch.stack(minibatch_ratios)).cpu()
        minibatch_means = per_minibatch[:, 0] / per_minibatch[:, 1].clamp(min=1)
        # TRL's objective/entropy: minus the log-probs of the sampled tokens, summed per completion
        sampled_entropy = self.dist.gather((-batch.logprobs * mask).sum(1)).mean()
        return {
            "entropy": means["ent"],
            "loss/policy_avg": means["pg"],
            "loss/value_avg": means["vf"],
            "policy/clipfrac_avg": means["clip"],
            "val/clipfrac_avg": means["vfclip"],
            "policy/approxkl_avg": means["approxkl_trl"],
            "policy/approxkl_k3": means["approxkl"],
            "policy/entropy_avg": means["ent"],
            "objective/entropy": float(sampled_entropy),
            "val/ratio": float(per_minibatch[:, 0].sum() / per_minibatch[:, 1].sum().clamp(min=1)),
            "val/ratio_var": float(minibatch_means.var()) if len(minibatch_means) > 1 else 0.0,
            "val/var_explained": float(1 - residual / var_returns) if var_returns > 0 else 0.0,
            "val/mean": masked_token_mean(self.dist.gather(batch.values), self.dist.gather(mask)),
        }
