"""LoRA policies: the adapter a config asks for (:func:`adapted`), the reference within the same weights,
and the adapters folded into a weight copy (sampling).

With ``lora = {...}`` an agent's policy is a peft ``PeftModel``, and its reference is the same model, so
there is no second copy of the weights. The reference is the policy as it started: with the LoRA paper's
initialisation (``B = 0``, peft's default) that is the model with its adapters switched off. Other
initialisations start elsewhere: PiSSA and OLoRA move the principal part of each adapted
weight into the adapter (the base keeps the residual), and ``init_lora_weights = false`` starts from random
adapters. Switched off, such a model is not the policy that training started from, and the KL penalty would
pull towards a model nobody chose. Those policies keep a frozen copy of their initial adapter, the
``reference`` adapter (a few MB), and compute the reference through it (:func:`reference_weights`). In bf16
a rollout samples from the adapters folded into the bf16 weight copy that it makes anyway
(agents/precision.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from textgym.errors import ConfigError, did_you_mean, user_stacklevel
from textgym.models import cpu_seeded
from textgym.scoring import restore_linears

__all__ = [
    "REFERENCE",
    "adapted",
    "adapters_disabled",
    "add_reference_adapter",
    "fold_lora",
    "foldable_lora_layers",
    "is_peft_model",
    "linear_names",
    "load_reference_adapter",
    "quiet_peft",
    "reference_weights",
    "restoring",
    "seeded_init",
    "starts_at_base",
]  # fmt: skip

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
REFERENCE = "reference"  # the frozen initial adapter of a policy that does not start at its base model
# the initialisations whose adapters start with B A = 0 exactly: the LoRA paper's (B = 0; A uniform or
# gaussian). peft's "orthogonal" (A and B orthogonal halves of one matrix) makes B A = 0 up to rounding only,
# which bf16 turns into a KL of 1e-3 before any update against the adapter-disabled model: it keeps a reference
ZERO_START = (True, "gaussian")


# True while a checkpoint builds its agent around the peft model it restored (adapters and reference in place)
_RESTORING = contextvars.ContextVar("textgym_lora_restoring", default=False)


@contextlib.contextmanager
def restoring() -> Iterator[None]:
    """Within the block, an agent takes a peft model as its policy as it is: a checkpoint's, restored with
    its adapters and reference. Outside it, a peft model given as the policy is refused (agents/base.py)."""
    token = _RESTORING.set(True)
    try:
        yield
    finally:
        _RESTORING.reset(token)


def is_restoring() -> bool:
    return _RESTORING.get()


def starts_at_base(lora: dict) -> bool:
    """Whether a ``lora`` config's adapters start as a no-op, so that the policy starts as the model with
    its adapters switched off. Decided from the config alone, the same on every process, meta-device
    skeletons included."""
    return lora.get("init_lora_weights", True) in ZERO_START


@contextlib.contextmanager
def seeded_init(seed: int) -> Iterator[None]:
    """Within the block, torch's random numbers start from ``seed``; outside, they continue as if the block
    had drawn none. For the adapters' initialisation, as made and as remade when a checkpoint loads: peft
    makes every adapter again from its config before it reads the saved weights, and a randomized one
    (``init_lora_weights = "pissa_niter_K"``: a randomized SVD) also leaves the base its residual, which the
    checkpoint does not hold. Seeded alike both times, the base is the one the adapter was trained over;
    and every process makes the same adapters. They are made on the CPU, before the policy moves to its
    device: the CPU's generator is the one seeded."""
    with cpu_seeded(seed), quiet_peft():
        yield


