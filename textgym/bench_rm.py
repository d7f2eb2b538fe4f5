"""Proxy reward models that a bench trains before its runs: ``[[reward_models]]`` in the designs file.

```toml
[[reward_models]]
output = "runs/rm-copy"            # the model directory; designs score with { name = "rm_score", model = ... }
pairs = { prompts = "copy-train", policy = "tiny-char-llama", rewards = [{ name = "match", partial = true }],
          num_prompts = 8000, max_new_tokens = 4, max_prompt_tokens = 3 }   # textgym label-pairs
train = { model = "tiny-random-llama", epochs = 3, learning_rate = 1e-3, max_length = 32 }  # textgym train-rm
```

Each entry labels pairs with its gold stack (:func:`textgym.pairs.label_pairs`, written to
``<output>.pairs.jsonl``) and trains a Bradley–Terry reward model on them
(:func:`textgym.reward_model.train_reward_model`). ``<output>/bench-rm.json`` records the settings; a later
bench reuses the model when they match and refuses to overwrite it when they do not. The settings are part
of every run's identity, so runs trained against another proxy are never reported as this one's.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from textgym.errors import ConfigError
from textgym.factories import check_arguments
from textgym.rewards import check_reward_specs
from textgym.rundir import write_atomic

RECORD = "bench-rm.json"
KEYS = ("output", "pairs", "train")
REQUIRED_PAIRS = ("prompts", "policy", "rewards")


def check_reward_models(entries: Any, source: str) -> list[dict[str, Any]]:
    """The ``[[reward_models]]`` entries, checked (names, arguments, values, gold rewards) and each with its
    settings ``digest``. Nothing is loaded or trained here."""
    from textgym.bench_identity import (
        data_paths,
        file_digest,
        fn_files,
        fn_modules,
        packages_used,
        with_local_imports,
    )
    from textgym.errors import TextgymError
    from textgym.models import EMBEDDED, check_model_source
    from textgym.pairs import check_label_settings, gold_specs, label_pairs
    from textgym.prompts import load_prompts
    from textgym.reward_model import check_lora, check_train_settings, train_reward_model
    from textgym.rewards import parse_reward_spec
    from textgym.scoring import resolve_device

    if entries is None:
        return []
    if not isinstance(entries, list) or not all(isinstance(e, Mapping) for e in entries):
        raise ConfigError(f"{source}: [[reward_models]] must be a list of tables with {', '.join(KEYS)}.")
    out = []
    for entry in entries:
        unknown = sorted(set(entry) - set(KEYS))
        output = entry.get("output")
        where = f"{source}: reward model {output!r}"
        if unknown:
            raise ConfigError(
                f"{where}: unknown key {unknown[0]!r}; a [[reward_models]] table has {', '.join(KEYS)}."
            )
        if not isinstance(output, str) or not output:
            raise ConfigError(f'{source}: every [[reward_models]] table needs output = "<model directory>".')
        pairs, train = entry.get("pairs"), entry.get("train", {})
        if not isinstance(pairs, Mapping) or any(k not in pairs for k in REQUIRED_PAIRS):
            raise ConfigError(
                f"{where}: pairs must be a table with at least {', '.join(REQUIRED_PAIRS)} (the arguments of "
                f"textgym label-pairs; rewards is the gold stack that labels them)."
            )
        if not isinstance(train, Mapping):
            raise ConfigError(f"{where}: train must be a table (the arguments of textgym train-rm).")
        check_arguments("label-pairs", "pairs", _signature(label_pairs, "output", "progress"), pairs)
        check_arguments(
            "train-rm", "train", _signature(train_reward_model, "pairs", "output", "progress"), train
        )
        label_defaults = _defaults(label_pairs)
        try:
            check_label_settings(**{k: pairs.get(k, label_defaults[k]) for k in
                                    inspect.signature(check_label_settings).parameters})  # fmt: skip
            train_defaults = _defaults(train_reward_model)
            check_train_settings(**{k: train.get(k, train_defaults[k]) for k in
                                    inspect.signature(check_train_settings).parameters})  # fmt: skip
            # what would otherwise fail after the pairs are labelled (minutes, for many prompts)
            check_lora(train.get("lora"), "train.lora")
            resolve_device(train.get("device", "auto"))
            check_model_source(train.get("model", EMBEDDED))
            check_model_source(pairs["policy"])
            load_prompts(pairs["prompts"])
        except TextgymError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        check_reward_specs(gold_specs(pairs["rewards"]), where=f"{where}: pairs.rewards")
        settings = {"pairs": dict(pairs), "train": dict(train)}
        # by content: the gold stack's .toml files, its functions' code, and the data (prompt files, policy
        # and model directories, also those the gold stack names)
        gold = [
            parse_reward_spec(s) if isinstance(s, str) else s
            for s in gold_specs(pairs["rewards"])["components"]
        ]
        named = pairs["rewards"] if isinstance(pairs["rewards"], list) else [pairs["rewards"]]
        tomls = [str(item) for item in named if isinstance(item, str) and item.endswith(".toml")]
        modules, provided = fn_modules(gold)
        code = with_local_imports(fn_files(gold) + modules)
        files = sorted(set(tomls + code + data_paths(settings) + data_paths(gold)))
        digested = {**settings, "files": {f: file_digest(f) for f in files}} if files else settings
        if packages := {
            **packages_used(gold),
            **provided,
        }:  # gold code from an installed package: its version and code
            digested = {**digested, "packages": dict(sorted(packages.items()))}
        digest = hashlib.sha256(json.dumps(digested, sort_keys=True, default=str).encode()).hexdigest()[:16]
        # `~` expanded once, here: a TOML string never reaches a shell, and every step reads this path
        out.append({"output": str(Path(output).expanduser()), **settings, "digest": digest})
    outputs = [Path(e["output"]).resolve() for e in out]
    if len(set(outputs)) < len(outputs):
        raise ConfigError(f"{source}: two [[reward_models]] tables write the same output directory.")
    return out


def _signature(fn: Any, *drop: str) -> inspect.Signature:
    sig = inspect.signature(fn)
    return sig.replace(parameters=[p for n, p in sig.parameters.items() if n not in drop])


def _defaults(fn: Any) -> dict[str, Any]:
    return {n: p.default for n, p in inspect.signature(fn).parameters.items()}


def pending(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries still to train. Raises :class:`ConfigError` for an output directory this bench cannot
    reuse (made with other settings, or not by a bench): checked before anything trains."""
    todo = []
    for entry in entries:
        output = Path(entry["output"])
        if not output.exists():
            todo.append(entry)
            continue
        record = _read(output / RECORD)
        intent = _read(_intent(output))
        if record is None and intent is not None and intent.get("digest") == entry["digest"]:
            record = intent  # trained by this bench, cut before it recorded the settings
            write_atomic(output / RECORD, json.dumps(record, indent=2, default=str))
        if record is None:
            raise ConfigError(
                f"reward model output {str(output)!r} exists but no bench made it ({RECORD} is missing): choose "
                f"another output, or move it away."
            )
        if record.get("digest") != entry["digest"]:
            raise ConfigError(
                f"reward model {str(output)!r} was made with other settings than [[reward_models]] now gives; a "
                f"bench never replaces it: choose another output, or move it away to train it again."
            )
    return todo


