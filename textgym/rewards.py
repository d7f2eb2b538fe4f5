"""Samples, the Reward protocol, and the weighted stack of reward plugins."""

from __future__ import annotations

import inspect
import math
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from textgym.errors import ConfigError, PluginArgumentError, RewardError

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class Sample:
    """One finished episode: the unit a reward scores.

    Attributes:
        prompt: the prompt text as the user wrote it (before any chat template).
        completion: the generated text, without the EOS token or the stop string.
        prompt_ids: token ids the model saw as the prompt (chat template applied, if any).
        completion_ids: generated token ids, EOS included when the episode ended on it.
        finish_reason: ``"stop"`` (EOS or a stop string) or ``"length"`` (hit ``max_new_tokens``).
        meta: whatever the prompt source attached to the prompt (reference answer, topic, ...).
    """

    prompt: str
    completion: str
    prompt_ids: tuple[int, ...] = ()
    completion_ids: tuple[int, ...] = ()
    finish_reason: FinishReason = "stop"
    meta: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class Reward(Protocol):
    """Anything with a ``name`` that scores a batch of samples, one float each. May also have ``close()``."""

    name: str

    def __call__(self, samples: Sequence[Sample]) -> Sequence[float]: ...


class FunctionReward:
    """A reward made from a plain batched function ``fn(samples, **kwargs) -> list[float]``."""

    def __init__(self, name: str, fn: Callable[..., Sequence[float]], **kwargs: Any):
        self.name, self.fn, self.kwargs = name, fn, kwargs

    def __call__(self, samples: Sequence[Sample]) -> Sequence[float]:
        return self.fn(samples, **self.kwargs)

    def __repr__(self) -> str:
        return f"FunctionReward({self.name!r}, {self.fn.__qualname__}, **{self.kwargs!r})"


