"""Sample completions from a causal LM by stepping a ``TextGenVectorEnv``, one KV-cached token per step."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from textgym.envs import TextGenVectorEnv


def sample_episodes(
    model: Any,
    env: TextGenVectorEnv,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    options: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Run one episode in every sub-env of ``env`` (``autoreset_mode="Disabled"``) with ``model`` choosing
    the tokens; returns per episode its prompt, completion, finish reason, reward and reward components.

    ``temperature=0`` is greedy decoding. The prompt is encoded once; afterwards each step feeds one new
    token per episode through the KV cache.
    """
    import torch

    if env.autoreset_mode.value != "Disabled":
        raise ValueError("sample_episodes needs a TextGenVectorEnv with autoreset_mode='Disabled'.")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, not {temperature}.")
    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu")
    generator.manual_seed(0 if seed is None else seed)
    obs, _ = env.reset(seed=seed, options=options)
    P, n = env.episodes.P, env.num_envs
    mask = torch.from_numpy(obs["attention_mask"][:, :P]).long().to(device)  # (N, P), prompts left-padded
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (N, P)
    results: list[dict[str, Any] | None] = [None] * n
    with torch.inference_mode():
        out = model(
            input_ids=torch.from_numpy(obs["input_ids"][:, :P]).to(device),
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
        )
        next_position = positions[:, -1:] + 1  # (N, 1)
        while True:
            logits = out.logits[:, -1].float().cpu()  # (N, V)
            logits = logits[:, : env.single_action_space.n]
            if temperature == 0:
                tokens = logits.argmax(-1)
            else:
                logits = logits / temperature
                if top_k:
                    kth = logits.topk(top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                tokens = torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
            _, rewards, terminated, truncated, infos = env.step(tokens.numpy())
            for i in np.flatnonzero(terminated | truncated):
                results[i] = {
                    "prompt": infos["prompt"][i],
                    "completion": infos["completion"][i],
                    "finish_reason": infos["finish_reason"][i],
                    "reward_components": {
                        k: float(v[i]) for k, v in infos["reward_components"].items() if not k.startswith("_")
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
                **cache_kwargs(model, out),
            )
            next_position = next_position + 1
    return [r for r in results if r is not None]


def cache_kwargs(model: Any, out: Any) -> dict[str, Any]:
    """The KV cache of ``out`` as the keyword ``model.forward`` takes: ``cache`` in transformers 5.x,
    ``past_key_values`` before (5.x still accepts it, with a deprecation warning)."""
    if "cache" in inspect.signature(model.forward).parameters:
        return {"cache": out["cache"]}
    return {"past_key_values": out["past_key_values"]}
