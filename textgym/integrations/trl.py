"""A textgym reward stack as TRL reward functions, for ``GRPOTrainer(reward_funcs=..., args=GRPOConfig(...))``.

TRL calls each reward function as ``f(prompts=..., completions=..., completion_ids=..., **columns)``: lists
with one item per completion, every other dataset column as a keyword list, and ``trainer_state``. Each
returns ``list[float | None]``; TRL multiplies by ``GRPOConfig.reward_weights`` and sums, leaving out
``None``. TRL is not imported here.

Example::

    from trl import GRPOConfig, GRPOTrainer
    from textgym import build_reward_stack
    from textgym.integrations.trl import reward_funcs, reward_weights

    stack = build_reward_stack([{"name": "math"}, {"name": "length_penalty", "weight": 0.1, "target": 64}])
    trainer = GRPOTrainer(model=..., train_dataset=...,
                          reward_funcs=reward_funcs(stack), args=GRPOConfig(reward_weights=reward_weights(stack)))
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from textgym.conversation import AGENT_ROLE
from textgym.errors import ConfigError
from textgym.reward_functions import TRLCall, trl_call
from textgym.rewards import BaseDir, RewardStack, Sample, Turn, build_reward_stack

TRLRewardFunc = Callable[..., list[float | None]]
NOT_COLUMNS = ("trainer_state",)  # keywords TRL passes that are not dataset columns
# one id, or several (Llama 3's and Qwen2.5's generation_config.eos_token_id is a list)
EosIds = int | Iterable[int] | None


def reward_funcs(
    stack_or_specs: RewardStack | Any, base_dir: BaseDir = None, eos_token_id: EosIds = None
) -> list[TRLRewardFunc]:
    """One TRL reward function per component, in order; each ``__name__`` is the component's name (TRL logs
    ``rewards/<name>/mean``). They return the raw (unweighted) scores, ``None`` where the reward does not
    apply; pass :func:`reward_weights` as ``GRPOConfig.reward_weights``.

    ``eos_token_id`` (the tokenizer's, or a list such as ``generation_config.eos_token_id``): a completion
    whose ``completion_ids`` do not end on it (on one of them) was cut at
    the token limit (``finish_reason = "length"``, which ``length_penalty`` charges and ``fluency`` scores
    without an EOS), as TRL's ``completion_ids`` hold the EOS only where the completion ended on it.
    Without it every completion counts as stopped.

    A stack with gates cannot be split this way (TRL sums the functions and has no gates): export it whole
    with :func:`total_reward_func`. ``aggregate="normalize_then_sum"`` corresponds to
    ``GRPOConfig(multi_objective_aggregation="normalize_then_sum")``, which standardises per prompt group.

    Build the stack once (``build_reward_stack``) and pass it to both functions: passing specs to each
    builds the rewards twice.
    """
    eos = eos_ids(eos_token_id)
    stack = build_reward_stack(stack_or_specs, base_dir)
    if stack.gates:
        raise ConfigError(
            f"this stack has gates ({'; '.join(map(str, stack.gates))}), which TRL's summed reward functions "
            f"cannot express; use total_reward_func(stack) to export the whole stack as one function."
        )
    return [_component_func(stack, name, eos) for name in stack.names]


def reward_weights(
    stack_or_specs: RewardStack | Any, p: float | None = None, base_dir: BaseDir = None
) -> list[float]:
    """The weights of :func:`reward_funcs`' functions, in order, for ``GRPOConfig(reward_weights=...)``.

    TRL's weights are constant for the whole run. A stack with a weight schedule needs ``p`` (the training
    progress in [0, 1] at which to freeze it); :func:`total_reward_func` follows the schedule instead.
    """
    stack = build_reward_stack(stack_or_specs, base_dir)
    if p is None:
        scheduled = [n for n in stack.names if stack.weights_at(0.0)[n] != stack.weights_at(1.0)[n]]
        if scheduled:
            raise ConfigError(
                f"components {scheduled} have weight schedules, but TRL's reward_weights are constant. Pass p "
                f"(0..1) to freeze the schedules there, or use total_reward_func(stack), which follows them."
            )
        p = stack.progress
    return list(stack.weights_at(p).values())


def total_reward_func(
    stack_or_specs: RewardStack | Any, base_dir: BaseDir = None, eos_token_id: EosIds = None
) -> TRLRewardFunc:
    """The whole stack as one TRL reward function named ``textgym_total``: aggregation, weight schedules and
    gates as textgym computes them (give it weight 1): textgym's total for every completion (0 where no
    component applies and no gate fails, as inside textgym).
    With TRL's ``trainer_state``, schedules follow ``global_step / max_steps``. ``eos_token_id``: as for
    :func:`reward_funcs`."""
    eos = eos_ids(eos_token_id)
    stack = build_reward_stack(stack_or_specs, base_dir)

    def textgym_total(
        prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float]:
        state = kwargs.get("trainer_state")
        if getattr(state, "max_steps", 0):
            stack.set_progress(min(1.0, state.global_step / state.max_steps))
        samples = samples_from_trl(prompts, completions, completion_ids, kwargs, eos)
        with trl_call(_call(samples, prompts, completions, completion_ids, kwargs)):
            total, _ = stack.score(samples)
        # textgym's total for every completion, gates included, never None: TRL (1.12) takes a completion
        # every function returned None for as unscorable (out of its group's baseline, advantage 0), which
        # would drop a gate's penalty on a completion none of the weighted components applies to
        return [float(v) for v in total]

    return textgym_total


def _component_func(stack: RewardStack, name: str, eos_token_id: EosIds) -> TRLRewardFunc:
    def func(
        prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float | None]:
        samples = samples_from_trl(prompts, completions, completion_ids, kwargs, eos_token_id)
        with trl_call(_call(samples, prompts, completions, completion_ids, kwargs)):
            scores = stack.score_component(name, samples)
        return [None if math.isnan(v) else float(v) for v in scores]

    func.__name__ = func.__qualname__ = name
    func.__doc__ = f"textgym reward component {name!r} with TRL's reward-function signature."
    return func


def _call(
    samples: Sequence[Sample],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Any,
    kwargs: Mapping[str, Any],
) -> TRLCall:
    """TRL's arguments, to pass on as they are to the TRL-style functions of the stack."""
    columns = per_row(kwargs, len(samples))
    ids = completion_ids if completion_ids is not None else [list(s.completion_ids) for s in samples]
    rows = {"prompts": prompts, "completions": completions, "completion_ids": ids, **columns}
    return TRLCall(samples, rows, {k: v for k, v in kwargs.items() if k not in columns})


