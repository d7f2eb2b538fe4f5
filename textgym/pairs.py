"""Preference pairs: the JSONL format ``textgym train-rm`` reads, and ``textgym label-pairs``, which makes
such pairs from a policy's samples and a gold reward stack.

One pair per line: ``{"prompt": ..., "chosen": ..., "rejected": ...}`` (strings; other keys are ignored).
``label-pairs`` also writes ``chosen_score``, ``rejected_score``, ``gold_margin`` (chosen minus rejected,
under the gold stack) and ``flipped`` (true where label noise swapped the two, so the margin is negative).
Not ``margin``: TRL's ``RewardTrainer`` reads a ``margin`` column into its loss, which would then ask for
a gap in the gold stack's units, and a negative one on flipped rows.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from textgym.composition import is_number
from textgym.config import MAX_SEED
from textgym.errors import ConfigError, PairsError
from textgym.formatting import shortened

FIELDS = ("prompt", "chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    """One preference: ``chosen`` is the better completion of ``prompt``, ``rejected`` the worse."""

    prompt: str
    chosen: str
    rejected: str
    line: int  # where it came from: the 1-based line of the file (or position in a list)


PairsLike = str | os.PathLike | Sequence[Mapping[str, Any] | Pair]


def read_pairs(source: PairsLike) -> list[Pair]:
    """Read and check preference pairs from a JSONL file or a list of dicts.

    Raises:
        PairsError: the file does not exist or is empty, or a row is not a JSON object with string
            ``prompt``, ``chosen`` and ``rejected`` that differ (the message names the line).
    """
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        if not path.is_file():
            raise PairsError(
                f"pairs file {str(source)!r} {'is a directory' if path.is_dir() else 'does not exist'}. Write "
                f"JSONL rows with prompt, chosen and rejected, or make them with `textgym label-pairs`."
            )
        where = str(source)
        records: list[tuple[int, Any]] = []
        # lines end at "\n" only: JSON strings may hold U+2028, U+0085 (splitlines would cut them there)
        for n, raw in enumerate(path.read_bytes().split(b"\n"), start=1):
            try:
                text = raw.decode("utf-8-sig" if n == 1 else "utf-8")  # a BOM, as some editors write
            except UnicodeDecodeError as exc:
                raise PairsError(
                    f"{where}, line {n}: not UTF-8 (byte {raw[exc.start]:#04x} at column {exc.start + 1}); save "
                    f"the file as UTF-8."
                ) from None
            if not text.strip():
                continue
            try:
                records.append((n, json.loads(text)))
            except json.JSONDecodeError as exc:
                array = (
                    " The file reads as JSONL: one object per line, not a JSON array."
                    if text.lstrip()[:1] == "["
                    else ""
                )
                raise PairsError(f"{where}, line {n}: not valid JSON ({exc.msg}).{array}") from None
    else:
        where = "the pairs list"
        records = list(enumerate(source, start=1))
    pairs = [_to_pair(record, where, n) for n, record in records]
    if not pairs:
        raise PairsError(f"{where} has no pairs: give JSONL rows with prompt, chosen and rejected.")
    return pairs


def _to_pair(record: Any, where: str, line: int) -> Pair:
    if isinstance(record, Pair):  # keeps the line it was read from (RMReport.eval_lines)
        record, line = (
            {"prompt": record.prompt, "chosen": record.chosen, "rejected": record.rejected},
            record.line,
        )
    if not isinstance(record, Mapping):
        hint = (
            " (the file reads as JSONL: one object per line, not a JSON array)"
            if isinstance(record, list)
            else ""
        )
        raise PairsError(
            f"{where}, line {line}: expected an object with prompt, chosen and rejected, not "
            f"{_short(record)}{hint}."
        )
    missing = [key for key in FIELDS if key not in record]
    if missing:
        raise PairsError(
            f"{where}, line {line}: the row has no {' or '.join(map(repr, missing))} "
            f"(it has {', '.join(map(repr, record)) or 'no keys'}). Every row needs prompt, chosen and rejected."
        )
    for key in FIELDS:
        value = record[key]
        if not isinstance(value, str):
            messages = " (a list of chat messages: give the texts, e.g. the last message's content)"
            raise PairsError(
                f"{where}, line {line}: {key!r} must be a string, not {_short(value)}"
                f"{messages if isinstance(value, list) else ''}."
            )
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # valid JSON ("\\ud83d" alone), but no text a tokenizer takes
            raise PairsError(
                f"{where}, line {line}: {key!r} holds a lone surrogate ({_short(value)}), half of a character "
                f"that cannot be written as text; fix the escape or remove the row."
            ) from None
    if record["chosen"] == record["rejected"]:
        text = shortened(record["chosen"], 40)
        raise PairsError(
            f"{where}, line {line}: chosen and rejected are the same text ({text!r}), which teaches no "
            f"preference. Remove the row (label-pairs skips such ties)."
        )
    return Pair(record["prompt"], record["chosen"], record["rejected"], line)


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)`` cut to ``limit`` characters: a message names a row, it does not print it whole."""
    return shortened(repr(value), limit)


