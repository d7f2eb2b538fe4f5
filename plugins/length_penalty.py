"""``length_penalty``: penalise completions away from a target length or outside a range."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence

from textgym import Sample, hookimpl
from textgym.errors import RewardError


class LengthPenalty:
    """``-(distance / scale) ** p`` where distance is how far the length is from ``target`` (or outside
    ``[min, max]``), ``p`` is 1 (``shape="linear"``) or 2 (``"quadratic"``), and ``scale`` defaults to the
    target (or ``max``). ``missing_eos_penalty`` is subtracted when the completion hit the token limit
    without ending (``finish_reason == "length"``). At most 0: 0 at the target (or inside the range).

    ``unit``: ``"tokens"`` (the completion's text tokens: the EOS or stop string that ended it does not
    count) or ``"words"`` (whitespace-separated). Example: ``target=3``, a 4-token completion cut at the
    limit scores ``-(1/3) - 1 = -1.333``.
    """

    name = "length_penalty"

    def __init__(
        self,
        target: int | None = None,
        min: int | None = None,
        max: int | None = None,
        unit: str = "tokens",
        shape: str = "linear",
        scale: float | None = None,
        missing_eos_penalty: float = 1.0,
    ):
        for key, value in (("target", target), ("min", min), ("max", max), ("scale", scale)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
                raise ValueError(f"{key} must be a number, not {value!r}.")
            if value is not None and not math.isfinite(value):  # every score would be NaN or -inf
                raise ValueError(f"{key} must be a finite number, not {value!r}.")
        # a negative one rewarded the completions cut at the token limit
        if (
            isinstance(missing_eos_penalty, bool)
            or not isinstance(missing_eos_penalty, numbers.Real)
            or not 0 <= missing_eos_penalty < math.inf
        ):
            raise ValueError(
                f"missing_eos_penalty must be a finite number >= 0 (it is subtracted), not {missing_eos_penalty!r}."
            )
        if (target is None) == (min is None and max is None):
            raise ValueError("give either target, or min and/or max (a range), not both and not neither.")
        if target is not None and target < 0:
            raise ValueError(f"target must be >= 0, not {target}.")
        if min is not None and max is not None and min > max:
            raise ValueError(f"min ({min}) is larger than max ({max}).")
        if unit not in ("tokens", "words"):
            raise ValueError(f"unit must be 'tokens' or 'words', not {unit!r}.")
        if shape not in ("linear", "quadratic"):
            raise ValueError(f"shape must be 'linear' or 'quadratic', not {shape!r}.")
        self.low = target if target is not None else (min if min is not None else 0)
        self.high = target if target is not None else (max if max is not None else float("inf"))
        default_scale = target if target is not None else (max if max is not None else min)
        self.scale = float(scale if scale is not None else default_scale or 1)
        if self.scale <= 0:
            raise ValueError(f"scale must be > 0, not {self.scale}.")
        self.unit, self.power, self.missing_eos_penalty = (
            unit,
            1 if shape == "linear" else 2,
            missing_eos_penalty,
        )

    def length(self, sample: Sample) -> int:
        if self.unit == "words":
            return len(sample.completion.split())
        n = len(sample.completion_ids)
        if not n and sample.completion:  # a length of 0 for a text, and the same penalty for every one
            raise RewardError(
                f"length_penalty counts tokens and completion {sample.completion[:40]!r} has no completion_ids "
                f"(a TRL call without them?): pass the token ids, or give unit = 'words'."
            )
        # The tokens that ended the (last) turn are not text: the EOS, or a stop string's
        return sample.text_tokens()

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        scores = []
        for s in samples:
            n = self.length(s)
            distance = max(self.low - n, n - self.high, 0)
            penalty = (distance / self.scale) ** self.power
            if s.finish_reason == "length":
                penalty += self.missing_eos_penalty
            scores.append(-float(penalty))
        return scores


@hookimpl
def register_rewards(register: Callable[..., None]) -> None:
    register("length_penalty", LengthPenalty)
