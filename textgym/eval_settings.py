"""What an evaluation measures, as configured: the ``[eval]`` section (and a bench's ``[metrics]``), its metric
reward specs with their labels and ranges, and the built-in metrics. :mod:`textgym.evaluation` measures them."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from textgym.config import MAX_SEED, settings_table
from textgym.errors import ConfigError


@dataclass(frozen=True)
class MetricInfo:
    """How a metric reads: which way is better (None: not ranked) and the range its values live in."""

    direction: str | None
    low: float = -math.inf
    high: float = math.inf
    doc: str = ""


BUILTIN_METRICS: dict[str, MetricInfo] = {
    "kl": MetricInfo(
        "lower", 0.0, math.inf, "KL(policy || reference) per completion in nats: the sum over its tokens of "
        "log pi - log pi_ref of the sampled tokens, both at the sampling temperature (LM agents only)"
    ),
    "length": MetricInfo(None, 0.0, math.inf, "generated tokens per completion, EOS included"),
    "distinct_2": MetricInfo(
        "higher", 0.0, 1.0, "unique token bigrams / all token bigrams over the held-out completions (multi-turn: within each agent turn)"
    ),
    "eos_rate": MetricInfo(
        "higher", 0.0, 1.0, "share of completions that ended on EOS or a stop string (multi-turn: the last turn)"
    ),
}  # fmt: skip
REWARD = "reward"  # the training total on the held-out prompts: always reported
RESERVED = (REWARD, *BUILTIN_METRICS, "iteration", "timesteps")
EVAL_DEFAULTS: dict[str, Any] = {
    "every": 10,
    "prompts": None,
    "episodes": 32,
    "rewards": [],
    "builtin": list(BUILTIN_METRICS),
    "seed": 1234,
}
# keys of a metric reward spec that are not the reward's own; `args` holds reward arguments of those names
METRIC_SPEC_KEYS = ("label", "range", "args")


# -- the section and its metric specs --------------------------------------------------------------
def check_eval_section(section: Any, where: str) -> dict[str, Any]:
    """The ``[eval]`` settings with defaults filled in, checked for types and names. The metric rewards'
    plugin names and arguments are checked by :func:`check_metric_specs` once plugin files are loaded."""
    resolved = settings_table(section, "eval", EVAL_DEFAULTS, where)
    for key in ("every", "episodes"):
        check_positive_int(f"eval.{key}", resolved[key], where)
    seed = resolved["seed"]
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED:
        raise ConfigError(f"{where}: eval.seed must be an integer in [0, 2**32), not {seed!r}.")
    if resolved["prompts"] is not None and not isinstance(resolved["prompts"], (str, list)):
        raise ConfigError(
            f"{where}: eval.prompts must be a prompt source (a registered name or a file) or a list of "
            f"prompts, not {resolved['prompts']!r}."
        )
    resolved["builtin"] = check_builtin(resolved["builtin"], f"{where}: eval.builtin")
    resolved["rewards"] = metric_specs(resolved["rewards"], f"{where}: eval.rewards")
    return resolved


def check_positive_int(name: str, value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where}: {name} must be a positive integer, not {value!r}.")


def check_builtin(names: Any, where: str) -> list[str]:
    from textgym.errors import UnknownNameError

    if isinstance(names, str) or not isinstance(names, list):
        raise ConfigError(f"{where} must be a list of built-in metric names ({', '.join(BUILTIN_METRICS)}).")
    for name in names:
        if name not in BUILTIN_METRICS:
            raise UnknownNameError("metric", name, BUILTIN_METRICS, where)
    return list(dict.fromkeys(names))


def metric_specs(specs: Any, where: str) -> list[dict[str, Any]]:
    """Metric reward specs as tables (a spec string is parsed), each with a checked ``label`` (default: its
    reward name) and optional ``range = [low, high]`` (confidence intervals are clipped to it)."""
    from textgym.rewards import parse_reward_spec

    if isinstance(specs, Mapping) and "components" in specs:
        raise ConfigError(
            f"{where}: a stack table (components, aggregate, gates) combines rewards into a training total; "
            f"metrics are measured one by one. Give them as a list of reward specs, e.g. the components "
            f"alone: {list(specs['components'])!r}."
        )
    if isinstance(specs, (str, Mapping)) or not isinstance(specs, list):
        raise ConfigError(f"{where} must be a list of reward specs, not {specs!r}.")
    out = []
    for spec in specs:
        spec = parse_reward_spec(spec) if isinstance(spec, str) else spec
        if not isinstance(spec, Mapping) or not ("name" in spec or "fn" in spec):
            raise ConfigError(
                f"{where}: {spec!r} is not a reward spec; give a table with a 'name' (a registered reward) or "
                f'an \'fn\', e.g. {{ name = "match", label = "exact_copy" }}.'
            )
        spec = dict(spec)
        spec["label"] = label = spec.get("label", metric_label(spec))
        if not isinstance(label, str) or not label.strip() or label != label.strip():
            raise ConfigError(
                f"{where}: metric label {label!r} must be a non-empty name without spaces around it."
            )
        if label in RESERVED or label.endswith(("_se", "_n")):
            raise ConfigError(
                f"{where}: metric label {label!r} clashes with a built-in metric or column ({', '.join(RESERVED)}, "
                f"and names ending in _se or _n); give this metric another `label`."
            )
        if not isinstance(spec.get("args", {}), Mapping):
            raise ConfigError(
                f"{where}: metric {label!r}: args = {spec['args']!r} must be a table of the reward's arguments, "
                f"e.g. args = {{ label = 1 }} for an argument named as a metric's own key."
            )
        if "range" in spec:
            value = spec["range"]
            ok = isinstance(value, list) and len(value) == 2 and all(_is_number(v) for v in value)
            if not ok or not value[0] < value[1]:
                raise ConfigError(
                    f"{where}: metric {label!r}: range = {value!r} must be [low, high] with low < high."
                )
        out.append(spec)
    labels = [s["label"] for s in out]
    repeated = sorted({x for x in labels if labels.count(x) > 1})
    if repeated:
        raise ConfigError(
            f"{where}: metric name {repeated[0]!r} repeats; give the metrics distinct `label`s."
        )
    return out


def metric_label(spec: Mapping[str, Any]) -> str:
    """A metric's default name: its reward name, or the function name of an ``fn`` spec."""
    return str(spec.get("name") or str(spec.get("fn")).rpartition(":")[2])


