"""``LMPPO``: PPO with a causal-LM policy and a value head, stepping ``TextGenVectorEnv`` token by token.

A first, compact version of the agent: rollout through the env with a KV cache (log-probs and hidden
states kept from that pass), reference log-probs in one forward, per-token KL penalty plus score, GAE,
whitened advantages, clipped policy and value losses over minibatches of whole sequences, gradient
clipping, early stop on approx-KL. The update reads top to bottom; the math lives in ``ppo_core``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from textgym.agents.ppo_core import (
    AdaptiveKLController,
    FixedKLController,
    gae,
    logprobs_from_logits,
    masked_whiten,
    per_token_rewards,
    policy_loss,
    value_loss,
)
from textgym.envs import TextGenVectorEnv
from textgym.errors import ConfigError
from textgym.sampling import rollout


@dataclass
class LMPPOConfig:
    learning_rate: float = 1e-5
    """AdamW learning rate for the policy and the value head."""
    n_epochs: int = 4
    """PPO epochs over each batch of episodes."""
    n_minibatches: int = 1
    """Minibatches of whole sequences per epoch."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are taken at the same temperature everywhere."""
    gamma: float = 1.0
    gae_lambda: float = 0.95
    clip_range: float = 0.2
    clip_range_vf: float | None = 0.2
    vf_coef: float = 0.1
    max_grad_norm: float = 1.0
    target_kl: float | None = None
    """Stop the epochs of an update early when approx-KL exceeds 1.5 x this."""
    kl_coef: float = 0.05
    """Initial (or fixed) coefficient of the per-token KL penalty."""
    kl_target: float | None = None
    """With a target, the coefficient adapts (Ziegler et al. 2019); None keeps it fixed."""
    kl_horizon: int = 10_000
    kl_estimator: str = "k1"
    whiten_rewards: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature > 0:  # log-probs divide by it; greedy rollouts have no PPO ratio
            raise ConfigError(f"temperature must be > 0 for PPO, not {self.temperature!r}.")
        for name in ("n_epochs", "n_minibatches"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, not {getattr(self, name)!r}.")
        if self.kl_estimator not in ("k1", "k3"):
            raise ConfigError(f"kl_estimator must be 'k1' or 'k3', not {self.kl_estimator!r}.")


class ValueHead(nn.Module):
    """``Linear(hidden, 1)``, zero-initialised so that early values do not add noise to the advantages."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden).squeeze(-1)


class LMPPO:
    """PPO for a causal LM on a ``TextGenVectorEnv`` in ``"Disabled"`` autoreset mode."""

    def __init__(self, policy: Any, env: TextGenVectorEnv, **hyperparameters: Any):
        from textgym.models import load_model

        self.config = LMPPOConfig(**hyperparameters)
        self.env = env
        self.policy = load_model(policy)[0] if isinstance(policy, str) else policy
        self.policy.eval()  # dropout off: rollout and training log-probs must agree
        self.ref_policy = copy.deepcopy(self.policy).requires_grad_(False)
        self.value_head = ValueHead(self.policy.config.hidden_size)
        self.params = [*self.policy.parameters(), *self.value_head.parameters()]
        self.optimizer = torch.optim.AdamW(self.params, lr=self.config.learning_rate)
        c = self.config
        self.kl_ctl = (
            AdaptiveKLController(c.kl_coef, c.kl_target, c.kl_horizon)
            if c.kl_target
            else FixedKLController(c.kl_coef)
        )
        self.num_timesteps, self.iteration = 0, 0
        torch.manual_seed(c.seed)

    def _forward(self, model: Any, b: dict[str, torch.Tensor], hidden: bool) -> tuple[torch.Tensor, Any]:
        """One forward over prompt + response; returns the logits that chose each response token (N, T, V)."""
        ids = torch.cat([b["query_ids"], b["response_ids"]], dim=1)  # (N, P+T)
        mask = torch.cat([b["query_mask"], b["response_mask"]], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=hidden)
        P = b["query_ids"].shape[1]
        last_hidden = out.hidden_states[-1][:, P - 1 : -1] if hidden else None  # (N, T, H)
        return out.logits[:, P - 1 : -1], last_hidden

    def collect_rollouts(self) -> dict[str, torch.Tensor]:
        c = self.config
        r = rollout(
            self.policy, self.env, temperature=c.temperature, seed=c.seed + self.iteration, keep_hidden=True
        )
        b = {
            "query_ids": r.query_ids,
            "query_mask": r.query_mask,
            "response_ids": r.response_ids,
            "response_mask": r.response_mask,
            "logprobs": r.logprobs,
        }
        mask = r.response_mask
        with torch.no_grad():
            b["values"] = self.value_head(r.hidden) * mask
            ref_logits, _ = self._forward(self.ref_policy, b, hidden=False)
            ref_logprobs = logprobs_from_logits(ref_logits, r.response_ids, c.temperature) * mask
            scores = torch.as_tensor(r.scores, dtype=torch.float32)
            rewards, kl = per_token_rewards(
                scores, r.logprobs, ref_logprobs, mask, self.kl_ctl.kl_coef, c.kl_estimator
            )
            if c.whiten_rewards:
                rewards = masked_whiten(rewards, mask, shift_mean=False)
            advantages, returns = gae(rewards, b["values"], mask, c.gamma, c.gae_lambda)
            b["advantages"], b["returns"] = masked_whiten(advantages, mask), returns
        self.stats = {
            "objective/scores": float(scores.mean()),
            "objective/kl": float(kl.sum(1).mean()),
            "env/response_length": float(mask.sum(1).float().mean()),
        }
        self.infos = r.infos
        return b

    def train(self, b: dict[str, torch.Tensor]) -> None:
        c = self.config
        n = len(b["response_ids"])
        mb_size = max(1, n // c.n_minibatches)
        approx_kls = []
        for _ in range(c.n_epochs):
            for start in range(0, n, mb_size):
                mb = {k: v[start : start + mb_size] for k, v in b.items()}
                mask = mb["response_mask"]
                logits, hidden = self._forward(self.policy, mb, hidden=True)
                logprobs = logprobs_from_logits(logits, mb["response_ids"], c.temperature)
                values = self.value_head(hidden)
                pg_loss, _, approx_kl = policy_loss(
                    logprobs, mb["logprobs"], mb["advantages"], mask, c.clip_range
                )
                vf_loss, _ = value_loss(values, mb["values"], mb["returns"], mask, c.clip_range_vf)
                loss = pg_loss + c.vf_coef * vf_loss
                self.optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(self.params, c.max_grad_norm)
                self.optimizer.step()
                approx_kls.append(approx_kl.item())
            if c.target_kl is not None and approx_kls[-1] > 1.5 * c.target_kl:  # cleanrl's early stop
                break
        self.kl_ctl.update(self.stats["objective/kl"], n)
        self.stats["policy/approxkl_avg"] = float(np.mean(approx_kls))

    def learn(self, total_timesteps: int) -> LMPPO:
        """Alternate rollouts and updates until ``total_timesteps`` tokens have been generated."""
        history = []
        while self.num_timesteps < total_timesteps:
            b = self.collect_rollouts()
            self.num_timesteps += int(b["response_mask"].sum())
            self.train(b)
            self.iteration += 1
            history.append(dict(self.stats))
        self.history = history
        return self
