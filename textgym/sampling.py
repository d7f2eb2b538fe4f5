"""Generate with a causal LM by stepping a ``TextGenVectorEnv``, one KV-cached token per step.

The prompt is encoded once; afterwards each step feeds one new token per episode through the KV cache,
so a rollout costs what ``model.generate`` costs. Agents use :func:`rollout`, which also keeps each
sampled token's log-probability (at the sampling temperature) and, optionally, the last hidden states
for a value head; ``textgym sample`` uses :func:`sample_episodes`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np

from textgym.envs import TextGenVectorEnv
from textgym.errors import TrainingError


@dataclass
class Rollout:
    """One batch of episodes, one row per sub-env. Response tensors are (N, T) with T = max_new_tokens;
    ``response_mask`` is 1 on generated tokens (EOS included) and 0 after the episode ended."""

    query_ids: Any  # (N, P) left-padded prompts
    query_mask: Any  # (N, P)
    response_ids: Any  # (N, T), pad after the end
    response_mask: Any  # (N, T)
    logprobs: Any  # (N, T) log p(token) at the sampling temperature, 0 after the end
    hidden: Any | None  # (N, T, H) last hidden state that produced each token's logits, if asked for
    scores: np.ndarray  # (N,) reward-stack totals
    infos: list[dict[str, Any]]  # per episode: prompt, completion, finish_reason, reward_components


def rollout(
    model: Any,
    env: TextGenVectorEnv,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    options: dict[str, Any] | None = None,
    keep_hidden: bool = False,
) -> Rollout:
    """Run one episode in every sub-env of ``env`` (``autoreset_mode="Disabled"``), ``model`` choosing the
    tokens. ``temperature=0`` is greedy decoding (log-probs are then taken at temperature 1)."""
    import torch

    if env.autoreset_mode.value != "Disabled":
        raise ValueError("rollout needs a TextGenVectorEnv with autoreset_mode='Disabled'.")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, not {temperature}.")
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu")
    generator.manual_seed(0 if seed is None else seed)
    obs, _ = env.reset(seed=seed, options=options)
    P, T, n = env.max_prompt_tokens, env.max_new_tokens, env.num_envs
    query_ids = torch.from_numpy(obs["input_ids"][:, :P].copy())
    query_mask = torch.from_numpy(obs["attention_mask"][:, :P].astype(np.int64))
    start = int(query_mask.any(0).long().argmax())  # columns that are padding in every prompt are skipped
    mask = query_mask[:, start:].to(device)  # (N, P'), grows by one column per step
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (N, P')
    response_ids = torch.full((n, T), env.pad_token_id, dtype=torch.long)
    response_mask = torch.zeros(n, T, dtype=torch.long)
    logprobs = torch.zeros(n, T)
    hidden: list[Any] = []
    scores = np.zeros(n)
    infos: list[dict[str, Any]] = [{} for _ in range(n)]
    scale = temperature if temperature > 0 else 1.0
    with torch.inference_mode():
        out = model(
            input_ids=query_ids[:, start:].to(device),
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            output_hidden_states=keep_hidden,
            **logits_to_keep(model, 1),  # the prompt's last position only, as generate() does
        )
        next_position = positions[:, -1:] + 1  # (N, 1)
        # transformers 5.x names the KV cache `cache`, older versions `past_key_values`; the model takes it
        # back under the name it returned it (wrappers such as peft pass unknown keywords through).
        cache_key = "cache" if "cache" in out else "past_key_values"
        for t in range(T):
            active = torch.from_numpy(env.active)
            logits = out.logits[:, -1, : env.single_action_space.n].float().cpu()  # (N, V)
            if scale != 1.0:
                logits = logits / scale
            if keep_hidden:
                hidden.append(out.hidden_states[-1][:, -1].float().cpu())  # (N, H)
            if temperature == 0:
                tokens = logits.argmax(-1)
            else:
                if top_k:
                    kth = logits.topk(top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                try:
                    tokens = torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
                except RuntimeError as exc:  # NaN or inf logits: the model's weights have diverged
                    raise TrainingError(
                        f"the model's next-token distribution is not finite ({exc}); its weights have diverged."
                    ) from None
            tokens = torch.where(active, tokens, env.pad_token_id)
            response_ids[:, t] = tokens
            response_mask[:, t] = active.long()
            # log p(token) = logit - logsumexp(logits): no (N, V) log-softmax tensor per step
            chosen = logits.gather(-1, tokens[:, None]).squeeze(-1)
            logprobs[:, t] = (chosen - torch.logsumexp(logits, -1)) * active
            _, rewards, terminated, truncated, step_infos = env.step(tokens.numpy())
            for i in np.flatnonzero(terminated | truncated):
                scores[i] = rewards[i]
                infos[i] = {
                    "prompt": step_infos["prompt"][i],
                    "completion": step_infos["completion"][i],
                    "finish_reason": step_infos["finish_reason"][i],
                    "num_tokens": int(step_infos["num_tokens"][i]),
                    "reward_components": {  # not applicable (NaN) becomes None: null in JSON files
                        k: None if np.isnan(v[i]) else float(v[i])
                        for k, v in step_infos["reward_components"].items()
                        if not k.startswith("_")
                    },
                    "reward": float(rewards[i]),
                }
            if not env.active.any():
                break
            mask = torch.cat([mask, mask.new_ones(n, 1)], dim=1)
            out = model(
                input_ids=tokens[:, None].to(device),
                attention_mask=mask,
                position_ids=next_position,
                use_cache=True,
                output_hidden_states=keep_hidden,
                **{cache_key: out[cache_key]},
            )
            next_position = next_position + 1
    hidden_states = None
    if keep_hidden:
        hidden_states = torch.zeros(n, T, hidden[0].shape[-1])
        hidden_states[:, : len(hidden)] = torch.stack(hidden, dim=1)
    return Rollout(query_ids, query_mask, response_ids, response_mask, logprobs, hidden_states, scores, infos)


def sample_episodes(
    model: Any,
    env: TextGenVectorEnv,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    options: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One episode per sub-env: its prompt, completion, finish reason, reward and reward components."""
    result = rollout(model, env, temperature=temperature, top_k=top_k, seed=seed, options=options)
    return result.infos


def logits_to_keep(model: Any, k: int) -> dict[str, int]:
    """``{"logits_to_keep": k}`` when the model can compute logits for its last ``k`` positions only (the
    LM head over a 49k vocabulary is a large share of a small model's cost), else ``{}``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {"logits_to_keep": k} if "logits_to_keep" in inspect.signature(base.forward).parameters else {}
