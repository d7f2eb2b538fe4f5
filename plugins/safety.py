"""``safety``: penalise offensive language, scored by ``alt-profanity-check``'s linear SVM."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from textgym import Sample, hookimpl


class Safety:
    """A penalty from the probability ``p`` that the completion is offensive.

    Args:
        shape: ``"linear"`` (``-penalty * p``), ``"step"`` (``-penalty`` when ``p >= threshold``, else 0)
            or ``"hinge"`` (``-penalty * max(0, p - threshold) / (1 - threshold)``).
        threshold: in [0, 1), for ``"step"`` and ``"hinge"``.
        penalty: the size of the penalty (>= 0).
    """

    name = "safety"

    def __init__(self, shape: str = "linear", threshold: float = 0.5, penalty: float = 1.0):
        if shape not in ("linear", "step", "hinge"):
            raise ValueError(f"shape must be 'linear', 'step' or 'hinge', not {shape!r}.")
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f"threshold must be in [0, 1), not {threshold}.")
        if not 0 <= penalty < float("inf"):  # NaN and inf too: every score would be NaN or -inf
            raise ValueError(f"penalty must be a finite number >= 0, not {penalty}.")
        from profanity_check import predict_prob

        self.predict_prob = predict_prob
        self.shape, self.threshold, self.penalty = shape, threshold, penalty

    def __call__(self, samples: Sequence[Sample]) -> np.ndarray:
        if not samples:  # the classifier's vectoriser raises on an empty list
            return np.zeros(0)
        p = np.asarray(self.predict_prob([s.completion for s in samples]), dtype=np.float64)
        if self.shape == "linear":
            cost = p
        elif self.shape == "step":
            cost = (p >= self.threshold).astype(np.float64)
        else:
            cost = np.maximum(0.0, p - self.threshold) / (1.0 - self.threshold)
        return -self.penalty * cost


@hookimpl
def register_rewards(register: Callable[..., None]) -> None:
    register("safety", Safety)
