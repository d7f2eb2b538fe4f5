"""Helpers shared by the model-based reward plugins: batching, devices, precision, prompt/completion
formatting, and the pieces of a fast causal-LM forward (shared prefixes, the LM head on chosen positions)."""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Iterator, Sequence
from typing import Any


def length_sorted_batches(lengths: Sequence[int], size: int) -> Iterator[list[int]]:
    """Indices of the items, longest first, in batches of ``size``: each batch pads to nearly its own
    longest item instead of the call's. The caller writes each result back at its index, so the order of
    the scores is the order of the samples."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep their order
    for start in range(0, len(order), size):
        yield order[start : start + size]


def resolve_device(device: str = "auto") -> str:
    """``device``, or for ``"auto"`` the GPU when torch sees one, else the CPU. Raises :class:`ConfigError`
    for a name torch does not know, and for a GPU torch does not see."""
    import torch

    from textgym.errors import ConfigError

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError):
        raise ConfigError(
            f"device must be 'auto', 'cpu' or a GPU such as 'cuda' or 'cuda:1', not {device!r}."
        ) from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}, but torch sees no CUDA GPU: use device = 'auto' or 'cpu'.")
    return device


def cuda_has_native_bf16() -> bool:
    """Whether the GPU computes in bf16 natively (Ampere or newer). torch emulates it on older ones (V100,
    T4), slower than fp32, so bf16 is no default there."""
    import torch

    return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)


def resolve_bf16(bf16: bool | None, device: str) -> bool:
    """bf16 autocast: ``bf16`` when given, else on for GPUs with native bf16 and off on the CPU, where fp32
    keeps the scores of earlier runs (bf16 moves a mean log-prob by about 0.01)."""
    if bf16 is None:
        return device.startswith("cuda") and cuda_has_native_bf16()
    if bf16 not in (True, False):
        raise ValueError(f"bf16 must be true, false or left unset (auto), not {bf16!r}.")
    return bool(bf16)


def autocast(device: str, bf16: bool) -> contextlib.AbstractContextManager[Any]:
    """bf16 autocast on ``device`` when ``bf16``, else autocast off there: a reward scores in its own
    precision, whatever autocast its caller runs in."""
    import torch

    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16, enabled=bf16)


def bf16_linears(model: Any) -> list[tuple[Any, str, Any]]:
    """Store the weights and biases of ``model``'s linear layers in bf16, for a model that runs under bf16
    :func:`autocast`. Autocast would cast them from fp32 at every call (on a 2-core CPU with AMX, a
    fifth of a bf16 ``fluency`` call, and a cast of every weight per token in a rollout); cast ahead,
    every result is bit for bit the same. A weight that a linear layer shares with another module (the LM
    head tied to the input embedding) is replaced in the linear layer only: the embedding keeps its fp32
    table, which autocast never casts. Returns ``(module, name, fp32 parameter)`` for each replacement, for
    :func:`restore_linears` (:func:`textgym.agents.precision.bf16_linear_weights`)."""
    import torch

    replaced = []
    try:
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):
                    for name in ("weight", "bias"):
                        value = module._parameters.get(name)
                        if value is not None and value.dtype == torch.float32:
                            module._parameters[name] = torch.nn.Parameter(
                                value.bfloat16(), requires_grad=False
                            )
                            replaced.append((module, name, value))
    except BaseException:  # out of memory halfway, or a Ctrl-C: the model as it was, not half cast
        restore_linears(replaced)
        raise
    return replaced


def restore_linears(replaced: list[tuple[Any, str, Any]]) -> None:
    """Put back the fp32 parameters that :func:`bf16_linears` replaced (the same objects)."""
    for module, name, value in replaced:
        module._parameters[name] = value


LEARNED_POSITIONS = ("wpe", "position_embeddings", "embed_positions")  # GPT-2's, BERT's, OPT's and BART's


def position_limit(model: Any) -> int | None:
    """The most tokens ``model`` reads in one text where it holds a table of learned positions (GPT-2, BERT,
    OPT): a longer text fails in its forward pass with an index error. None for rotary positions (Llama,
    SmolLM2), which have no such table."""
    import torch

    config = model.config
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    learned = any(
        isinstance(module, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in LEARNED_POSITIONS
        for name, module in model.named_modules()
    )
    return limit if learned and isinstance(limit, int) else None


def check_positive(**values: Any) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, not {value!r}.")


def uses_chat_template(tokenizer: Any, chat_template: bool | str) -> bool:
    """Resolve a plugin's ``chat_template`` argument (``"auto"``, True or False) for ``tokenizer``."""
    has = bool(getattr(tokenizer, "chat_template", None))
    if chat_template == "auto":
        return has
    if chat_template not in (True, False):
        raise ValueError(f"chat_template must be 'auto', true or false, not {chat_template!r}.")
    if chat_template and not has:
        raise ValueError("chat_template=true, but the model's tokenizer has no chat template.")
    return bool(chat_template)