class RewardStack:
    """A weighted sum of rewards that validates every plugin's output.

    ``RewardStack([(reward, weight), ...]).score(samples)`` returns ``(total, components)``: ``total`` is a
    float array (one per sample), ``components`` maps each reward's name to its raw (unweighted) scores.
    A weight of 0 keeps a reward as a logged metric that does not change the total.
    """

    def __init__(self, rewards: Sequence[tuple[Reward, float]]):
        self.rewards: list[tuple[Reward, float]] = []
        self.names: list[str] = []
        for reward, weight in rewards:
            if not callable(reward) or not hasattr(reward, "name"):
                raise ConfigError(f"{reward!r} is not a reward: it needs a `name` and `__call__(samples)`.")
            if not isinstance(weight, (int, float)) or not math.isfinite(weight):
                raise ConfigError(f"weight {weight!r} of reward {reward.name!r} must be a finite number.")
            name, n = reward.name, 2
            while name in self.names:  # the same plugin twice with other arguments
                name, n = f"{reward.name}_{n}", n + 1
            self.names.append(name)
            self.rewards.append((reward, float(weight)))

    @property
    def weights(self) -> dict[str, float]:
        return {name: weight for name, (_, weight) in zip(self.names, self.rewards)}

    def score(self, samples: Sequence[Sample]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        total = np.zeros(len(samples), dtype=np.float64)
        components: dict[str, np.ndarray] = {}
        if not samples:
            return total, {name: total.copy() for name in self.names}
        for name, (reward, weight) in zip(self.names, self.rewards):
            scores = _validated(name, reward, samples)
            components[name] = scores
            if weight:
                total += weight * scores
        return total, components

    def close(self) -> None:
        for reward, _ in self.rewards:
            close = getattr(reward, "close", None)
            if callable(close):
                close()

    def __repr__(self) -> str:
        return "RewardStack(" + ", ".join(f"{n}×{w:g}" for n, w in self.weights.items()) + ")"


def _validated(name: str, reward: Reward, samples: Sequence[Sample]) -> np.ndarray:
    try:
        out = reward(samples)
    except Exception as exc:
        raise RewardError(f"reward plugin {name!r} raised {type(exc).__name__}: {exc}") from exc
    try:
        scores = np.asarray(out, dtype=np.float64)
        if scores.ndim != 1:
            raise ValueError
    except (TypeError, ValueError):
        raise RewardError(
            f"reward plugin {name!r} returned {type(out).__name__} {str(out)[:80]!r}; "
            f"it must return one float per sample."
        ) from None
    if len(scores) != len(samples):
        raise RewardError(
            f"reward plugin {name!r} returned {len(scores)} scores for {len(samples)} samples; "
            f"it must return exactly one score per sample."
        )
    bad = ~np.isfinite(scores)
    if bad.any():
        i = int(np.argmax(bad))
        raise RewardError(
            f"reward plugin {name!r} returned {scores[i]} for sample {i} "
            f"(completion {samples[i].completion[:60]!r}); scores must be finite."
        )
    return scores


def check_arguments(kind: str, name: str, factory: Callable[..., Any], kwargs: Mapping[str, Any]) -> None:
    """Raise :class:`PluginArgumentError` if ``factory`` does not take every key of ``kwargs``."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    valid = [p.name for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise PluginArgumentError(
            f"{kind} {name!r} got unknown argument(s) {', '.join(map(repr, unknown))}. "
            f"Valid arguments: {', '.join(valid) or '(none)'}."
        )


def make_reward(name: str, **kwargs: Any) -> Reward:
    """Build the reward registered as ``name`` with ``kwargs``; unknown arguments are an error."""
    from textgym import plugin_manager

    factory = plugin_manager.get("register_rewards", name).value
    check_arguments("reward", name, factory, kwargs)
    try:
        reward = factory(**kwargs)
    except PluginArgumentError:
        raise
    except (TypeError, ValueError) as exc:
        raise PluginArgumentError(f"reward {name!r}: {exc}") from exc
    if not callable(reward):
        raise RewardError(f"reward plugin {name!r}: its factory returned {reward!r}, which is not callable.")
    try:
        reward.name = name  # components carry the name users type in configs
    except AttributeError:
        pass
    return reward


RewardSpec = Mapping[str, Any] | str | tuple[Any, float] | Reward


def check_reward_specs(specs: Sequence[RewardSpec], where: str = "rewards") -> None:
    """Check names and argument names of reward specs without building them (no models are loaded)."""
    from textgym import plugin_manager

    for spec in specs:
        if isinstance(spec, str):
            spec = parse_reward_spec(spec)
        if not isinstance(spec, Mapping) or "name" not in spec:
            raise ConfigError(f"{where}: {spec!r} is not a reward spec (a table with a 'name').")
        args = {k: v for k, v in spec.items() if k not in ("name", "weight")}
        factory = plugin_manager.get("register_rewards", spec["name"]).value
        check_arguments("reward", spec["name"], factory, args)


def build_reward_stack(specs: RewardStack | Sequence[RewardSpec] | None) -> RewardStack:
    """A :class:`RewardStack` from specs: ``{"name": ..., "weight": ..., **args}``, ``"name"``,
    ``"name weight=0.5 target=32"``, ``(reward, weight)`` or a reward object (weight 1)."""
    if isinstance(specs, RewardStack):
        return specs
    if specs is None:
        specs = [{"name": "length_penalty", "target": 32}]
    if isinstance(specs, (str, Mapping)):
        specs = [specs]
    rewards: list[tuple[Reward, float]] = []
    for spec in specs:
        if isinstance(spec, str):
            spec = parse_reward_spec(spec)
        if isinstance(spec, Mapping):
            args = dict(spec)
            if "name" not in args:
                raise ConfigError(f"reward spec {dict(spec)!r} has no 'name'.")
            name, weight = args.pop("name"), args.pop("weight", 1.0)
            rewards.append((make_reward(name, **args), weight))
        elif isinstance(spec, tuple) and len(spec) == 2:
            rewards.append((spec[0], spec[1]))
        else:
            rewards.append((spec, 1.0))
    return RewardStack(rewards)


def parse_reward_spec(text: str) -> dict[str, Any]:
    """``"length_penalty weight=0.2 target=32 unit='words'"`` -> a spec dict (values parsed as TOML)."""
    name, *pairs = text.split()
    spec: dict[str, Any] = {"name": name}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"reward spec {text!r}: {pair!r} is not key=value.")
        try:
            spec[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            spec[key] = value  # a bare word: take it as a string
    return spec


def reward(name: str) -> Callable[[Callable[..., Sequence[float]]], Callable[..., Sequence[float]]]:
    """Register a batched function as a reward plugin, for quick experiments in a plain file.

    Example::

        import textgym

        @textgym.reward("shouting")
        def shouting(samples, bonus=1.0):
            return [bonus * sum(c.isupper() for c in s.completion) / max(len(s.completion), 1)
                    for s in samples]

    Extra keyword arguments of the function become the reward's arguments in a spec.
    """

    def decorator(fn: Callable[..., Sequence[float]]) -> Callable[..., Sequence[float]]:
        from textgym import plugin_manager
        from textgym.hookspecs import hookimpl

        def factory(**kwargs: Any) -> FunctionReward:
            return FunctionReward(name, fn, **kwargs)

        params = list(inspect.signature(fn).parameters.values())[1:]
        factory.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [p.replace(kind=p.KEYWORD_ONLY) for p in params]
        )

        class _Plugin:
            @staticmethod
            @hookimpl
            def register_rewards(register: Callable[..., None]) -> None:
                register(name, factory)

        file = inspect.getsourcefile(fn) or fn.__module__
        plugin_manager.register_plugin(
            _Plugin(), name=f"{file}::{fn.__name__}", source=f"@textgym.reward in {file}"
        )
        return fn

    return decorator
