"""``match``: compare the completion with a reference answer (verifiable tasks)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Sequence

from textgym import Sample, hookimpl
from textgym.errors import RewardError


class Match:
    """1.0 when the completion matches the reference, else 0.0.

    Args:
        mode: ``"exact"`` (whole completion), ``"contains"`` (reference anywhere in it) or ``"regex"``
            (the reference is a pattern searched in the completion).
        reference: a fixed reference; by default each prompt's metadata supplies it under ``reference_key``.
        reference_key: the metadata key holding the reference (default ``"reference"``).
        normalize: strip surrounding whitespace and compare case-insensitively (not for regex).
        partial: with ``mode="exact"``, score the string similarity in [0, 1] (difflib's ratio) instead of
            all-or-nothing: partial credit for almost-right answers.
    """

    name = "match"

    def __init__(
        self,
        mode: str = "exact",
        reference: str | None = None,
        reference_key: str = "reference",
        normalize: bool = True,
        partial: bool = False,
    ):
        if mode not in ("exact", "contains", "regex"):
            raise ValueError(f"mode must be 'exact', 'contains' or 'regex', not {mode!r}.")
        if partial and mode != "exact":
            raise ValueError("partial=True needs mode='exact'.")
        # a number from TOML or --set (`reference=5`) is its text, as a prompt's metadata reference is
        reference = None if reference is None else str(reference)
        if reference is not None and not reference.strip():  # "contains" found it in every completion
            raise ValueError(
                f"reference {reference!r} is blank: give a text to match, or no reference (each prompt's own)."
            )
        if mode == "regex" and reference is not None:
            try:
                re.compile(reference)
            except re.error as exc:
                raise ValueError(
                    f"reference {reference!r} is not a valid regular expression: {exc}."
                ) from None
        self.mode, self.reference, self.reference_key = mode, reference, reference_key
        self.normalize, self.partial = normalize, partial

    def _reference(self, sample: Sample) -> str | None:
        """The sample's reference; None where its prompt has an empty one (a JSONL null, a blank CSV cell):
        the reward does not apply there, rather than scoring against the text "None" or ""."""
        if self.reference is not None:
            return self.reference
        if self.reference_key not in sample.meta:
            raise RewardError(
                f"prompt {sample.prompt[:50]!r} has no {self.reference_key!r} in its metadata; give the "
                f"prompts a {self.reference_key!r} field (null where none applies: the reward skips those) or "
                f"the reward a fixed `reference`."
            )
        reference = sample.meta[self.reference_key]
        # blank too (a CSV cell with a space): stripped to "", every completion would "contain" it
        return None if reference is None or str(reference).strip() == "" else str(reference)

    def score(self, completion: str, reference: str) -> float:
        if self.mode == "regex":
            return float(re.search(reference, completion) is not None)
        if self.normalize:
            completion, reference = completion.strip().lower(), reference.strip().lower()
        if self.mode == "contains":
            return float(reference in completion)
        if self.partial:
            return difflib.SequenceMatcher(None, completion, reference, autojunk=False).ratio()
        return float(completion == reference)

    def __call__(self, samples: Sequence[Sample]) -> list[float | None]:
        references = [self._reference(s) for s in samples]
        scores = []
        for sample, reference in zip(samples, references):
            try:
                scores.append(None if reference is None else self.score(sample.completion, reference))
            except re.error as exc:  # a prompt's reference, in regex mode
                raise RewardError(
                    f"prompt {sample.prompt[:50]!r}: its {self.reference_key!r} {reference!r} is not a valid "
                    f"regular expression ({exc}); fix it, or use mode = 'exact' or 'contains'."
                ) from None
        return scores


@hookimpl
def register_rewards(register: Callable[..., None]) -> None:
    register("match", Match)