def split_pairs(pairs: Sequence[Pair], eval_fraction: float, seed: int) -> tuple[list[Pair], list[Pair]]:
    """A seeded split into (train, held-out); the held-out part is ``eval_fraction * n`` pairs, rounded half up.
    Copies of one pair (the same prompt, chosen and rejected texts) go to the same part, so the held-out
    accuracy is never partly measured on training pairs; the held-out part may then hold a few more.

    Raises:
        PairsError: either part would be empty.
    """
    import numpy as np

    if not (isinstance(eval_fraction, (int, float)) and 0 < eval_fraction < 1):
        raise PairsError(f"eval_fraction must be between 0 and 1 (exclusive), not {eval_fraction!r}.")

    def held_out_size(n: int) -> int:
        return math.floor(eval_fraction * n + 0.5)

    n = len(pairs)
    n_eval = held_out_size(n)
    if n_eval < 1 or n_eval >= n:
        # the fewest pairs that split, by the same float arithmetic (a formula for it was off by one, as
        # 0.95 * 10 + 0.5 is 9.999999999999998): a binary search, as more pairs never split worse
        def splits(k: int) -> bool:
            return 1 <= held_out_size(k) < k

        low, high = 1, 2
        while not splits(high):
            low, high = high, 2 * high
        while high - low > 1:  # splits(high), not splits(low)
            middle = (low + high) // 2
            low, high = (low, middle) if splits(middle) else (middle, high)
        need = high
        raise PairsError(
            f"{n} pair(s) at eval_fraction {eval_fraction} leave {n_eval} held-out and {n - n_eval} training "
            f"pair(s); both need at least one. Give at least {need} pairs, or change --eval-fraction."
        )
    copies: dict[tuple[str, str, str], list[int]] = {}  # each distinct pair's rows
    for i, p in enumerate(pairs):
        copies.setdefault((p.prompt, p.chosen, p.rejected), []).append(i)
    rows = list(copies.values())
    held_out: list[int] = []
    for k in np.random.default_rng(seed).permutation(len(rows)):  # without copies: the first n_eval pairs
        if len(held_out) >= n_eval:
            break
        held_out.extend(rows[k])
    if len(held_out) == n:
        raise PairsError(
            f"the {n} pairs are copies of {len(rows)} distinct pair(s), too few to hold some out at "
            f"eval_fraction {eval_fraction}: copies of a pair stay on one side. Give more distinct pairs."
        )
    chosen = set(held_out)
    return [p for i, p in enumerate(pairs) if i not in chosen], [pairs[i] for i in sorted(held_out)]


