"""``fluency``: mean per-token log-probability of the completion given the prompt under a reference LM."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from textgym import Sample, hookimpl
from textgym.scoring import (
    batched,
    chat_prompt,
    check_positive,
    distinct_n,
    resolve_device,
    uses_chat_template,
)


class Fluency:
    """Mean log p(completion token | prompt, earlier tokens) under ``model`` (EOS included when the
    completion ended on it), minus ``repetition_penalty * (1 - distinct-n)`` of the completion's words.

    Args:
        model: zoo name, model directory or hub id of a causal LM (default: the embedded SmolLM2).
        chat_template: ``"auto"`` (when the tokenizer has one), true or false: score the completion as the
            assistant's reply to the prompt.
        repetition_penalty: weight of the distinct-n penalty (0 = off). n: the n of distinct-n.
        batch_size, max_length: batching and truncation (the prompt is cut from the left).
    """

    name = "fluency"

    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        chat_template: bool | str = "auto",
        repetition_penalty: float = 0.0,
        n: int = 2,
        batch_size: int = 16,
        max_length: int = 512,
        device: str = "auto",
    ):
        check_positive(n=n, batch_size=batch_size, max_length=max_length)
        if repetition_penalty < 0:
            raise ValueError(f"repetition_penalty must be >= 0, not {repetition_penalty}.")
        from textgym.models import load_model

        self.device = resolve_device(device)
        self.model, self.tokenizer = load_model(model)
        self.model.to(self.device)
        self.chat = uses_chat_template(self.tokenizer, chat_template)
        self.repetition_penalty, self.n = repetition_penalty, n
        self.batch_size, self.max_length = batch_size, max_length

    def _ids(self, s: Sample) -> tuple[list[int], list[int]]:
        tok = self.tokenizer
        if self.chat:
            prompt = tok.encode(chat_prompt(tok, s.prompt), add_special_tokens=False)
        else:
            prompt = tok.encode(s.prompt)
        completion = tok.encode(s.completion, add_special_tokens=False)
        if s.finish_reason == "stop" or not completion:
            completion.append(tok.eos_token_id)  # p(EOS) is part of a fluent, finished reply
        completion = completion[: self.max_length - 1]
        return prompt[-(self.max_length - len(completion)) :], completion

    def logprobs(self, samples: Sequence[Sample]) -> list[float]:
        import torch

        out: list[float] = []
        for batch in batched(samples, self.batch_size):
            pairs = [self._ids(s) for s in batch]
            width = max(len(p) + len(c) for p, c in pairs)
            ids = torch.full((len(pairs), width), self.tokenizer.pad_token_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            target = torch.zeros_like(ids, dtype=torch.bool)  # positions of completion tokens
            for row, (p, c) in enumerate(pairs):
                ids[row, : len(p) + len(c)] = torch.tensor(p + c)
                mask[row, : len(p) + len(c)] = 1
                target[row, len(p) : len(p) + len(c)] = True
            with torch.inference_mode():
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
            logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, W-1, V): predicts token t+1
            token_logp = logp.gather(-1, ids[:, 1:, None].to(self.device)).squeeze(-1).cpu()  # (B, W-1)
            t = target[:, 1:]
            out.extend(((token_logp * t).sum(1) / t.sum(1)).tolist())
        return out

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        scores = self.logprobs(samples)
        if self.repetition_penalty:
            scores = [
                score - self.repetition_penalty * (1.0 - distinct_n(s.completion, self.n))
                for score, s in zip(scores, samples)
            ]
        return scores


@hookimpl
def register_rewards(register: Callable[..., Any]) -> None:
    register("fluency", Fluency)
