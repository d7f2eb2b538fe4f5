"""LoRA policies: the adapter switched off (the reference), and folded into a weight copy (sampling).

With ``lora = {...}`` an agent's policy is a peft ``PeftModel``; its reference is the same model with the
adapters switched off, so there is no second copy of the weights. In bf16 a rollout samples from the
adapters folded into the bf16 weight copy that it makes anyway (agents/precision.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from textgym.scoring import restore_linears

__all__ = ["adapters_disabled", "fold_lora", "foldable_lora_layers"]

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """peft's ``model.disable_adapter()``, with every parameter's ``requires_grad`` as it was on exit
    (peft's exit sets it on all of the active adapters' weights, a frozen one's included)."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        with model.disable_adapter():
            yield
    finally:
        for parameter, flag in flags:
            parameter.requires_grad_(flag)


def plain_bases() -> tuple[type, ...]:
    """The base layers whose output is a matmul by their weight alone: ``nn.Linear`` and GPT-2's
    ``Conv1D`` (transposed), not the quantized or scaled ``nn.Linear`` subclasses."""
    from transformers.pytorch_utils import Conv1D

    return (nn.Linear, Conv1D)


def foldable_lora_layers(model: nn.Module) -> list[nn.Module]:
    """The LoRA layers of a peft ``model`` when every adapter layer in it is a plain LoRA ``Linear`` (no
    DoRA or other variant, no LoRA bias, not merged, adapters on) over a plain ``Linear`` (or GPT-2's
    ``Conv1D``) with a float weight: then the adapters' effect is exactly a change of the base weights.
    Otherwise none, and the rollout runs through the adapters. A model with trained copies of whole
    modules (``modules_to_save``, ``trainable_token_indices``) is not folded either: with the adapters
    off, peft would run the original modules instead."""
    try:
        from peft import PeftModel
        from peft.tuners.lora.layer import Linear as LoraLinear
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils import ModulesToSaveWrapper
        from peft.utils import other as peft_utils
    except ImportError:
        return []
    if not isinstance(model, PeftModel):
        return []
    # newer peft: the base class of ModulesToSaveWrapper and TrainableTokensWrapper
    wrapper = getattr(peft_utils, "AuxiliaryTrainingWrapper", ModulesToSaveWrapper)
    if any(isinstance(m, wrapper) for m in model.modules()):
        return []
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]

    def plain(layer: nn.Module) -> bool:
        if type(layer) is not LoraLinear or layer.merged or layer.disable_adapters:
            return False
        base = layer.get_base_layer()  # a plain matmul by a float weight (not a quantized or scaled one)
        if type(base) not in plain_bases() or base.weight.dtype not in FLOATS:
            return False
        active = [a for a in layer.active_adapters if a in layer.lora_A]
        return all(
            a not in getattr(layer, "lora_variant", {})
            and not layer.use_dora.get(a, False)
            and not getattr(layer, "lora_bias", {}).get(a, False)
            for a in active
        )

    return layers if layers and all(map(plain, layers)) else []


def fold_lora(layers: list[nn.Module]) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Give each LoRA layer's base ``Linear`` a bf16 weight with its active adapters folded in (computed in
    fp32, outside any autocast, then cast); returns the replacements for
    :func:`~textgym.scoring.restore_linears`."""
    replaced = []
    try:
        for layer in layers:
            base = layer.get_base_layer()
            with torch.no_grad(), torch.autocast(base.weight.device.type, enabled=False):
                weight = base._parameters["weight"]
                folded = weight.detach().float()
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A:
                        folded = folded + layer.get_delta_weight(adapter).float()
            base._parameters["weight"] = nn.Parameter(folded.bfloat16(), requires_grad=False)
            replaced.append((base, "weight", weight))
    except BaseException:
        restore_linears(replaced)
        raise
    return replaced