@contextlib.contextmanager
def quiet_peft() -> Iterator[None]:
    """Within the block, transformers' notice that ``is_gradient_checkpointing`` is deprecated, which peft's
    own call raises as it adds adapters, is kept from the user, who can do nothing about it."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing.* is deprecated", category=FutureWarning
        )
        yield


def add_reference_adapter(model: nn.Module, on_meta: bool = False) -> None:
    """Add the ``reference`` adapter to a peft ``model``: a frozen copy of its active adapter as it is now
    (``on_meta``: of the same shapes, for the main process's weights to fill). The active adapter stays
    active and trainable."""
    import copy

    active = model.active_adapter
    config = copy.deepcopy(model.peft_config[active])
    config.init_lora_weights, config.inference_mode = False, True  # nothing read from the (residual) base
    with _made_for_this_base(), _requires_grad_kept(model):  # adding one may mark the others trainable
        model.add_adapter(REFERENCE, config)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, parameter in params.items():
            parts = name.split(".")
            if active in parts:  # e.g. ...q_proj.lora_A.default.weight, ...lora_embedding_A.default
                twin = params[".".join(REFERENCE if part == active else part for part in parts)]
                if not on_meta:
                    twin.copy_(parameter)
                twin.requires_grad_(False)


def load_reference_adapter(model: nn.Module, directory: Path) -> None:
    """The ``reference`` adapter that a checkpoint saved (peft writes it to ``policy/reference/``), frozen;
    nothing where the checkpoint has none (its policy started at its base model)."""
    if not (directory / REFERENCE / "adapter_config.json").is_file():
        return
    active = model.active_adapter
    with _made_for_this_base(), _requires_grad_kept(model):
        model.load_adapter(str(directory / REFERENCE), adapter_name=REFERENCE)
        model.set_adapter(active)
    for name, parameter in model.named_parameters():
        if REFERENCE in name.split("."):
            parameter.requires_grad_(False)


@contextlib.contextmanager
def _made_for_this_base() -> Iterator[None]:
    """Without peft's warning that an adapter which changed the base weights (PiSSA, OLoRA, CorDA) should
    not be combined with another: it is meant for adapters made for the original base, and the reference
    adapter is a copy of the first one, made for the changed base."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".* changes the base weights of the model")
        yield


@contextlib.contextmanager
def reference_weights(model: nn.Module) -> Iterator[None]:
    """Within the block, ``model`` (a peft model) computes the policy's reference: through its ``reference``
    adapter if it has one, else with its adapters switched off. Every parameter's ``requires_grad`` is as it
    was on exit."""
    if REFERENCE not in getattr(model, "peft_config", {}):
        with adapters_disabled(model):
            yield
        return
    active = model.active_adapter
    with _requires_grad_kept(model):
        try:
            model.set_adapter(REFERENCE)
            yield
        finally:
            model.set_adapter(active)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """peft's ``model.disable_adapter()``, with every parameter's ``requires_grad`` as it was on exit
    (peft's exit sets it on all of the active adapters' weights, a frozen one's included)."""
    with _requires_grad_kept(model), model.disable_adapter():
        yield


@contextlib.contextmanager
def _requires_grad_kept(model: nn.Module) -> Iterator[None]:
    """On exit, every parameter that ``model`` had on entry has the ``requires_grad`` it had then (peft's
    adapter switches set it for whole adapters); parameters added within the block keep their own."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
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


def adapted(model: Any, settings: dict[str, Any] | None, seed: int, on_meta: bool = False) -> Any:
    """``model`` with the LoRA adapter ``settings`` ask for (the model itself without them, or while a
    checkpoint's peft model is restored), made under ``seed``, and, where the adapter does not start as a
    no-op (PiSSA, OLoRA, ...), a frozen copy of it as the reference. ``on_meta``: a meta-device skeleton,
    whose adapter weights come from the main process, so no initialisation may read the base weights."""
    if is_restoring():  # a checkpoint's peft model, its adapters and reference restored
        return model
    if is_peft_model(model):
        raise ConfigError(
            f"the policy is already a peft model ({type(model).__name__}): textgym adds the LoRA adapter "
            f"itself and keeps the policy as it starts as the KL reference, which a given adapter would "
            f"miss. Give the base model (by name or path) with lora = {{...}}, or merge the adapter "
            f"(model.merge_and_unload()) and give the merged model."
        )
    if settings is None:
        return model
    from peft import LoraConfig, get_peft_model

    check_lora_keys(settings, f"lora {settings!r}", "CAUSAL_LM")
    warn_of_inert_dropout(settings)
    init = {"init_lora_weights": False} if on_meta else {}
    try:  # seeded as a checkpoint remakes it (checkpoint.load_checkpoint)
        with seeded_init(seed):
            peft_model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **{**settings, **init}))
    except (TypeError, ValueError) as exc:  # peft's checks of its arguments, and of the target modules
        reason = str(exc).rstrip(". ")
        if "target_modules" in settings or "Target modules" in reason:  # name what the model has
            reason += f" (this model's linear layers: {', '.join(linear_names(model)) or 'none'})"
        raise ConfigError(f"lora {settings!r}: {reason}. See peft's LoraConfig for its arguments.") from None
    targets = settings.get("target_modules")
    if isinstance(targets, (list, tuple)):  # peft refuses only a list that matches nothing
        found = peft_model.targeted_module_names
        missed = [t for t in targets if not any(n == t or n.endswith(f".{t}") for n in found)]
        if missed:
            raise ConfigError(
                f"lora.target_modules {missed!r} matched no layer of the model, so they would not be "
                f"trained (this model's linear layers: {', '.join(linear_names(model)) or 'none'})."
            )
    if not starts_at_base(settings):  # the reference: the policy as it starts
        add_reference_adapter(peft_model, on_meta)
    return peft_model


def is_peft_model(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def check_lora_keys(settings: Mapping[str, Any], where: str, task_type: str) -> None:
    """Refuse a setting peft's ``LoraConfig`` does not take, with the closest one (peft's own TypeError named
    none), and ``task_type``, which textgym sets (``task_type``)."""
    import dataclasses

    from peft import LoraConfig

    known = [f.name for f in dataclasses.fields(LoraConfig) if f.init and f.name != "task_type"]
    for name in settings:
        if name == "task_type":
            raise ConfigError(f"{where}: task_type is textgym's to set ({task_type!r} here): leave it out.")
        if name not in known:
            raise ConfigError(
                f"{where}: unknown LoRA setting {name!r}.{did_you_mean(name, known)} See peft's LoraConfig for "
                f"its arguments."
            )


def warn_of_inert_dropout(settings: Mapping[str, Any]) -> None:
    """Warn that a ``lora_dropout`` above 0 does nothing: textgym trains with dropout off. Called where the
    adapter is made, once per run (the main process)."""
    from textgym.launch import rank

    dropout = settings.get("lora_dropout")
    if isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and dropout > 0 and rank() == 0:
        warnings.warn(
            f"lora_dropout = {dropout} has no effect: textgym trains with dropout off, as TRL does (with it on, "
            f"a completion's log-probs would differ between the rollout and the update).",
            stacklevel=user_stacklevel(),
        )


def linear_names(model: nn.Module) -> list[str]:
    """The names that LoRA's ``target_modules`` match: the last part of each linear layer's name."""
    return sorted({name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
