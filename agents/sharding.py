"""Sharded training of the LM agents with PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``).

Asked for the way accelerate asks for it: ``ACCELERATE_USE_FSDP=true`` in the environment, which
``accelerate launch --config_file examples/accelerate/fsdp.yaml`` sets (torchrun or ``run.processes = N``
with the variable set do the same). textgym applies ``fully_shard`` itself, on CPUs (gloo) and GPUs alike:
accelerate never shards on CPUs, and on GPUs its own FSDP wrapping would take the policy out of textgym's
hands (the rollout's KV-cached forwards, the reference, the checkpoint format). The ``Accelerator`` is made
with the variable hidden, so it only runs the process group and wraps the optimizer.

What is sharded: the policy and a separate reference copy, one FSDP unit per decoder layer and one at the
root; and the agent's small modules (LMPPO's value head), each one unit. Sharding a ``Linear(hidden, 1)``
saves no memory, but it makes every trainable parameter a DTensor: one optimizer parameter group (the fused
AdamW kernel refuses DTensors and plain tensors together), one gradient-sync switch for accumulation, and
one way to gather and load checkpoints. Its cost is one tiny all-gather per value-head forward.

Every forward of a sharded model all-gathers its parameters, so every process must run the same number of
them: rollouts run in lockstep (``rollout(..., lockstep=...)``), sample tables and evaluations run on every
process, and checkpoints gather the full weights collectively before the main process writes them.

The accelerate config's FSDP options that textgym does not honour are refused by name (see
:func:`fsdp_requested`), never ignored.
"""

from __future__ import annotations

import contextlib
import copy
import os
import pickle
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from textgym.agents import zero3
from textgym.agents.zero3 import is_zero3
from textgym.errors import ConfigError
from textgym.launch import SHARDING_VARS

__all__ = [
    "ENGINE_ENVIRONMENT",
    "FSDPSettings",
    "accelerate_without_sharding",
    "broadcast_from_main",
    "clip_grad_norm",
    "fsdp_requested",
    "full_optimizer_state",
    "full_state_dict",
    "full_tensor",
    "load_from_main",
    "load_full_optimizer_state",
    "load_full_state_dict",
    "load_on_main",
    "local",
    "main_weights",
    "refuse_accelerate_sharding",
    "shard",
    "shard_module",
]  # fmt: skip


