"""A reward model under training (``textgym train-rm``): its model and tokenizer as ``rm_score`` will load
them, and its scores of preference pairs, each text formatted and tokenized as ``rm_score`` formats it."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from textgym.errors import ModelError, PairsError, UnknownNameError
from textgym.formatting import one_line
from textgym.models import EMBEDDED, SMOLLM2_PAD
from textgym.pairs import Pair
from textgym.scoring import chat_pair


@dataclass(frozen=True)
class PairMetrics:
    """How a reward model ranks a set of pairs."""

    accuracy: float  # share of pairs with r(chosen) > r(rejected)
    mean_margin: float  # mean of r(chosen) - r(rejected)
    loss: float  # mean Bradley–Terry loss, -log sigmoid(margin)


def format_text(tokenizer: Any, chat: bool, prompt: str, completion: str) -> str:
    """The text a reward model scores, as ``rm_score`` formats it by default (``RMScore.format``)."""
    if chat:
        return chat_pair(tokenizer, prompt, completion)
    return f"{prompt}{completion}"


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings and its loading/saving progress bars off (the trainer has its own bar)."""
    from transformers.utils import logging

    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


@contextlib.contextmanager
def model_dir(model: str | os.PathLike) -> Iterator[Path]:
    """A directory holding ``model`` in Hugging Face format: the directory itself, the embedded model's
    converted copy, or a temporary save of another zoo model (removed on exit)."""
    from textgym import plugin_manager
    from textgym.models import load_model, smollm2_dir

    path = Path(model).expanduser()
    if path.is_dir():
        yield path
        return
    name = str(model)
    if name == EMBEDDED:
        yield smollm2_dir()
        return
    models = plugin_manager.registry("register_models")
    if name not in models:
        if os.sep in name or name.startswith((".", "~")):
            raise ModelError(f"model directory {name!r} does not exist.")
        raise UnknownNameError("model", name, models.names())
    from transformers import PreTrainedTokenizerBase

    lm, tokenizer = load_model(name)
    # a Hugging Face tokenizer: textgym's character tokenizer saves itself, but AutoTokenizer cannot read it
    if lm is None or not hasattr(lm, "save_pretrained") or not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise ModelError(
            f"model {name!r} has no Hugging Face model and tokenizer to save ({type(tokenizer).__name__}); "
            f"rm_score loads both from the output directory. Use e.g. tiny-random-llama or a model directory."
        )
    with tempfile.TemporaryDirectory(prefix="textgym-rm-base-") as tmp, quiet_transformers():
        lm.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        yield Path(tmp)


