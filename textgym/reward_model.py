"""Reward models from preference pairs: ``textgym train-rm``.

:func:`train_reward_model` puts a one-output sequence-classification head on a causal LM and trains it
with the Bradley–Terry loss ``-log sigmoid(r(chosen) - r(rejected))`` (Ouyang et al. 2022, eq. 1), then
writes a plain Hugging Face model directory that the ``rm_score`` reward loads as it is
(``{name = "rm_score", model = "DIR"}``). The trainer formats and tokenizes each prompt + completion exactly
as ``rm_score`` does with its defaults (the tokenizer's chat template when it has one, else the two texts
concatenated; right padding; cut from the left at ``max_length``), so the reward scores what was trained.
"""

from __future__ import annotations

import json
import math
import os
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from textgym.atomic import atomic_build_dir, is_complete
from textgym.errors import ConfigError, TrainingError
from textgym.models import EMBEDDED
from textgym.pairs import Pair, PairsLike, read_pairs, split_pairs
from textgym.rm_scoring import (
    PairMetrics,
    PairScorer,
    load_for_training,
    model_dir,
    quiet_transformers,
)

REPORT = "train_rm.json"
LEARNING_RATE = 1e-5  # full fine-tuning; LoRA trains fewer weights and takes a larger step
LORA_LEARNING_RATE = 1e-4
# The score head starts from scratch while the LM is pretrained: at the LM's 1e-5, AdamW moves each head
# weight by ~1e-5 a step, so a few hundred pairs barely move the margin (measured: SmolLM2 on 150 sentiment
# pairs, held-out accuracy 0.58 -> 0.58 in one epoch; a larger LM rate memorised: 0.55, training loss 0.36).
# A linear probe on the frozen LM's features learnt the same pairs at 1e-3 (0.71 held-out), not at 1e-4.
HEAD_LEARNING_RATE = 1e-3
HEAD_NAMES = frozenset({"score", "classifier"})  # what transformers calls the sequence-classification head


@dataclass
class RMReport:
    """What :func:`train_reward_model` did; also written to ``DIR/train_rm.json``."""

    output: str
    model: str
    pairs: int
    train_pairs: int
    eval_pairs: int
    before: PairMetrics  # held-out, with the head the model started with (new, unless the model had one)
    after: PairMetrics  # held-out, after training
    score_mean: float  # mean and std of the trained model's held-out scores (Bradley–Terry fixes no offset)
    score_std: float
    train_loss: list[float]  # mean loss of each epoch
    seconds: float
    settings: dict[str, Any] = field(default_factory=dict)
    eval_lines: list[int] = field(default_factory=list)  # the held-out pairs' lines in the pairs file
    # held-out pairs whose prompt is also a training pair's (the split is by pair): their accuracy is not
    # measured on prompts the model never saw
    eval_prompts_seen: int = 0

    def summary(self) -> str:
        b, a = self.before, self.after
        return "\n".join(
            [
                f"held-out pairs: {self.eval_pairs} (trained on {self.train_pairs}) in {self.seconds:.0f} s"
                + (
                    f"; {self.eval_prompts_seen} of them on prompts also in training pairs"
                    if self.eval_prompts_seen
                    else ""
                ),
                f"  accuracy     {b.accuracy:.3f} -> {a.accuracy:.3f} ({round(b.accuracy * self.eval_pairs)} -> "
                f"{round(a.accuracy * self.eval_pairs)} of {self.eval_pairs} pairs)",
                f"  mean margin  {b.mean_margin:+.3f} -> {a.mean_margin:+.3f}",
                f"  loss         {b.loss:.3f} -> {a.loss:.3f}",
                f"  scores       mean {self.score_mean:+.3f}, std {self.score_std:.3f} (held-out, trained)"
                + (", in bf16 as rm_score scores on a GPU" if self.settings.get("bf16") else ""),
                f"wrote {self.output}; score with: --reward \"rm_score model='{self.output}'\"",
            ]
        )


