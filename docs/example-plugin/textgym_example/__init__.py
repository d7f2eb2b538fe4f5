"""An example textgym plugin package: one reward and one prompt set, registered through entry points."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import textgym


class KeywordBonus:
    """``bonus`` for each of ``keywords`` that the completion mentions (case-insensitive)."""

    name = "keyword_bonus"

    def __init__(self, keywords: Sequence[str] = ("please", "thank"), bonus: float = 1.0):
        if isinstance(keywords, str) or not keywords:
            raise ValueError(f"keywords must be a non-empty list of strings, not {keywords!r}.")
        self.keywords = [k.lower() for k in keywords]
        self.bonus = bonus

    def __call__(self, samples: Sequence[textgym.Sample]) -> list[float]:
        return [self.bonus * sum(k in s.completion.lower() for k in self.keywords) for s in samples]


@textgym.hookimpl
def register_rewards(register: Callable[..., None]) -> None:
    register("keyword_bonus", KeywordBonus)


@textgym.hookimpl
def register_prompt_sources(register: Callable[..., None]) -> None:
    register("polite-requests", lambda: ["Ask a neighbour to water your plants.", "Ask for the salt."])
