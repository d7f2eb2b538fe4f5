"""Sharded training of the LM agents with DeepSpeed ZeRO stage 3.

Asked for the way accelerate asks for it: ``ACCELERATE_USE_DEEPSPEED=true`` in the environment, which
``accelerate launch --config_file examples/accelerate/zero3.yaml`` sets with ``ACCELERATE_DEEPSPEED_*``
variables (or a DeepSpeed JSON file in ``ACCELERATE_DEEPSPEED_CONFIG_FILE``). As with FSDP2
(:mod:`textgym.agents.sharding`), textgym starts the engine itself and the ``Accelerator`` is made with the
variable hidden: accelerate's DeepSpeed set-up counts one process per machine when there is no GPU, and its
wrapping would take over the policy's forwards and the checkpoint format.

One ``DeepSpeedEngine`` trains the policy and the agent's modules (LMPPO's value head) together, as one
:class:`EngineModel` whose forward is the policy's; training forwards go through the engine (it counts the
micro-batches a step accumulates), rollouts and reference passes call the policy directly. A separate
reference copy gets an engine without an optimizer. Every forward gathers its weights from every process, so
rollouts, evaluations and checkpoints run on every process in lockstep, as under FSDP2.

textgym keeps its own meaning of the settings the engine would otherwise own: the agent's AdamW and
``learning_rate``, its ``max_grad_norm`` (the engine's ``gradient_clipping``), its micro-batches (the engine's
accumulation boundary is set per backward) and its ``bf16`` autocast. A config that sets any of those, or
asks for offloading, is refused by name, never ignored. A step whose gradient norm is not finite is skipped
by the engine on every process; textgym counts it.

Checkpoints are gathered whole (weights and AdamW moments, one parameter at a time) and written by the main
process in the unsharded layout, so a ZeRO-3 run's checkpoint loads in one process and resumes sharded or not.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from textgym.errors import ConfigError

__all__ = [
    "EngineModel",
    "check_one_dtype",
    "full_optimizer_state",
    "full_state_dict",
    "initialize",
    "is_zero3",
    "load_from_main",
    "load_full_optimizer_state",
    "reference",
    "zero3_requested",
]

# the main process's state dict and buffers, by name (empty on the others); see sharding.main_weights
Weights = tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None

INSTALL = "DS_BUILD_OPS=0 pip install --no-build-isolation 'deepspeed>=0.19.8'"  # build isolation would fetch another torch
# What textgym sets itself, by DeepSpeed config key (the values "auto" and absent are accepted).
_OWNED = {
    "gradient_clipping": "the agent's max_grad_norm",
    "gradient_accumulation_steps": "the agent's micro_batch_size (micro-batches per optimizer step)",
    "optimizer": "the agent's AdamW with learning_rate",
    "scheduler": "the agent's lr_schedule",
    "fp16": "the agent's bf16 = true (textgym's own autocast)",
    "bf16": "the agent's bf16 = true (textgym's own autocast)",
}
_IGNORABLE = {"train_batch_size", "train_micro_batch_size_per_gpu", "steps_per_print", "wall_clock_breakdown",
              "zero_allow_untested_optimizer"}  # fmt: skip


# `accelerate launch` passes its config on as ACCELERATE_* variables; a variable may also be set by hand
ACCELERATE_CONFIG = "the accelerate config (or the environment)"


def _refuse(key: str, value: Any, why: str, where: str = ACCELERATE_CONFIG) -> ConfigError:
    return ConfigError(
        f"{where} sets {key}: {value}, which textgym's DeepSpeed ZeRO-3 does not honour ({why}). See "
        f"examples/accelerate/zero3.yaml and docs/distributed.md."
    )


def _unset(key: str, value: Any) -> bool:
    """Whether a DeepSpeed config value leaves the setting to textgym."""
    if value in ("auto", None) or (key == "gradient_accumulation_steps" and value == 1):
        return True
    return isinstance(value, dict) and str(value.get("enabled", True)).lower() in ("false", "auto")


def _env(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


def zero3_asked() -> bool:
    """Whether the environment asks for DeepSpeed (:func:`zero3_requested` checks what it asks for)."""
    return _env("ACCELERATE_USE_DEEPSPEED") in ("1", "true")


def zero3_requested(on_gpu: bool = False) -> dict[str, Any] | None:
    """The ``zero_optimization`` section the environment asks for (``ACCELERATE_USE_DEEPSPEED=true``), None
    without it (on a machine without GPUs, ``DS_ACCELERATOR`` is set to ``cpu`` either way). ``accelerate
    launch`` passes the config's ``deepspeed_config`` as ``ACCELERATE_*`` variables and a
    ``deepspeed_config_file`` as a path: both are checked.

    Raises:
        ConfigError: without the deepspeed package (or, on CPUs, a C++ compiler); for a ZeRO stage other
            than 3, offloading, or a setting textgym owns (see the module doc).
    """
    if not torch.cuda.is_available():  # DeepSpeed's own guess, said: it warns when it guesses, and
        os.environ.setdefault(
            "DS_ACCELERATOR", "cpu"
        )  # transformers' save_pretrained imports it when installed
    if not zero3_asked():
        return None
    # DeepSpeed picks its device once per process, from this variable or by guessing: the agent's device
    accelerator = "cuda" if on_gpu else "cpu"
    if os.environ.setdefault("DS_ACCELERATOR", accelerator) != accelerator:
        raise ConfigError(
            f"DS_ACCELERATOR={os.environ['DS_ACCELERATOR']} in the environment, but the agent trains on "
            f"{accelerator} (its device setting): unset DS_ACCELERATOR or set it to {accelerator}."
        )
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{ACCELERATE_CONFIG} asks for DeepSpeed (ACCELERATE_USE_DEEPSPEED="
            f"{os.environ['ACCELERATE_USE_DEEPSPEED']}), which is not installed: `{INSTALL}` (or shard with "
            f"FSDP2: examples/accelerate/fsdp.yaml, which needs nothing beyond torch)."
        ) from None
    if not on_gpu and not shutil.which(os.environ.get("CXX", "c++")):
        raise ConfigError(
            "DeepSpeed on CPUs compiles a small communication op at first use, and no C++ compiler was found "
            f"({os.environ.get('CXX', 'c++')!r}): install one (e.g. apt-get install g++) or set CXX."
        )
    config: dict[str, Any] = {}
    where = ACCELERATE_CONFIG
    if path := os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE"):
        where = f"the DeepSpeed config {path}"
        try:
            config = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the DeepSpeed config {path!r}: {exc}") from None
    for key, value in config.items():
        if key in _OWNED and not _unset(key, value):
            raise _refuse(key, value, f"textgym sets it: {_OWNED[key]}; remove it", where)
        if key not in _OWNED and key not in _IGNORABLE and key != "zero_optimization":
            raise _refuse(
                key, value, "textgym passes only zero_optimization on to the engine; remove it", where
            )
    zero = dict(config.get("zero_optimization", {}))
    # each setting from the accelerate config (a variable) and from the file: both must agree with textgym
    stages = {
        (ACCELERATE_CONFIG, _env("ACCELERATE_DEEPSPEED_ZERO_STAGE")),
        (where, str(zero.get("stage", ""))),
    }
    for source, stage in stages:
        if stage not in ("", "3"):
            raise _refuse("zero_stage", stage, "textgym shards with ZeRO stage 3 only: set it to 3", source)
    for key, var in (("offload_optimizer_device", "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
                     ("offload_param_device", "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE")):  # fmt: skip
        section = zero.get(key.removesuffix("_device")) or {}
        for source, device in ((ACCELERATE_CONFIG, _env(var)), (where, str(section.get("device", "")))):
            if device.lower() not in ("", "none"):
                raise _refuse(key, device, "offloading is not supported: set it to none", source)
    # (zero3_init_flag is accepted either way: a policy by name is read by the main process only, and every
    # process builds its shards one module at a time; see _partition)
    if _env("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL") in ("1", "true"):
        raise _refuse(
            "zero3_save_16bit_model",
            "true",
            "checkpoints are always one full-precision Hugging Face directory; set it to false",
        )
    clipping = _env("ACCELERATE_GRADIENT_CLIPPING")
    if clipping not in ("", "none", "auto"):
        raise _refuse(
            "gradient_clipping", clipping, f"textgym sets it: {_OWNED['gradient_clipping']}; remove it"
        )
    accumulation = _env("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    if accumulation not in ("", "1", "auto"):
        raise _refuse(
            "gradient_accumulation_steps",
            accumulation,
            f"{_OWNED['gradient_accumulation_steps']}; set it to 1",
        )
    precision = _env("ACCELERATE_MIXED_PRECISION")
    if precision not in ("", "no"):
        raise _refuse(
            "mixed_precision", precision, "use the agent's bf16 = true, textgym's own autocast; set no"
        )
    zero["stage"] = 3
    return zero


def _quiet() -> None:
    """DeepSpeed logs its whole configuration at INFO on every process; keep its warnings."""
    import logging

    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    # DeepSpeed 0.19 calls these torch collectives by their old names, once per gather: hundreds a run
    warnings.filterwarnings(
        "ignore",
        r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
        FutureWarning,
    )


def _engine_config(zero: dict[str, Any], max_grad_norm: float | None = None) -> dict[str, Any]:
    config = {
        # nominal: textgym feeds the engine its own micro-batches; DeepSpeed checks these add up
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": torch.distributed.get_world_size(),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,  # torch's AdamW: the CPU and GPUs alike, no compiled ops
        "steps_per_print": 2**31 - 1,
    }
    if max_grad_norm is not None:
        config["gradient_clipping"] = max_grad_norm
    return config


class EngineModel(nn.Module):
    """The policy and the agent's modules as one model (an engine trains one); its forward is the policy's,
    in the agent's bf16 autocast (the engine's forward turns an autocast from outside it off)."""

    def __init__(self, policy: nn.Module, modules: dict[str, nn.Module], device_type: str, bf16: bool):
        super().__init__()
        self.policy = policy
        self.extra = nn.ModuleDict(modules)
        self.device_type, self.bf16 = device_type, bf16

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=torch.bfloat16, enabled=self.bf16):
            return self.policy(*args, **kwargs)


def _partition(
    module: nn.Module, config: dict[str, Any], device: torch.device, weights: Weights = None
) -> None:
    """Turn ``module``'s parameters into ZeRO-3 ones, in place, a module's own parameters at a time (its
    children's first): each goes to ``device`` whole, takes the main process's values (``zero.Init`` sends
    them: e.g. LoRA's random init under per-process seeds) and keeps this process's shard. Neither the device
    nor the host holds more than one module whole beyond what the process had: the engine alone would first
    move the whole model to the device.

    A model built on the meta device (a skeleton of :func:`~textgym.agents.sharding.load_on_main`, on the
    processes that did not read the policy) is allocated one module at a time, as it goes; on the main
    process, ``weights`` (:func:`~textgym.agents.sharding.main_weights`) fill a skeleton there (the
    reference). Buffers (rotary frequencies) are small and go to the device whole, the main process's."""
    import deepspeed

    from textgym.agents.sharding import broadcast_buffers

    state, buffers = weights or ({}, {})
    deepspeed.init_distributed()  # DeepSpeed's view of the process group torch already runs
    names: dict[int, str] = {}  # by id: the parameters stay alive (in ``originals``) while it is read
    owners: dict[int, list[tuple[nn.Module, str]]] = {}  # a tied parameter has two
    originals = []
    for prefix, sub in module.named_modules():
        for key, param in sub._parameters.items():
            if param is not None:
                originals.append(param)
                names.setdefault(id(param), f"{prefix}.{key}" if prefix else key)
                owners.setdefault(id(param), []).append((sub, key))
    # a module after its children; its Init converts what is left of its parameters, a shared child's too
    for sub in reversed(list(module.modules())):
        mine = [p for p in sub.parameters() if not is_zero3(p)]
        for param in mine:
            if param.is_meta:
                whole = nn.Parameter(
                    torch.empty_like(param, device=device), requires_grad=param.requires_grad
                )
                if names[id(param)] in state:
                    with torch.no_grad():
                        whole.copy_(state[names[id(param)]])
                for owner, name in owners[id(param)]:
                    owner._parameters[name] = whole
        if mine:  # (mem_efficient_linear would replace torch.nn.functional.linear for the whole process)
            deepspeed.zero.Init(module=sub, config_dict_or_path=config, mem_efficient_linear=False)
    del originals
    broadcast_buffers(module, device, buffers)


def initialize(
    model: nn.Module, modules: dict[str, nn.Module], zero: dict[str, Any],
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer], max_grad_norm: float,
    device: torch.device, bf16: bool,
) -> tuple[Any, Any, list[nn.Parameter]]:  # fmt: skip
    """Start the training engine over ``model`` and ``modules`` with the agent's optimizer (``make_optimizer``
    over the trainable parameters: the same AdamW as unsharded, so checkpoints agree). Returns the engine, its
    optimizer and the trainable parameters (in the order of an unsharded agent's optimizer: the policy's,
    then each module's), now ZeRO-3 parameters that each hold one shard (``ds_tensor``)."""
    import deepspeed

    _quiet()
    box = EngineModel(model, modules, device.type, bf16)
    config = _engine_config(zero, max_grad_norm)
    _partition(box, config, device)
    params = [p for p in box.parameters() if p.requires_grad]
    engine, optimizer, _, _ = deepspeed.initialize(
        model=box, optimizer=make_optimizer(params), config=config, dist_init_required=False
    )
    return engine, optimizer, params


def check_one_dtype(models: dict[str, nn.Module]) -> None:
    """Refuse trainable parameters of several dtypes, before anything is partitioned: the engine flattens
    them into one buffer per group, which takes one dtype (its own check is a bare assertion deep in its
    set-up)."""
    dtypes = {name: {p.dtype for p in m.parameters() if p.requires_grad} for name, m in models.items()}
    if len(set().union(*dtypes.values())) > 1:
        held = ", ".join(f"{name}: {'/'.join(sorted(str(d).removeprefix('torch.') for d in kinds))}"
                         for name, kinds in dtypes.items() if kinds)  # fmt: skip
        raise ConfigError(
            f"DeepSpeed ZeRO-3 trains parameters of one dtype, and these differ ({held}): load the policy in "
            f"float32 (bf16 = true trains it in bf16 autocast), or shard with FSDP2 "
            f"(examples/accelerate/fsdp.yaml), which takes both."
        )


def reference(
    model: nn.Module, zero: dict[str, Any], device: torch.device, weights: Weights = None
) -> nn.Module:
    """A frozen reference copy sharded the same way (an engine without an optimizer); returns the model.
    ``weights``: the main process's policy (:func:`~textgym.agents.sharding.main_weights`), for a ``model``
    built on the meta device (see :func:`_partition`)."""
    import deepspeed

    _quiet()
    config = _engine_config(zero)
    _partition(model, config, device, weights)
    engine, *_ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
    return engine.module


def is_zero3(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "ds_id")


def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This process's elements of a ZeRO-3 parameter: its flat shard (``ds_tensor``) without the padding.
    DeepSpeed pads a parameter whose size the number of processes does not divide (a value head's one-element
    bias, on two processes) up to equal shards, and leaves the padding uninitialized: read whole, a healthy
    shard can hold NaN."""
    shard = param.ds_tensor
    return shard[: max(0, min(shard.numel(), param.ds_numel - _shard_start(param)))]


def _shard_start(param: torch.Tensor) -> int:
    """Where this process's shard of a ZeRO-3 parameter starts in the flat parameter."""
    return torch.distributed.get_rank() * param.ds_tensor.numel()  # every shard is that long, padded


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter, gathered from every process (collective), as a new tensor."""
    import deepspeed

    with deepspeed.zero.GatheredParameters([param]):
        return param.detach().clone()


def full_state_dict(module: nn.Module, keep: bool = True) -> dict[str, torch.Tensor] | None:
    """The module's full state dict on the CPU of the process that ``keep``s it (the others return None),
    gathered one parameter at a time (collective: every process calls it). Tied weights (the embeddings and
    the LM head) stay one tensor, so ``save_pretrained`` writes them once, as for an unsharded model."""
    state, seen = {}, {}
    for name, t in module.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            whole = full_tensor(t) if is_zero3(t) else t.detach()  # every process takes part in the gather
            seen[id(t)] = whole.cpu() if keep else None
        if keep:
            state[name] = seen[id(t)]
    return state if keep else None


def _set_local(
    param: nn.Parameter, value: torch.Tensor, key: str | None = None, start: int | None = None
) -> None:
    """Write this process's part of a whole ``value`` into the optimizer's fp32 shard of ``param`` (its
    master weights, or the moment ``key``); ``start=0``: ``value`` is this process's part. DeepSpeed's own
    full-tensor setter fails on the padded shard of a parameter smaller than the number of processes; its
    local getter returns a view, written in place."""
    from deepspeed.utils import safe_get_local_fp32_param, safe_get_local_optimizer_state

    target = safe_get_local_fp32_param(param) if key is None else safe_get_local_optimizer_state(param, key)
    start = _shard_start(param) if start is None else start
    part = value.flatten()[start : start + target.numel()]  # shorter (or empty) in the padding
    with torch.no_grad():
        target[: part.numel()].copy_(part.to(target.device, target.dtype))


def load_from_main(module: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """The main process's full ``state`` (read from ``source``; the other processes' is not read, and may be
    empty: they need never hold it whole) into a module of the engine: the weights forwards use, and the
    optimizer's fp32 master copy, from the new shard (collective, one parameter at a time)."""
    import deepspeed

    params = dict(module.named_parameters())
    missing = [sorted(set(params) - set(state))] if torch.distributed.get_rank() == 0 else [None]
    torch.distributed.broadcast_object_list(missing, src=0)  # every process stops, or none
    if missing[0]:
        raise ConfigError(
            f"{source} has no {', '.join(missing[0][:3])}{' ...' if len(missing[0]) > 3 else ''}: it does "
            f"not hold the weights this agent expects."
        )
    for name, param in params.items():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if torch.distributed.get_rank() == 0:
                param.data.copy_(state[name])
        if param.requires_grad:
            _set_local(param, local_shard(param), start=0)


