"""Samples, the Reward protocol, and the weighted stack of reward plugins: its specs and its total.

How the stack combines its components (schedules, ``normalize_then_sum``, gates) lives in
:mod:`textgym.composition`, the checks of every plugin's output in :mod:`textgym.reward_checks`, plain
functions as rewards in :mod:`textgym.reward_functions`, building a registered plugin from its arguments in
:mod:`textgym.factories`; docs/rewards.md is the user's guide.
"""

from __future__ import annotations

import inspect
import os
import tomllib
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from textgym import composition
from textgym.composition import Gate, Weight
from textgym.errors import ConfigError, PluginArgumentError, RewardError
from textgym.factories import build_registered, check_arguments
from textgym.reward_checks import TimeoutReward, validated_scores
from textgym.reward_functions import (
    TRL_COLUMNS,
    FunctionReward,
    as_reward,
    fixed_signature,
    function_reward,
    is_trl_style,
    load_function,
)

FinishReason = Literal["stop", "length", "max_turns", "overflow"]
# The finish reasons whose completion ends on the token that ended it (EOS, or a stop string's): it stopped,
# or (multi-turn) the agent's last turn ended before its reply was withheld (max_turns) or did not fit
# (overflow). Only "length" was cut without one.
ENDED_ON_A_TOKEN: tuple[FinishReason, ...] = ("stop", "max_turns", "overflow")


@dataclass(frozen=True)
class Turn:
    """One turn of a multi-turn episode: who wrote it (``"assistant"`` for the agent, else the responder's
    role, e.g. ``"tool"`` or ``"user"``), its text, and the token ids it occupies in the episode (for an
    environment turn: the reply formatted with the chat template)."""

    role: str
    text: str
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Sample:
    """One finished episode: the unit a reward scores.

    Attributes:
        prompt: the prompt text as the user wrote it (before any chat template).
        completion: the generated text, without the EOS token or the stop string.
        prompt_ids: token ids the model saw as the prompt (chat template applied, if any).
        completion_ids: generated token ids, EOS included when the episode ended on it, and the tokens of the
            stop string when one ended it.
        finish_reason: ``"stop"`` (EOS or a stop string; in a multi-turn episode: the responder ended it),
            ``"length"`` (hit ``max_new_tokens``), and in multi-turn episodes ``"max_turns"`` (the agent's
            last allowed turn ended) or ``"overflow"`` (the environment's reply did not fit the token budget).
        meta: whatever the prompt source attached to the prompt (reference answer, topic, ...).
        turns: in a multi-turn episode, every turn after the prompt in order, the agent's and the
            environment's (:class:`Turn`); ``completion`` is then the agent's last turn. Empty for a
            single-turn episode.
        stop_tokens: how many of the last ``completion_ids`` ended the completion and are not in its text:
            1 for an EOS, the tokens of a stop string, 0 for a completion cut at the limit. ``None`` (a sample
            built outside an env, as from TRL's arguments): not known, and taken as 1 where ``finish_reason``
            says it ended on a token (:data:`ENDED_ON_A_TOKEN`), else 0 (:meth:`text_tokens`).
    """

    prompt: str
    completion: str
    prompt_ids: tuple[int, ...] = ()
    completion_ids: tuple[int, ...] = ()
    finish_reason: FinishReason = "stop"
    meta: Mapping[str, Any] = field(default_factory=dict)
    turns: tuple[Turn, ...] = ()
    stop_tokens: int | None = None

    def text_tokens(self) -> int:
        """How many of ``completion_ids`` make up ``completion``: those before the EOS or stop string."""
        n = len(self.completion_ids)
        if self.stop_tokens is not None:
            return max(n - self.stop_tokens, 0)
        return n - 1 if self.finish_reason in ENDED_ON_A_TOKEN and n else n


@runtime_checkable
class Reward(Protocol):
    """Anything with a ``name`` that scores a batch of samples: one float, or ``None`` where the reward does
    not apply, per sample. May also have ``close()``."""

    name: str

    def __call__(self, samples: Sequence[Sample]) -> Sequence[float | None]: ...