def prepare(entries: list[dict[str, Any]], progress: bool = True) -> None:
    """Label pairs and train every entry of ``pending(entries)``, then record its settings."""
    from textgym.pairs import label_pairs
    from textgym.reward_model import train_reward_model

    for entry in pending(entries):
        output = Path(entry["output"])
        pairs_file = output.with_name(output.name + ".pairs.jsonl")
        stats = label_pairs(output=pairs_file, progress=progress, **entry["pairs"])
        if not stats.pairs:  # train_reward_model would blame the file, which the user never wrote
            raise ConfigError(
                f"reward model {str(output)!r}: label-pairs wrote no pairs from {stats.prompts} prompts "
                f"({stats.ties} ties, {stats.unscored} not comparable): the gold stack never told a prompt's two "
                f"completions apart. Raise num_prompts or temperature, or change the gold rewards."
            )
        record = json.dumps({"digest": entry["digest"], "pairs": entry["pairs"], "train": entry["train"]},
                            indent=2, default=str)  # fmt: skip
        # the settings are written beside the output first: a kill between the model's rename into place and
        # its record would leave a model no bench claims
        write_atomic(_intent(output), record)
        train_reward_model(pairs_file, output, progress=progress, **entry["train"])
        write_atomic(output / RECORD, record)
        _intent(output).unlink(missing_ok=True)


def _intent(output: Path) -> Path:
    return output.with_name(f".{output.name}.{RECORD}")


def _read(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
