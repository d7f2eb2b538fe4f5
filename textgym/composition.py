"""How a reward stack turns its components into one total: weight schedules, aggregation and gates, and the
table form of a stack's spec.

The pieces here are small and pure; :class:`textgym.rewards.RewardStack` puts them together, and
:mod:`textgym.reward_functions` makes plain functions into rewards. The user's guide is docs/rewards.md.
Conventions, stated once:

- ``scores`` is a float array of shape (N, K): N samples scored together, K components, raw (unweighted).
  NaN marks "not applicable" (the plugin returned ``None`` for that sample).
- Training progress ``p`` runs from 0 (start of training) to 1 (end).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from textgym.errors import ConfigError

AGGREGATES = ("sum", "normalize_then_sum")
STACK_KEYS = ("aggregate", "components", "gates")
SCHEDULE_KEYS = ("start", "end", "from", "to", "shape")
SCHEDULE_SHAPES = ("linear", "cosine")
GATE_KEYS = ("component", "min", "max", "action", "cap")
GATE_ACTIONS = ("zero", "cap")


def is_number(value: Any) -> bool:
    """A real number, numpy's included (np.int64, np.float32), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# -- weights and their schedules -------------------------------------------------------------------
@dataclass(frozen=True)
class WeightSchedule:
    """A weight that moves from ``start`` to ``end`` as training progress ``p`` goes from ``from_`` to ``to``.

    Constant outside the window: ``start`` before ``from_``, ``end`` after ``to``. ``shape="linear"`` ramps
    evenly; ``shape="cosine"`` follows half a cosine (slow at both ends of the window). In TOML:
    ``weight = { start = 1.0, end = 0.2, from = 0.2, to = 0.8, shape = "cosine" }``.
    """

    start: float
    end: float
    from_: float = 0.0
    to: float = 1.0
    shape: str = "linear"

    def __post_init__(self) -> None:
        for key, value in (("start", self.start), ("end", self.end)):
            if not is_number(value) or not math.isfinite(value):
                raise ConfigError(f"weight schedule: {key} = {value!r} must be a finite number.")
        for key, value in (("from", self.from_), ("to", self.to)):
            if not is_number(value) or not 0.0 <= value <= 1.0:
                raise ConfigError(
                    f"weight schedule: {key} = {value!r} is outside the run. Training progress runs from 0 "
                    f"(start) to 1 (end): give 0 <= from < to <= 1."
                )
        if self.from_ >= self.to:
            raise ConfigError(
                f"weight schedule: from = {self.from_} must come before to = {self.to} (0 <= from < to <= 1)."
            )
        if self.shape not in SCHEDULE_SHAPES:
            raise ConfigError(
                f"weight schedule: shape {self.shape!r} is not one of {', '.join(map(repr, SCHEDULE_SHAPES))}."
            )

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> WeightSchedule:
        unknown = sorted(set(spec) - set(SCHEDULE_KEYS))
        if unknown:
            raise ConfigError(
                f"weight schedule {dict(spec)!r}: unknown key(s) {', '.join(map(repr, unknown))}. "
                f"Keys: {', '.join(SCHEDULE_KEYS)} (start and end are required)."
            )
        if "start" not in spec or "end" not in spec:
            raise ConfigError(
                f"weight schedule {dict(spec)!r} needs both start and end, e.g. {{ start = 1.0, end = 0.2 }}."
            )
        return cls(
            spec["start"],
            spec["end"],
            spec.get("from", 0.0),
            spec.get("to", 1.0),
            spec.get("shape", "linear"),
        )

    def __call__(self, p: float) -> float:
        if p <= self.from_:
            return float(self.start)
        if p >= self.to:
            return float(self.end)
        t = (p - self.from_) / (self.to - self.from_)
        if self.shape == "cosine":
            t = (1.0 - math.cos(math.pi * t)) / 2.0
        return float(self.start + (self.end - self.start) * t)

    def __str__(self) -> str:
        window = "" if (self.from_, self.to) == (0.0, 1.0) else f" over p in [{self.from_:g}, {self.to:g}]"
        return f"{self.start:g}->{self.end:g}" + (f" {self.shape}" if self.shape != "linear" else "") + window


Weight = float | WeightSchedule


def parse_weight(value: Any, where: str) -> Weight:
    """A component's weight: a finite number, or a schedule table (see :class:`WeightSchedule`)."""
    if isinstance(value, WeightSchedule):
        return value
    if isinstance(value, Mapping):
        try:
            return WeightSchedule.from_spec(value)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if not is_number(value) or not math.isfinite(value):
        schedule = "a schedule table such as { start = 1.0, end = 0.2 }"
        if isinstance(value, str):  # weight = "0.5" reads as a number in the message unless called a string
            raise ConfigError(
                f"{where}: weight is the string {value!r}: give a number (no quotes) or {schedule}."
            )
        raise ConfigError(f"{where}: weight {value!r} must be a finite number or {schedule}.")
    return float(value)


def weight_at(weight: Weight, p: float) -> float:
    return weight(p) if isinstance(weight, WeightSchedule) else weight


