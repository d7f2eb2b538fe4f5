"""``fluency``: mean per-token log-probability of the completion given the prompt under a reference LM."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from textgym import Sample, hookimpl
from textgym.rewards import ENDED_ON_A_TOKEN
from textgym.sampling import logits_to_keep
from textgym.scoring import (
    autocast,
    bf16_linears,
    can_group,
    can_share_prefix,
    chat_prompt,
    check_positive,
    distinct_n,
    grouped_forward,
    length_sorted_batches,
    lm_head_split,
    ones_before,
    padded,
    prefix_cache,
    resolve_bf16,
    resolve_device,
    shared_prefix_length,
    uses_chat_template,
)

HEAD_CHUNK = 2048  # positions per LM-head call: bounds the (N, V) logits at 2048 x V floats
LSE_ROWS = 32  # logits rows per logsumexp: 32 x 49,152 floats (6 MB) stay in the CPU's cache between passes


class Fluency:
    """Mean log p(completion token | prompt, earlier tokens) under ``model`` (EOS included when the
    completion ended by itself, on EOS or a stop string: p(EOS) scores a finished reply), minus
    ``repetition_penalty * (1 - distinct-n)`` of the completion's words. In a multi-turn episode the
    completion is the agent's last turn, scored after the prompt alone (not the turns between).

    Args:
        model: zoo name, model directory or hub id of a causal LM (default: the embedded SmolLM2).
        chat_template: ``"auto"`` (when the tokenizer has one), true or false: score the completion as the
            assistant's reply to the prompt.
        repetition_penalty: weight of the distinct-n penalty (0 = off). n: the n of distinct-n.
        batch_size, max_length: batching and truncation: the prompt is cut from the left, and a completion
            longer than ``max_length - 1`` tokens is scored on its first ``max_length - 1`` (its EOS cut).
            An empty prompt (through the Python API) is scored after the tokenizer's BOS (else EOS) token.
        device: ``"auto"`` (the GPU when there is one) or a torch device.
        bf16: bf16 autocast; unset: on for GPUs, off on the CPU.
        share_prefix: run the token prefix that a batch's prompts share, and each prompt that comes more
            than once, once, through the KV cache (the scores do not change; a model whose cache cannot be
            repeated across rows runs each row whole).

    The forward costs only what the score reads: samples are sorted by length so each batch is tight, the
    prompts' shared prefix (the chat template's system prompt) runs once per batch, so does each prompt
    that comes more than once (a group method's completions of one prompt: then samples are sorted by
    prompt first), and the LM head runs on the positions that predict a completion token only, with
    log p = logit - logsumexp(logits).
    """

    name = "fluency"

    def __init__(
        self,
        model: str = "smollm2-135m-instruct",
        chat_template: bool | str = "auto",
        repetition_penalty: float = 0.0,
        n: int = 2,
        batch_size: int = 32,
        max_length: int = 512,
        device: str = "auto",
        bf16: bool | None = None,
        share_prefix: bool = True,
    ):
        check_positive(n=n, batch_size=batch_size, max_length=max_length)
        if max_length < 2:  # a token to predict from and one to score
            raise ValueError(
                f"max_length must be at least 2 (a context token and a scored one), not {max_length}."
            )
        if not 0 <= repetition_penalty < float("inf"):  # NaN and inf too: every score would be NaN
            raise ValueError(f"repetition_penalty must be a finite number >= 0, not {repetition_penalty}.")
        from textgym.models import load_model

        self.device = resolve_device(device)
        self.model, self.tokenizer = load_model(model)
        self.model.to(self.device)
        self.bf16 = resolve_bf16(bf16, self.device)
        self.split = lm_head_split(self.model)  # (trunk, head), or None: the model's own forward
        trunk = self.split[0] if self.split else self.model
        self.share_prefix = share_prefix and can_share_prefix(trunk)
        # each prompt of a batch once (_grouped), where the model's outputs allow it (scoring.can_group)
        self.group = bool(self.share_prefix and self.split and can_group(trunk))
        if self.bf16:
            bf16_linears(self.model)  # after lm_head_split, whose check runs outside autocast
        self.chat = uses_chat_template(self.tokenizer, chat_template)
        self.repetition_penalty, self.n = repetition_penalty, n
        self.batch_size, self.max_length = batch_size, max_length
        tok = self.tokenizer
        # padding is masked and never read: any id will do where the tokenizer names none (GPT-2, Llama 3)
        self.pad_id = next((i for i in (tok.pad_token_id, tok.eos_token_id) if i is not None), 0)
        # what an empty prompt is scored after: the first completion token needs something to predict it
        self.start_id = next((i for i in (tok.bos_token_id, tok.eos_token_id) if i is not None), self.pad_id)

    def _ids(self, s: Sample) -> tuple[list[int], list[int]]:
        tok = self.tokenizer
        if self.chat:
            prompt = tok.encode(chat_prompt(tok, s.prompt), add_special_tokens=False)
        else:
            prompt = tok.encode(s.prompt)
        text = s.completion
        if s.finish_reason not in ENDED_ON_A_TOKEN:  # cut at the token limit, maybe inside a character: its
            text = text.rstrip("\ufffd")  # first bytes decode to U+FFFD, a token the policy never wrote
        completion = tok.encode(text, add_special_tokens=False)
        if s.finish_reason in ENDED_ON_A_TOKEN or not completion:
            completion.append(tok.eos_token_id)  # p(EOS) is part of a fluent, finished reply
        completion = completion[: self.max_length - 1]
        return prompt[-(self.max_length - len(completion)) :] or [self.start_id], completion

    def logprobs(self, samples: Sequence[Sample]) -> list[float]:
        """Mean log-prob of each completion given its prompt (EOS included when it ended on it)."""
        pairs = [self._ids(s) for s in samples]
        out = [0.0] * len(pairs)
        for rows in self._batches(pairs):
            batch = [pairs[i] for i in rows]
            scores = self._grouped(batch) if self._has_groups(batch) else self._mean_logprobs(batch)
            for i, score in zip(rows, scores):
                out[i] = score
        return out

    def _has_groups(self, pairs: list[tuple[list[int], list[int]]]) -> bool:
        """Whether some prompt comes more than once (a group method's completions of one prompt) and
        :meth:`_grouped` may run each prompt once."""
        prompts = {tuple(p) for p, _ in pairs}
        return self.group and all(prompts) and len(prompts) < len(pairs)

    def _batches(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[int]]:
        """Indices of the pairs in batches: sorted by length, so each batch pads little; when prompts come
        more than once, by prompt length and prompt first, so that a prompt's completions share batches."""
        if not self._has_groups(pairs):
            return list(length_sorted_batches([len(p) + len(c) for p, c in pairs], self.batch_size))
        order = sorted(range(len(pairs)), key=lambda i: (-len(pairs[i][0]), pairs[i][0], -len(pairs[i][1])))
        return [order[start : start + self.batch_size] for start in range(0, len(order), self.batch_size)]

    def _layout(self, pairs: list[tuple[list[int], list[int]]]) -> tuple[int, Any, Any, Any]:
        """``(L, ids, mask, predicts)`` for one batch: the length L of the prefix that all prompts share
        (it runs once), then each row's remaining tokens, right-padded (B, W), and which columns' outputs
        predict a completion token (B, W-1)."""
        import torch

        # Every row keeps its last prompt token at least: its output predicts the first completion token.
        L = 0
        if self.share_prefix and len(pairs) > 1:  # one row gains nothing from a prefix run apart
            L = shared_prefix_length([p for p, _ in pairs], min(len(p) for p, _ in pairs) - 1)
        ids, mask = padded([p[L:] + c for p, c in pairs], self.pad_id, self.device)
        predicts = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool)  # column t predicts t+1
        for r, (p, c) in enumerate(pairs):
            predicts[r, max(len(p) - L - 1, 0) : len(p) - L + len(c) - 1] = True
        return L, ids, mask, predicts.to(self.device)

    def _mean_logprobs(self, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
        import torch

        L, ids, mask, predicts = self._layout(pairs)
        (B, W), targets = ids.shape, ids[:, 1:][predicts]  # targets (N,): the completion tokens, row by row
        trunk = self.split[0] if self.split else self.model
        with torch.inference_mode(), autocast(self.device, self.bf16):
            kwargs: dict[str, Any] = {"attention_mask": mask}
            if L:
                prefix = torch.tensor([pairs[0][0][:L]], device=self.device)  # (1, L)
                key, cache = prefix_cache(trunk, prefix, B)
                kwargs = {"attention_mask": ones_before(mask, L), key: cache}
            if self.split:
                hidden = trunk(input_ids=ids, **kwargs).last_hidden_state[:, :-1][predicts]  # (N, H)
                token_logp = self._head_logprobs(hidden, targets)
            else:
                # Columns before the earliest predicting one need no logits; logits_to_keep (where the model
                # has it) keeps the last W - first, which covers every row's completion.
                first = int(predicts.any(0).long().argmax())
                keep = logits_to_keep(self.model, W - first)
                logits = self.model(input_ids=ids, **kwargs, **keep).logits[:, -(W - first) : -1]
                token_logp = token_logprobs(logits[predicts[:, first:]], targets)
        return row_means(token_logp, predicts)

    def _grouped(self, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
        """Mean log-probs of a batch in which some prompts come more than once: each distinct prompt runs
        once, then the completions after their prompt's cache (:func:`textgym.scoring.grouped_forward`).
        The positions that predict a completion token are the prompt's last one and each completion token
        but the last."""
        import torch

        trunk = self.split[0]  # type: ignore[index]
        prompts = list(dict.fromkeys(tuple(p) for p, _ in pairs))  # distinct, in order
        of_row = [prompts.index(tuple(p)) for p, _ in pairs]
        pad = self.pad_id
        completions, is_token = padded([c for _, c in pairs], pad, self.device)  # (B, C)
        predicts = is_token.bool()  # column t's output predicts completion token t
        with torch.inference_mode(), autocast(self.device, self.bf16):
            prompt_last, rest = grouped_forward(trunk, prompts, [c[:-1] for _, c in pairs], of_row, pad)
            hidden = prompt_last[of_row, None]  # (B, 1, H): predicts each completion's first token
            if rest is not None:
                hidden = torch.cat([hidden, rest], 1)  # (B, C, H)
            token_logp = self._head_logprobs(hidden[predicts], completions[predicts])  # (N,)
        return row_means(token_logp, predicts)

    def _head_logprobs(self, hidden: Any, targets: Any) -> Any:
        """log p(target) from the trunk's outputs (N, H) that predict ``targets`` (N,), the LM head run
        HEAD_CHUNK positions at a time."""
        import torch

        head = self.split[1]  # type: ignore[index]
        chunks = zip(hidden.split(HEAD_CHUNK), targets.split(HEAD_CHUNK))
        return torch.cat([token_logprobs(head(h), t) for h, t in chunks])  # (N,)

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        scores = self.logprobs(samples)
        if self.repetition_penalty:
            scores = [
                score - self.repetition_penalty * (1.0 - distinct_n(s.completion, self.n))
                for score, s in zip(scores, samples)
            ]
        return scores


def row_means(values: Any, where: Any) -> list[float]:
    """The mean of each row's ``values`` (N,), which fill the True cells of ``where`` (B, W) row by row."""
    import torch

    per_row = torch.zeros(where.shape, device=values.device)
    per_row[where] = values.float()
    return (per_row.sum(1) / where.sum(1)).tolist()


def token_logprobs(logits: Any, tokens: Any) -> Any:
    """log p(token) = logit - logsumexp(logits) from (N, V) logits, with no (N, V) log-softmax tensor. It
    runs LSE_ROWS rows at a time, so that logsumexp's passes over a chunk (max, exp, sum) read it from the
    cache rather than from memory: 3x faster than one pass over 1,700 x 49,152 logits, the same values."""
    import torch

    chunks = []
    for rows, targets in zip(logits.split(LSE_ROWS), tokens.split(LSE_ROWS)):
        rows = rows.float()
        chunks.append(rows.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(rows, -1))
    return torch.cat(chunks)  # (N,)


@hookimpl
def register_rewards(register: Callable[..., Any]) -> None:
    register("fluency", Fluency)
