"""A prompt's text to the ids an episode starts from: through the chat template or with the tokenizer's
special tokens, and cut to ``max_prompt_tokens`` from the left, keeping the framing (the template's opening
and assistant header, or BOS) whole. A mixin of :class:`~textgym.envs.episodes.Episodes`."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from textgym.errors import PromptError


class PromptIds:
    """``encode_prompt`` (cached per prompt) and the truncation it applies (see the module doc)."""

    # set by Episodes.__init__
    tokenizer: Any
    chat_template: bool
    prompts: list[Any]
    prompt_overflow: str
    n_source: int
    P: int
    _encoded: dict[int, np.ndarray]
    _overflowed: int

    def encode_prompt(self, index: int, warn: bool = True) -> np.ndarray:
        if index not in self._encoded:
            self._encoded[index] = self._encode(self.prompts[index].text, index, warn)
        return self._encoded[index]

    def _which(self, index: int) -> str:
        """How a message names prompt ``index``: its index in the source, or a text given to ``reset``."""
        return f"prompt {index}" if index < self.n_source else "the prompt given in reset's options"

    def _encode(self, text: str, index: int, warn: bool = True) -> np.ndarray:
        """``text`` (prompt ``index``, or it with a responder's opening) as the ids an episode starts from."""
        if self.chat_template:
            templated = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            ids = self.tokenizer.encode(templated, add_special_tokens=False)
        else:
            try:
                ids = self.tokenizer.encode(text)
            except ValueError as exc:  # e.g. a character outside a character tokenizer's alphabet
                raise PromptError(
                    f"{self._which(index)} ({text[:40]!r}) cannot be tokenized: {exc}"
                ) from None
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) > self.P:
            where = f"{self._which(index)} ({text[:40]!r}...) has {len(ids)} tokens"
            if self.prompt_overflow == "error":
                raise PromptError(
                    f"{where}, more than max_prompt_tokens={self.P}. Raise max_prompt_tokens, shorten "
                    f"the prompt, or pass prompt_overflow='truncate' to keep the end of its text."
                )
            head, tail = self._framing(text, ids)
            rerender = self.chat_template and not len(head) and not len(tail)  # the template changed the text
            framing = self._rendered([], 0) if rerender else np.concatenate([head, tail])
            room = self.P - len(framing)
            if room < 1:
                raise PromptError(
                    f"{where}, and its framing alone ({'the chat template' if self.chat_template else 'special tokens'}"
                    f": {len(framing)} tokens) leaves no room for its text in max_prompt_tokens={self.P}: "
                    f"raise max_prompt_tokens."
                )
            if warn:
                warnings.warn(
                    f"{where}; keeping the last {room} tokens of its text"
                    f"{' inside the chat template' if self.chat_template else ''} (max_prompt_tokens={self.P}). "
                    f"Raise max_prompt_tokens to keep it whole.",
                    stacklevel=5,
                )
            self._overflowed += 1
            # the text is cut from the left (its end is what the completion continues); the chat template's
            # opening and its assistant header, or a BOS token, are kept: cut with them, a policy met a prompt
            # without its user turn's start, or without BOS
            if rerender:
                ids = self._rendered_end(text)
            else:
                body = ids[len(head) : len(ids) - len(tail)]
                ids = np.concatenate([head, body[len(body) - room :], tail])
        return ids

    def _rendered(self, text_ids: Sequence[int], m: int) -> np.ndarray:
        """The ids of the chat template around the text of the last ``m`` of ``text_ids``."""
        end = self.tokenizer.decode(text_ids[len(text_ids) - m :]).lstrip("\ufffd") if m else ""
        templated = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": end}], tokenize=False, add_generation_prompt=True
        )
        return np.asarray(self.tokenizer.encode(templated, add_special_tokens=False), dtype=np.int64)

    def _rendered_end(self, text: str) -> np.ndarray:
        """The template rendered around the longest end of ``text`` that fits in ``P`` tokens, for a template
        that changes the text it frames (Llama 3's trims it; a leading blank line merges with the header's
        newline), whose ids the text's cannot be found among: cutting those from the left lost the
        template's opening and user header."""
        text_ids = self.tokenizer.encode(text, add_special_tokens=False)
        m = self.P - len(self._rendered(text_ids, 0))  # at least 1: the caller checked the room
        ids = self._rendered(text_ids, m)
        while len(ids) > self.P and m > 1:  # the end's tokens re-encoded, or merged, to more
            m -= 1
            ids = self._rendered(text_ids, m)
        return ids[len(ids) - self.P :] if len(ids) > self.P else ids

    def _framing(self, text: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids before and after a prompt's text in its ``ids``: the chat template's opening and closing
        (its assistant header), or the special tokens the tokenizer adds (BOS). None found: nothing."""
        empty = np.zeros(0, dtype=np.int64)
        if self.chat_template:
            templated = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            at = templated.rfind(text)
            if at < 0:
                return empty, empty
            head = self.tokenizer.encode(templated[:at], add_special_tokens=False)
            tail = self.tokenizer.encode(templated[at + len(text) :], add_special_tokens=False)
            if list(ids[: len(head)]) != head or (tail and list(ids[len(ids) - len(tail) :]) != tail):
                return empty, empty  # the text's tokens merged with the template's: cut the whole
            return np.asarray(head, dtype=np.int64), np.asarray(tail, dtype=np.int64)
        plain = np.asarray(self.tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)
        for start in range(min(4, len(ids) - len(plain)) + 1):  # the text's tokens after a few special ones
            if np.array_equal(ids[start : start + len(plain)], plain):
                return ids[:start], ids[start + len(plain) :]
        return empty, empty