class RewardStack:
    """Weighted reward components that validate every plugin's output and combine into one total.

    ``RewardStack([(reward, weight), ...]).score(samples)`` returns ``(total, components)``: ``total`` is a
    float array (one per sample, the training signal), ``components`` maps each component's name to its raw
    (unweighted) scores, NaN where the reward returned ``None`` (not applicable).

    Args:
        rewards: ``(reward, weight)`` pairs. A reward is a :class:`Reward` or a plain function; a weight is a
            number (0 = logged metric only) or a :class:`~textgym.composition.WeightSchedule` (or its table).
        aggregate: ``"sum"`` (the weighted sum of applicable scores) or ``"normalize_then_sum"`` (each
            component standardised over the samples scored together first).
        gates: :class:`~textgym.composition.Gate` objects or tables; applied to the total in order.
    """

    def __init__(
        self,
        rewards: Sequence[tuple[Reward | Callable, Weight | Mapping[str, Any]]],
        aggregate: str = "sum",
        gates: Sequence[Gate | Mapping[str, Any]] = (),
    ):
        self.rewards: list[tuple[Reward, Weight]] = []
        for reward, weight in rewards:
            reward = as_reward(reward)
            self.rewards.append((reward, composition.parse_weight(weight, f"reward {reward.name!r}")))
        self.names: list[str] = composition.unique_names([r.name for r, _ in self.rewards])
        self.aggregate = composition.check_aggregate(aggregate, "RewardStack")
        self.gates: tuple[Gate, ...] = tuple(Gate.from_spec(g, self.names, "RewardStack") for g in gates)
        if self.aggregate == "normalize_then_sum" and any(g.action == "zero" for g in self.gates):
            warnings.warn(
                "a gate with action = 'zero' under aggregate = 'normalize_then_sum' sets a failing sample's total to "
                "0, the batch's mean: a failing sample below the mean gains from failing. To penalise it, use "
                "action = 'cap' with a cap below the batch's totals (e.g. cap = -3, three standard deviations).",
                UserWarning,
                stacklevel=2,
            )
        self.progress = 0.0

    def set_progress(self, p: float) -> None:
        """Set training progress ``p`` in [0, 1] (0 at the start): scheduled weights follow it. Training code
        calls this once per iteration, e.g. with ``num_timesteps / total_timesteps``."""
        self.progress = composition.check_progress(p)

    def weights_at(self, p: float) -> dict[str, float]:
        """Each component's weight at progress ``p`` (for logging and for TRL's ``reward_weights``)."""
        p = composition.check_progress(p)
        return {name: composition.weight_at(w, p) for name, (_, w) in zip(self.names, self.rewards)}

    @property
    def weights(self) -> dict[str, float]:
        """Each component's weight at the current progress."""
        return self.weights_at(self.progress)

    @property
    def is_metrics_only(self) -> bool:
        """True when no component has a non-zero weight at any point of the run: nothing to train on."""
        return all(composition.is_metric_weight(w) for _, w in self.rewards)

    def score_component(self, name: str, samples: Sequence[Sample]) -> np.ndarray:
        """One component's raw scores, validated (NaN = not applicable)."""
        return validated_scores(name, self.rewards[self.names.index(name)][0], samples)

    def score(self, samples: Sequence[Sample]) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        if not samples or not self.names:
            empty = np.zeros(len(samples), dtype=np.float64)
            return empty, {name: empty.copy() for name in self.names}
        components = {
            name: validated_scores(name, r, samples) for name, (r, _) in zip(self.names, self.rewards)
        }
        return self.combine(components), components

    def combine(self, components: Mapping[str, Sequence[float]]) -> np.ndarray:
        """The totals from raw component scores (NaN = not applicable): aggregate at the current progress,
        then the gates. ``score`` calls it on one batch; training code may call it on the components of a
        whole rollout (e.g. ``normalize_then_sum`` over all of a prompt's completions)."""
        missing = [name for name in self.names if name not in components]
        if missing:
            raise RewardError(f"components {missing} are missing; this stack has {self.names}.")
        scores = np.column_stack([np.asarray(components[n], dtype=np.float64) for n in self.names])  # (N, K)
        weights = np.array(list(self.weights.values()))  # (K,)
        total = composition.AGGREGATORS[self.aggregate](scores, weights)
        for gate in self.gates:
            total = gate.apply(total, scores[:, self.names.index(gate.component)])
        bad = np.flatnonzero(~np.isfinite(total))
        if len(bad):  # finite scores whose weighted sum overflowed (1e308 x 10), or inf - inf
            i = int(bad[0])
            weighted = {n: float(w) * scores[i, k] for k, (n, w) in enumerate(zip(self.names, weights))}
            raise RewardError(
                f"the total reward of sample {i} is {total[i]} (weighted scores {weighted}): the components' "
                f"scores are finite, but too large to sum; scale them down or lower their weights."
            )
        return total

    def close(self) -> None:
        for reward, _ in self.rewards:
            close = getattr(reward, "close", None)
            if callable(close):
                close()

    def __repr__(self) -> str:
        parts = [
            f"{n}×{w:g}" if isinstance(w, float) else f"{n}×[{w}]"
            for n, (_, w) in zip(self.names, self.rewards)
        ]
        if self.aggregate != "sum":
            parts.append(f"aggregate={self.aggregate!r}")
        parts += [f"gate: {gate}" for gate in self.gates]
        return "RewardStack(" + ", ".join(parts) + ")"


