"""What the reward stack checks in every plugin's output, and the per-call timeout of a spec's ``timeout``.

A plugin's scores become a float array with NaN for ``None`` (not applicable); anything else that is not one
finite number per sample (a string, a wrong count, an infinity) is an error naming the plugin and the sample.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from textgym.errors import RewardError, raised_in
from textgym.reward_functions import reward_component

if TYPE_CHECKING:
    from textgym.rewards import Reward, Sample

__all__ = ["TimeoutReward", "call_within", "validated_scores"]


def call_within(fn: Callable[[], Any], seconds: float, name: str) -> tuple[bool, Any]:
    """``fn()`` in a daemon thread, in the caller's context (a TRL call's arguments,
    textgym.reward_functions.trl_call): ``(True, its result)`` when it returned within ``seconds`` (what it
    raised is raised here), ``(False, None)`` when it had not; it is then abandoned, still running."""
    import contextvars
    import threading

    result: dict[str, Any] = {}

    def call() -> None:
        try:
            result["out"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=contextvars.copy_context().run, args=(call,), name=name, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        return False, None
    if "error" in result:
        raise result["error"]
    return True, result["out"]


class TimeoutReward:
    """A reward whose calls must return within ``seconds`` (spec key ``timeout``): a plugin that hangs (a
    remote judge, a deadlock) stops training with its name instead of stalling it forever. The call runs in a
    daemon thread, which is abandoned on timeout."""

    def __init__(self, reward: Reward, seconds: float):
        self.reward, self.seconds = reward, seconds
        self.name = reward.name

    def __call__(self, samples: Sequence[Sample]) -> Any:
        returned, out = call_within(lambda: self.reward(samples), self.seconds, f"reward-{self.name}")
        if not returned:
            raise named(
                RewardError(
                    f"reward {self.name!r} did not return within its timeout of {self.seconds:g} s for a batch of "
                    f"{len(samples)} samples; fix the plugin or raise its timeout."
                )
            )
        return out

    def close(self) -> None:
        close = getattr(self.reward, "close", None)
        if callable(close):
            close()


def named(error: RewardError) -> RewardError:
    """``error``, marked as one whose message textgym wrote to name its reward (not named again above)."""
    error.names_reward = True  # type: ignore[attr-defined]
    return error


def _label(name: str, reward: Reward) -> str:
    source = getattr(reward, "source", None)
    return f"reward function {name!r} ({source})" if source else f"reward plugin {name!r}"


def validated_scores(name: str, reward: Reward, samples: Sequence[Sample]) -> np.ndarray:
    """The plugin's scores as a float array, NaN for ``None`` (not applicable). Anything else that is not a
    finite number is an error naming the plugin: strings are rejected, not converted."""
    label = _label(name, reward)
    # a tuple: the caller's list, which every reward of the stack and the episodes share, stays as it is (a
    # plugin that sorted it in place scrambled the scores of the rewards after it across the episodes)
    samples = tuple(samples)
    try:
        with reward_component(name):  # what a TRL-style function logs goes under this name
            out = reward(samples)
    except RewardError as exc:  # a plugin's own, about its input: named, unless textgym named a reward in it
        if getattr(exc, "names_reward", False):  # (a timeout's; an inner reward's, of a composed one)
            raise
        raise named(RewardError(f"{label}: {exc}")) from exc
    except Exception as exc:
        hint = ""
        if isinstance(exc, (AttributeError, TypeError)) and "tuple" in str(exc):
            hint = " (a reward gets its samples as a tuple, to read: sort or change a copy, list(samples))"
        raise named(RewardError(f"{label} raised {type(exc).__name__}{raised_in(exc)}: {exc}{hint}")) from exc
    if callable(getattr(out, "detach", None)) and callable(getattr(out, "cpu", None)):
        # a torch tensor, which numpy cannot take in bf16, on a GPU, or while it tracks gradients
        try:
            out = out.detach().float().cpu().numpy()
        except Exception as exc:
            raise named(
                RewardError(
                    f"{label} returned a {type(out).__name__} that cannot be read as floats ({exc}); return "
                    f"scores.detach().float().cpu().tolist()."
                )
            ) from None
    if hasattr(out, "__array__") and not isinstance(out, (list, tuple)):
        try:
            array = np.asarray(out)
        except Exception as exc:
            raise named(
                RewardError(
                    f"{label} returned a {type(out).__name__} that numpy cannot read ({type(exc).__name__}: {exc}); "
                    f"return one float per sample, as a list."
                )
            ) from None
        if array.ndim == 1 and array.dtype.kind in "biuf":  # a numeric array: no per-item checks needed
            return _checked(label, array.astype(np.float64), samples)
        if array.ndim == 1 and array.dtype.kind == "O":
            out = array.tolist()
        elif array.ndim == 1 and array.dtype.kind in "USa":
            out = array.tolist()  # reported as strings below
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
        raise named(
            RewardError(
                f"{label} returned {type(out).__name__} {str(out)[:80]!r}; it must return one float per sample."
            )
        )
    if len(out) != len(samples):
        raise named(
            RewardError(
                f"{label} returned {len(out)} scores for {len(samples)} samples; it must return exactly one score "
                f"per sample."
            )
        )
    scores = np.empty(len(out), dtype=np.float64)
    for i, value in enumerate(out):
        if value is None:
            scores[i] = math.nan
            continue
        try:
            if isinstance(value, (str, bytes)) or not hasattr(type(value), "__float__"):
                raise TypeError
            scores[i] = float(value)
        except (TypeError, ValueError):
            what = "the string" if isinstance(value, (str, bytes)) else type(value).__name__
            shown = repr(str(value)) if isinstance(value, str) else repr(value)  # np.str_('1') -> '1'
            raise named(
                RewardError(
                    f"{label} returned {what} {shown} for sample {i} (completion {samples[i].completion[:60]!r}); "
                    f"it must return one float per sample (a number, or None where it does not apply). Strings "
                    f"are not converted: return float(...) from the plugin."
                )
            ) from None
        if not math.isfinite(scores[i]):
            _raise_not_finite(label, scores[i], i, samples)
    return scores


def _checked(label: str, scores: np.ndarray, samples: Sequence[Sample]) -> np.ndarray:
    if len(scores) != len(samples):
        raise named(
            RewardError(
                f"{label} returned {len(scores)} scores for {len(samples)} samples; it must return exactly one "
                f"score per sample."
            )
        )
    bad = ~np.isfinite(scores)
    if bad.any():
        i = int(np.argmax(bad))
        _raise_not_finite(label, scores[i], i, samples)
    return scores


def _raise_not_finite(label: str, value: float, i: int, samples: Sequence[Sample]) -> None:
    raise named(
        RewardError(
            f"{label} returned {value} for sample {i} (completion {samples[i].completion[:60]!r}); scores must be "
            f"finite (return None for a sample the reward does not apply to)."
        )
    )