def load_for_training(path: Path, seed: int) -> tuple[Any, Any]:
    """``(model, tokenizer)``: a one-output sequence-classification model on the LM in ``path`` (new head,
    seeded) and its tokenizer, with a pad token distinct from EOS saved in the model's config."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises OSError, ValueError or TypeError, by what is missing
        raise ModelError(
            f"{path} has no Hugging Face tokenizer that loads ({type(exc).__name__}: {one_line(exc, 160)}): save the "
            f"model's tokenizer there (tokenizer.save_pretrained)."
        ) from None
    torch.manual_seed(seed)
    try:
        with quiet_transformers():  # "score.weight is newly initialised, you should train it": we do
            model = AutoModelForSequenceClassification.from_pretrained(
                path, num_labels=1, dtype=torch.float32
            )
    except (ValueError, OSError) as exc:
        raise ModelError(f"{path} cannot be loaded as a sequence-classification model: {exc}") from exc
    except RuntimeError as exc:  # a classifier with another number of labels (its head's size mismatches)
        raise ModelError(
            f"{path} is a classifier whose head does not have one output ({one_line(exc, 160)}): train-rm puts a "
            f"one-output head on a causal LM; start from the LM it was made from."
        ) from None
    if mismatch := vocabulary_mismatch(tokenizer, model):
        raise ModelError(f"{path}: {mismatch}")
    set_distinct_pad(tokenizer, model)
    tokenizer.padding_side, tokenizer.truncation_side = "right", "left"  # as rm_score sets them
    return model, tokenizer


def vocabulary_mismatch(tokenizer: Any, model: Any) -> str | None:
    """What is wrong where ``tokenizer`` has ids ``model`` does not embed (the first such text failed in
    the forward with "IndexError: index out of range in self"), else None."""
    embedded = model.get_input_embeddings().num_embeddings
    if len(tokenizer) <= embedded:
        return None
    return (
        f"its tokenizer has {len(tokenizer)} tokens, its model embeds {embedded}: the tokenizer is not the "
        f"model's. Save the tokenizer the model was trained with into the directory."
    )


def set_distinct_pad(tokenizer: Any, model: Any) -> None:
    """Give ``tokenizer`` a pad token that is not EOS and save its id in ``model.config``.

    The classifier reads the last non-pad position of each row; were pad EOS, a text's own EOS could be
    taken for padding. SmolLM2 pads with EOS (<|im_end|>), so as in textgym.models its <|endoftext|> is used.
    """
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    if pad is None or pad == eos:
        vocab = tokenizer.get_vocab()
        candidates = [t for t in (tokenizer.unk_token, SMOLLM2_PAD) if t in vocab and vocab[t] != eos]
        if candidates:
            tokenizer.pad_token = candidates[0]
        else:
            tokenizer.add_special_tokens({"pad_token": "<pad>"})
            model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id


class PairScorer:
    """Rewards of (prompt, completion) texts under the model being trained, formatted as rm_score does."""

    def __init__(self, model: Any, tokenizer: Any, max_length: int, device: str):
        from textgym.scoring import uses_chat_template

        self.model, self.tokenizer, self.max_length, self.device = model, tokenizer, max_length, device
        self.chat = uses_chat_template(tokenizer, "auto")

    def texts(self, pairs: Sequence[Pair]) -> list[str]:
        """chosen texts, then rejected texts: 2B texts for B pairs."""
        fmt = self.tokenizer, self.chat
        return [format_text(*fmt, p.prompt, p.chosen) for p in pairs] + [
            format_text(*fmt, p.prompt, p.rejected) for p in pairs
        ]

    def check(self, pairs: Sequence[Pair]) -> None:
        """Refuse pairs that teach nothing: a text of no tokens (scored at a pad token), or chosen and rejected
        the same tokens once formatted, or once cut to ``max_length``: their margin is 0 whatever the model,
        and they would count as wrong."""
        texts, n, special = self.texts(pairs), len(pairs), not self.chat
        full = self.tokenizer(texts, add_special_tokens=special)["input_ids"]
        cut = self.tokenizer(texts, truncation=True, max_length=self.max_length, add_special_tokens=special)
        cut = cut["input_ids"]
        empty = [p for k, p in enumerate(pairs) if not full[k] or not full[n + k]]
        same = [p for k, p in enumerate(pairs) if full[k] == full[n + k]]
        same_cut = [p for k, p in enumerate(pairs) if cut[k] == cut[n + k] and full[k] != full[n + k]]
        if empty:
            raise PairsError(
                f"{_lines(empty)} format to no tokens (empty texts, and a tokenizer with no chat template or BOS "
                f"token): the reward model would have nothing to read. Remove them."
            )
        if same:
            raise PairsError(
                f"{_lines(same)} have the same chosen and rejected tokens once formatted (the tokenizer or its "
                f"chat template drops what tells them apart, such as spaces at the end), which teaches no "
                f"preference: remove them."
            )
        if same_cut:
            raise PairsError(
                f"{_lines(same_cut)} have the same chosen and rejected text once cut to max_length="
                f"{self.max_length} tokens (from the left), which teaches no preference: raise --max-length or "
                f"remove them."
            )

    def margins(self, pairs: Sequence[Pair]) -> tuple[Any, Any]:
        """``(r_chosen - r_rejected, rewards)``: (B,) and (2B,), in one forward over the 2B texts."""
        enc = self.tokenizer(  # a chat template writes its own BOS, as in rm_score
            self.texts(pairs), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt",
            add_special_tokens=not self.chat,
        ).to(self.device)  # fmt: skip
        rewards = self.model(**enc).logits[:, 0].float()  # (2B,)
        return rewards[: len(pairs)] - rewards[len(pairs) :], rewards

    def evaluate(self, pairs: Sequence[Pair], batch_size: int, bf16: bool = False) -> tuple[PairMetrics, Any]:
        """Metrics over ``pairs`` and all their rewards (2N,), without gradients, in eval mode; with ``bf16``
        in the precision ``rm_score`` scores in with ``bf16`` on (its default on GPUs): bf16 autocast over
        bf16 linear weights, the fp32 ones put back after."""
        import torch
        import torch.nn.functional as F

        from textgym.scoring import autocast, bf16_linears, restore_linears

        self.model.eval()
        margins, rewards = [], []
        replaced = bf16_linears(self.model) if bf16 else []
        try:
            with torch.inference_mode(), autocast(self.device, bf16):
                for start in range(0, len(pairs), batch_size):
                    m, r = self.margins(pairs[start : start + batch_size])
                    margins.append(m.cpu())
                    rewards.append(r.cpu())
        finally:
            restore_linears(replaced)
        margin = torch.cat(margins)  # (N,)
        metrics = PairMetrics(
            accuracy=int((margin > 0).sum())
            / len(margin),  # in Python: a float32 mean wrote 0.800000011920929
            mean_margin=float(margin.mean()),
            loss=float(-F.logsigmoid(margin).mean()),
        )
        return metrics, torch.cat(rewards)


def _lines(pairs: Sequence[Pair]) -> str:
    """``"3 pair(s) (line 4, 9, 12)"``, at most five lines named."""
    lines = ", ".join(str(pair.line) for pair in pairs[:5]) + (", ..." if len(pairs) > 5 else "")
    return f"{len(pairs)} pair(s) (line {lines})"