REWARD_SPEC_KEYS = ("weight", "timeout")  # a reward spec's keys that are not its plugin's arguments


def make_reward(name: str, **kwargs: Any) -> Reward:
    """Build the reward registered as ``name`` with ``kwargs``; unknown arguments are an error."""
    return build_registered("reward", "register_rewards", name, kwargs, RewardError)


RewardSpec = Mapping[str, Any] | str | tuple[Any, float] | Reward | Callable[..., Any]
BaseDir = str | os.PathLike | None


@dataclass
class _Component:
    """A component spec, checked but not built: its name, its weight, and how to build it."""

    name: str
    weight: Weight
    build: Callable[[], Reward]


def _component(spec: RewardSpec, base_dir: BaseDir, where: str) -> _Component:
    """Check one component spec (names, arguments, weight, ``fn`` target) without building it."""
    from textgym import plugin_manager

    if isinstance(spec, str):
        spec = parse_reward_spec(spec)
    if isinstance(spec, Mapping) and "timeout" in spec and not takes_its_own_timeout(spec, base_dir, where):
        args = dict(spec)
        seconds = args.pop("timeout")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ConfigError(f"{where}: timeout must be a number of seconds > 0, not {seconds!r}.")
        inner = _component(args, base_dir, where)
        return _Component(inner.name, inner.weight, lambda: TimeoutReward(inner.build(), float(seconds)))
    if isinstance(spec, Mapping):
        args = dict(spec)
        if "fn" in args:
            ref, display = args.pop("fn"), args.pop("name", None)
            if callable(ref):  # in Python, the function itself, as in the (function, weight) form
                fn, source = ref, f"{getattr(ref, '__module__', '?')}:{getattr(ref, '__qualname__', ref)}"
            else:
                fn, source = load_function(ref, base_dir, where), str(ref)
            name = display or getattr(fn, "__name__", str(ref))
            weight = composition.parse_weight(args.pop("weight", 1.0), f"{where}: reward {name!r}")
            _check_fixed_arguments(fn, name, args)
            return _Component(name, weight, lambda: function_reward(fn, name, source, **args))
        if "name" not in args:
            # `--reward match=1`, a weight written as name=weight: the spec's form, for that reward
            hint = ""
            if len(args) == 1 and (key := next(iter(args))) in plugin_manager.registry("register_rewards"):
                hint = f" For the reward {key!r} with a weight, write '{key} weight={args[key]}'."
            raise ConfigError(
                f"{where}: reward spec {dict(spec)!r} has no 'name' (a registered reward) or 'fn' (a function, "
                f"'path/to/file.py:func' or 'module:func').{hint}"
            )
        name = args.pop("name")
        weight = composition.parse_weight(args.pop("weight", 1.0), f"{where}: reward {name!r}")
        check_arguments(
            "reward", name, plugin_manager.get("register_rewards", name).value, args, REWARD_SPEC_KEYS
        )
        return _Component(name, weight, lambda: make_reward(name, **args))
    if isinstance(spec, tuple) and len(spec) == 2:
        reward = as_reward(spec[0])
        weight = composition.parse_weight(spec[1], f"{where}: reward {reward.name!r}")
        return _Component(reward.name, weight, lambda: reward)
    if callable(spec):
        reward = as_reward(spec)
        return _Component(reward.name, 1.0, lambda: reward)
    raise ConfigError(
        f"{where}: {spec!r} is not a reward spec: give a table with a 'name' or an 'fn', a spec string, "
        f"(reward, weight), or a function."
    )