def check_label_settings(
    num_prompts: int | None,
    max_new_tokens: int,
    temperature: float,
    label_noise: float,
    batch_size: int,
    top_k: int = 0,
    seed: int = 0,
) -> None:
    """Raise :class:`ConfigError` for a value ``label_pairs`` cannot work with."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED:
        raise ConfigError(f"seed must be an integer in [0, 2**32), not {seed!r}.")
    for name, value in (("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, not {value!r}.")
    if num_prompts is not None and (
        not isinstance(num_prompts, int) or isinstance(num_prompts, bool) or num_prompts < 1
    ):
        raise ConfigError(
            f"num_prompts must be a positive integer (or omitted for all), not {num_prompts!r}."
        )
    if not is_number(temperature) or not 0 < temperature < math.inf:
        raise ConfigError(
            f"temperature must be a finite number > 0, not {temperature!r}: greedy decoding would give both "
            f"completions of a prompt the same text, and an infinite one samples every token alike."
        )
    if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0 or top_k == 1:
        raise ConfigError(
            f"top_k must be 0 (off) or an integer >= 2, not {top_k!r}: top_k = 1 is greedy decoding, which "
            f"would give both completions of a prompt the same text."
        )
    if not is_number(label_noise) or not 0 <= label_noise < 0.5:
        raise ConfigError(
            f"label_noise must be in [0, 0.5), not {label_noise!r}: it is the share of labels flipped, and at "
            f"0.5 or more the labels say more about the noise than the gold reward."
        )


@dataclass(frozen=True)
class LabelStats:
    """What :func:`label_pairs` did."""

    output: str
    prompts: int  # prompts sampled, two completions each
    pairs: int  # rows written
    ties: int  # prompts skipped: both completions had the same gold score, or the same text
    flipped: int  # rows whose labels label noise swapped (marked "flipped": true)
    seconds: float
    # prompts skipped: a weighted gold component applied to one completion and not to the other (None), so
    # their totals were not comparable, or none applied to either (no gold signal)
    unscored: int = 0

    def summary(self) -> str:
        unscored = f", {self.unscored} not comparable" if self.unscored else ""
        return (
            f"wrote {self.pairs} pairs to {self.output} from {self.prompts} prompts in {self.seconds:.0f} s "
            f"({self.ties} ties skipped{unscored}, {self.flipped} labels flipped)"
        )


def gold_specs(rewards: Any) -> dict[str, Any]:
    """The gold reward stack as a stack table (``aggregate``, ``components``, ``gates``): from a stack table,
    or a list of specs (``"name key=value"`` strings or dicts) in which a ``.toml`` path stands for that
    file's stack: its top-level ``rewards`` list, with optional ``gates`` and ``aggregate`` (a file with them
    is the whole stack). A relative ``fn`` file in a .toml resolves against the file's directory."""
    from textgym.composition import STACK_KEYS, stack_table
    from textgym.config import read_toml
    from textgym.reward_functions import resolve_fn_paths

    if isinstance(rewards, Mapping) and any(key in rewards for key in STACK_KEYS):
        return stack_table(rewards, "gold rewards")
    items = [rewards] if isinstance(rewards, (str, os.PathLike, Mapping)) else list(rewards or [])
    components: list[Any] = []
    whole = None  # a file's stack with gates or an aggregate
    for item in items:
        if isinstance(item, (str, os.PathLike)) and str(item).endswith(".toml"):
            table = read_toml(item, "rewards file")
            unknown = sorted(set(table) - {"rewards", "gates", "aggregate"})
            if unknown:  # (gates and aggregate were dropped unsaid: the pairs were labelled by another stack)
                raise ConfigError(
                    f"rewards file {str(item)!r}: unknown top-level key(s) {', '.join(map(repr, unknown))}; it "
                    f'takes rewards = [...] and optionally gates = [...] and aggregate = "...".'
                )
            if not isinstance(table.get("rewards"), list) or not table["rewards"]:
                raise ConfigError(
                    f"rewards file {str(item)!r} needs a top-level list, e.g. "
                    f'rewards = [{{ name = "sentiment" }}, {{ name = "length_penalty", weight = 0.5, target = 24 }}].'
                )
            stack = {
                "components": table["rewards"],
                **{k: table[k] for k in ("gates", "aggregate") if k in table},
            }
            stack = stack_table(resolve_fn_paths(stack, Path(item).expanduser().resolve().parent), str(item))
            if stack["gates"] or stack["aggregate"] != "sum":
                whole = (str(item), stack)
            components.extend(stack["components"])
        else:
            components.append(item)
    if not components:
        raise ConfigError("give the gold reward stack: at least one reward spec or a rewards .toml file.")
    if whole is not None:
        if len(items) > 1:  # whose components would its gates and aggregate apply to?
            raise ConfigError(
                f"rewards file {whole[0]!r} has gates or an aggregate: it is the whole gold stack; give it alone."
            )
        return whole[1]
    return {"aggregate": "sum", "components": components, "gates": []}


