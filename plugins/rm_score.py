"""``rm_score``: the score of a local Hugging Face sequence-classification (reward) model."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from textgym import Sample, hookimpl
from textgym.errors import RewardError
from textgym.rm_scoring import vocabulary_mismatch
from textgym.scoring import (
    autocast,
    bf16_linears,
    cache_argument,
    can_group,
    can_share_prefix,
    chat_pair,
    check_positive,
    grouped_forward,
    length_sorted_batches,
    ones_before,
    position_limit,
    prefix_cache,
    resolve_bf16,
    resolve_device,
    score_head_split,
    shared_prefix_length,
    uses_chat_template,
)

DEFAULT_TEMPLATE = "{prompt}{completion}"


def trained_settings(model: str) -> dict[str, Any]:
    """How ``textgym train-rm`` formatted the texts it trained the model in ``model`` on (its train_rm.json):
    ``max_length`` and ``chat_template`` where recorded; empty for another model."""
    import json

    from textgym.reward_model import REPORT

    try:
        settings = json.loads((Path(model).expanduser() / REPORT).read_text())["settings"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not isinstance(settings, dict):
        return {}
    out: dict[str, Any] = {}
    value = settings.get("max_length")
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        out["max_length"] = value
    if isinstance(settings.get("chat_template"), bool):
        out["chat_template"] = settings["chat_template"]
    return out


class RMScore:
    """One label's logit (or probability) from a sequence-classification model on prompt + completion
    (in a multi-turn episode: the agent's last turn after the prompt, without the turns between).

    Args:
        model: a local directory with an ``AutoModelForSequenceClassification`` model and its tokenizer.
        label: label index or name (``config.id2label``); optional when the model has a single output.
        output: ``"logit"`` or ``"probability"`` (softmax over labels; sigmoid for a single output).
        chat_template: ``"auto"``, true or false: format the pair as a user turn and an assistant turn with
            the reward model's chat template. Otherwise ``template`` is used.
        template: format string with ``{prompt}`` and ``{completion}`` (default: the two concatenated).
        batch_size, max_length: batching; texts longer than ``max_length`` tokens are cut from the left:
            the prompt goes first, and a completion longer than ``max_length`` loses its start too. Unset:
            the ``max_length`` the model was trained with where its ``train_rm.json`` says, else 512.
        device: ``"auto"`` (the GPU when there is one) or a torch device.
        bf16: bf16 autocast; unset: on for GPUs, off on the CPU.
        share_prefix: for a causal reward model, run the token prefix that a batch's texts share, and
            the tokens that the texts of one prompt share, once, through the KV cache (the scores do not
            change; a model whose cache cannot be repeated across rows runs each text whole).

    Texts are sorted by length so each batch pads little (by prompt first when prompts repeat), and for
    causal (decoder) reward models the token prefix that a batch's texts share (the chat template's
    system prompt) runs once, so do the tokens that a prompt's texts share when it comes more than once
    (a group method's completions of one prompt).
    """

    name = "rm_score"

    def __init__(
        self,
        model: str | None = None,
        label: int | str | None = None,
        output: str = "logit",
        chat_template: bool | str = "auto",
        template: str = DEFAULT_TEMPLATE,
        batch_size: int = 16,
        max_length: int | None = None,
        device: str = "auto",
        bf16: bool | None = None,
        share_prefix: bool = True,
    ):
        check_positive(batch_size=batch_size, **({} if max_length is None else {"max_length": max_length}))
        if output not in ("logit", "probability"):
            raise ValueError(f"output must be 'logit' or 'probability', not {output!r}.")
        if "{completion}" not in template:
            raise ValueError(f"template {template!r} must contain {{completion}}.")
        how = "train one with `textgym train-rm` (docs/reward-models.md) and give its directory"
        if model is None:
            raise ValueError(
                f"rm_score needs model=, a directory with a sequence-classification model: {how}."
            )
        if not Path(model).expanduser().is_dir():
            raise ValueError(
                f"model {model!r} is not a local directory with a sequence-classification model: {how}."
            )
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = resolve_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.tokenizer.truncation_side = "left"
        self.tokenizer.padding_side = "right"
        # fp32 whatever dtype the checkpoint was saved in (bf16 is the bf16 option's, below): a bf16-saved
        # reward model would otherwise run in bf16 with bf16 off, norms included
        loaded, loading = AutoModelForSequenceClassification.from_pretrained(
            model, dtype=torch.float32, output_loading_info=True
        )
        if loading["missing_keys"]:  # transformers starts them at random: the scores would be noise
            missing = sorted(loading["missing_keys"])
            raise ValueError(
                f"{model!r} is not a trained sequence-classification model: its weights lack "
                f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}, which would start at random (a "
                f"causal LM's directory?): {how}."
            )
        self.model = loaded.to(self.device).eval()
        if mismatch := vocabulary_mismatch(self.tokenizer, self.model):
            raise ValueError(f"{model!r}: {mismatch}")
        # The classifier reads each row at its last token that is not config.pad_token_id: the texts must be
        # padded with that id, or a short text in a batch with a longer one is read on its padding.
        config_pad = self.model.config.pad_token_id
        # A model that names no pad token reads a text alone at its last token. Batched, it needs one: any
        # the tokenizer has (EOS, or one of its own) made a text ending on that token read a token early, at
        # the one before it. Each batch then pads with an id none of its texts holds (_free_id), and reads
        # each row at its last token.
        self.reads_last = config_pad is None
        if config_pad is not None and config_pad != self.tokenizer.pad_token_id:
            token = self.tokenizer.convert_ids_to_tokens(config_pad)
            if not isinstance(token, str):
                raise ValueError(
                    f"the reward model {model!r} names pad_token_id = {config_pad} in its config.json, which its "
                    f"tokenizer does not have: set config.json's pad_token_id to the tokenizer's pad token id."
                )
            self.tokenizer.pad_token = token
        elif self.tokenizer.pad_token_id is None:  # (for tokenizer.pad: reads_last pads with a free id)
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        if not self.reads_last:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        # Encoders (BERT, DeBERTa) take no KV cache, and their tokens see the whole text: nothing to share.
        self.share_prefix = (
            share_prefix and cache_argument(self.model) is not None and can_share_prefix(self.model)
        )
        self.split = score_head_split(self.model) if self.share_prefix else None  # (trunk, head) or None
        # each prompt of a batch once (_grouped), where the model's outputs allow it (scoring.can_group)
        self.group = self.split is not None and can_group(self.split[0])
        self.bf16 = resolve_bf16(bf16, self.device)
        if self.bf16:
            bf16_linears(self.model)  # after score_head_split, whose check runs outside autocast
        self.label = self._label_index(label)
        self.output, self.template = output, template
        self.chat = uses_chat_template(self.tokenizer, chat_template)
        if self.chat and template != DEFAULT_TEMPLATE:
            raise ValueError(
                f"template {template!r} is not used: {model!r} formats texts with its chat template. Give "
                f"chat_template=false as well to score with the template instead (right only for a model "
                f"trained on texts formatted with it)."
            )
        trained = trained_settings(model)
        self.batch_size, self.max_length = batch_size, max_length or trained.get("max_length") or 512
        if (positions := position_limit(self.model)) is not None and self.max_length > positions:
            if max_length is not None:  # (a default beyond the model's positions is cut to them)
                raise ValueError(
                    f"max_length={max_length} is more than the model's {positions} positions: a text that long "
                    f"fails in its forward pass. Give max_length={positions} or less."
                )
            self.max_length = positions
        differs = []  # a train-rm model scored on texts formatted otherwise than it was trained on
        if "chat_template" in trained and self.chat != trained["chat_template"]:
            differs.append(f"chat_template={self.chat} (trained with {trained['chat_template']})")
        if trained and not self.chat and template != DEFAULT_TEMPLATE:
            differs.append(f"template={template!r} (trained on the prompt and completion concatenated)")
        if "max_length" in trained and self.max_length != trained["max_length"]:
            differs.append(f"max_length={self.max_length} (trained with {trained['max_length']})")
        if differs:
            warnings.warn(
                f"rm_score: {model!r} was trained by textgym train-rm on texts formatted otherwise: "
                f"{'; '.join(differs)}. Its scores move away from those it was trained and evaluated on; "
                f"leave these settings unset to score as it was trained.",
                stacklevel=2,
            )

    def _label_index(self, label: int | str | None) -> int:
        config = self.model.config
        labels = {int(i): name for i, name in (config.id2label or {}).items()}
        if label is None:
            if config.num_labels == 1:
                return 0
            raise ValueError(f"the model has {config.num_labels} labels {labels}; choose one with `label`.")
        if isinstance(label, bool) or not isinstance(label, (int, str)):
            raise ValueError(f"label must be a label index or name, not {label!r}.")
        if isinstance(label, str):
            by_name = {name: i for i, name in labels.items()}
            if label not in by_name:
                raise ValueError(f"label {label!r} is not one of the model's labels {sorted(by_name)}.")
            return by_name[label]
        if not 0 <= label < config.num_labels:
            count = f"{config.num_labels} label{'s' if config.num_labels != 1 else ''}"
            raise ValueError(
                f"label {label} is out of range: the model has {count} (0 to {config.num_labels - 1})."
            )
        return label

    def format(self, s: Sample) -> str:
        if self.chat:
            return chat_pair(self.tokenizer, s.prompt, s.completion)
        return self.template.format(prompt=s.prompt, completion=s.completion)

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        if not samples:
            return []  # the tokenizer has nothing to pad
        encodings = self.tokenizer(  # a chat template writes its own BOS: the tokenizer adds none again
            [self.format(s) for s in samples], truncation=True, max_length=self.max_length,
            add_special_tokens=not self.chat,
        )  # fmt: skip
        rows = [{key: values[i] for key, values in encodings.items()} for i in range(len(samples))]
        empty = [i for i, row in enumerate(rows) if not row["input_ids"]]
        # nothing for the model to read: a batch of them crashed in the forward, else a pad was read
        if empty:
            raise RewardError(
                f"sample {empty[0]} (prompt {samples[empty[0]].prompt[:40]!r}, completion "
                f"{samples[empty[0]].completion[:40]!r}) formats to no tokens: this reward model's tokenizer "
                f"has no chat template or BOS token to put before an empty text. Give rm_score a template "
                f'that adds text (template = "Prompt: {{prompt}}\\nReply: {{completion}}").'
            )
        scores = [0.0] * len(rows)
        prompts = [s.prompt for s in samples]
        if self._has_groups(prompts):  # a prompt's texts in the same batches, each prompt run once there
            order = sorted(range(len(rows)), key=lambda i: (prompts[i], -len(rows[i]["input_ids"])))
            batches = [
                order[start : start + self.batch_size] for start in range(0, len(order), self.batch_size)
            ]
        else:
            batches = list(length_sorted_batches([len(row["input_ids"]) for row in rows], self.batch_size))
        for batch in batches:
            ids, batch_prompts = [rows[i]["input_ids"] for i in batch], [prompts[i] for i in batch]
            grouped = self._grouped(ids, batch_prompts) if self._has_groups(batch_prompts) else None
            batch_scores = grouped if grouped is not None else self._scores([rows[i] for i in batch])
            for i, score in zip(batch, batch_scores):
                scores[i] = score
        return scores

    def _has_groups(self, prompts: Sequence[str]) -> bool:
        """Whether some prompt comes more than once and :meth:`_grouped` may run it once."""
        return self.group and len(set(prompts)) < len(prompts)

    def _read_at(self, ids: list[list[int]]) -> list[int]:
        """Where the model reads each row's score: its last token that is not the pad token (its last token,
        for a model that names no pad token)."""
        if self.reads_last:
            return [max(len(row) - 1, 0) for row in ids]
        pad = self.model.config.pad_token_id
        return [max((i for i, t in enumerate(row) if t != pad), default=0) for row in ids]

    def _free_id(self, ids: list[list[int]]) -> int:
        """A token id that none of ``ids`` holds, from the top of the vocabulary: padding the model reads as
        none of the texts' tokens."""
        used = {t for row in ids for t in row}
        return next(i for i in range(self.model.config.vocab_size - 1, -1, -1) if i not in used)

    def _grouped(self, ids: list[list[int]], prompts: list[str]) -> list[float] | None:
        """Scores of rows of which some share a prompt: the tokens that a prompt's rows start with run once,
        then each row's remaining tokens (:func:`textgym.scoring.grouped_forward`), and the score head reads
        where the model does. A prompt whose rows share no tokens before the read ones (cut from the left
        by max_length) runs each row apart. None (for :meth:`_scores`) when no prompt's texts share a token,
        or a row has no token before its read one."""
        import torch

        read_at = self._read_at(ids)
        groups: dict[str, list[int]] = {}
        for r, prompt in enumerate(prompts):
            groups.setdefault(prompt, []).append(r)
        starts, of_row = [], [0] * len(ids)
        shares = [
            shared_prefix_length([ids[r] for r in m], min(read_at[r] for r in m)) for m in groups.values()
        ]
        if not any(n for n, m in zip(shares, groups.values()) if len(m) > 1):
            return None  # no prompt's texts share a token (all cut from the left): one forward does
        for members, shared in zip(groups.values(), shares):
            parts = [(members, shared)] if shared else [([r], read_at[r]) for r in members]  # else each apart
            for part, n in parts:
                if not n:
                    return None
                for r in part:
                    of_row[r] = len(starts)
                starts.append(ids[part[0]][:n])
        rests = [row[len(starts[g]) :] for row, g in zip(ids, of_row)]
        at = torch.tensor([i - len(starts[g]) for i, g in zip(read_at, of_row)], device=self.device)
        trunk, score = self.split  # type: ignore[misc]
        with torch.inference_mode(), autocast(self.device, self.bf16):
            pad = self.tokenizer.pad_token_id if self.reads_last else self.model.config.pad_token_id
            _, hidden = grouped_forward(trunk, starts, rests, of_row, pad)  # (B, C, H)
            logits = score(hidden[torch.arange(len(ids), device=self.device), at]).float()  # (B, labels)
        return self._outputs(logits)

    def _scores(self, rows: list[dict[str, list[int]]]) -> list[float]:
        import torch

        prefix = self._shared_prefix([row["input_ids"] for row in rows])
        L = len(prefix)
        batch = self.tokenizer.pad([{k: v[L:] for k, v in row.items()} for row in rows], return_tensors="pt")
        batch = batch.to(self.device)  # right-padded
        if self.reads_last:  # padded with an id no text holds: the model reads each row at its last token
            free = self._free_id([row["input_ids"] for row in rows])
            batch["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, free)
            self.model.config.pad_token_id = free
        with torch.inference_mode(), autocast(self.device, self.bf16):
            if L:
                key, cache = prefix_cache(self.model, torch.tensor([prefix], device=self.device), len(rows))
                mask = batch["attention_mask"]
                batch = {**batch, "attention_mask": ones_before(mask, L), key: cache}
            logits = self.model(**batch).logits.float()  # (B, num_labels)
        return self._outputs(logits)

    def _outputs(self, logits: Any) -> list[float]:
        """The chosen label's logit, or probability, of each row of (B, num_labels) ``logits``."""
        if self.output == "probability":
            probs = logits.sigmoid() if logits.shape[-1] == 1 else logits.softmax(-1)
            return probs[:, self.label].tolist()
        return logits[:, self.label].tolist()

    def _shared_prefix(self, ids: list[list[int]]) -> list[int]:
        """The leading tokens that all rows share, for a causal model. Sequence-classification models score
        the last token that is not the pad token, so each row keeps that token after the prefix."""
        if not self.share_prefix or len(ids) < 2:  # one row gains nothing from a prefix run apart
            return []
        return ids[0][: shared_prefix_length(ids, min(self._read_at(ids)))]


@hookimpl
def register_rewards(register: Callable[..., Any]) -> None:
    register("rm_score", RMScore)