ENGINE_ENVIRONMENT = {
    "fsdp": {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"},
    "zero3": {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3"},
}
"""The environment that asks for each engine without an accelerate config file, for torchrun or
``run.processes = N`` (the variables ``accelerate launch`` sets from examples/accelerate/fsdp.yaml and
zero3.yaml)."""


def _flag(name: str, default: str = "false") -> str:
    return os.environ.get(name, default).strip().lower()


@dataclass(frozen=True)
class FSDPSettings:
    """What textgym honours of an accelerate FSDP config."""

    reshard_after_forward: bool = True
    """Free each unit's gathered parameters after its forward (FULL_SHARD; False: SHARD_GRAD_OP)."""
    layer_classes: tuple[str, ...] = ()
    """Class names of the modules that get their own FSDP unit (empty: the model's ``_no_split_modules``)."""


# accelerate config key -> (environment variable, the values textgym refuses, why)
_REFUSED = (
    ("fsdp_offload_params", "FSDP_OFFLOAD_PARAMS", ("true", "1"), "CPU offload is not supported"),
    ("fsdp_activation_checkpointing", "FSDP_ACTIVATION_CHECKPOINTING", ("true", "1"),
     "activation checkpointing is not supported"),
    ("fsdp_activation_checkpointing_offload", "FSDP_ACTIVATION_CHECKPOINTING_OFFLOAD", ("true", "1"),
     "activation checkpointing is not supported"),
    ("fsdp_state_dict_type", "FSDP_STATE_DICT_TYPE", ("sharded_state_dict", "local_state_dict"),
     "checkpoints are always one full Hugging Face directory (FULL_STATE_DICT)"),
    ("fsdp_auto_wrap_policy", "FSDP_AUTO_WRAP_POLICY", ("size_based_wrap", "no_wrap"),
     "textgym wraps each decoder layer (TRANSFORMER_BASED_WRAP)"),
)  # fmt: skip


def fsdp_requested() -> FSDPSettings | None:
    """The FSDP settings the environment asks for (``ACCELERATE_USE_FSDP=true``), None without it.

    Raises:
        ConfigError: for Megatron-LM, FSDP version 1, or an FSDP option textgym does not honour.
    """
    if _flag("ACCELERATE_USE_MEGATRON_LM") in ("1", "true"):
        raise ConfigError(
            "Megatron-LM (tensor and pipeline parallelism) is not supported by textgym's LM agents: shard with "
            "FSDP2 (an accelerate config with distributed_type: FSDP and fsdp_version: 2, e.g. "
            "examples/accelerate/fsdp.yaml) or DeepSpeed ZeRO-3 (examples/accelerate/zero3.yaml); see "
            "docs/distributed.md."
        )
    if _flag("ACCELERATE_USE_FSDP") not in ("1", "true"):
        return None

    def refuse(key: str, var: str, why: str, fix: str = "remove it") -> ConfigError:
        # `accelerate launch` passes its config on as variables; a variable may also be set by hand
        return ConfigError(
            f"the accelerate config (or the environment) sets {key}: {os.environ[var]} ({var}), which textgym's "
            f"FSDP does not honour ({why}); {fix} (see examples/accelerate/fsdp.yaml)."
        )

    if _flag("FSDP_VERSION", "2") != "2":
        raise refuse(
            "fsdp_version", "FSDP_VERSION", "textgym shards with FSDP2 only",
            "set fsdp_version: 2 (a config without an fsdp_version line gets accelerate's default, 1)",
        )  # fmt: skip
    for key, var, refused, why in _REFUSED:
        if _flag(var) in refused:
            raise refuse(key, var, why)
    if os.environ.get("FSDP_IGNORED_MODULES"):
        raise refuse("fsdp_ignored_modules", "FSDP_IGNORED_MODULES", "every module is sharded")
    if _flag("ACCELERATE_MIXED_PRECISION", "no") not in ("no", ""):
        raise refuse(
            "mixed_precision", "ACCELERATE_MIXED_PRECISION", "textgym has its own autocast",
            "use the agent's bf16 = true and mixed_precision: no",
        )  # fmt: skip
    reshard = _flag("FSDP_RESHARD_AFTER_FORWARD", "true")
    if reshard not in ("true", "1", "full_shard", "false", "0", "shard_grad_op"):
        raise refuse(
            "fsdp_reshard_after_forward", "FSDP_RESHARD_AFTER_FORWARD", "it takes true or false", "set one"
        )
    classes = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "")
    return FSDPSettings(
        reshard_after_forward=reshard in ("true", "1", "full_shard"),
        layer_classes=tuple(c.strip() for c in classes.split(",") if c.strip()),
    )


SHARDING_ENGINES = ("FSDP", "DEEPSPEED", "MEGATRON_LM")


def refuse_accelerate_sharding(accelerator: Any) -> None:
    """Refuse an ``Accelerator`` that shards by itself (DeepSpeed, Megatron-LM, or its own FSDP wrapping):
    textgym's LM agents start FSDP2 or DeepSpeed ZeRO-3 themselves, asked for (:func:`fsdp_requested`,
    :func:`~textgym.agents.zero3.zero3_requested`) before the ``Accelerator`` exists, so a run never gets some
    other engine than it asked for."""
    kind = accelerator.distributed_type.value
    if kind in SHARDING_ENGINES:  # see docs/distributed.md
        raise ConfigError(
            f"the Accelerator is set up for {kind}, which textgym's LM agents do not use: they start their own "
            f"FSDP2 (examples/accelerate/fsdp.yaml) or DeepSpeed ZeRO-3 (examples/accelerate/zero3.yaml), or "
            f"train data-parallel (a plain multi-GPU accelerate config or torchrun)."
        )


@contextlib.contextmanager
def accelerate_without_sharding() -> Iterator[None]:
    """Hide ``ACCELERATE_USE_FSDP`` and ``ACCELERATE_USE_DEEPSPEED`` while an ``Accelerator`` is made: textgym
    shards itself (module doc; :mod:`textgym.agents.zero3`)."""
    saved = {name: os.environ.pop(name) for name in SHARDING_VARS if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def load_on_main(
    load: Callable[[], nn.Module],
    dist: Any,
    adapt: Callable[[nn.Module, bool], nn.Module] = lambda model, on_meta: model,
) -> tuple[nn.Module, Callable[[], nn.Module] | None]:
    """The policy for FSDP2 or DeepSpeed ZeRO-3, read by the main process only: ``(model, skeleton)``.

    The main process calls ``load`` and gets the model; every other process builds the same architecture
    on the meta device (no memory), from the class and config the main process sends. :func:`shard` (or
    ZeRO-3's partitioning, :mod:`textgym.agents.zero3`) then gives each process its shard of the main
    process's weights (``weights=main_weights(...)``), so no other
    process ever holds the whole model on the host: eight processes with an 8B fp32 policy and its
    reference would otherwise hold 16 whole copies (512 GB) before sharding. ``adapt(model, on_meta)`` wraps
    the model on every process (LoRA). ``skeleton()`` builds another meta copy of the loaded model, on every
    process (the reference, loaded the same way).

    Every process loads the model itself instead, and ``skeleton`` is None everywhere, when the main
    process cannot describe it (a class not built from a config, a config that does not pickle) or when a
    meta-device copy fails or differs from it (a parameter or buffer of another dtype or shape, e.g. from
    a loader that casts the model after building it). A failed load on the main process stops every
    process."""

    def load_and_adapt() -> tuple[nn.Module, nn.Module]:
        loaded = load()
        return loaded, adapt(loaded, False)

    loaded, model = dist.on_main(load_and_adapt) or (None, None)
    blueprint = _blueprint(loaded, model) if dist.is_main else None
    try:
        blueprint = dist.gather_objects([blueprint])[0]
    except Exception:  # a class the other processes cannot import
        blueprint = None
    skeleton = None
    if blueprint is not None:
        cls, config, dtype, generation, kinds = blueprint

        def skeleton() -> nn.Module:
            with torch.device("meta"):
                built = cls._from_config(copy.deepcopy(config), dtype=dtype)
            if generation is not None:
                built.generation_config = copy.deepcopy(generation)
            return built.eval()

        if not dist.is_main:
            try:
                model = adapt(skeleton(), True)
                blueprint = blueprint if _kinds(model) == kinds else None
            except Exception:
                blueprint = None
    if dist.any(blueprint is None):
        return (model if dist.is_main else adapt(load(), False)), None
    return model, skeleton


def _kinds(model: nn.Module) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The dtype and shape of every parameter and buffer."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {name: (t.dtype, tuple(t.shape)) for name, t in tensors}


def _blueprint(loaded: nn.Module, model: nn.Module) -> tuple[Any, ...] | None:
    """What the other processes need to build ``loaded`` on the meta device and check it against
    ``model`` (``loaded`` adapted); None when it cannot be sent."""
    if not hasattr(type(loaded), "_from_config"):
        return None
    generation = getattr(loaded, "generation_config", None)
    blueprint = (type(loaded), loaded.config, loaded.dtype, generation, _kinds(model))
    try:
        pickle.dumps(blueprint)
    except Exception:  # e.g. a class defined inside a plugin's loader
        return None
    return blueprint


def main_weights(model: nn.Module, dist: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """For :func:`shard` after :func:`load_on_main`: the main process's state dict and every buffer of its
    whole model (rotary tables are buffers outside the state dict); empty on the other processes."""
    if not dist.is_main:
        return {}, {}
    return model.state_dict(), dict(model.named_buffers())


def load_from_main(
    model: nn.Module, weights: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]], device: torch.device
) -> None:
    """Give a sharded model (on the meta device on some processes) the main process's ``weights``
    (:func:`main_weights`): each process allocates its shards, then every tensor is broadcast whole, one at
    a time, and cut. Buffers missing from the main process's ``weights`` keep the main process's values."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    state, buffers = weights
    if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
        model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, dict(state), options=options)  # it writes the shards into the dict it gets
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in buffers:  # on the main process (its reference skeleton takes the policy's)
                buffer.copy_(buffers[name])
    _broadcast_in_place(model.buffers(), device)  # FSDP2 leaves buffers whole


def shard(
    model: nn.Module,
    settings: FSDPSettings,
    device: torch.device,
    weights: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None,
) -> nn.Module:
    """``fully_shard`` every decoder layer, then the root (embeddings, final norm, LM head); in place.

    ``model`` may be on the CPU: each ``fully_shard`` call moves its unit's weights to ``device`` and keeps
    this process's shard, so the device never holds more than one unit whole. With ``weights``
    (:func:`main_weights`), the model may be a meta-device skeleton (:func:`load_on_main`) and takes the
    main process's weights once sharded; without, each process's model is whole, and the main process's
    weights are broadcast into it first."""
    from torch.distributed.fsdp import fully_shard

    # FSDP2 warns that a module's output is a view (an in-place op on it would skip the backward's
    # all-gather): the LM's sliced logits and the value head's squeeze are; textgym never updates them in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft: the wrapped model
    names = set(settings.layer_classes or getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(
            f"no {sorted(names) or 'decoder layer'} modules in {type(base).__name__} to shard: set "
            f"fsdp_transformer_layer_cls_to_wrap in the accelerate config to its decoder layer class."
        )
    if weights is None:
        broadcast_from_main(model, device)
    for layer in layers:
        fully_shard(layer, reshard_after_forward=settings.reshard_after_forward)
    fully_shard(model, reshard_after_forward=settings.reshard_after_forward)
    if weights is not None:
        load_from_main(model, weights, device)
    return model


def shard_module(module: nn.Module, settings: FSDPSettings, device: torch.device) -> nn.Module:
    """``fully_shard`` a small module (a value head) as one unit; in place."""
    from torch.distributed.fsdp import fully_shard

    broadcast_from_main(module, device)
    return fully_shard(module, reshard_after_forward=settings.reshard_after_forward)


def broadcast_from_main(module: nn.Module, device: torch.device) -> None:
    """The main process's weights on every process, before each keeps its shard (DDP does the same when it
    wraps a model): weights drawn at random per process, e.g. LoRA's A matrices under per-process seeds,
    would otherwise make the shards of different models. One tensor at a time passes through ``device``
    (NCCL broadcasts device tensors only)."""
    _broadcast_in_place([*module.parameters(), *module.buffers()], device)


def broadcast_buffers(
    module: nn.Module, device: torch.device, buffers: dict[str, torch.Tensor] | None = None
) -> None:
    """Every buffer of ``module`` on ``device``, with the main process's values: ``buffers`` by name where the
    main process gives them (a skeleton there takes the policy's), else its own. Meta buffers are allocated."""
    buffers = buffers or {}
    done: dict[int, torch.Tensor] = {}  # by the id of the buffer it replaces: one registered twice stays one
    originals = [b for sub in module.modules() for b in sub._buffers.values()]  # (alive while ids are read)
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for key, buffer in sub._buffers.items():
            if buffer is None:
                continue
            if id(buffer) not in done:
                moved = torch.empty_like(buffer, device=device) if buffer.is_meta else buffer.to(device)
                name = f"{prefix}.{key}" if prefix else key
                if name in buffers:
                    moved.copy_(buffers[name])
                done[id(buffer)] = moved
            sub._buffers[key] = done[id(buffer)]
    del originals
    _broadcast_in_place(module.buffers(), device)


def _broadcast_in_place(tensors: Iterable[torch.Tensor], device: torch.device) -> None:
    """Each tensor takes the main process's values, passing through ``device`` one at a time."""
    import torch.distributed as dist

    with torch.no_grad():
        for tensor in tensors:
            on_device = tensor.data.to(device)
            dist.broadcast(on_device, src=0)
            if on_device is not tensor.data:
                tensor.data.copy_(on_device)


def is_sharded(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a sharded tensor (FSDP2's DTensor, or a DeepSpeed ZeRO-3 parameter's flat
    shard, without its padding); the tensor itself otherwise."""
    if is_zero3(t):
        return zero3.local_shard(t)
    return t.to_local() if is_sharded(t) else t


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded one, gathered from every process (collective); the tensor otherwise."""
    if is_zero3(t):
        return zero3.full_tensor(t)
    return t.full_tensor() if is_sharded(t) else t


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` over sharded (DTensor) and data-parallel gradients together: the norm of each
    kind is taken apart (a DTensor's over every process's shard), then they are combined. Returns the
    total norm, the same on every process."""
    grads = [p.grad for p in params if p.grad is not None]
    sharded = [g for g in grads if is_sharded(g)]
    replicated = [g for g in grads if not is_sharded(g)]
    norms = []
    if sharded:
        norms.append(torch.nn.utils.get_total_norm(sharded).full_tensor().cpu())
    if replicated:
        norms.append(torch.nn.utils.get_total_norm(replicated).cpu())
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The sharded model's full state dict on the CPU (collective: every process calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load a full (unsharded) state dict into a sharded model; every process passes the whole dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(optimizer: torch.optim.Optimizer, keep: bool) -> dict[str, Any] | None:
    """The optimizer's state dict with every sharded state tensor gathered whole (collective), on the CPU
    of the process that ``keep``s it (the others return None): the same layout as an unsharded optimizer's,
    so a checkpoint resumes sharded or not. One tensor at a time is whole on the device."""
    state = optimizer.state_dict()  # its per-parameter dicts are the optimizer's own: build new ones
    whole = {}
    for index, entry in state["state"].items():
        for key, value in entry.items():
            value = value.full_tensor() if is_sharded(value) else value  # every process takes part
            if keep:
                whole.setdefault(index, {})[key] = value.cpu() if isinstance(value, torch.Tensor) else value
    state["state"] = whole
    return state if keep else None


def load_full_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a full optimizer state dict (:func:`full_optimizer_state`) into an optimizer over sharded
    parameters: each state tensor of a sharded parameter is cut to this process's shard."""
    from torch.distributed.tensor import distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entry in state["state"].items():
        param = params[int(index)]
        if not is_sharded(param):
            continue
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape:
                entry[key] = distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
    optimizer.load_state_dict(state)