def is_metric_weight(weight: Weight) -> bool:
    """True when the weight is 0 for the whole run: the component is logged but never trained on."""
    if isinstance(weight, WeightSchedule):
        return weight.start == 0 and weight.end == 0
    return weight == 0


def check_progress(p: float) -> float:
    if not is_number(p) or not 0.0 <= p <= 1.0:
        raise ValueError(
            f"training progress p = {p!r} must be a number in [0, 1] (0 at the start of training, 1 at the end)."
        )
    return float(p)


# -- aggregation -----------------------------------------------------------------------------------
def weighted_sum(scores: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(N, K) scores, (K,) weights -> (N,) totals. A NaN (not applicable) score is left out of its sample's
    total; a sample with no applicable weighted component gets 0. Weight-0 components never count."""
    used = weights != 0
    return np.nansum(scores[:, used] * weights[used], axis=1)


def standardize(x: np.ndarray) -> np.ndarray:
    """(N,) -> (N,) z-scores over the applicable (non-NaN) values, NaN kept. Population std (ddof=0). A
    constant column (std 0, up to rounding: 1e-12 of the largest value, or of 1) carries no signal and becomes
    0."""
    out = np.full_like(x, np.nan, dtype=np.float64)
    valid = ~np.isnan(x)
    if not valid.any():
        return out
    v = x[valid]
    scale = float(np.abs(v).max())
    u = v / scale if scale > 0 else v  # within [-1, 1]: the mean and std of 1e308s do not overflow
    std = u.std()
    # mean() of equal floats can differ from them in the last bit, which would turn rounding noise into
    # z-scores of +-1; treat a std that small relative to the values (or to 1, for values near 0: 0.1 + 0.2
    # - 0.3 is noise around 0) as exactly 0.
    if std * scale <= 1e-12 * max(1.0, scale):
        out[valid] = 0.0
    else:
        out[valid] = (u - u.mean()) / std
    return out


def normalize_then_sum(scores: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Standardize each weighted component over the batch, then take the weighted sum (GDPO; TRL's
    ``multi_objective_aggregation="normalize_then_sum"``, which standardizes per prompt group instead)."""
    used = weights != 0
    z = np.stack([standardize(col) for col in scores[:, used].T], axis=1) if used.any() else scores[:, used]
    return np.nansum(z * weights[used], axis=1)


AGGREGATORS: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "sum": weighted_sum,
    "normalize_then_sum": normalize_then_sum,
}


def check_aggregate(aggregate: Any, where: str) -> str:
    if aggregate not in AGGREGATES:
        raise ConfigError(
            f"{where}: aggregate = {aggregate!r} is not one of {', '.join(map(repr, AGGREGATES))}."
        )
    return aggregate


# -- gates -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gate:
    """When ``component``'s raw score is outside [``min``, ``max``], the sample's total becomes 0
    (``action="zero"``) or ``min(total, cap)`` (``action="cap"``). A not-applicable score never fails."""

    component: str
    min: float = -math.inf
    max: float = math.inf
    action: str = "zero"
    cap: float = 0.0

    @classmethod
    def from_spec(cls, spec: Gate | Mapping[str, Any], names: Sequence[str], where: str) -> Gate:
        """A gate from its table, checked against the stack's component ``names``."""
        if isinstance(spec, Gate):
            spec = {k: getattr(spec, k) for k in GATE_KEYS}
        if not isinstance(spec, Mapping):
            raise ConfigError(
                f"{where}: gate {spec!r} must be a table such as "
                f'{{ component = "safety", min = -0.5, action = "zero" }}.'
            )
        unknown = sorted(set(spec) - set(GATE_KEYS))
        if unknown:
            raise ConfigError(
                f"{where}: gate {dict(spec)!r} has unknown key(s) {', '.join(map(repr, unknown))}. "
                f"Keys: {', '.join(GATE_KEYS)}."
            )
        component = spec.get("component")
        if component not in names:
            raise ConfigError(
                f"{where}: gate on unknown component {component!r}. The stack's components are: "
                f"{', '.join(map(repr, names)) or '(none)'}; name one of them (a gate may watch a weight-0 "
                f"component)."
            )
        if "min" not in spec and "max" not in spec:
            raise ConfigError(f"{where}: gate on {component!r} needs min and/or max.")
        low, high = spec.get("min", -math.inf), spec.get("max", math.inf)
        for key, value in (("min", low), ("max", high)):
            if not is_number(value) or math.isnan(value):
                raise ConfigError(f"{where}: gate on {component!r}: {key} = {value!r} must be a number.")
        if low > high:
            raise ConfigError(f"{where}: gate on {component!r}: min = {low} is above max = {high}.")
        if low == math.inf or high == -math.inf:  # no finite score passes: every total gated
            raise ConfigError(
                f"{where}: gate on {component!r}: {'min = inf' if low == math.inf else 'max = -inf'} fails "
                f"every score; leave that bound out for no bound."
            )
        action = spec.get("action", "zero")
        if action not in GATE_ACTIONS:
            raise ConfigError(
                f"{where}: gate on {component!r}: action {action!r} is not one of "
                f"{', '.join(map(repr, GATE_ACTIONS))}."
            )
        cap = spec.get("cap", 0.0)
        if "cap" in spec and action != "cap":
            raise ConfigError(f"{where}: gate on {component!r}: cap only applies with action = 'cap'.")
        if not is_number(cap) or not math.isfinite(cap):
            raise ConfigError(f"{where}: gate on {component!r}: cap = {cap!r} must be a finite number.")
        return cls(component, float(low), float(high), action, float(cap))

    def failed(self, scores: np.ndarray) -> np.ndarray:
        """(N,) raw scores of the gated component -> (N,) bool. NaN compares False: never fails."""
        return (scores < self.min) | (scores > self.max)

    def apply(self, total: np.ndarray, scores: np.ndarray) -> np.ndarray:
        failed = self.failed(scores)
        total = total.copy()
        if self.action == "zero":
            total[failed] = 0.0
        else:
            total[failed] = np.minimum(total[failed], self.cap)
        return total

    def __str__(self) -> str:
        outcome = "0" if self.action == "zero" else f"at most {self.cap:g}"
        return f"{self.component} outside [{self.min:g}, {self.max:g}] -> total {outcome}"