def parse_lora(lora: Mapping[str, Any] | str | None, key: str = "--lora") -> dict[str, Any] | None:
    """peft ``LoraConfig`` arguments from a dict or a TOML inline table such as ``'{r = 8}'`` (``key``: how
    messages name the setting)."""
    if lora is None or isinstance(lora, Mapping):
        return None if lora is None else dict(lora)
    try:
        value = tomllib.loads(f"v = {lora}")["v"]
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{key} {lora!r} is not a TOML inline table such as '{{r = 8}}' ({exc}).") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{key} {lora!r} must be a TOML inline table such as '{{r = 8, lora_alpha = 16}}'.")
    return value


def check_train_settings(
    epochs: int,
    learning_rate: float | None,
    head_learning_rate: float | None,
    batch_size: int,
    eval_fraction: float,
    max_length: int,
    seed: int = 0,
) -> None:
    """Raise :class:`ConfigError` for a value the trainer cannot work with."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
        raise ConfigError(f"seed (--seed) must be an integer in [0, 2**32), not {seed!r}.")
    for name, value in (("epochs", epochs), ("batch_size", batch_size), ("max_length", max_length)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} (--{name.replace('_', '-')}) must be an integer >= 1, not {value!r}.")
    for name, value, example in (
        ("learning_rate", learning_rate, LEARNING_RATE),
        ("head_learning_rate", head_learning_rate, HEAD_LEARNING_RATE),
    ):
        valid = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf
        if value is not None and not valid:
            raise ConfigError(
                f"{name} (--{name.replace('_', '-')}) must be a finite number > 0, not {value!r}, e.g. "
                f"{example:g}."
            )
    if not (isinstance(eval_fraction, (int, float)) and 0 < eval_fraction < 1):
        raise ConfigError(
            f"eval_fraction (--eval-fraction) must be between 0 and 1 (exclusive), not {eval_fraction!r}: "
            f"held-out accuracy is how a reward model is judged."
        )


def train_reward_model(
    pairs: PairsLike,
    output: str | os.PathLike,
    *,
    model: str | os.PathLike = EMBEDDED,
    lora: Mapping[str, Any] | str | None = None,
    epochs: int = 1,
    learning_rate: float | None = None,
    head_learning_rate: float | None = None,
    batch_size: int = 8,
    eval_fraction: float = 0.1,
    seed: int = 0,
    max_length: int = 512,
    device: str = "auto",
    progress: bool | None = None,
) -> RMReport:
    """Train a Bradley–Terry reward model on preference pairs and save it where ``rm_score`` loads it.

    Args:
        pairs: a JSONL file (or list of dicts) with ``prompt``, ``chosen`` and ``rejected`` strings.
        output: the model directory to write (atomically; a previous train-rm output there is replaced).
        model: the causal LM to start from: a zoo name or a model directory.
        lora: peft ``LoraConfig`` arguments (dict or TOML inline table ``'{r = 8}'``); the adapter is merged
            into the weights before saving, so ``output`` is a plain model directory.
        epochs: passes over the training pairs.
        learning_rate: AdamW's for the LM (or its adapter), decayed linearly to 0 (default 1e-5, or 1e-4
            with LoRA).
        head_learning_rate: the same for the new score head, which starts from scratch (default 1e-3).
        batch_size: pairs per step (each step is one forward over 2 x batch_size texts).
        eval_fraction: the share of pairs held out (seeded) to measure accuracy before and after training.
        seed: seeds the split, the new head's initialisation and the order of the pairs.
        max_length: tokens per text, cut from the left (written to train_rm.json, where ``rm_score`` takes
            it from when it is not given one).
        device: ``"auto"`` (a GPU when there is one, with bf16 autocast in training), ``"cpu"``, ``"cuda"``.
        progress: show a progress bar (default: when writing to a terminal).

    Returns:
        The :class:`RMReport`, also written to ``output/train_rm.json``.

    Raises:
        PairsError: the pairs file is missing, a row lacks a field or repeats chosen as rejected (the
            message names the line), or there are too few pairs for the held-out split.
        ConfigError: a setting is out of range, or ``output`` is a directory train-rm did not write.
        UnknownNameError, ModelError: ``model`` is neither a zoo model nor a usable model directory.
    """
    from textgym.scoring import position_limit, resolve_bf16, resolve_device

    check_train_settings(
        epochs, learning_rate, head_learning_rate, batch_size, eval_fraction, max_length, seed
    )
    lora = parse_lora(lora)
    lora_config = _lora_config(lora) if lora is not None else None
    if learning_rate is None:
        learning_rate = LORA_LEARNING_RATE if lora is not None else LEARNING_RATE
    if head_learning_rate is None:
        head_learning_rate = HEAD_LEARNING_RATE
    output = Path(output).expanduser()
    if output.exists() and not (is_complete(output) and (output / REPORT).is_file()):
        raise ConfigError(
            f"--output {str(output)!r} exists and is not a train-rm output: choose a new directory (a "
            f"previous train-rm output is replaced, nothing else is)."
        )
    all_pairs = read_pairs(pairs)
    train, held_out = split_pairs(all_pairs, eval_fraction, seed)
    device = resolve_device(device)
    bf16 = resolve_bf16(None, device)  # the held-out figures in the precision rm_score scores in by default
    start = time.perf_counter()
    with model_dir(model) as path:
        rm, tokenizer = load_for_training(path, seed)
    if (positions := position_limit(rm)) is not None and max_length > positions:
        raise ConfigError(
            f"max_length={max_length} is more than the {positions} positions of {model}: a text that long fails "
            f"in its forward pass. Give --max-length {positions} or less."
        )
    if lora_config is not None:
        rm = _with_lora(rm, lora_config, lora)
    scorer = PairScorer(rm.to(device), tokenizer, max_length, device)
    scorer.check(all_pairs)
    before, _ = scorer.evaluate(held_out, batch_size, bf16)
    train_loss = _fit(scorer, train, epochs, (learning_rate, head_learning_rate), batch_size, seed, progress)
    if lora is not None:
        scorer.model = scorer.model.merge_and_unload()  # a plain model: rm_score loads it without peft
    after, rewards = scorer.evaluate(held_out, batch_size, bf16)  # of the weights that are saved
    trained_prompts = {pair.prompt for pair in train}
    report = RMReport(
        output=str(output),
        model=str(model),
        pairs=len(all_pairs),
        train_pairs=len(train),
        eval_pairs=len(held_out),
        eval_prompts_seen=sum(p.prompt in trained_prompts for p in held_out),
        before=before,
        after=after,
        score_mean=float(rewards.mean()),
        score_std=float(rewards.std()),
        train_loss=train_loss,
        seconds=time.perf_counter() - start,
        settings={
            "lora": lora,
            "epochs": epochs,
            "learning_rate": learning_rate,
            "head_learning_rate": head_learning_rate,
            "batch_size": batch_size,
            "eval_fraction": eval_fraction,
            "seed": seed,
            "max_length": max_length,
            "chat_template": scorer.chat,
            "bf16": bf16,
        },
        eval_lines=[p.line for p in held_out],
    )

    def build(tmp: Path) -> None:
        with quiet_transformers():
            scorer.model.to("cpu").save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / REPORT).write_text(json.dumps(asdict(report), indent=2) + "\n")

    atomic_build_dir(output, build, replace=True)
    return report


def _fit(
    scorer: PairScorer,
    train: Sequence[Pair],
    epochs: int,
    learning_rates: tuple[float, float],
    batch_size: int,
    seed: int,
    progress: bool | None,
) -> list[float]:
    """Minimise the Bradley–Terry loss over ``train``, at ``learning_rates`` (the LM's, the head's);
    returns each epoch's mean loss."""
    import torch
    import torch.nn.functional as F
    from tqdm.auto import tqdm

    from textgym.formatting import Tenths

    model = scorer.model
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    head = [p for name, p in named if HEAD_NAMES & set(name.split("."))]  # peft's copy of it too
    lm = [p for name, p in named if not HEAD_NAMES & set(name.split("."))]
    params = lm + head
    groups = [{"params": lm, "lr": learning_rates[0]}, {"params": head, "lr": learning_rates[1]}]
    try:  # the fused kernel is ~3x faster per step on the CPU than the default (see agents/ppo.py)
        optimizer = torch.optim.AdamW(groups, fused=True)
    except (RuntimeError, TypeError):
        optimizer = torch.optim.AdamW(groups)
    total_steps, step = epochs * math.ceil(len(train) / batch_size), 0
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1 - done / total_steps)
    order_rng = torch.Generator().manual_seed(seed)
    autocast = scorer.device.startswith("cuda")  # bf16 on GPUs; fp32 on the CPU
    epoch_losses: list[float] = []
    disable = None if progress is None else not progress  # None: a bar only on a terminal
    with tqdm(total=total_steps, desc="train-rm", unit="step", disable=disable) as bar:
        lines = Tenths(bar, "train-rm", "steps", progress)
        for _ in range(epochs):
            # eval mode: no dropout (TRL's disable_dropout). Chosen and rejected ran with masks of their own,
            # and the margin, the gradient's one signal, carried their noise; gradients flow all the same
            model.eval()
            order = torch.randperm(len(train), generator=order_rng).tolist()
            losses = []
            for first in range(0, len(train), batch_size):
                step += 1
                batch = [train[i] for i in order[first : first + batch_size]]
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    margin, _ = scorer.margins(batch)  # (B,)
                loss = -F.logsigmoid(margin).mean()  # Bradley–Terry: -log P(chosen is preferred)
                if not torch.isfinite(loss):  # saved, it would score nan for every text
                    raise TrainingError(
                        f"train-rm: the loss became {loss.item()} at step {step} of {total_steps}, so nothing was saved. "
                        f"Lower the learning rates (learning_rate={learning_rates[0]:g}, "
                        f"head_learning_rate={learning_rates[1]:g})."
                    )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()
                schedule.step()
                losses.append(loss.item() * len(batch))  # a short last batch weighs by its pairs
                bar.update(1)
                figures = {"loss": f"{loss.item():.3f}", "acc": f"{float((margin > 0).float().mean()):.2f}"}
                bar.set_postfix(figures)
                lines.update(step, f"batch loss {figures['loss']}, batch accuracy {figures['acc']}")
            epoch_losses.append(sum(losses) / len(train))
    return epoch_losses