_MOMENTS = ("exp_avg", "exp_avg_sq")


def full_optimizer_state(optimizer: Any, params: list[nn.Parameter], keep: bool) -> dict[str, Any] | None:
    """AdamW's state as an unsharded agent's ``optimizer.state_dict()`` holds it (indexed by ``params``),
    gathered whole (collective), on the CPU of the process that ``keep``s it (the others return None)."""
    from deepspeed.utils import safe_get_full_optimizer_state

    inner = optimizer.optimizer  # torch's AdamW over the engine's flat fp32 shards
    steps = [s["step"] for s in inner.state.values() if "step" in s]  # the same on every process
    state: dict[int, dict[str, Any]] = {}
    for index, param in enumerate(params if steps else ()):  # no step yet: AdamW has no state to gather
        moments = {key: safe_get_full_optimizer_state(param, key) for key in _MOMENTS}
        if keep:
            entry = {key: value.view(param.ds_shape).cpu() for key, value in moments.items()}
            state[index] = {"step": steps[0].detach().clone().cpu(), **entry}
    if not keep:
        return None
    group = {k: v for k, v in inner.param_groups[0].items() if k != "params"}
    return {"state": state, "param_groups": [{**group, "params": list(range(len(params)))}]}


def load_full_optimizer_state(optimizer: Any, params: list[nn.Parameter], state: dict[str, Any]) -> None:
    """Load a full AdamW state dict (an unsharded agent's, or :func:`full_optimizer_state`'s): each process
    keeps its shard of the moments; the step count and hyperparameters go to every flat group."""
    inner = optimizer.optimizer
    entries = {int(k): v for k, v in state["state"].items()}
    if not entries:  # saved before the first step: nothing to restore
        return
    if len(entries) != len(params):
        raise ConfigError(
            f"the optimizer state holds {len(entries)} parameters; this agent trains {len(params)}."
        )
    step = next(iter(entries.values()))["step"]
    saved = {k: v for k, v in state["param_groups"][0].items() if k != "params"}
    for group in inner.param_groups:  # one group (textgym's AdamW has one)
        group.update({k: v for k, v in saved.items() if k in group})
    on_device = saved.get("fused") or saved.get("capturable")
    # AdamW makes its state at its first step: make it now, to fill. The engine steps its flat fp32 shards
    # one at a time through the AdamW, whose param_groups hold none of them in between.
    for flat in optimizer.fp32_partitioned_groups_flat:
        inner.state[flat] = {
            "step": step.detach().clone().float().to(flat.device if on_device else "cpu"),
            **{key: torch.zeros_like(flat) for key in _MOMENTS},
        }
    for index, param in enumerate(params):
        for key in _MOMENTS:
            _set_local(param, entries[index][key], key)
