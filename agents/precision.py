"""bf16 in the agent's forwards without gradients: the rollout, the behaviour log-probs, the reference.

Under ``bf16 = true`` (the default on GPUs) every forward of the policy runs in bf16 autocast, not only the
training one: the rollout samples from the model in the precision it is trained in, at bf16's speed.

- A rollout calls the model once per token, and autocast would cast every fp32 weight to bf16 at each
  call. :func:`bf16_linear_weights` casts each linear layer's weight once per rollout instead (the results
  are bit for bit autocast's), while the fp32 parameters that the optimizer steps stay untouched.
- The PPO ratio and the KL penalty compare log-probs of the sampled tokens. bf16 rounds a forward
  differently with its shape: the rollout's token-by-token forwards against a KV cache, a whole-sequence
  forward, and forwards over different rows all disagree a little (in fp32 within about 2e-5; in bf16 on a
  CPU by 0.03 in the mean per token, docs/performance.md). So in bf16 the agent takes the behaviour
  log-probs (and LMPPO's values) again from whole-sequence forwards without gradients, as TRL does: the
  behaviour, reference and training log-probs then come from one kind of forward, and an unchanged policy's
  KL to the reference is exactly 0. The noise between micro-batches of different rows remains.
- A LoRA policy's rollout samples from its adapters folded into the bf16 copy (W + B A scale, cast once),
  with the adapters switched off: a decoding step then runs one matmul per projection instead of three.
  On a GPU, where small-batch decoding waits on kernel launches, the adapters' extra kernels took about a
  quarter of a step (docs/performance.md). Only the sampling sees the fold: the behaviour log-probs are
  taken again, as above, through the adapters.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn

from textgym.agents.lora import adapters_disabled, fold_lora, foldable_lora_layers
from textgym.errors import ConfigError, user_stacklevel
from textgym.scoring import bf16_linears, restore_linears


@contextlib.contextmanager
def bf16_linear_weights(model: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, ``model``'s linear layers hold bf16 copies of their fp32 weights and biases, made
    once on entry (one more bf16 copy of those weights in memory); on exit the fp32 parameters are back in
    place, the same objects. A LoRA model's adapters are folded into its copies and switched off within
    the block (:func:`foldable_lora_layers`). Only for sampling forwards under bf16 autocast, and not for a
    sharded model, whose parameters are shards."""
    if not enabled:
        yield
        return
    folded = foldable_lora_layers(model)
    replaced = fold_lora(folded) if folded else []
    try:
        replaced += bf16_linears(model)
        with adapters_disabled(model) if folded else contextlib.nullcontext():
            yield
    finally:
        restore_linears(replaced)


def check_trainable(model: nn.Module) -> None:
    """Refuse a policy with nothing to train, or whose trained weights are fp16 (its first masked logit
    overflows, and textgym keeps no loss scale); warn of bf16 ones, whose AdamW updates mostly round away (at
    lr 1e-5, 85% of one iteration's). A model path is loaded in fp32; an object loaded with
    ``from_pretrained`` keeps the dtype it was saved in."""
    parameters = list(model.named_parameters())
    trained = [(name, p) for name, p in parameters if p.requires_grad]
    if not trained:
        raise ConfigError(
            "the policy has no trainable parameter (all have requires_grad = False; with LoRA, "
            "lora.inference_mode = true freezes the adapter): unfreeze it, or leave inference_mode out."
        )
    dtypes = {p.dtype for _, p in trained if p.is_floating_point()}
    # fp16 anywhere, a frozen base under fp32 LoRA adapters too: its forwards overflow all the same
    dtypes |= {p.dtype for _, p in parameters if p.dtype == torch.float16}
    low = sorted(str(d).removeprefix("torch.") for d in dtypes - {torch.float32, torch.float64})
    if not low:
        return
    message = (
        f"the policy's parameters are {'/'.join(low)}: an optimizer step rounds most updates away in "
        f"16 bits. Load it in fp32 (from_pretrained(..., dtype=torch.float32), or model.float()), and set "
        f"bf16 = true for bf16 computation on fp32 weights."
    )
    if torch.float16 in dtypes:
        raise ConfigError(message)
    warnings.warn(message, stacklevel=user_stacklevel())
