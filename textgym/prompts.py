"""Prompt sources: inline lists, ``.txt`` / ``.jsonl`` / ``.csv`` files, datasets saved to disk, named sets."""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from textgym.errors import PromptError, UnknownNameError
from textgym.hookspecs import hookimpl

DATA_DIR = Path(__file__).parent / "data" / "prompts"
DEFAULT_PROMPTS = "chat"


@dataclass(frozen=True)
class Prompt:
    """A prompt's text and whatever metadata came with it (reference answer, topic, ...)."""

    text: str
    meta: Mapping[str, Any] = field(default_factory=dict)


PromptsLike = str | os.PathLike | Sequence[str | Mapping[str, Any] | Prompt] | None


def load_prompts(source: PromptsLike = None) -> list[Prompt]:
    """Resolve ``source`` to a non-empty list of :class:`Prompt`.

    Args:
        source: a registered prompt-source name (``textgym plugins`` lists them), a path to a ``.txt`` file
            (one prompt per line), a ``.jsonl`` file (objects with a ``prompt`` key; the other keys become
            metadata), a ``.csv`` file (a ``prompt`` column; the other columns become metadata), a directory
            written by ``datasets.Dataset.save_to_disk`` (a ``prompt`` column), or a list of strings/dicts.
            ``None`` means the shipped ``"chat"`` set.
    """
    if source is None:
        source = DEFAULT_PROMPTS
    where = repr(str(source)) if isinstance(source, (str, os.PathLike)) else "the prompt list"
    if isinstance(source, (str, os.PathLike)):
        records = _resolve(source)
    elif not _is_prompt_list(source):
        # a dict was iterated over its keys: each key became a prompt
        raise PromptError(
            f"prompts must be a name, a file, or a list of prompts, not a {type(source).__name__} "
            f"({str(source)[:60]!r}); wrap a single prompt in a list: [...]."
        )
    else:
        records = list(source)
    prompts = [_to_prompt(record, where, i) for i, record in enumerate(records)]
    if not prompts:
        raise PromptError(f"prompt source {where} is empty: give at least one prompt.")
    return prompts


def _is_prompt_list(value: Any) -> bool:
    """An iterable of prompts, not one prompt or a record (a string is iterated by character, a dict by key)."""
    return isinstance(value, Iterable) and not isinstance(value, (str, Mapping, Prompt, bytes))


def _resolve(source: str | os.PathLike) -> Sequence[Any]:
    from textgym import plugin_manager

    sources = plugin_manager.registry("register_prompt_sources")
    if isinstance(source, str) and source in sources:
        entry = sources.get(source)
        records = entry.value()
        if not _is_prompt_list(records):
            raise PromptError(
                f"prompt source {source!r} (plugin {entry.plugin!r}) returned a {type(records).__name__} "
                f"({str(records)[:60]!r}): its factory must return a list of prompts (strings, or dicts "
                f"with a 'prompt' key)."
            )
        return list(records)
    if isinstance(source, str) and not source.strip():  # Path("") is the current directory
        raise PromptError(
            "prompts is an empty string: give a registered name (textgym plugins lists them), a .txt, "
            ".jsonl or .csv file, a saved dataset's directory, or a list of prompts."
        )
    path = Path(source).expanduser()
    if path.is_dir():
        return _read_dataset_dir(path)
    if path.is_file():
        return read_prompt_file(path)
    if isinstance(source, str) and os.sep not in source and "." not in source:
        raise UnknownNameError("prompt source", source, sources.names())
    raise PromptError(f"prompt file {str(source)!r} does not exist (nor is it a registered prompt source).")


def read_prompt_file(path: Path) -> list[Any]:
    """Records from a ``.txt``, ``.jsonl`` or ``.csv`` prompt file."""
    suffix = path.suffix.lower()
    try:  # (bytes: read_text would turn a lone "\r", or one in a quoted CSV cell, into a line break)
        text = path.read_bytes().decode("utf-8-sig")  # a BOM (Excel's "CSV UTF-8") is not text
    except UnicodeDecodeError as exc:
        raise PromptError(
            f"prompt file {str(path)!r} is not UTF-8 text (byte {exc.start}: {exc.reason}); save it as UTF-8."
        ) from None
    # lines end at "\n" ("\r\n" too) only: splitlines() also cut at U+2028, form feeds and the like, which a
    # prompt may hold (and a JSON string may hold raw)
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    if suffix == ".txt":
        return [line for line in lines if line.strip()]
    if suffix == ".jsonl":
        records = []
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptError(f"{path}:{n} is not valid JSON: {exc.msg}.") from None
            _check_record(record, f"{path}:{n}")  # named by its line, not its place among the records
            records.append(record)
        return records
    if suffix == ".csv":
        return _read_csv(path, text)
    raise PromptError(
        f"prompt file {str(path)!r} must end in .txt, .jsonl or .csv, not {suffix or '(none)'}."
    )