def chat_prompt(tokenizer: Any, prompt: str) -> str:
    """The prompt as a user turn followed by the start of the assistant's turn."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def chat_pair(tokenizer: Any, prompt: str, completion: str) -> str:
    """The prompt as a user turn and the completion as the assistant's, as a reward model scores them
    (``rm_score`` and the ``train-rm`` trainer alike). The template writes its own BOS, if any: tokenize the
    text with ``add_special_tokens=False``."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}], tokenize=False
    )


def ngrams(units: Sequence[Any], n: int) -> list[tuple[Any, ...]]:
    return [tuple(units[i : i + n]) for i in range(len(units) - n + 1)]


def distinct_n(text: str, n: int) -> float:
    """Unique word n-grams / all word n-grams (1.0 when the text has fewer than n words)."""
    grams = ngrams(text.split(), n)
    return len(set(grams)) / len(grams) if grams else 1.0


def corpus_distinct_n(sequences: Sequence[Sequence[Any]], n: int) -> float:
    """Distinct-n of a set of generations (Li et al. 2016): unique n-grams / all n-grams, over all of them.
    Give token ids (the model's units, which also works for character-level tasks) or words. NaN (not
    measured) when no generation has n units: a policy that collapsed to bare EOS replies is not maximally
    diverse."""
    grams = [g for seq in sequences for g in ngrams(list(seq), n)]
    return len(set(grams)) / len(grams) if grams else math.nan


def shared_prefix_length(rows: Sequence[Sequence[int]], limit: int) -> int:
    """Length of the token prefix that every row starts with, at most ``limit``. Chat templates put the
    same system prompt before every prompt, and group methods score several completions of one prompt:
    a model forward computes that prefix once (:func:`prefix_cache`) instead of once per row."""
    if not rows:
        return 0
    first = rows[0]
    n = min([limit, *map(len, rows)])
    for row in rows[1:]:
        i = 0
        while i < n and row[i] == first[i]:
            i += 1
        n = i
    return max(n, 0)


def cache_argument(model: Any) -> str | None:
    """The keyword under which ``model.forward`` takes a KV cache (``cache`` in transformers 5,
    ``past_key_values`` before), or None when it takes none (encoders such as BERT)."""
    params = inspect.signature(model.forward).parameters
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def prefix_cache(trunk: Any, prefix: Any, rows: int) -> tuple[str, Any]:
    """Run the causal ``trunk`` over ``prefix`` (1, L) once and return ``(keyword, cache)``: its KV cache
    repeated for ``rows`` rows, to pass to the next forward under ``keyword``. That forward continues at
    position L and needs an attention mask of L + its own width columns."""
    out = trunk(input_ids=prefix, use_cache=True)
    # transformers 5 names the cache `cache`, older versions `past_key_values`; the model takes it back
    # under the name it returned it.
    key = "cache" if "cache" in out else "past_key_values"
    cache = out[key]
    cache.batch_repeat_interleave(rows)
    return key, cache