def label_pairs(
    prompts: Any,
    policy: str | os.PathLike,
    rewards: Any,
    output: str | os.PathLike,
    *,
    num_prompts: int | None = None,
    max_new_tokens: int = 32,
    max_prompt_tokens: int = 96,
    temperature: float = 1.0,
    top_k: int = 0,
    label_noise: float = 0.0,
    seed: int = 0,
    batch_size: int = 8,
    chat_template: bool | None = None,
    progress: bool | None = None,
) -> LabelStats:
    """Sample two completions per prompt with ``policy``, label them with a gold reward stack, write pairs.

    The completion with the higher gold total is ``chosen``. Ties (equal totals or equal texts) are skipped
    and counted, and so are prompts whose two completions the gold stack did not score alike: a weighted
    component that applies to one and not to the other (``None``) leaves the totals of different sums.
    Label noise flips ``label_noise * pairs`` labels (rounded half up), picked at random (seeded) within
    each batch while the running count is kept at the target, so a prefix of the file (an interrupted run)
    has the same noise rate. Rows are written and flushed after each batch.

    Args:
        prompts: a prompt source: registered name, file, or list (see :func:`textgym.load_prompts`).
        policy: the model that samples: a zoo name or a model directory.
        rewards: the gold stack: reward specs (``"sentiment"``, ``"length_penalty weight=0.5 target=24"``,
            dicts), or ``.toml`` files with a top-level ``rewards`` list.
        output: the JSONL file to write (replaced).
        num_prompts: how many prompts (default: all); past the end of the source it starts over, so a
            prompt then gets several pairs.
        max_new_tokens, max_prompt_tokens, temperature, top_k, chat_template: as ``textgym sample``.
        label_noise: the share of labels flipped, in [0, 0.5).
        seed: seeds the sampling (batch ``b`` uses ``seed + b``) and the label noise.
        batch_size: prompts sampled together (two episodes each).
        progress: show a progress bar (default: when writing to a terminal).
    """
    import time

    import numpy as np
    from tqdm.auto import tqdm

    from textgym import composition
    from textgym.envs import TextGenVectorEnv
    from textgym.formatting import Tenths
    from textgym.models import load_model
    from textgym.prompts import load_prompts
    from textgym.rewards import check_reward_specs
    from textgym.sampling import sample_episodes
    from textgym.scoring import resolve_device

    check_label_settings(num_prompts, max_new_tokens, temperature, label_noise, batch_size, top_k, seed)
    output = Path(output).expanduser()  # as read_pairs and train_reward_model read it
    if output.is_dir():
        raise ConfigError(f"output {str(output)!r} is a directory: give the JSONL file to write.")
    specs = gold_specs(rewards)
    check_reward_specs(specs, where="gold rewards")
    source = load_prompts(prompts)
    total = num_prompts or len(source)
    per_batch = min(batch_size, total)
    start_time = time.perf_counter()
    env = TextGenVectorEnv(
        num_envs=2 * per_batch,
        model=policy,
        prompts=source,
        rewards=specs,
        max_new_tokens=max_new_tokens,
        max_prompt_tokens=max_prompt_tokens,
        chat_template=chat_template,
        autoreset_mode="Disabled",
    )
    if top_k > env.single_action_space.n:
        env.close()
        raise ConfigError(
            f"top_k {top_k} is larger than the vocabulary ({env.single_action_space.n} tokens)."
        )
    model, _ = load_model(policy)
    if model is None:
        env.close()
        raise ConfigError(
            f"policy {policy!r} is a tokenizer without weights; label with a model, e.g. a zoo LM."
        )
    model.to(resolve_device("auto"))
    noise_rng = np.random.default_rng(seed)
    stack = env.reward_stack  # the components a total is made of: the weighted ones, and the gates'
    counted = {n for n, (_, w) in zip(stack.names, stack.rewards) if not composition.is_metric_weight(w)}
    counted |= {gate.component for gate in stack.gates}
    written = ties = flipped = unscored = 0
    output.parent.mkdir(parents=True, exist_ok=True)
    opened = False
    try:
        with (
            output.open("w", encoding="utf-8") as out,
            tqdm(total=total, desc="label-pairs", unit="prompt", disable=_disable(progress)) as bar,
        ):
            opened = True
            lines = Tenths(bar, "label-pairs", "prompts", progress)
            for batch, first in enumerate(range(0, total, per_batch)):
                indices = [i % len(source) for i in range(first, min(first + per_batch, total))]
                # Each prompt goes to two neighbouring sub-envs; a short last batch resets only its own.
                options: dict[str, Any] = {"prompts": [i for i in indices for _ in range(2)]}
                if 2 * len(indices) < env.num_envs:
                    options["reset_mask"] = np.arange(env.num_envs) < 2 * len(indices)
                episodes = sample_episodes(
                    model, env, temperature=temperature, top_k=top_k, seed=seed + batch, options=options
                )
                ranked = []  # (better, worse) episode of each prompt under the gold stack
                for a, b in zip(episodes[0 : 2 * len(indices) : 2], episodes[1 : 2 * len(indices) : 2]):
                    applied = _applied(a, counted)  # none: no gold signal; or two different ones
                    if not applied or applied != _applied(b, counted):
                        unscored += 1
                    elif _tied(a["reward"], b["reward"]) or a["completion"] == b["completion"]:
                        ties += 1
                    else:
                        ranked.append((a, b) if a["reward"] > b["reward"] else (b, a))
                # Keep the running number of flips at label_noise * pairs so far, rounded half up.
                target = math.floor(label_noise * (written + len(ranked)) + 0.5)
                flips = set(noise_rng.choice(len(ranked), size=target - flipped, replace=False).tolist())
                flipped = target
                rows = [
                    _row(worse, better, flipped=True) if k in flips else _row(better, worse)
                    for k, (better, worse) in enumerate(ranked)
                ]
                out.writelines(json.dumps(row) + "\n" for row in rows)
                out.flush()
                written += len(rows)
                bar.update(len(indices))
                bar.set_postfix(pairs=written, ties=ties, flipped=flipped)
                lines.update(first + len(indices), f"{written} pairs, {ties} ties, {flipped} flipped")
    except BaseException as exc:
        if opened:  # what the file holds now, for the command to say (a file an error or a Ctrl-C cut short)
            exc.pairs_written = written  # type: ignore[attr-defined]
        raise
    finally:
        env.close()
    seconds = time.perf_counter() - start_time
    return LabelStats(str(output), total, written, ties, flipped, seconds, unscored)


def _tied(a: float, b: float) -> bool:
    """Equal totals, up to float rounding: a stack of several components can reach one total by two sums
    (0.1 + 0.2 and 0.3 + 0.0) that round apart, and no gold signal prefers either."""
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _applied(episode: Mapping[str, Any], counted: set[str]) -> set[str]:
    """The counted gold components that applied to ``episode`` (not ``None``)."""
    return {k for k, v in episode["reward_components"].items() if k in counted and v is not None}


def _row(chosen: Mapping[str, Any], rejected: Mapping[str, Any], flipped: bool = False) -> dict[str, Any]:
    return {
        "prompt": chosen["prompt"],
        "chosen": chosen["completion"],
        "rejected": rejected["completion"],
        "chosen_score": chosen["reward"],
        "rejected_score": rejected["reward"],
        "gold_margin": chosen["reward"] - rejected["reward"],
        "flipped": flipped,
    }


def _disable(progress: bool | None) -> bool | None:
    """tqdm's ``disable``: None (the default) shows the bar only on a terminal."""
    return None if progress is None else not progress