def check_lora(lora: Mapping[str, Any] | str | None, key: str = "--lora") -> None:
    """Raise :class:`ConfigError` for LoRA settings ``train_reward_model`` could not use (``key``: how the
    message names them)."""
    settings = parse_lora(lora, key)
    if settings is not None:
        _lora_config(settings, key)


def _lora_config(lora: dict[str, Any], key: str = "--lora") -> Any:
    from peft import LoraConfig

    from textgym.agents.lora import check_lora_keys

    check_lora_keys(lora, f"{key} {_toml(lora)}", "SEQ_CLS")
    try:
        # task_type SEQ_CLS also trains (and saves) the new score head in full
        return LoraConfig(task_type="SEQ_CLS", **lora)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{key} {_toml(lora)}: {exc}. See peft's LoraConfig for its arguments.") from None


def _toml(table: Mapping[str, Any]) -> str:
    """A dict as a TOML inline table, as the user wrote it (``{r = 8}``), not as Python prints it."""
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in table.items()) + "}"


def _with_lora(model: Any, config: Any, lora: Mapping[str, Any]) -> Any:
    from peft import get_peft_model

    from textgym.agents.lora import quiet_peft, warn_of_inert_dropout

    warn_of_inert_dropout(lora)
    try:
        with quiet_peft():
            return get_peft_model(model, config)
    except ValueError as exc:
        raise ConfigError(f"--lora {_toml(lora)}: {exc}") from None
