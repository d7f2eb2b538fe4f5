"""Generate with a causal LM by stepping a ``TextGenVectorEnv``, one KV-cached token per step.

The prompt is encoded once; afterwards each step feeds one new token per episode through the KV cache,
so a rollout costs what ``model.generate`` costs. Agents use :func:`rollout`, which also keeps each
sampled token's log-probability (at the sampling temperature) and, optionally, the last hidden states
for a value head; ``textgym sample`` uses :func:`sample_episodes`.

Multi-turn episodes (an env with a responder): when an agent turn ends, the environment's reply is fed
through the KV cache in the same forward as the agent's last token, one chunk per turn. Rows whose turns end
on the same step share the chunk: each row's new tokens are right-aligned in it, the padding before them has
attention mask 0, and position ids continue from each row's own last position, so the cache holds exactly
what one forward over the whole conversation would compute (tests/test_multiturn_rollout.py checks the
log-probs against that forward).
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from textgym.envs import TextGenVectorEnv
from textgym.errors import TextgymError, TrainingError


@dataclass
class Rollout:
    """One batch of episodes, one row per sub-env. Response tensors are (N, T) with T = max_new_tokens;
    ``response_mask`` is 1 on the episode's tokens after the prompt (EOS included) and 0 after the episode
    ended; ``action_mask`` is 1 on the agent's tokens only (it differs from ``response_mask`` where a
    responder wrote: those tokens are observations, not actions)."""

    query_ids: Any  # (N, P) left-padded prompts
    query_mask: Any  # (N, P)
    response_ids: Any  # (N, T), pad after the end
    response_mask: Any  # (N, T)
    logprobs: Any  # (N, T) log p(token) at the sampling temperature, 0 except on agent tokens
    hidden: Any | None  # (N, T, H) last hidden state that produced each agent token's logits, if asked for
    scores: np.ndarray  # (N,) episode returns: the reward-stack total plus any turn rewards
    infos: list[dict[str, Any]]  # per episode: prompt, completion, finish_reason, reward_components, ...
    action_mask: Any = None  # (N, T) 1 on agent tokens; None: the same as response_mask


MASKED_LOGIT = -1e8  # a token the agent may not choose: probability 0, log-probability finite (no 0 * -inf)


def allowed_actions(env: Any, device: Any) -> Any:
    """(V,) bool tensor on ``device``: the tokens the env lets the agent choose (``allowed_tokens``, never
    pad; its ``action_masks()``), or None when it allows every token."""
    import torch

    allowed = np.asarray(env.action_masks())[0]
    return None if allowed.all() else torch.from_numpy(allowed).to(device)


def mask_logits(logits: Any, allowed: Any) -> Any:
    """``logits`` (..., V) with the tokens ``allowed`` (see :func:`allowed_actions`) leaves out set to
    :data:`MASKED_LOGIT`: the rollout samples, and the agents score, from the same distribution."""
    return logits if allowed is None else logits.masked_fill(~allowed, MASKED_LOGIT)


def rollout(
    model: Any,
    env: TextGenVectorEnv,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    options: dict[str, Any] | None = None,
    keep_hidden: bool = False,
    lockstep: Callable[..., bool] | None = None,
    precision: Callable[[], Any] = contextlib.nullcontext,
) -> Rollout:
    """Run one episode in every sub-env of ``env`` (``autoreset_mode="Disabled"``), ``model`` choosing the
    tokens. ``temperature=0`` is greedy decoding (log-probs are then taken at temperature 1).

    ``lockstep`` (a sharded model, whose every forward needs every process): called each step with whether
    this process still has an active episode, it returns whether any process has. A process whose episodes
    have ended keeps feeding pad tokens (results discarded) until none has, so all run the same forwards;
    its episodes are exactly those it gets without ``lockstep``. A process whose env fails (a reward plugin
    raising) calls ``lockstep(False, True)`` before raising, and on that call the others raise, so that no
    process waits for the failed one's next forward.

    ``precision``: a context for each forward of ``model`` (an agent's bf16 autocast). The env and its
    rewards run outside it, in their own precision."""
    import torch

    if env.autoreset_mode.value != "Disabled":
        raise ValueError("rollout needs a TextGenVectorEnv with autoreset_mode='Disabled'.")
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, numbers.Real)
        or not 0 <= temperature < math.inf
    ):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), not {temperature!r}.")
    V = env.single_action_space.n
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or not 0 <= top_k <= V:
        raise ValueError(
            f"top_k must be an integer in [0, {V}] (0: off; {V} tokens in the env), not {top_k!r}."
        )
    device = next(model.parameters()).device
    # Sampling stays on the model's device. Per step one transfer, the N chosen tokens down (the env needs
    # them), and on the steps where an episode or a turn ended a second, the rows' state up (which rows are
    # active, where their next token goes); otherwise the device advances that state itself. Logits,
    # log-probs, hidden states and the tokens fed back stay where the model wrote them.
    generator = torch.Generator(device=device)
    # no seed: one drawn from torch's global stream, so calls differ and torch.manual_seed reproduces them
    generator.manual_seed(int(torch.randint(0, 2**62, ())) if seed is None else seed)
    try:
        obs, _ = env.reset(seed=seed, options=options)
    except TextgymError:
        if lockstep is not None:  # the others stop too (a responder's opening that failed on this process)
            lockstep(False, True)
        raise
    if lockstep is not None:
        lockstep(True)  # raises if another process's reset failed
    idle = ~np.asarray(env.active, bool)  # rows a partial reset (reset_mask) left out: no episode of theirs
    P, T, n = env.max_prompt_tokens, env.max_new_tokens, env.num_envs
    query_ids = torch.from_numpy(obs["input_ids"][:, :P].copy())
    query_mask = torch.from_numpy(obs["attention_mask"][:, :P].astype(np.int64))
    start = int(query_mask.any(0).long().argmax())  # columns that are padding in every prompt are skipped
    mask = query_mask[:, start:].to(device)  # (N, P'), grows by one column per step (a chunk after a turn)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (N, P')
    logprobs = torch.zeros(n, T, device=device)
    hidden: Any = None
    finite = torch.ones((), dtype=torch.bool, device=device)  # checked once at the end: no per-step sync
    length = np.zeros(n, dtype=np.int64)  # response tokens so far per row: where its next agent token goes
    scores = np.zeros(n)  # episode returns
    infos: list[dict[str, Any]] = [{} for _ in range(n)]
    scale = temperature if temperature > 0 else 1.0
    allowed = allowed_actions(env, device)
    multi_turn = env.responder is not None
    every_row = torch.arange(n, device=device)
    state_np, state = None, None  # (2, N) active flags and next-token columns: the host's copy, the device's

    def forward(**kwargs: Any) -> Any:
        with precision():
            return model(**kwargs)

    with _no_grad(model):
        out = forward(
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
        # (lockstep: until no process has an active episode, however many tokens its episodes may have)
        for _ in range(T) if lockstep is None else itertools.count():
            active_np = env.active
            if not active_np.any():  # with lockstep, the other processes' episodes go on
                if lockstep is None or not lockstep(False):  # (none active at all: options' reset_mask)
                    break
                mask = torch.cat([mask, mask.new_ones(n, 1)], dim=1)
                out = forward(
                    input_ids=torch.full((n, 1), env.pad_token_id, dtype=torch.long, device=device),
                    attention_mask=mask,
                    position_ids=next_position,
                    use_cache=True,
                    output_hidden_states=keep_hidden,
                    **{cache_key: out[cache_key]},
                )
                next_position = next_position + 1
                continue
            wanted = np.stack([active_np, np.minimum(length, T - 1)])
            if state_np is None or not np.array_equal(wanted, state_np):
                state_np, state = wanted, torch.from_numpy(wanted).to(device)
            active, cols = state[0].bool(), state[1]  # (a row that has ended keeps its values below)
            logits = out.logits[:, -1, : env.single_action_space.n].float()  # (N, V), on the device
            if scale != 1.0:
                logits = logits / scale
            logits = mask_logits(logits, allowed)
            if temperature == 0:
                tokens = logits.argmax(-1)
            else:
                if top_k:
                    kth = logits.topk(top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = logits.softmax(-1)
                ok = torch.isfinite(probs).all(-1, keepdim=True)  # NaN or inf: the weights have diverged
                finite &= ok.all()
                probs = torch.where(ok, probs, 1.0)  # sampled anyway (uniform); the rollout fails at its end
                tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            tokens = torch.where(active, tokens, env.pad_token_id)
            # log p(token) = logit - logsumexp(logits): no (N, V) log-softmax tensor per step
            chosen = logits.gather(-1, tokens[:, None]).squeeze(-1)
            step_logprobs = chosen - torch.logsumexp(logits, -1)
            if temperature == 0:  # argmax of a NaN row picks a token anyway: the check sampling makes above
                finite &= torch.where(active, torch.isfinite(step_logprobs), True).all()
            logprobs[every_row, cols] = torch.where(active, step_logprobs, logprobs[every_row, cols])
            if keep_hidden:
                h = out.hidden_states[-1][:, -1].float()  # (N, H)
                if hidden is None:
                    hidden = torch.zeros(n, T, h.shape[-1], device=device)
                hidden[every_row, cols] = torch.where(active[:, None], h, hidden[every_row, cols])
            step_tokens = tokens.cpu().numpy()  # the step's one transfer to the host
            try:
                obs, rewards, terminated, truncated, step_infos = env.step(step_tokens)
            except TextgymError:  # e.g. a reward plugin that failed on this process only
                if lockstep is not None:  # the others leave the rollout on this step too
                    lockstep(False, True)
                raise
            scores += rewards  # turn rewards on the steps that end turns, the stack's total on the last
            for i in np.flatnonzero(terminated | truncated):
                infos[i] = _episode_info(step_infos, i, scores[i])
            if not (env.active.any() if lockstep is None else lockstep(bool(env.active.any()))):
                break
            new_length = length + active_np  # each active row wrote its token...
            if multi_turn:  # ...and, where a turn ended, the environment's reply after it
                new_length = obs["attention_mask"][:, P:].sum(1).astype(np.int64)
            # environment tokens appended after each row's agent token (rows still in their episode)
            extra = np.where(env.active, new_length - length - 1, 0)
            if not extra.any():  # one new token per row, already on the device
                mask = torch.cat([mask, mask.new_ones(n, 1)], dim=1)
                feed, feed_positions, keep = tokens[:, None], next_position, {}
                next_position = next_position + 1
                # each active row's next token goes one column on: predicted on both sides, no transfer
                state_np = np.stack([state_np[0], np.minimum(state_np[1] + state_np[0], T - 1)])
                state = torch.stack([state[0], (state[1] + state[0]).clamp(max=T - 1)])
            else:  # a turn ended: its chunk comes from the env's record, on the host
                chunk = _turn_chunk(obs["input_ids"], P + length, 1 + extra, env.pad_token_id, next_position)
                feed, feed_mask, feed_positions = (x.to(device) for x in chunk)
                mask = torch.cat([mask, feed_mask], dim=1)
                keep = logits_to_keep(model, 1)
                next_position = next_position + torch.from_numpy(1 + extra)[:, None].to(device)
            length = np.where(active_np, new_length, length)
            out = forward(
                input_ids=feed,
                attention_mask=mask,
                position_ids=feed_positions,
                use_cache=True,
                output_hidden_states=keep_hidden,
                **{cache_key: out[cache_key]},
                **keep,
            )
    if not bool(finite):
        raise TrainingError("the model's next-token distribution is not finite; its weights have diverged.")
    logprobs = logprobs.cpu()
    # the env's record of each conversation after the prompt, pad after the end: (N, T)
    response_ids = torch.from_numpy(obs["input_ids"][:, P:].copy())
    response_mask = torch.from_numpy(obs["attention_mask"][:, P:].astype(np.int64))
    action_mask = response_mask * torch.from_numpy(1 - env.env_token_mask[:, P:].astype(np.int64))
    if idle.any():  # their observations still hold an earlier episode: none of it is this rollout's
        rows = torch.from_numpy(idle)
        response_ids[rows], response_mask[rows], action_mask[rows] = env.pad_token_id, 0, 0
    hidden_states = None
    if keep_hidden:
        hidden_states = hidden if hidden is not None else torch.zeros(n, T, 1)
    return Rollout(
        query_ids,
        query_mask,
        response_ids,
        response_mask,
        logprobs,
        hidden_states,
        scores,
        infos,
        action_mask,
    )


def _no_grad(model: Any) -> Any:
    """``inference_mode``, except for a sharded model (FSDP2 or DeepSpeed ZeRO-3): the parameters it
    all-gathers in an inference context would be inference tensors, which its later training forwards
    cannot reuse."""
    import torch

    if hasattr(next(model.parameters()), "ds_id"):  # ZeRO-3 converts every parameter (no deepspeed import)
        return torch.no_grad()
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without distributed support
        return torch.inference_mode()
    return torch.no_grad() if isinstance(model, FSDPModule) else torch.inference_mode()


def _turn_chunk(
    input_ids: np.ndarray, begin: np.ndarray, count: np.ndarray, pad_id: int, next_position: Any
) -> tuple[Any, Any, Any]:
    """One forward's input after a step on which some rows ended a turn: row i's ``count[i]`` new tokens
    (its agent token, then the environment's reply) from ``input_ids[i, begin[i]:]``, right-aligned in a
    (N, max count) chunk so that every row's last real token is the last column. The padding before them has
    attention mask 0; positions continue from ``next_position`` (N, 1). Returns (ids, mask, positions)."""
    import torch

    width = int(count.max())
    offset = np.arange(width)[None, :] - (width - count)[:, None]  # (N, W) index into each row's new tokens
    real = offset >= 0
    src = np.clip(begin[:, None] + offset, 0, input_ids.shape[1] - 1)
    ids = np.where(real, np.take_along_axis(input_ids, src, axis=1), pad_id)
    positions = next_position.cpu() + torch.from_numpy(np.maximum(offset, 0))
    return torch.from_numpy(ids), torch.from_numpy(real.astype(np.int64)), positions


def _episode_info(step_infos: dict[str, Any], i: int, episode_return: float) -> dict[str, Any]:
    """What a rollout keeps of an episode's last-step info (JSON-serialisable)."""
    info = {
        "prompt": step_infos["prompt"][i],
        "completion": step_infos["completion"][i],
        "finish_reason": step_infos["finish_reason"][i],
        "num_tokens": int(step_infos["num_tokens"][i]),
        "reward_components": {  # not applicable (NaN) becomes None: null in JSON files
            k: None if np.isnan(v[i]) else float(v[i])
            for k, v in step_infos["reward_components"].items()
            if not k.startswith("_")
        },
        "reward": float(episode_return),
    }
    if "turns" in step_infos:
        info["turns"] = list(step_infos["turns"][i])
        info["turn_rewards"] = [float(r) for r in step_infos["turn_rewards"][i]]
    extras = step_infos.get("reward_extras")
    if extras is not None and step_infos["_reward_extras"][i]:  # TRL-style functions' log_extra columns
        info["reward_extras"] = dict(extras[i])  # (a RewardExtras mapping in the env's info)
    return info


def sample_episodes(
    model: Any,
    env: TextGenVectorEnv,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    options: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One episode per sub-env: its prompt, completion, finish reason, reward and reward components. A
    ``normalize_then_sum`` stack's totals are standardised over all of them, as a training batch's are (the
    env's own are over the episodes that ended on the same step)."""
    result = rollout(model, env, temperature=temperature, top_k=top_k, seed=seed, options=options)
    if getattr(env.reward_stack, "aggregate", "sum") != "sum":
        from textgym.agents.batch_checks import recombine_totals

        recombine_totals(env.reward_stack, result)
    return result.infos


def logits_to_keep(model: Any, k: int) -> dict[str, int]:
    """``{"logits_to_keep": k}`` when the model can compute logits for its last ``k`` positions only (the
    LM head over a 49k vocabulary is a large share of a small model's cost), else ``{}``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {"logits_to_keep": k} if "logits_to_keep" in inspect.signature(base.forward).parameters else {}