def takes_its_own_timeout(spec: Mapping[str, Any], base_dir: BaseDir, where: str) -> bool:
    """Whether the plugin or function of ``spec`` has a ``timeout`` argument of its own (``math``'s, a judge
    model's): the spec's ``timeout`` is then that argument, as the plugin documents it, not textgym's limit
    on its calls. A factory taking ``**kwargs`` does not count (its arguments are not named)."""
    from textgym import plugin_manager

    if "fn" in spec:
        ref = spec["fn"]
        target = ref if callable(ref) else load_function(ref, base_dir, where)
    elif isinstance(spec.get("name"), str) and spec["name"] in plugin_manager.registry("register_rewards"):
        target = plugin_manager.get("register_rewards", spec["name"]).value
    else:
        return False
    try:
        param = inspect.signature(target).parameters.get("timeout")
    except (TypeError, ValueError):
        return False
    return param is not None and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)


def _check_fixed_arguments(fn: Callable, name: str, args: Mapping[str, Any]) -> None:
    if is_trl_style(fn):
        reserved = sorted(set(args) & set(TRL_COLUMNS))
        if reserved:
            raise PluginArgumentError(
                f"reward function {name!r}: {', '.join(map(repr, reserved))} is filled in by textgym on every "
                f"call; remove it from the spec."
            )
    signature = fixed_signature(fn)
    if signature is not None:
        check_arguments("reward function", name, signature, args, ("fn", "name", *REWARD_SPEC_KEYS))


def _components(
    specs: Any, base_dir: BaseDir, where: str, allow_all_metrics: bool
) -> tuple[dict[str, Any], list[_Component], list[str]]:
    table = composition.stack_table(specs, where)
    components = [_component(spec, base_dir, where) for spec in table["components"]]
    names = composition.unique_names([c.name for c in components])
    for gate in table["gates"]:
        Gate.from_spec(gate, names, where)
    if not components and not allow_all_metrics:
        raise ConfigError(f"{where}: the reward stack has no components; give at least one reward.")
    if not allow_all_metrics and all(composition.is_metric_weight(c.weight) for c in components):
        raise ConfigError(
            f"{where}: every component ({', '.join(names) or 'none'}) has weight 0, so the total is always 0 "
            f"and there is nothing to train on. Give at least one component a non-zero weight (weight 0 "
            f"keeps a reward as a logged metric); a stack of metrics only is built with "
            f"allow_all_metrics=True."
        )
    return table, components, names


def check_reward_specs(
    specs: Any, where: str = "rewards", base_dir: BaseDir = None, *, allow_all_metrics: bool = False
) -> None:
    """Check a stack spec without building it (no models are loaded): reward names and arguments, ``fn``
    targets (their files are imported), weights and schedules, aggregate, gates, and that something is
    trained on unless ``allow_all_metrics``. ``base_dir`` resolves relative ``fn`` paths (default: the
    current directory)."""
    _components(specs, base_dir, where, allow_all_metrics)