def per_row(kwargs: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The keywords TRL passes with one value per completion (dataset columns), of ``n`` completions."""
    return {k: v for k, v in kwargs.items() if isinstance(v, (list, tuple)) and len(v) == n}


def samples_from_trl(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]] | None = None,
    columns: Mapping[str, Any] | None = None,
    eos_token_id: EosIds = None,
) -> list[Sample]:
    """textgym samples from TRL's arguments. Prompts and completions may be plain text or, for
    conversational data, lists of ``{"role", "content"}`` messages (the prompt's last user message is used;
    a completion of several messages, as with tools, is a multi-turn sample whose completion is the last
    assistant message). A keyword that is a list with one value per completion becomes
    metadata, ``None`` values included: a dataset's empty cell reads as a prompt file's ``null`` (a reference
    that does not apply: ``match`` leaves the completion out), while a column the dataset lacks is a
    missing key (``match`` says so). A ``finish_reason`` column sets the samples'
    finish reasons; TRL has none, so with ``eos_token_id`` and ``completion_ids`` a completion that does not
    end on the EOS was cut (``"length"``), and otherwise every one counts as ``"stop"``."""
    n = len(completions)
    if len(prompts) != n:
        raise ConfigError(
            f"got {len(prompts)} prompts for {n} completions; TRL passes one prompt per completion."
        )
    if completion_ids is not None and len(completion_ids) != n:
        raise ConfigError(f"got {len(completion_ids)} completion_ids for {n} completions.")
    columns = {
        key: list(values) for key, values in per_row(columns or {}, n).items() if key not in NOT_COLUMNS
    }
    finish = columns.pop("finish_reason", None)
    eos = eos_ids(eos_token_id)
    if finish is None and eos is not None and completion_ids is not None:
        finish = ["stop" if len(ids) and int(ids[-1]) in eos else "length" for ids in completion_ids]
    finish = finish or ["stop"] * n
    texts = [_completion(c) for c in completions]
    return [
        Sample(
            prompt=_prompt(prompts[i]),
            completion=completion,
            completion_ids=tuple(int(t) for t in completion_ids[i]) if completion_ids is not None else (),
            finish_reason=finish[i] if finish[i] in ("stop", "length") else "stop",
            meta={key: values[i] for key, values in columns.items()},
            turns=turns,
        )
        for i, (completion, turns) in enumerate(texts)
    ]


def eos_ids(eos_token_id: EosIds) -> frozenset[int] | None:
    """The EOS ids of ``eos_token_id`` (one id or several), else a ConfigError naming it."""
    if eos_token_id is None or isinstance(eos_token_id, frozenset):
        return eos_token_id
    several = isinstance(eos_token_id, Iterable) and not isinstance(eos_token_id, (str, bytes))
    ids = list(eos_token_id) if several else [eos_token_id]
    if not ids or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in ids):
        raise ConfigError(
            f"eos_token_id must be a token id or a list of them (tokenizer.eos_token_id, or the model's "
            f"generation_config.eos_token_id), not {eos_token_id!r}."
        )
    return frozenset(int(i) for i in ids)


def _completion(value: Any) -> tuple[str, tuple[Turn, ...]]:
    """The completion's text and, for several messages (a tool-calling completion: the assistant's call, the
    tool's result, the assistant's answer), its turns: then the text is the last assistant message's, as in a
    multi-turn textgym episode."""
    if isinstance(value, str):
        return value, ()
    messages = _messages(value)
    if len(messages) == 1:
        return _content(messages[0]), ()
    turns = tuple(Turn(str(m.get("role", AGENT_ROLE)), _content(m)) for m in messages)
    return next((t.text for t in reversed(turns) if t.role == AGENT_ROLE), ""), turns


def _prompt(value: Any) -> str:
    """A plain prompt, or a conversation's last user message (its last message if no user wrote)."""
    if isinstance(value, str):
        return value
    messages = _messages(value)
    users = [m for m in messages if m.get("role") == "user"] or messages
    return _content(users[-1]) if users else ""


def _messages(value: Any) -> list[Mapping[str, Any]]:
    if (
        isinstance(value, Sequence)
        and not isinstance(value, (str, bytes))
        and all(isinstance(m, Mapping) and ("content" in m or "role" in m) for m in value)
    ):
        return list(value)
    raise ConfigError(f"{value!r} is neither text nor a list of chat messages ({{'role', 'content'}}).")


def _content(message: Mapping[str, Any]) -> str:
    """A message's text: ``None`` or no content (a message with tool calls only) is empty; a list of parts
    (``{"type": "text", "text": ...}``) gives its text parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(str(p["text"]) for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return str(content)