# -- the spec of a whole stack ---------------------------------------------------------------------
def stack_table(specs: Any, where: str = "rewards") -> dict[str, Any]:
    """Any accepted stack spec as ``{"aggregate": ..., "components": [...], "gates": [...]}``.

    Accepted: a table with ``components`` (and optional ``aggregate``, ``gates``); a list of component
    specs; or a single component spec (a table with ``name`` or ``fn``, a spec string, a reward, a function).
    """
    if isinstance(specs, Mapping) and any(key in specs for key in STACK_KEYS):
        unknown = sorted(set(specs) - set(STACK_KEYS))
        if unknown:
            raise ConfigError(
                f"{where}: unknown key(s) {', '.join(map(repr, unknown))} in the reward-stack table. Keys: "
                f"{', '.join(STACK_KEYS)} (one reward is a table with `name` or `fn` instead)."
            )
        components = specs.get("components")
        if isinstance(components, (str, Mapping)) or not isinstance(components, Sequence) or not components:
            raise ConfigError(
                f"{where}: the reward-stack table needs components = [...], a non-empty list of reward specs."
            )
        gates = specs.get("gates", [])
        if isinstance(gates, (str, Mapping)) or not isinstance(gates, Sequence):
            raise ConfigError(f"{where}: gates = {gates!r} must be a list of gate tables.")
        aggregate = check_aggregate(specs.get("aggregate", "sum"), where)
        return {"aggregate": aggregate, "components": list(components), "gates": list(gates)}
    if isinstance(specs, (str, Mapping)) or not isinstance(specs, Sequence):
        specs = [specs]
    return {"aggregate": "sum", "components": list(specs), "gates": []}


def unique_names(names: Sequence[str]) -> list[str]:
    """Component names, the second and later uses of one name suffixed ``_2``, ``_3``, ... A name that
    starts with ``_`` is refused: a Gymnasium vector info keeps under ``_<key>`` which sub-envs have
    ``<key>``, so such a component would be dropped from the logs or logged as another's mask."""
    out: list[str] = []
    for name in names:
        if name.startswith("_"):
            suggested = name.lstrip("_") or "reward"
            raise ConfigError(
                f"reward name {name!r} starts with '_', which Gymnasium's vector infos keep for their own "
                f"masks: give it a name without the underscore (for a function, name = {suggested!r} in its spec)."
            )
        unique, n = name, 2
        while unique in out:  # the same plugin twice with other arguments
            unique, n = f"{name}_{n}", n + 1
        out.append(unique)
    return out


def describe_stack(specs: Any) -> str:
    """One line for a report: ``"sentiment x1, length_penalty x0.5 target=24"`` plus aggregate and gates."""
    from textgym.rewards import parse_reward_spec

    table = stack_table(specs)
    parts = []
    for spec in table["components"]:
        if isinstance(spec, str):
            spec = parse_reward_spec(spec)
        if isinstance(spec, Mapping):
            label = spec.get("name") or str(spec.get("fn")).rpartition(":")[2]
            weight = spec.get("weight", 1.0)
            weight = f"{weight:g}" if is_number(weight) else f"[{parse_weight(weight, 'rewards')}]"
            args = "".join(f" {k}={v}" for k, v in spec.items() if k not in ("name", "fn", "weight"))
            parts.append(f"{label} x{weight}{args}")
        else:
            parts.append(repr(spec))
    text = ", ".join(parts)
    if table["aggregate"] != "sum":
        text = f"{table['aggregate']} of {text}"
    if table["gates"]:
        text += "; gates: " + "; ".join(
            f"{g.get('component')} outside [{g.get('min', '-inf')}, {g.get('max', 'inf')}] -> "
            + ("0" if g.get("action", "zero") == "zero" else f"cap {g.get('cap', 0.0)}")
            for g in table["gates"]
            if isinstance(g, Mapping)
        )
    return text