def build_reward_stack(
    specs: RewardStack | Any = None, base_dir: BaseDir = None, *, allow_all_metrics: bool = False
) -> RewardStack:
    """A :class:`RewardStack` from a spec: a list of component specs, or a table
    ``{"aggregate": ..., "components": [...], "gates": [...]}``.

    A component spec is ``{"name": ..., "weight": ..., **args}`` (a registered reward),
    ``{"fn": "path/to/file.py:func" or "module:func", "weight": ..., "name": ..., **fixed_kwargs}``,
    ``"name weight=0.5 target=32"``, ``(reward, weight)``, a reward object or a plain function (weight 1).
    A weight is a number or a schedule table ``{"start": 1.0, "end": 0.2, "from": 0.2, "to": 0.8}``.

    Args:
        specs: the spec; a :class:`RewardStack` is returned as it is; None gives a default length reward.
        base_dir: where relative ``fn`` file paths resolve (default: the current directory).
        allow_all_metrics: allow a stack whose weights are all 0 (an error otherwise: nothing to train on).
    """
    if isinstance(specs, RewardStack):
        return specs
    if specs is None:
        specs = [{"name": "length_penalty", "target": 32}]
    table, components, _ = _components(specs, base_dir, "rewards", allow_all_metrics)
    return RewardStack([(c.build(), c.weight) for c in components], table["aggregate"], table["gates"])


def build_reward(spec: RewardSpec, base_dir: BaseDir = None, where: str = "rewards") -> tuple[Reward, Weight]:
    """One component, built: ``(reward, weight)``."""
    component = _component(spec, base_dir, where)
    return component.build(), component.weight


def parse_reward_spec(text: str) -> dict[str, Any]:
    """``"length_penalty weight=0.2 target=32 unit='words'"`` -> a spec dict (values parsed as TOML).

    A spec without a leading name, such as ``"fn=my_rewards.py:brevity weight=0.5"``, is all key=value pairs.
    """
    words = _split_spec(text)
    spec: dict[str, Any] = {}
    if words and "=" not in words[0]:
        spec["name"] = words.pop(0)
    for pair in words:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ConfigError(f"reward spec {text!r}: {pair!r} is not key=value.")
        if key in spec:  # the last one would win without a word; a name= would replace the leading name
            raise ConfigError(f"reward spec {text!r}: {key} is given twice; give it once.")
        try:
            spec[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            spec[key] = value  # a bare word: take it as a string
    return spec


def _split_spec(text: str) -> list[str]:
    """Split on whitespace outside quotes and brackets, keeping both, so values stay TOML:
    ``keyword_bonus keywords=['thank you', "please"]`` -> ``["keyword_bonus", "keywords=['thank you', \"please\"]"]``."""
    words, current, quote, depth = [], "", None, 0
    for char in text:
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char.isspace() and depth == 0:
            if current:
                words.append(current)
            current = ""
            continue
        current += char
    if quote or depth:
        raise ConfigError(f"reward spec {text!r} has an unclosed quote or bracket.")
    return [*words, current] if current else words


def reward(name: str) -> Callable[[Callable[..., Sequence[float]]], Callable[..., Sequence[float]]]:
    """Register a batched function as a reward plugin, for quick experiments in a plain file.

    Example::

        import textgym

        @textgym.reward("shouting")
        def shouting(samples, bonus=1.0):
            return [bonus * sum(c.isupper() for c in s.completion) / max(len(s.completion), 1)
                    for s in samples]

    Extra keyword arguments of the function become the reward's arguments in a spec. A function with TRL's
    signature (``prompts, completions, **kwargs``) works too.
    """
    from textgym import plugin_manager

    plugin_manager.check_decorator_name(name, "@textgym.reward")

    def decorator(fn: Callable[..., Sequence[float]]) -> Callable[..., Sequence[float]]:
        plugin_manager.check_decorated(fn, "@textgym.reward", "register_rewards")

        def factory(**kwargs: Any) -> FunctionReward:
            return FunctionReward(name, fn, **kwargs)

        factory.__signature__ = fixed_signature(fn)  # type: ignore[attr-defined]
        factory.__doc__ = fn.__doc__  # (`textgym plugins NAME` shows it)
        plugin_manager.register_function_plugin("register_rewards", name, factory, fn, "@textgym.reward")
        return fn

    return decorator
