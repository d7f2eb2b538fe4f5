"""``math``: check a math answer against a reference with Hugging Face's ``math-verify`` (verifiable tasks)."""

from __future__ import annotations

import functools
import re
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from textgym import Sample, hookimpl


class MathVerify:
    """1.0 when the completion's answer equals the reference mathematically, 0.0 when it does not, and
    ``None`` (not applicable) when the prompt has no reference or its reference does not parse.

    ``math-verify`` extracts the answer from the completion (LaTeX such as ``\\boxed{\\frac{1}{2}}`` or a plain
    expression such as ``-8``; a ``\\boxed`` answer first, else the last expression when there are several) and
    compares it with the reference numerically and symbolically, so ``0.5``, ``1/2`` and ``\\frac12`` all
    match ``\\frac{1}{2}``.

    Args:
        reference_key: the metadata key holding the reference answer (default ``"reference"``, as in the
            shipped ``arithmetic`` prompts).
        timeout: seconds (whole) that parsing or comparing one answer may take; one that takes longer scores
            0.0. math-verify enforces it with ``signal.alarm``, which works on the main thread only: on any
            other thread (a reward server, a thread pool) textgym turns the timeout off rather than fail.
            0 turns it off everywhere.
    """

    name = "math"

    def __init__(self, reference_key: str = "reference", timeout: int = 5):
        if not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 0:
            raise ValueError(f"timeout must be a whole number of seconds >= 0 (0 = off), not {timeout!r}.")
        import math_verify

        self.reference_key, self.timeout, self._mv = reference_key, timeout, math_verify

    def _timeout(self) -> int | None:
        # math-verify's timeouts install a SIGALRM handler, which Python allows on the main thread only;
        # elsewhere it raises ValueError, so we pass None (math-verify's documented "no timeout").
        if self.timeout and threading.current_thread() is threading.main_thread():
            return self.timeout
        return None

    def score(self, completion: str, reference: str) -> float | None:
        timeout = self._timeout()
        gold = _parse_reference(reference, timeout)
        if not gold:
            return None
        completion = completion.replace("\u2212", "-")  # the typographic minus, as "−8"
        answer = self._mv.parse(completion, parsing_timeout=timeout)
        if not _read(answer) and _bare(completion):  # "+29", "(29)": math that math-verify's search of
            answer = self._mv.parse(f"${completion}$", parsing_timeout=timeout)  # prose skips
        if (last := _undelimited_latex(completion)) is not None:  # "2^{10}" read as prose was 2, as the
            latex = self._mv.parse(f"${last}$", parsing_timeout=timeout)  # reference's was
            answer = latex if _read(latex) else answer
        return float(self._mv.verify(gold, answer, timeout_seconds=timeout))

    def __call__(self, samples: Sequence[Sample]) -> list[float | None]:
        scores: list[float | None] = []
        for s in samples:
            reference = s.meta.get(self.reference_key)
            missing = reference is None or not str(reference).strip()
            scores.append(None if missing else self.score(s.completion, str(reference)))
        return scores


LATEX = re.compile(r"[\\^{}]")  # a backslash command, a power, a group: LaTeX math, not prose
WORD = re.compile(r"[A-Za-z]{2,}")
COMMAND = re.compile(r"\\[A-Za-z]+")  # \sqrt, \frac: names, not words


def _delimited(text: str) -> bool:
    """Whether ``text`` marks its math itself (``$...$``, ``\\(...\\)``, ``\\[...\\]``, ``\\boxed``)."""
    return any(mark in text for mark in ("$", "\\(", "\\[", "\\boxed"))


def _bare(text: str) -> bool:
    """Undelimited text without words ("+29", "(-8)"): math to read as if between ``$``. Words stay prose:
    between ``$``, "Paris" would be the product P*a*r*i*s, equal to "Sirap"."""
    return not _delimited(text) and not WORD.search(COMMAND.sub("", text))


def _undelimited_latex(text: str) -> str | None:
    """The LaTeX a completion ends with, written without delimiters: the whole text where it has no words
    (``2^{10}``), else its last word-free stretch (``The answer is \\frac{1}{2}.`` -> ``\\frac{1}{2}``).
    None where the text marks its math itself, or does not end on LaTeX."""
    if _delimited(text) or not LATEX.search(text):
        return None
    if _bare(text):
        return text
    words = text.split()
    last = words[-1].rstrip(".,;:!?") if words else ""
    return last if LATEX.search(last) and not WORD.search(COMMAND.sub("", last)) else None


def _read(parsed: Sequence[Any]) -> bool:
    """Whether math-verify read math: it returns only the text where it read none."""
    return any(not isinstance(p, str) for p in parsed)


@functools.lru_cache(maxsize=4096)
def _parse_reference(reference: str, timeout: int | None) -> Any:
    """References repeat across samples (G completions per prompt, many epochs): parse each once. One without
    delimiters that holds LaTeX (a backslash, ``^``, braces) is read as if between ``$``: math-verify reads
    bare text as prose, and took ``2^{10}`` for 2 and ``\\sqrt{2}`` for nothing. One that does not parse is
    said, once."""
    import math_verify

    text = reference.replace("\u2212", "-")
    latex = not _delimited(text) and LATEX.search(text)  # "2^{10}" read as prose was 2
    gold = math_verify.parse(f"${text}$" if latex else text, parsing_timeout=timeout)
    if not _read(gold) and _bare(text):  # "+29", "(-8)"
        gold = math_verify.parse(f"${text}$", parsing_timeout=timeout)
    if not _read(gold):  # nothing, or only the text it could not read as math
        warnings.warn(
            f"math: the reference {reference!r} does not parse, so its prompts score None (not applicable): "
            f"write it as LaTeX math (e.g. \\frac{{1}}{{2}}, 2^{{10}}).",
            stacklevel=2,
        )
        return []
    return gold


@hookimpl
def register_rewards(register: Callable[..., None]) -> None:
    register("math", MathVerify)