def _read_csv(path: Path, text: str) -> list[dict[str, str]]:
    """The rows of a CSV file as dicts. A quoted cell keeps its line breaks; a row with more or fewer cells
    than the header, or a quote left open, is an error naming its line (they shifted or swallowed cells)."""
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    rows: list[dict[str, str]] = []
    try:
        header = next(reader, None)
        if header is None:
            return rows
        if "prompt" not in header:
            raise PromptError(f"{path} has no 'prompt' column (columns: {', '.join(header)}).")
        # "" (a spreadsheet's blank columns) is no name
        twice = sorted({name for name in header if name and header.count(name) > 1})
        if twice:  # the last such column's cells would win without a word
            raise PromptError(f"{path} has column {twice[0]!r} more than once; name each column once.")
        for cells in reader:
            if not cells:
                continue
            if len(cells) != len(header):
                raise PromptError(
                    f"{path}:{reader.line_num} has {len(cells)} cell{'s' * (len(cells) != 1)} for {len(header)} columns "
                    f"({', '.join(header)}); quote a cell that holds a comma."
                )
            row = {name: cell for name, cell in zip(header, cells) if name}  # a blank column is no metadata
            _check_record(row, f"{path}:{reader.line_num}")
            rows.append(row)
    except csv.Error as exc:
        raise PromptError(f"{path}:{reader.line_num} is not valid CSV: {exc} (a quote left open?).") from None
    return rows


def _check_record(record: Any, where: str) -> None:
    """A file's row holds a non-empty ``prompt`` string, else a PromptError naming its line."""
    if not isinstance(record, Mapping) or not _is_text(record.get("prompt")):
        raise PromptError(f"{where}: each row needs a non-empty 'prompt' string, not {str(record)[:80]!r}.")


def _read_dataset_dir(path: Path) -> list[Any]:
    saved = ("state.json", "dataset_dict.json")  # what save_to_disk writes: a dataset's, a DatasetDict's
    if not any((path / name).is_file() for name in saved):
        raise PromptError(
            f"{str(path)!r} is a directory but not a dataset saved with save_to_disk: give a .txt, .jsonl or "
            f".csv file, a saved dataset's directory, or a registered prompt source."
        )
    try:
        import datasets
    except ImportError:
        raise PromptError(
            f"{str(path)!r} is a directory; reading a saved dataset needs `pip install datasets`."
        ) from None
    try:
        dataset = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:  # one save_to_disk did not finish
        raise PromptError(f"{str(path)!r} is not a complete saved dataset: {exc}") from None
    if isinstance(dataset, datasets.DatasetDict):  # saved with its splits
        if len(dataset) != 1:
            raise PromptError(
                f"dataset {str(path)!r} holds the splits {', '.join(dataset)}: give one of them, as "
                f"{str(path / next(iter(dataset)))!r}."
            )
        dataset = next(iter(dataset.values()))
    if "prompt" not in dataset.column_names:
        raise PromptError(f"dataset {str(path)!r} has no 'prompt' column (columns: {dataset.column_names}).")
    return list(dataset)


def _to_prompt(record: Any, where: str, index: int) -> Prompt:
    if isinstance(record, Prompt):
        return record
    if isinstance(record, str):
        text, meta = record, {}
    elif isinstance(record, Mapping):
        meta = dict(record)
        text = meta.pop("prompt", None)
    else:
        text, meta = None, {}
    if not _is_text(text):
        raise PromptError(
            f"prompt {index} of {where} is {record!r}: each prompt must be a non-empty string, "
            f"or a mapping with a non-empty 'prompt' string."
        )
    return Prompt(text, meta)


def _is_text(text: Any) -> bool:
    """A prompt's text: a string with something but whitespace in it."""
    return isinstance(text, str) and bool(text.strip())


def _shipped(name: str) -> Callable[[], list[Any]]:
    return lambda: read_prompt_file(DATA_DIR / f"{name}.jsonl")


def copy_prompts(alphabet: str = "abcdefgh", length: int = 3) -> list[dict[str, Any]]:
    """Every string of ``length`` letters from ``alphabet``, each its own reference (the Copy task)."""
    words = [""]
    for _ in range(length):
        words = [w + c for w in words for c in alphabet]
    return [{"prompt": w, "reference": w} for w in words]


def _copy_held_out(word: str, alphabet: str = "abcdefgh") -> bool:
    """Whether a Copy string is held out: its letters' indices sum to 7 modulo 8. Every letter then takes
    every position equally often in both parts (every 8th string in order held out the words ending in
    "h" alone, a letter at a position that training never had)."""
    return sum(alphabet.index(c) for c in word) % len(alphabet) == len(alphabet) - 1


@hookimpl
def register_prompt_sources(register: Callable[..., None]) -> None:
    register("chat", _shipped("chat"))
    register("reviews", _shipped("reviews"))
    register("arithmetic", _shipped("arithmetic"))
    # 40 "What is the capital of X? Answer with the city name only." with the city as reference: a verifiable
    # task the embedded SmolLM2-135M gets right about a quarter of the time when sampling (GRPO's example).
    register("capitals", _shipped("capitals"))
    register("copy", copy_prompts)
    # A fixed split of the same strings: one in 8 for evaluation, the rest for training
    register("copy-train", lambda: [p for p in copy_prompts() if not _copy_held_out(p["prompt"])])
    register("copy-heldout", lambda: [p for p in copy_prompts() if _copy_held_out(p["prompt"])])