def padded(rows: Sequence[Sequence[int]], pad_id: int, device: Any) -> tuple[Any, Any]:
    """``(ids, mask)``: the rows right-padded to the longest, (len(rows), width), on ``device``."""
    import torch

    ids = torch.full((len(rows), max(map(len, rows))), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[r, : len(row)] = 1
    return ids.to(device), mask.to(device)


def grouped_forward(
    trunk: Any,
    starts: Sequence[Sequence[int]],
    rests: Sequence[Sequence[int]],
    of_row: Sequence[int],
    pad_id: int,
) -> tuple[Any, Any]:
    """Run the causal ``trunk`` over rows that share their first tokens: row r is ``starts[of_row[r]] +
    rests[r]``, each start non-empty. The prefix that all starts share runs once (1 row), then each start's
    remaining tokens once (a row per start), then every row's rest after its start's KV cache (a row per
    row), so a start that several rows share (a prompt and its group's completions) runs once. Only for a
    model where :func:`can_group` holds: a shorter start's padding sits between it and its rest.

    Returns ``(start_last, rest)``: the trunk's output at each start's last token (len(starts), H), and at
    each rest token (B, C, H), right-padded to the longest rest (None when every rest is empty). Call it
    under ``torch.inference_mode()``."""
    import torch

    device = next(trunk.parameters()).device
    rows = torch.tensor(list(of_row), device=device)  # (B,)
    L = shared_prefix_length(starts, min(map(len, starts)) - 1)  # each start keeps its last token
    tails, tail_mask = padded([start[L:] for start in starts], pad_id, device)  # (P, T)
    tail_len = tail_mask.sum(1)  # (P,)
    kwargs: dict[str, Any] = {}
    if L:
        key, cache = prefix_cache(trunk, torch.tensor([list(starts[0][:L])], device=device), len(starts))
        kwargs = {key: cache}
    out = trunk(input_ids=tails, attention_mask=ones_before(tail_mask, L), use_cache=True, **kwargs)
    start_last = out.last_hidden_state[torch.arange(len(starts), device=device), tail_len - 1]  # (P, H)
    if not max(map(len, rests)):
        return start_last, None
    key = "cache" if "cache" in out else "past_key_values"
    cache = out[key]
    cache.reorder_cache(rows)  # (P, L+T) -> (B, L+T): each row continues its start's cache
    ids, mask = padded(rests, pad_id, device)  # (B, C)
    positions = (L + tail_len[rows])[:, None] + torch.arange(ids.shape[1], device=device)  # (B, C)
    # A padding column's output is never read; position 0 keeps it within the model's learned positions
    # and out of a dynamic RoPE's rescaling, which looks at the largest position.
    positions = positions.masked_fill(mask == 0, 0)
    attention = ones_before(torch.cat([tail_mask[rows], mask], 1), L)  # the start's pads stay masked
    rest = trunk(input_ids=ids, attention_mask=attention, position_ids=positions, **{key: cache})
    return start_last, rest.last_hidden_state


def can_group(trunk: Any) -> bool:
    """Whether :func:`grouped_forward` gives ``trunk``'s own outputs: when every layer attends to the whole
    past, its positions come from ``position_ids``, and its cache holds keys and values only (Llama, Qwen,
    SmolLM, GPT-2, ...). Masked padding between a start and its rest changes the outputs of a sliding
    window (it counts cache slots), of ALiBi taken by slot distance (MPT, Falcon with ``alibi``; BLOOM
    counts its ALiBi positions over the attention mask and groups), and of a convolution or recurrent state
    (it takes in every slot); those models share a batch's common prefix only (or nothing, where
    :func:`can_share_prefix` is false)."""
    config = trunk.config.get_text_config()
    window = getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if window or any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return False
    if getattr(config, "window_size", None) or "local" in (getattr(config, "attention_layers", None) or ()):
        return False  # GPT-Neo's local attention: a window by another name
    if getattr(config, "alibi", False) or getattr(getattr(config, "attn_config", None), "alibi", False):
        return False
    try:
        from transformers.cache_utils import DynamicCache, DynamicLayer
    except ImportError:
        return False
    cache = _probe_cache(trunk)
    layers = getattr(cache, "layers", None)
    return (
        type(cache) is DynamicCache and bool(layers) and all(type(layer) is DynamicLayer for layer in layers)
    )


def can_share_prefix(model: Any) -> bool:
    """Whether ``model``'s cache of a prefix can be repeated across rows (:func:`prefix_cache`): not for
    models whose cache holds states that cannot be (LFM2's convolution states)."""
    cache = _probe_cache(model)
    try:
        cache.batch_repeat_interleave(2)
    except (AttributeError, NotImplementedError, TypeError):  # None included: the model returns no cache
        return False
    return True


def _probe_cache(model: Any) -> Any:
    """The cache ``model`` returns for two tokens, or None (a model that takes no ``use_cache``)."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([[1, 2]], device=device) % model.config.get_text_config().vocab_size
    try:
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True)
    except TypeError:
        return None
    return out["cache"] if "cache" in out else out.get("past_key_values")


def ones_before(mask: Any, n: int) -> Any:
    """``mask`` (B, W) with ``n`` columns of ones before it: the attention mask of a forward that follows
    a cached prefix of ``n`` tokens that every row attends to."""
    import torch

    return torch.cat([mask.new_ones(len(mask), n), mask], 1)


def lm_head_split(model: Any) -> tuple[Any, Any] | None:
    """``(trunk, head)`` of a causal LM when ``head(trunk(x).last_hidden_state)`` gives the model's own
    logits, so the head (49k outputs for SmolLM2, a fifth of its FLOPs) can run on the positions that are
    read only. Checked on a few tokens, because some models scale or soft-cap the logits after the head
    (Gemma 2, Cohere, Granite); for those, and models without a separate head, None."""
    return _checked_split(model, model.get_output_embeddings(), pooled=False)


def score_head_split(model: Any) -> tuple[Any, Any] | None:
    """``(trunk, head)`` of a causal sequence-classification (reward) model whose score is
    ``head(trunk(x).last_hidden_state)`` at the last token that is not padding (Llama, Qwen, Mistral,
    GPT-2: the head is ``score``), so that rows can run through the trunk in pieces
    (:func:`grouped_forward`). Checked on a few tokens; None for other models."""
    return _checked_split(model, getattr(model, "score", None), pooled=True)


def _checked_split(model: Any, head: Any, pooled: bool) -> tuple[Any, Any] | None:
    """``(trunk, head)`` when the head on the trunk's output gives ``model``'s own logits on a few tokens:
    at every position, or (``pooled``) at the last one, where a sequence-classification model reads."""
    import torch

    trunk = getattr(model, "base_model", model)
    if trunk is model or head is None:
        return None
    device = next(model.parameters()).device
    pad = getattr(model.config, "pad_token_id", None)
    ids = [t % model.config.get_text_config().vocab_size for t in range(1, 10)]
    ids = torch.tensor([[t for t in ids if t != pad][:8]], device=device)  # (1, 8), no padding
    with torch.inference_mode():
        expected = model(input_ids=ids).logits.float()  # (1, 8, V), or (1, labels) when pooled
        try:
            got = head(trunk(input_ids=ids).last_hidden_state).float()
        except (TypeError, AttributeError):
            return None
    got = got[:, -1] if pooled else got
    if got.shape != expected.shape or not torch.allclose(got, expected, rtol=1e-4, atol=1e-4):
        return None
    return trunk, head
