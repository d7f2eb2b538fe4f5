"""``sentiment``: VADER's compound sentiment of the completion, in [-1, 1]."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from textgym import Sample, hookimpl


class Sentiment:
    """VADER's compound sentiment score of the completion, in [-1, 1] (0 for neutral or empty text);
    ``target="negative"`` flips the sign to reward negative text."""

    name = "sentiment"

    def __init__(self, target: str = "positive"):
        if target not in ("positive", "negative"):
            raise ValueError(f"target must be 'positive' or 'negative', not {target!r}.")
        from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

        self.sign = 1.0 if target == "positive" else -1.0
        self.analyzer = SentimentIntensityAnalyzer()

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        return [self.sign * self.analyzer.polarity_scores(s.completion)["compound"] for s in samples]


@hookimpl
def register_rewards(register: Callable[..., None]) -> None:
    register("sentiment", Sentiment)