def check_metric_specs(specs: Sequence[Mapping[str, Any]], where: str) -> None:
    """Reward names and arguments of metric specs (plugin files must be loaded by now)."""
    from textgym.rewards import check_reward_specs

    for spec in specs:
        weight = spec.get("weight", 1)
        if _is_number(weight) and weight < 0:  # what a negative weight means in a design: lower is better
            raise ConfigError(
                f"{where} {spec['label']!r}: weight = {weight!r}, but metrics are reported as their rewards score "
                f"them, higher better, and a weight changes nothing: for a metric where lower is better, "
                f"score it negated (a function returning -x), and leave the weight out."
            )
        check_reward_specs(
            [metric_reward_args(spec)], where=f"{where} {spec['label']!r}", allow_all_metrics=True
        )


def metric_ranges(
    specs: Sequence[Mapping[str, Any]], builtin: Sequence[str]
) -> dict[str, tuple[float, float]]:
    """The range of every metric an evaluation reports (unbounded where nothing is known)."""
    ranges = {REWARD: (-math.inf, math.inf)}
    ranges.update({s["label"]: tuple(s.get("range", (-math.inf, math.inf))) for s in specs})
    ranges.update({name: (BUILTIN_METRICS[name].low, BUILTIN_METRICS[name].high) for name in builtin})
    return ranges


def metric_reward_args(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A metric spec as a reward spec: without its label, range and weight, with its ``args`` (arguments of
    the reward named as a metric key: ``rm_score``'s ``label``)."""
    own = {k: v for k, v in spec.items() if k not in (*METRIC_SPEC_KEYS, "weight")}
    return {**own, **spec.get("args", {})}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
