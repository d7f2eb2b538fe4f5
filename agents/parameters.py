"""SB3's ``get_parameters`` and ``set_parameters`` for LM agents: the agent's weights and optimizer state by
name, as state dicts.

The names are ``"policy"`` (the language model; a LoRA policy's is the peft model's, base weights and
reference adapter included, which are its reference), one per trainable module of the agent (LMPPO's
``"value_head"``) and ``"optimizer"``. A separate reference model is not among them: it is where the policy
started, and stays that. As in SB3, the state dicts hold the agent's
own tensors, not copies (``copy.deepcopy`` the dict to keep a snapshot while training goes on).

``set_parameters`` takes such a dict, or a checkpoint directory that ``save`` wrote, and checks everything
(names, keys, shapes, optimizer groups) before it changes anything: a refused call leaves the agent as it
was. A sharded agent (FSDP2, ZeRO-3) holds only its shards on each process; both calls refuse it, and
``save``/``load`` (which gather) are its way.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from textgym.agents.checkpoint import checked_checkpoint, keep_configured_optimizer_settings
from textgym.errors import ConfigError

if TYPE_CHECKING:
    from textgym.agents.base import LMAgent

__all__ = ["get_parameters", "parameter_names", "read_parameters", "set_parameters"]

SHOWN = 3  # keys named in an error, of each kind


def parameter_names(agent: LMAgent) -> list[str]:
    return ["policy", *agent.modules, "optimizer"]


def _refuse_sharded(agent: LMAgent, call: str) -> None:
    if agent.sharded:
        raise ConfigError(
            f"{call} needs the whole weights on this process, and this agent is sharded over processes "
            f"({agent.sharding_engine}): save() and load() gather and hand out the shards instead."
        )


def _modules(agent: LMAgent) -> dict[str, torch.nn.Module]:
    return {"policy": agent.rollout_model, **{k: agent.unwrap(m) for k, m in agent.modules.items()}}


def get_parameters(agent: LMAgent) -> dict[str, dict[str, Any]]:
    _refuse_sharded(agent, "get_parameters()")
    params = {name: module.state_dict() for name, module in _modules(agent).items()}
    params["optimizer"] = agent.optimizer.state_dict()
    return params


def _listed(keys: list[str]) -> str:
    more = f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else ""
    return ", ".join(map(repr, keys[:SHOWN])) + more


def _check_module(name: str, own: dict[str, Any], given: Any, exact_match: bool, source: str) -> None:
    if not isinstance(given, dict):
        raise ValueError(f"{source}[{name!r}] must be a state dict, not {type(given).__name__}.")
    missing = [k for k in own if k not in given]
    unexpected = [k for k in given if k not in own]
    if exact_match and (missing or unexpected):
        found = [
            f"missing keys {_listed(missing)}" if missing else "",
            f"unknown keys {_listed(unexpected)}" if unexpected else "",
        ]
        raise ValueError(
            f"{source}[{name!r}] does not fit the agent's {name}: {'; '.join(filter(None, found))}. Give "
            f"the state dict of the same model (exact_match=False loads the keys that are there)."
        )
    shared = [k for k in own if k in given]
    if not shared and own:  # (exact_match=False: nothing would load, and nothing would say so)
        raise ValueError(
            f"{source}[{name!r}] shares no key with the agent's {name} (its keys: {_listed(list(given))}; the "
            f"agent's: {_listed(list(own))}): the state dict of another model, or of a LoRA policy where the "
            f"agent's is whole (or the other way round)."
        )
    for key in shared:
        if not torch.is_tensor(given[key]):
            raise ValueError(
                f"{source}[{name!r}][{key!r}] is a {type(given[key]).__name__}, not a torch tensor."
            )
        theirs = given[key].shape
        if tuple(theirs) != tuple(own[key].shape):
            raise ValueError(
                f"{source}[{name!r}][{key!r}] has shape {tuple(theirs)}, the agent's {tuple(own[key].shape)}: "
                f"a state dict of another model's size."
            )


def _check_optimizer(agent: LMAgent, given: Any, source: str) -> None:
    groups = given.get("param_groups") if isinstance(given, dict) else None
    if not isinstance(groups, list) or "state" not in given:
        raise ValueError(f"{source}['optimizer'] must be an optimizer's state dict (state and param_groups).")
    ours = [len(g["params"]) for g in agent.optimizer.param_groups]
    theirs = [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in groups]
    if ours != theirs:
        raise ValueError(
            f"{source}['optimizer'] holds {theirs} parameters per group, the agent's optimizer {ours}: the "
            f"state of another model's or agent's optimizer. Leave it out (exact_match=False) to keep the "
            f"agent's."
        )
    # each parameter's state (AdamW's moments) as large as the parameter: the same count of another model's
    # parameters loads, and fails in the next step or reads the wrong memory
    params = [p for g in agent.optimizer.param_groups for p in g["params"]]
    ids = [i for g in groups for i in g["params"]]
    for i, param in zip(ids, params):
        for key, value in (given["state"].get(i) or {}).items():
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != param.shape:
                raise ValueError(
                    f"{source}['optimizer'] state {key!r} of parameter {i} has shape {tuple(value.shape)}, the "
                    f"parameter {tuple(param.shape)}: the state of another model's optimizer."
                )


def set_parameters(
    agent: LMAgent, load_path_or_dict: str | Path | dict[str, Any], exact_match: bool = True
) -> None:
    _refuse_sharded(agent, "set_parameters()")
    if isinstance(load_path_or_dict, dict):
        params, source = load_path_or_dict, "the parameters"
    else:
        params, source = read_parameters(agent, load_path_or_dict), str(load_path_or_dict)
    names = parameter_names(agent)
    unknown = [n for n in params if n not in names]
    if unknown:
        raise ValueError(
            f"{source} name {_listed(unknown)}, which this {agent.name} agent has not: it has {names}."
        )
    missing = [n for n in names if n not in params]
    if exact_match and missing:
        raise ValueError(
            f"{source} lack {_listed(missing)} of this {agent.name} agent's {names} (exact_match=False sets "
            f"only those given)."
        )
    modules = _modules(agent)
    for name, module in modules.items():  # everything is checked before anything changes
        if name in params:
            _check_module(name, module.state_dict(), params[name], exact_match, source)
    if "optimizer" in params:
        _check_optimizer(agent, params["optimizer"], source)
    for name, module in modules.items():
        if name in params:
            module.load_state_dict(params[name], strict=exact_match)
    if "optimizer" in params:  # (a copy: torch keeps the given state's tensors, which the caller still holds)
        agent.optimizer.load_state_dict(copy.deepcopy(params["optimizer"]))
        keep_configured_optimizer_settings(agent)


def read_parameters(agent: LMAgent, path: str | Path) -> dict[str, Any]:
    """The parameters of the checkpoint ``save`` wrote in ``path``, by :func:`parameter_names`, on the CPU:
    the policy, the modules of this agent that the checkpoint has, and the optimizer state (only when the
    checkpoint's agent is this agent: another's optimizer steps other parameters)."""
    path = checked_checkpoint(path, type(agent).__name__)
    state = json.loads((path / "state.json").read_text())
    saved_lora, lora = state["config"].get("lora"), agent.config.lora
    if (saved_lora is None) != (lora is None):
        held = "a LoRA adapter" if saved_lora is not None else "whole policy weights"
        trains = "trains a LoRA adapter" if lora is not None else "trains the whole policy"
        raise ConfigError(
            f"{str(path)!r} holds {held}, and this agent {trains}: make the agent with lora = {saved_lora!r} "
            f"to set its parameters from it, or load it with load()."
        )
    if lora is not None:
        _check_same_adapter(agent, path, state)
    try:
        params = {"policy": _policy_weights(agent, path / "policy", saved_lora is not None)}
        for name in agent.modules:
            if (path / f"{name}.pt").is_file():
                params[name] = torch.load(path / f"{name}.pt", weights_only=True, map_location="cpu")
        if state.get("agent", "lmppo") == agent.name:
            params["optimizer"] = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
    except Exception as exc:  # whatever a damaged file makes the loaders raise
        raise ConfigError(
            f"checkpoint {str(path)!r} is corrupt or incomplete: {type(exc).__name__}: {exc}"
        ) from exc
    return params


def _check_same_adapter(agent: LMAgent, path: Path, state: dict[str, Any]) -> None:
    """The checkpoint's adapter goes onto this agent's base weights with this agent's scaling: refused unless
    both were made alike (the same LoRA settings; for an initialisation that moves part of the weights into
    the adapter, PiSSA or OLoRA, the same seed too, which fixes the residual base)."""
    from textgym.agents import lora
    from textgym.agents.checkpoint import _lora_settings

    saved, ours = state["config"]["lora"], agent.config.lora
    if _lora_settings(saved) != _lora_settings(ours):
        raise ConfigError(
            f"{str(path)!r} was trained with lora = {saved!r}, this agent has lora = {ours!r}: its adapter "
            f"belongs to other base weights or another scaling. Make the agent with the checkpoint's lora, or "
            f"load it with load()."
        )
    seed = state["config"].get("seed")
    if not lora.starts_at_base(ours) and seed != agent.config.seed:
        raise ConfigError(
            f"{str(path)!r} was trained from seed {seed}, this agent from {agent.config.seed}: with lora's "
            f"init_lora_weights = {ours.get('init_lora_weights')!r} the seed makes the base weights the adapter "
            f"is trained on. Make the agent with seed = {seed}, or load it with load()."
        )


def _policy_weights(agent: LMAgent, policy_dir: Path, adapter: bool) -> dict[str, torch.Tensor]:
    if not adapter:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(policy_dir).state_dict()
    # the adapter's weights, in place of the agent's own in the peft model's state dict
    from peft import get_peft_model_state_dict
    from peft.utils import load_peft_weights

    model = agent.rollout_model
    full = model.state_dict()
    key_of = {tensor.data_ptr(): key for key, tensor in full.items()}
    ours = get_peft_model_state_dict(model)  # the adapter's names as saved, and the model's own tensors
    saved = load_peft_weights(str(policy_dir), device="cpu")
    differ = [k for k in ours if k not in saved or saved[k].shape != ours[k].shape]
    differ += [k for k in saved if k not in ours]
    if differ:
        raise ConfigError(
            f"the adapter in {str(policy_dir)!r} and this agent's differ in {_listed(differ)}: it was trained "
            f"with other LoRA settings or on another base model."
        )
    return {**full, **{key_of[ours[k].data_ptr()]: weights for k, weights in saved.items()}}
