"""``LMPPO``: PPO with a causal-LM policy and a value head, stepping ``TextGenVectorEnv`` token by token.

One iteration, in the order the code runs (the math is in ``ppo_core``, each piece tested on its own):
rollout through the env with a KV cache, keeping each token's log-prob and the hidden state for the value
head -> reference log-probs in one forward over the finished sequences -> score shaping -> per-token KL
penalty plus score on the last token -> GAE -> whitened advantages -> PPO epochs over minibatches of
whole sequences (micro-batches with gradient accumulation) -> KL controller update.

The user contract is Stable-Baselines3's: ``LMPPO(policy, env, **hyperparameters)``, ``learn``,
``predict``, ``save``, ``LMPPO.load``, SB3 callbacks and logger. One callback step is one PPO iteration
(a batch of episodes); ``num_timesteps`` counts generated tokens, since one token is one env step.
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from textgym.agents.ppo_core import (
    AdaptiveKLController,
    FixedKLController,
    entropy_from_logits,
    gae,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    per_token_rewards,
    policy_loss,
    value_loss,
)
from textgym.envs import TextGenVectorEnv
from textgym.errors import ConfigError
from textgym.sampling import logits_to_keep, rollout


@dataclass
class LMPPOConfig:
    learning_rate: float = 1e-5
    """AdamW learning rate for the policy and the value head."""
    lr_schedule: str = "constant"
    """"constant", or "linear" (anneal to 0 over the learn() call's total_timesteps)."""
    n_epochs: int = 4
    """PPO epochs over each batch of episodes."""
    n_minibatches: int = 1
    """Minibatches of whole sequences per epoch (one optimizer step each)."""
    micro_batch_size: int | None = None
    """Sequences per forward pass; gradients accumulate over the minibatch (None: the whole minibatch)."""
    temperature: float = 1.0
    """Sampling temperature; it divides the logits wherever log-probs are computed."""
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
    max_grad_norm: float = 1.0
    """Gradient clipping."""
    target_kl: float | None = None
    """Stop an update's epochs early when approx-KL exceeds 1.5 x this (cleanrl)."""
    kl_coef: float = 0.05
    """Initial (or fixed) coefficient of the per-token KL penalty."""
    kl_target: float | None = None
    """With a target (nats per sequence), the coefficient adapts (Ziegler et al. 2019); None: fixed."""
    kl_horizon: int = 10_000
    """Horizon of the adaptive KL controller, in episodes."""
    kl_estimator: str = "k1"
    """"k1" (log-ratio) or "k3" (unbiased, non-negative)."""
    score_scale: float = 1.0
    """Multiply the reward-stack total by this."""
    score_norm: bool = False
    """Normalise scores by their running mean and std."""
    score_clip: float | None = None
    """Clip (scaled, normalised) scores to [-score_clip, score_clip]."""
    whiten_rewards: bool = False
    """Whiten the per-token rewards (scale only, the mean is kept)."""
    missing_eos_penalty: float | None = None
    """Subtract this from the score of episodes that hit max_new_tokens without EOS."""
    lora: dict[str, Any] | None = None
    """peft LoraConfig arguments (e.g. {"r": 8}); the reference is then the adapter-disabled model."""
    device: str = "auto"
    """"auto" (the GPU when there is one), "cpu", "cuda", ..."""
    bf16: bool | None = None
    """bf16 autocast; None: on for GPUs, off on the CPU."""
    seed: int = 0
    """Seeds torch, numpy and the rollouts."""
    verbose: int = 1
    """0: silent; 1: log to stdout."""
    tensorboard_log: str | None = None
    """Folder for tensorboard (and CSV) logs."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:  # log-probs divide by it; greedy rollouts have no PPO ratio
            raise ConfigError(f"temperature must be > 0 for PPO, not {self.temperature!r}.")
        for name in ("n_epochs", "n_minibatches"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, not {getattr(self, name)!r}.")
        if self.micro_batch_size is not None and (
            not isinstance(self.micro_batch_size, int) or self.micro_batch_size < 1
        ):
            raise ConfigError(f"micro_batch_size must be a positive integer, not {self.micro_batch_size!r}.")
        if self.kl_estimator not in ("k1", "k3"):
            raise ConfigError(f"kl_estimator must be 'k1' or 'k3', not {self.kl_estimator!r}.")
        if self.lr_schedule not in ("constant", "linear"):
            raise ConfigError(f"lr_schedule must be 'constant' or 'linear', not {self.lr_schedule!r}.")


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
class RunningMoments:
    """Running mean and variance of scores (Chan et al.'s parallel update), for ``score_norm``."""

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
        return math.sqrt(self.var) if self.var > 0 else 1.0


@dataclass
class Batch:
    """One PPO iteration's data; response tensors are (N, T)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    episodes: list[dict[str, Any]] = field(default_factory=list)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[key]


class LMPPO:
    """PPO for a causal language model on a :class:`~textgym.envs.TextGenVectorEnv`.

    Args:
        policy: a zoo name or model directory (then also the reference, reloadable from the name), or a
            causal-LM model object.
        env: a ``TextGenVectorEnv`` with ``autoreset_mode="Disabled"`` whose tokenizer matches the policy.
            Optional for inference (``predict``).
        **hyperparameters: fields of :class:`LMPPOConfig`.
    """

    native_vector_env = True  # `textgym train` gives it a TextGenVectorEnv, not an SB3 VecEnv

    def __init__(self, policy: Any, env: TextGenVectorEnv | None = None, **hyperparameters: Any):
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        self.config = c = LMPPOConfig(**hyperparameters)
        on_gpu = torch.cuda.is_available() if c.device == "auto" else c.device.startswith("cuda")
        bf16 = on_gpu if c.bf16 is None else c.bf16
        self.accelerator = Accelerator(cpu=not on_gpu, mixed_precision="bf16" if bf16 else "no")
        self.device = self.accelerator.device
        # Each process (under `accelerate launch`) gets its own seed, hence its own rollouts.
        self.seed = c.seed + 10_007 * self.accelerator.process_index
        set_seed(self.seed)
        self.policy_source = str(policy) if isinstance(policy, (str, os.PathLike)) else None
        model = self._load_policy(policy)
        model.eval()  # dropout off: rollout and training log-probs must agree
        if c.lora is not None:
            from peft import LoraConfig, PeftModel, get_peft_model

            if not isinstance(model, PeftModel):
                model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **c.lora))
            self.ref_policy = None  # the reference is the same weights with the adapter disabled
        else:
            self.ref_policy = copy.deepcopy(model).requires_grad_(False).to(self.device)
        value_head = ValueHead(model.config.hidden_size)
        params = [p for p in [*model.parameters(), *value_head.parameters()] if p.requires_grad]
        try:  # the fused kernel is ~3x faster per step on the CPU (and on GPUs) than the default
            optimizer = torch.optim.AdamW(params, lr=c.learning_rate, fused=True)
        except (RuntimeError, TypeError):
            optimizer = torch.optim.AdamW(params, lr=c.learning_rate)
        self.policy, self.value_head, self.optimizer = self.accelerator.prepare(model, value_head, optimizer)
        self.params = params
        self.kl_ctl = (
            AdaptiveKLController(c.kl_coef, c.kl_target, c.kl_horizon)
            if c.kl_target
            else FixedKLController(c.kl_coef)
        )
        self.score_moments = RunningMoments()
        self.num_timesteps = 0
        self.iteration = 0  # never reset: it seeds the rollouts, so a resumed run continues the same stream
        self._total_timesteps = 0
        self._logger = None
        self.env: TextGenVectorEnv | None = None
        if env is not None:
            self.set_env(env)
        self.last_episodes: list[dict[str, Any]] = []
        self.stats: dict[str, float] = {}
        self.history: list[dict[str, float]] = []

    @staticmethod
    def _load_policy(policy: Any) -> Any:
        if isinstance(policy, (str, os.PathLike)):
            from textgym.models import load_model

            return load_model(policy)[0]
        if not hasattr(policy, "config") or not callable(policy):
            raise ConfigError(f"policy must be a zoo name, a model directory or a causal LM, not {policy!r}.")
        return policy

    # -- SB3 plumbing ------------------------------------------------------------------------------
    def set_env(self, env: TextGenVectorEnv) -> None:
        if not isinstance(env, TextGenVectorEnv):
            raise ConfigError(
                f"LMPPO needs a textgym TextGenVectorEnv, not {type(env).__name__}; e.g. "
                f'gymnasium.make_vec("textgym/TextGen-v0", num_envs=16, autoreset_mode="Disabled").'
            )
        if env.autoreset_mode.value != "Disabled":
            raise ConfigError("LMPPO generates whole batches: make the env with autoreset_mode='Disabled'.")
        vocab = self.accelerator.unwrap_model(self.policy).config.vocab_size
        if env.single_action_space.n > vocab:
            raise ConfigError(
                f"the env's vocabulary ({env.single_action_space.n} tokens) is larger than the policy's "
                f"({vocab}): use the policy's tokenizer in the env."
            )
        self.env = env

    def get_env(self) -> TextGenVectorEnv | None:
        return self.env

    def get_vec_normalize_env(self) -> None:
        return None

    @property
    def logger(self) -> Any:
        if self._logger is None:
            from stable_baselines3.common.logger import configure

            self._logger = configure(None, ["stdout"] if self.config.verbose else [])
        return self._logger

    def set_logger(self, logger: Any) -> None:
        self._logger = logger

    def _setup_logger(self, tb_log_name: str) -> None:
        if self.config.tensorboard_log is None:
            return
        from stable_baselines3.common.logger import configure
        from stable_baselines3.common.utils import get_latest_run_id

        run_id = get_latest_run_id(self.config.tensorboard_log, tb_log_name) + 1
        folder = os.path.join(self.config.tensorboard_log, f"{tb_log_name}_{run_id}")
        formats = ["stdout"] if self.config.verbose else []
        formats.append("csv")
        try:
            import tensorboard  # noqa: F401

            formats.append("tensorboard")
        except ImportError:
            pass
        self._logger = configure(folder, formats)

    # -- one iteration -----------------------------------------------------------------------------
    def _forward(self, model: Any, b: dict[str, torch.Tensor], hidden: bool) -> tuple[torch.Tensor, Any]:
        """One forward over prompt + response: the logits that chose each response token (N, T, V), and
        the hidden states they came from (N, T, H) if asked."""
        # Prompts are left-padded to max_prompt_tokens; columns that are padding in every row are dropped.
        start = int(b["query_mask"].any(0).long().argmax())
        query_ids, query_mask = b["query_ids"][:, start:], b["query_mask"][:, start:]
        ids = torch.cat([query_ids, b["response_ids"]], dim=1).to(self.device)  # (N, P'+T)
        mask = torch.cat([query_mask, b["response_mask"]], dim=1).to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        T = b["response_ids"].shape[1]
        keep = logits_to_keep(model, T + 1)  # the LM head runs over the response positions only
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=hidden, **keep
        )
        P = query_ids.shape[1]
        last_hidden = out.hidden_states[-1][:, P - 1 : -1] if hidden else None
        logits = out.logits[:, -(T + 1) : -1]  # (N, T, V): positions P-1 .. P+T-2 chose the response tokens
        return logits, last_hidden

    def reference_logprobs(self, b: dict[str, torch.Tensor]) -> torch.Tensor:
        """Log-probs (N, T) of the response tokens under the reference policy, at the sampling temperature."""
        c = self.config
        chunks = []
        step = c.micro_batch_size or len(b["response_ids"])
        for start in range(0, len(b["response_ids"]), step):
            mb = {k: v[start : start + step] for k, v in b.items()}
            if self.ref_policy is None:
                with self.accelerator.unwrap_model(self.policy).disable_adapter():
                    logits, _ = self._forward(self.policy, mb, hidden=False)
            else:
                logits, _ = self._forward(self.ref_policy, mb, hidden=False)
            chunks.append(logprobs_from_logits(logits, mb["response_ids"].to(self.device), c.temperature))
        return torch.cat(chunks)

    def _shape_scores(self, raw: torch.Tensor, episodes: list[dict[str, Any]]) -> torch.Tensor:
        c = self.config
        scores = raw.clone()
        if c.missing_eos_penalty is not None:
            no_eos = torch.tensor([e["finish_reason"] == "length" for e in episodes])
            scores[no_eos] -= c.missing_eos_penalty
        scores = scores * c.score_scale
        if c.score_norm:
            self.score_moments.update(scores)
            scores = (scores - self.score_moments.mean) / self.score_moments.std
        if c.score_clip is not None:
            scores = scores.clamp(-c.score_clip, c.score_clip)
        return scores

    def collect_rollouts(self) -> Batch:
        """Generate one episode per sub-env and compute everything the update needs."""
        c, env = self.config, self.env
        if env is None:
            raise ConfigError("this LMPPO has no env: pass one to LMPPO(...) or LMPPO.load(path, env).")
        start, reward_before = time.perf_counter(), env.episodes.reward_seconds
        r = rollout(
            self.policy,
            env,
            temperature=c.temperature,
            seed=self.seed * 1_000_003 + self.iteration,
            keep_hidden=True,
        )
        t_rollout = time.perf_counter() - start
        t_reward = env.episodes.reward_seconds - reward_before
        b = {
            "query_ids": r.query_ids,
            "query_mask": r.query_mask,
            "response_ids": r.response_ids,
            "response_mask": r.response_mask,
            "logprobs": r.logprobs,
        }
        mask = r.response_mask.float()
        start = time.perf_counter()
        with torch.no_grad():
            ref_logprobs = self.reference_logprobs(b).cpu() * mask
            b["values"] = self.value_head(r.hidden.to(self.device)).float().cpu() * mask
        t_reference = time.perf_counter() - start
        raw_scores = torch.as_tensor(r.scores, dtype=torch.float32)
        scores = self._shape_scores(raw_scores, r.infos)
        rewards, kl = per_token_rewards(
            scores, r.logprobs, ref_logprobs, mask, self.kl_ctl.kl_coef, c.kl_estimator
        )
        if c.whiten_rewards:
            rewards = masked_whiten(rewards, mask, shift_mean=False)
        advantages, returns = gae(rewards, b["values"], mask, c.gamma, c.gae_lambda)
        b["advantages"], b["returns"] = masked_whiten(advantages, mask), returns
        kl_per_episode = kl.sum(1)
        eos = [e["finish_reason"] == "stop" for e in r.infos]
        self.stats = {
            "objective/scores": float(raw_scores.mean()),
            "objective/kl": float(kl_per_episode.mean()),
            "objective/non_score_reward": float((-self.kl_ctl.kl_coef * kl_per_episode).mean()),
            "objective/rlhf_reward": float((scores - self.kl_ctl.kl_coef * kl_per_episode).mean()),
            "objective/kl_coef": float(self.kl_ctl.kl_coef),
            "env/response_length": float(mask.sum(1).mean()),
            "env/eos_rate": float(np.mean(eos)),
            "time/rollout": t_rollout - t_reward,
            "time/reward": t_reward,
            "time/reference": t_reference,
            "time/tokens_per_s": float(mask.sum()) / max(t_rollout, 1e-9),
        }
        for name in r.infos[0]["reward_components"]:
            self.stats[f"reward/{name}"] = float(np.mean([e["reward_components"][name] for e in r.infos]))
        self.last_episodes = r.infos
        return Batch(b, r.infos)

    def train(self, batch: Batch) -> None:
        """PPO epochs over minibatches of whole sequences; micro-batches accumulate gradients weighted by
        their share of the minibatch's tokens, so the result equals one forward over the minibatch."""
        c, b = self.config, batch.tensors
        start = time.perf_counter()
        n = len(b["response_ids"])
        mb_size = math.ceil(n / c.n_minibatches)
        micro = c.micro_batch_size or mb_size
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.iteration)
        logs: dict[str, list[float]] = {
            k: [] for k in ("pg", "vf", "clip", "vfclip", "approxkl", "ent", "ratio")
        }
        ratios = []
        for _ in range(c.n_epochs):
            epoch_kls = []
            for mb_inds in torch.randperm(n, generator=generator).split(mb_size):
                self.optimizer.zero_grad()
                mb_tokens = b["response_mask"][mb_inds].sum().clamp(min=1)
                for micro_inds in mb_inds.split(micro):
                    mb = {k: v[micro_inds] for k, v in b.items()}
                    mask = mb["response_mask"].to(self.device)
                    with self.accelerator.autocast():
                        logits, hidden = self._forward(self.policy, mb, hidden=True)
                        values = self.value_head(hidden).float()
                    logprobs = logprobs_from_logits(logits, mb["response_ids"].to(self.device), c.temperature)
                    old = {k: mb[k].to(self.device) for k in ("logprobs", "values", "advantages", "returns")}
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
                    self.accelerator.backward(loss * mask.sum() / mb_tokens)
                    with torch.no_grad():
                        ratio = (logprobs - old["logprobs"]).exp()[mask.bool()]
                    ratios.append(ratio.cpu())
                    for key, value in zip(
                        ("pg", "vf", "clip", "vfclip", "approxkl", "ent"),
                        (pg_loss, vf_loss, clipfrac, vf_clipfrac, approx_kl, entropy),
                    ):
                        logs[key].append(float(value.detach()))
                    epoch_kls.append(float(approx_kl.detach()))
                self.accelerator.clip_grad_norm_(self.params, c.max_grad_norm)
                self.optimizer.step()
            if c.target_kl is not None and np.mean(epoch_kls) > 1.5 * c.target_kl:
                break
        self.kl_ctl.update(self.stats["objective/kl"], n)
        all_ratios = torch.cat(ratios)
        mask = b["response_mask"].float()
        returns, values = b["returns"], b["values"]
        var_returns = masked_var(returns, mask)
        self.stats.update(
            {
                "loss/policy_avg": float(np.mean(logs["pg"])),
                "loss/value_avg": float(np.mean(logs["vf"])),
                "policy/clipfrac_avg": float(np.mean(logs["clip"])),
                "val/clipfrac_avg": float(np.mean(logs["vfclip"])),
                "policy/approxkl_avg": float(np.mean(logs["approxkl"])),
                "policy/entropy_avg": float(np.mean(logs["ent"])),
                "objective/entropy": float(np.mean(logs["ent"])),
                "val/ratio": float(all_ratios.mean()),
                "val/ratio_var": float(all_ratios.var()) if len(all_ratios) > 1 else 0.0,
                "val/var_explained": float(1 - masked_var(returns - values, mask) / var_returns)
                if var_returns > 0
                else 0.0,
                "lr": float(self.optimizer.param_groups[0]["lr"]),
                "time/update": time.perf_counter() - start,
            }
        )

    # -- SB3's user contract -----------------------------------------------------------------------
    def learn(
        self,
        total_timesteps: int,
        callback: Any = None,
        log_interval: int = 1,
        tb_log_name: str = "LMPPO",
        reset_num_timesteps: bool = True,
        progress_bar: bool = False,
    ) -> LMPPO:
        """Alternate rollouts and updates until ``total_timesteps`` tokens have been generated.

        ``callback``: SB3 callback(s) or a function of ``(locals, globals)``; ``on_step`` is called once per
        iteration and stops training when it returns False. Statistics are logged every ``log_interval``
        iterations under TRL's names (``objective/kl``, ``policy/approxkl_avg``, ...).
        """
        from tqdm.auto import tqdm

        if self.env is None:
            raise ConfigError("this LMPPO has no env: pass one to LMPPO(...) or LMPPO.load(path, env).")
        if reset_num_timesteps:
            self.num_timesteps = 0
        else:
            total_timesteps += self.num_timesteps
        self._total_timesteps = total_timesteps
        self._setup_logger(tb_log_name)
        callback = self._init_callback(callback)
        callback.on_training_start(locals(), globals())
        bar = tqdm(total=total_timesteps, initial=self.num_timesteps, unit="tok", disable=not progress_bar)
        while self.num_timesteps < total_timesteps:
            if self.config.lr_schedule == "linear":
                for group in self.optimizer.param_groups:
                    group["lr"] = self.config.learning_rate * max(
                        0.0, 1 - self.num_timesteps / total_timesteps
                    )
            callback.on_rollout_start()
            batch = self.collect_rollouts()
            tokens = int(batch["response_mask"].sum())
            self.num_timesteps += tokens
            callback.update_locals(locals())
            callback.on_rollout_end()
            self.train(batch)
            self.iteration += 1
            self.stats["time/iteration"] = sum(
                v for k, v in self.stats.items() if k.startswith("time/") and k != "time/tokens_per_s"
            )
            self.history.append({"iteration": self.iteration, "timesteps": self.num_timesteps, **self.stats})
            if log_interval and self.iteration % log_interval == 0:
                self.logger.record("time/iterations", self.iteration)
                for key, value in self.stats.items():
                    self.logger.record(key, value)
                self.logger.dump(step=self.num_timesteps)
            bar.update(tokens)
            bar.set_postfix(
                score=f"{self.stats['objective/scores']:.3f}", kl=f"{self.stats['objective/kl']:.3f}"
            )
            if not callback.on_step():
                break
        bar.close()
        callback.on_training_end()
        return self

    def _init_callback(self, callback: Any) -> Any:
        from stable_baselines3.common.callbacks import BaseCallback, CallbackList, ConvertCallback

        if isinstance(callback, list):
            callback = CallbackList(callback)
        if not isinstance(callback, BaseCallback):
            callback = ConvertCallback(callback)
        callback.init_callback(self)
        return callback

    def predict(
        self,
        observation: dict[str, np.ndarray],
        state: Any = None,
        episode_start: Any = None,
        deterministic: bool = False,
    ) -> tuple[np.ndarray, Any]:
        """The next token for each observation (a full forward; for generation, ``rollout`` is faster)."""
        ids = np.asarray(observation["input_ids"])
        single = ids.ndim == 1
        ids = torch.as_tensor(ids.reshape(-1, ids.shape[-1]), dtype=torch.long, device=self.device)
        mask = torch.as_tensor(np.asarray(observation["attention_mask"]).reshape(ids.shape), dtype=torch.long)
        mask = mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)  # (N,) index of each row's newest token
        with torch.no_grad():
            logits = self.policy(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        logits = logits[torch.arange(len(ids)), last].float()  # (N, V)
        if self.env is not None:
            logits = logits[:, : self.env.single_action_space.n]
        if deterministic:
            actions = logits.argmax(-1)
        else:
            actions = torch.multinomial((logits / self.config.temperature).softmax(-1), 1).squeeze(-1)
        actions = actions.cpu().numpy()
        return (actions[0] if single else actions), state

    def save(self, path: str | os.PathLike) -> None:
        """Write a checkpoint directory atomically: the policy in Hugging Face format (the adapter with
        LoRA), the value head, the optimizer, the KL controller, the counters and the config."""
        from textgym.models import atomic_build_dir

        policy = self.accelerator.unwrap_model(self.policy)
        if self.policy_source is None and self.config.lora is not None:
            raise ConfigError(
                "saving a LoRA policy needs the base model given by name or path, not as an object."
            )

        def build(out: Path) -> None:
            policy.save_pretrained(out / "policy")
            if self.policy_source is None:
                self.ref_policy.save_pretrained(out / "reference")
            torch.save(self.accelerator.unwrap_model(self.value_head).state_dict(), out / "value_head.pt")
            torch.save(self.optimizer.state_dict(), out / "optimizer.pt")
            state = {
                "config": asdict(self.config),
                "policy_source": self.policy_source,
                "num_timesteps": self.num_timesteps,
                "iteration": self.iteration,
                "kl_coef": self.kl_ctl.kl_coef,
                "score_moments": asdict(self.score_moments),
                "history": self.history,
            }
            (out / "state.json").write_text(json.dumps(state, indent=2))

        atomic_build_dir(Path(path), build, replace=True)

    @classmethod
    def load(cls, path: str | os.PathLike, env: TextGenVectorEnv | None = None, **overrides: Any) -> LMPPO:
        """An agent restored from :meth:`save`, with optimizer, KL controller and counters; ``overrides``
        replace config fields (e.g. ``learning_rate``)."""
        from transformers import AutoModelForCausalLM

        from textgym.models import is_complete

        path = Path(path)
        if not is_complete(path):
            raise ConfigError(
                f"{str(path)!r} is not a complete LMPPO checkpoint (no state.json written by save)."
            )
        state = json.loads((path / "state.json").read_text())
        config = {**state["config"], **overrides}
        source = state["policy_source"]
        if config.get("lora") is not None:
            from peft import PeftModel

            base = cls._load_policy(source)
            policy = PeftModel.from_pretrained(base, path / "policy", is_trainable=True)
        else:
            policy = AutoModelForCausalLM.from_pretrained(path / "policy")
        agent = cls(policy, env, **config)
        agent.policy_source = source
        if agent.ref_policy is not None:
            reference = (
                cls._load_policy(source)
                if source
                else AutoModelForCausalLM.from_pretrained(path / "reference")
            )
            agent.ref_policy = reference.requires_grad_(False).eval().to(agent.device)
        agent.accelerator.unwrap_model(agent.value_head).load_state_dict(torch.load(path / "value_head.pt"))
        agent.optimizer.load_state_dict(torch.load(path / "optimizer.pt"))
        agent.num_timesteps, agent.iteration = state["num_timesteps"], state["iteration"]
        agent.kl_ctl.kl_coef = state["kl_coef"]
        agent.score_moments = RunningMoments(**state["score_moments"])
        agent.history = state["history"]
        return agent
