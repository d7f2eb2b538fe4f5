"""``rm_score``: the score of a local Hugging Face sequence-classification (reward) model."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from textgym import Sample, hookimpl
from textgym.scoring import batched, check_positive, resolve_device, uses_chat_template


class RMScore:
    """One label's logit (or probability) from a sequence-classification model on prompt + completion.

    Args:
        model: a local directory with an ``AutoModelForSequenceClassification`` model and its tokenizer.
        label: label index or name (``config.id2label``); optional when the model has a single output.
        output: ``"logit"`` or ``"probability"`` (softmax over labels; sigmoid for a single output).
        chat_template: ``"auto"``, true or false: format the pair as a user turn and an assistant turn with
            the reward model's chat template. Otherwise ``template`` is used.
        template: format string with ``{prompt}`` and ``{completion}`` (default: the two concatenated).
        batch_size, max_length: batching; texts longer than ``max_length`` tokens are cut from the left,
            so the completion is always scored whole.
    """

    name = "rm_score"

    def __init__(
        self,
        model: str,
        label: int | str | None = None,
        output: str = "logit",
        chat_template: bool | str = "auto",
        template: str = "{prompt}{completion}",
        batch_size: int = 16,
        max_length: int = 512,
        device: str = "auto",
    ):
        check_positive(batch_size=batch_size, max_length=max_length)
        if output not in ("logit", "probability"):
            raise ValueError(f"output must be 'logit' or 'probability', not {output!r}.")
        if "{completion}" not in template:
            raise ValueError(f"template {template!r} must contain {{completion}}.")
        if not Path(model).expanduser().is_dir():
            raise ValueError(
                f"model {model!r} is not a local directory with a sequence-classification model."
            )
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.device = resolve_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.tokenizer.truncation_side = "left"
        self.tokenizer.padding_side = "right"
        self.model = AutoModelForSequenceClassification.from_pretrained(model).to(self.device).eval()
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token or self.tokenizer.unk_token
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.label = self._label_index(label)
        self.output, self.template = output, template
        self.chat = uses_chat_template(self.tokenizer, chat_template)
        self.batch_size, self.max_length = batch_size, max_length

    def _label_index(self, label: int | str | None) -> int:
        config = self.model.config
        labels = {int(i): name for i, name in (config.id2label or {}).items()}
        if label is None:
            if config.num_labels == 1:
                return 0
            raise ValueError(f"the model has {config.num_labels} labels {labels}; choose one with `label`.")
        if isinstance(label, str):
            by_name = {name: i for i, name in labels.items()}
            if label not in by_name:
                raise ValueError(f"label {label!r} is not one of the model's labels {sorted(by_name)}.")
            return by_name[label]
        if not 0 <= label < config.num_labels:
            raise ValueError(f"label {label} is out of range: the model has {config.num_labels} labels.")
        return label

    def format(self, s: Sample) -> str:
        if self.chat:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": s.prompt}, {"role": "assistant", "content": s.completion}],
                tokenize=False,
            )
        return self.template.format(prompt=s.prompt, completion=s.completion)

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        import torch

        scores: list[float] = []
        for batch in batched(samples, self.batch_size):
            enc = self.tokenizer(
                [self.format(s) for s in batch],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.device)
            with torch.inference_mode():
                logits = self.model(**enc).logits.float()  # (B, num_labels)
            if self.output == "probability":
                probs = logits.sigmoid() if logits.shape[-1] == 1 else logits.softmax(-1)
                scores.extend(probs[:, self.label].tolist())
            else:
                scores.extend(logits[:, self.label].tolist())
        return scores


@hookimpl
def register_rewards(register: Callable[..., Any]) -> None:
    register("rm_score", RMScore)
