"""Helpers shared by the model-based reward plugins: batching, devices, prompt/completion formatting."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def batched(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def resolve_device(device: str = "auto") -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def check_positive(**values: Any) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, not {value!r}.")


def uses_chat_template(tokenizer: Any, chat_template: bool | str) -> bool:
    """Resolve a plugin's ``chat_template`` argument (``"auto"``, True or False) for ``tokenizer``."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if chat_template == "auto":
        return has
    if chat_template not in (True, False):
        raise ValueError(f"chat_template must be 'auto', true or false, not {chat_template!r}.")
    if chat_template and not has:
        raise ValueError("chat_template=true, but the model's tokenizer has no chat template.")
    return bool(chat_template)


def chat_prompt(tokenizer: Any, prompt: str) -> str:
    """The prompt as a user turn followed by the start of the assistant's turn."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def ngrams(units: Sequence[Any], n: int) -> list[tuple[Any, ...]]:
    return [tuple(units[i : i + n]) for i in range(len(units) - n + 1)]


def distinct_n(text: str, n: int) -> float:
    """Unique word n-grams / all word n-grams (1.0 when the text has fewer than n words)."""
    grams = ngrams(text.split(), n)
    return len(set(grams)) / len(grams) if grams else 1.0


def corpus_distinct_n(sequences: Sequence[Sequence[Any]], n: int) -> float:
    """Distinct-n of a set of generations (Li et al. 2016): unique n-grams / all n-grams, over all of them.
    Give token ids (the model's units, which also works for character-level tasks) or words."""
    grams = [g for seq in sequences for g in ngrams(list(seq), n)]
    return len(set(grams)) / len(grams) if grams else 1.0
