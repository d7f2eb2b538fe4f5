"""Which agent a config names, and the hyperparameters it gets, checked before anything loads.

``[agent]`` holds ``name``, ``policy`` and hyperparameters shared by whatever agent is chosen; a table named
after an agent (``[agent.lmppo]``, ``[agent.sb3-a2c]``) holds the hyperparameters of that agent alone and wins
over the shared ones, so one file serves several agents (``textgym train CONFIG --agent NAME``).

Agents are registered names (``textgym plugins`` lists them) or any Stable-Baselines3 algorithm named directly
(``a2c``, ``dqn``, ``sb3-a2c``, ...; sb3-contrib's too when it is installed: ``recurrentppo``, ``qrdqn``,
``maskableppo``, ``trpo``, ...).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import re
from collections.abc import Mapping
from typing import Any

from textgym import plugin_manager
from textgym.errors import ConfigError, UnknownNameError, did_you_mean

SB3_MODULES = ("stable_baselines3", "sb3_contrib")
RESERVED = ("name", "policy")


def is_lm_agent(agent_class: Any) -> bool:
    """LM agents (subclasses of ``LMAgent``) step the native vector env; others get an SB3 VecEnv."""
    from textgym.agents.base import LMAgent

    return isinstance(agent_class, type) and issubclass(agent_class, LMAgent)


def _key(name: str) -> str:
    key = name.lower().replace("-", "").replace("_", "")
    return key[3:] if key.startswith("sb3") else key


def _sb3_algorithms() -> dict[str, type]:
    """The installed Stable-Baselines3 and sb3-contrib algorithm classes by their class names."""
    from stable_baselines3.common.base_class import BaseAlgorithm

    found: dict[str, type] = {}
    for module_name in SB3_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for attr in dir(module):
            value = getattr(module, attr)
            if isinstance(value, type) and issubclass(value, BaseAlgorithm) and value is not BaseAlgorithm:
                found.setdefault(attr, value)
    return found


def sb3_algorithm(name: str) -> type | None:
    """The Stable-Baselines3 (or sb3-contrib) algorithm class called ``name`` (case, ``-``, ``_`` and an
    ``sb3-`` prefix ignored), or None."""
    wanted = _key(name)
    return next((cls for attr, cls in _sb3_algorithms().items() if _key(attr) == wanted), None)


def registered_agent(name: Any) -> str | None:
    """The registered agent ``name`` names, as registered: itself, or its lower case (`--agent GRPO` is grpo,
    as `--agent A2C` is SB3's A2C); None for a name registered as no agent."""
    agents = plugin_manager.registry("register_agents")
    if name in agents:
        return name
    return name.lower() if isinstance(name, str) and name.lower() in agents else None


def find_agent(name: str) -> Any:
    """The agent class for a registered name or a Stable-Baselines3 algorithm's name."""
    try:
        return plugin_manager.load_agent(registered_agent(name) or name)
    except UnknownNameError as exc:
        algorithm = sb3_algorithm(name) if isinstance(name, str) else None
        if algorithm is None:
            close = difflib.get_close_matches(
                str(name).lower(), [a.lower() for a in _sb3_algorithms()], n=1, cutoff=0.6
            )
            suggested = "Did you mean" in str(exc)
            hint = f" Did you mean Stable-Baselines3's {close[0]!r}?" if close and not suggested else ""
            exc.args = (
                f"{exc}{hint} Stable-Baselines3's (and sb3-contrib's) algorithms are named directly too: a2c, "
                f"dqn, ppo, sb3-recurrentppo, ...",
            )
            raise
        return algorithm


def is_agent_name(name: str) -> bool:
    return registered_agent(name) is not None or sb3_algorithm(name) is not None


def _agent_tables(agent: Mapping[str, Any]) -> dict[str, Any]:
    """The tables of an ``[agent]`` table that are agents' own (``[agent.grpo]``, ``[agent.A2C]``)."""
    return {k: v for k, v in agent.items() if isinstance(v, dict) and k not in RESERVED and is_agent_name(k)}


def _own_tables(tables: Mapping[str, Any], name: str, agent_class: Any) -> list[str]:
    """The keys of ``tables`` that hold agent ``name``'s hyperparameters, under any of its names."""
    return [key for key in tables if key == name or find_agent(key) is agent_class]


def own_table_key(agent: Mapping[str, Any], name: str) -> str | None:
    """The key of agent ``name``'s own table in an ``[agent]`` table, as the config spells it (``A2C`` for
    a2c, ``LMPPO`` for lmppo); None without one, or when ``name`` names no agent."""
    try:
        mine = _own_tables(_agent_tables(agent), name, find_agent(name))
    except UnknownNameError:
        return None
    return name if name in mine else next(iter(mine), None)


def hyperparameter_names(agent_class: Any) -> list[str] | None:
    """The hyperparameters an agent takes: its config dataclass's fields (LM agents) or its constructor's
    keyword arguments (SB3 algorithms); None when it takes any keyword."""
    if is_lm_agent(agent_class):
        return [f.name for f in dataclasses.fields(agent_class.config_class)]
    try:
        params = inspect.signature(agent_class.__init__).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return [
        n
        for n, p in params.items()
        if n not in ("self", "policy", "env")
        and not n.startswith("_")
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def _place(name: str, own: bool, entry: str | None, table: str | None = None) -> str:
    """Where a hyperparameter of agent ``name`` was set, for a message: its own table (``entry``, as a bench
    calls it, which names the agent itself; else ``[agent.<table>]``, as the config spells it, e.g.
    ``[agent.A2C]`` for a2c), or the shared ``[agent]`` table."""
    if entry is not None:
        return entry if own else "[agent]"
    return f"[agent.{table or name}]" if own else f"[agent] {name}"


def _check_values(
    name: str,
    agent_class: Any,
    hyperparameters: dict[str, Any],
    own: Mapping[str, Any],
    entry: str | None = None,
    table: str | None = None,
    complete: bool = True,
) -> None:
    """Every value of ``hyperparameters`` is one the agent takes: an LM agent's config dataclass checks them
    all; an SB3 algorithm's annotations its plainly typed ones (``n_steps: int``: SB3 reads ``batch_size =
    32.0`` only in its first update, a TypeError after the first rollout). ``own``: the keys from the agent's
    own table. Not ``complete`` (an agent this run does not train): a field without a default may be left
    out."""
    from textgym.config import annotation_mismatch

    if is_lm_agent(agent_class):  # its config dataclass checks every value now, before anything loads
        try:
            agent_class.config_class(**hyperparameters)
        except (ConfigError, TypeError) as exc:  # (TypeError: a plugin config's field without a default)
            if isinstance(exc, TypeError) and not complete:  # one that a run of that agent would give
                return
            # the table that set the value a message starts with ("clip_range must be ..."), else the agent
            key = re.match(r"[A-Za-z_]\w*", f"{exc}")
            key = key[0] if key and key[0] in hyperparameters else None
            if key is not None:
                raise ConfigError(f"{_place(name, key in own, entry, table)}: {exc}") from None
            raise ConfigError(f"{exc}" if entry is not None else f"[agent] {name}: {exc}") from None
    else:
        try:
            params = inspect.signature(agent_class.__init__).parameters
        except (TypeError, ValueError):
            params = {}
        for key, value in hyperparameters.items():
            if key in params and (what := annotation_mismatch(params[key].annotation, value)):
                raise ConfigError(
                    f"{_place(name, key in own, entry, table)}: {key} must be {what}, not {value!r}."
                )
    if "learning_rate" in hyperparameters:
        lr = hyperparameters["learning_rate"]
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            where = _place(name, "learning_rate" in own, entry, table)
            raise ConfigError(f"{where}: learning_rate must be a positive number, not {lr!r}.")


# other libraries' names for a hyperparameter (TRL's GRPO calls the KL coefficient beta, its PPO kl_coef)
ALSO_CALLED = {"kl_coef": "beta", "beta": "kl_coef", "init_kl_coef": "kl_coef", "num_train_epochs": "n_epochs",
               "num_ppo_epochs": "n_epochs", "cliprange": "clip_range", "epsilon": "clip_range"}  # fmt: skip


def _check_names(
    name: str,
    agent_class: Any,
    hyperparameters: dict[str, Any],
    own: Any,
    entry: str | None = None,
    table: str | None = None,
) -> None:
    """Every key of ``hyperparameters`` is one ``agent_class`` takes; ``own``: the keys that came from the
    agent's own table (``True``: all of them), for the message."""
    valid = hyperparameter_names(agent_class)
    if valid is None:
        return
    valid = [v for v in valid if v != "seed"]  # run.seed seeds a run (refused above)
    for key in hyperparameters:
        if key in valid:
            continue
        mine = own is True or key in own
        # the agent table's own keys (name, policy) are candidates too: agent.nam meant agent.name
        near = difflib.get_close_matches(key, [*valid, *RESERVED], n=1)
        # a table no hyperparameter is close to: [agent.<key>], meant for an agent
        if not mine and isinstance(hyperparameters[key], dict) and not near:
            agents = plugin_manager.registry("register_agents").names()
            close = difflib.get_close_matches(key, agents, n=1)
            hint = f" Did you mean [agent.{close[0]}]?" if close else ""
            raise ConfigError(
                f"[agent.{key}] names no known agent.{hint} Known agents: {', '.join(agents)} and "
                f"Stable-Baselines3's algorithms; an agent from a plugin file needs the file loaded "
                f"(--plugin FILE.py or run.plugins)."
            )
        if ALSO_CALLED.get(key) in valid:
            hint = f" {name} calls it {ALSO_CALLED[key]!r}."
        elif difflib.get_close_matches(key, ["seed"], n=1):
            hint = " Did you mean run.seed (a run's seed)?"
        else:
            hint = f" Did you mean {near[0]!r}?" if near else ""
        if mine:
            tables = ""
        elif entry is not None:
            tables = f" Hyperparameters of one agent only belong in its own table ({entry})."
        else:
            tables = (
                f" Hyperparameters of one agent only belong in its own table, e.g. [agent.{name}] or "
                f"[agent.<other agent>]."
            )
        raise ConfigError(
            f"{_place(name, mine, entry, table)}: unknown hyperparameter {key!r}.{hint} {name} takes: "
            f"{', '.join(sorted(valid))}.{tables}"
        )


def resolve_agent(agent: dict[str, Any], entry: str | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """``(agent_class, policy, hyperparameters)`` for the ``[agent]`` table of a validated config: shared keys,
    then the chosen agent's own table; every hyperparameter checked against what the agent takes. ``entry``:
    what the messages call the agent's own table where it is not ``[agent.<name>]`` (a bench's ``[[agents]]``
    entry; the bench's message names the agent)."""
    name = agent["name"]
    agent_class = find_agent(name)
    tables = _agent_tables(agent)
    mine = _own_tables(tables, name, agent_class)
    if len(mine) > 1:  # one would silently win over the other
        raise ConfigError(
            f"{' and '.join(f'[agent.{k}]' for k in mine)} both hold {name}'s hyperparameters: keep one table."
        )
    own = dict(tables[mine[0]]) if mine else {}
    table = mine[0] if mine else None  # as the config spells it: [agent.A2C] for a2c
    shared = {k: v for k, v in agent.items() if k not in RESERVED and k not in tables}
    own_policy = "policy" in own
    policy = own.pop("policy", agent.get("policy"))
    hyperparameters = {**shared, **own}
    if "seed" in hyperparameters:  # it would win over run.seed: a bench's seeds would train one run
        raise ConfigError(
            f"{_place(name, True, entry, table) if 'seed' in own else '[agent]'} sets seed, but a run is seeded "
            f"by run.seed (a bench sets it for each of its seeds); remove seed from the agent's table, and set "
            f"run.seed (in a bench: bench.seeds) instead."
        )
    _check_names(name, agent_class, hyperparameters, own=own, entry=entry, table=table)
    # this run's agent first: a shared value bad for every agent is named for it
    _check_values(name, agent_class, hyperparameters, own, entry, table)
    for key in [k for k in tables if k not in mine]:  # another agent's table too: a typo or a bad value in
        # it would wait, unseen, for the run that reads it (`--agent <it>`), and be copied into this run's
        # config.toml. Its values are checked with the shared ones it takes, as that run would take them.
        other, theirs = find_agent(key), {k: v for k, v in tables[key].items() if k != "policy"}
        _check_names(key, other, theirs, own=True)
        takes = hyperparameter_names(other)
        common = {k: v for k, v in shared.items() if takes is not None and k in takes and k != "seed"}
        _check_values(key, other, {**common, **theirs}, own=theirs, table=key, complete=False)
    if not is_lm_agent(agent_class):
        aliases = getattr(agent_class, "policy_aliases", {})
        if own_policy and policy not in aliases:
            raise ConfigError(
                f"{_place(name, True, entry, table)}: policy {policy!r} is not one of {name}'s policies: "
                f"{', '.join(aliases)}."
            )
        if not isinstance(policy, str) or policy not in aliases:
            # the env's observations are a dict: the agent's MultiInput policy (RecurrentPPO's is
            # MultiInputLstmPolicy); the LM policy name (if any) only picks the env's tokenizer
            policy = next((p for p in aliases if p.startswith("MultiInput")), None)
            # (without this, sb3-contrib's ARS failed once the env was made: "Policy MultiInputPolicy
            # unknown")
            if policy is None:
                raise ConfigError(
                    f"{name} has no policy for dict observations (its policies: {', '.join(aliases) or 'none'}), "
                    f"and textgym's envs observe a dict (token ids and an attention mask): choose another "
                    f"algorithm, e.g. ppo, a2c, dqn or recurrentppo."
                )
        if "policy_kwargs" in hyperparameters:
            where = _place(name, "policy_kwargs" in own, entry, table)
            hyperparameters["policy_kwargs"] = policy_kwargs(hyperparameters["policy_kwargs"], where)
    elif policy is None:
        raise ConfigError(
            "agent.policy is required: a zoo name (e.g. smollm2-135m-instruct) or a model directory."
        )
    return agent_class, policy, hyperparameters


def policy_kwargs(value: Any, where: str) -> dict[str, Any]:
    """An SB3 agent's ``policy_kwargs`` from a config, where a class is written by name (TOML has no
    classes): ``activation_fn = "Tanh"`` (or ``"nn.Tanh"``, ``"torch.nn.Tanh"``), ``optimizer_class =
    "RMSprop"``, any ``*_fn`` or ``*_class`` key as ``"package.module.Class"``. The config keeps the names."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: policy_kwargs must be a table, not {value!r}.")
    out = dict(value)
    for key, name in value.items():
        if key.endswith(("_fn", "_class")) and isinstance(name, str):
            out[key] = _named_class(name, f"{where}: policy_kwargs.{key}")
    return out


def _named_class(name: str, where: str) -> Any:
    """The class ``name`` names: one of torch.nn's or torch.optim's by its own name (``nn.`` and ``torch.``
    prefixes allowed), or any importable ``package.module.Class``."""
    bare = name.removeprefix("torch.").removeprefix("nn.").removeprefix("optim.")
    candidates = [("torch.nn", bare), ("torch.optim", bare)] if "." not in bare else []
    module, _, attribute = name.rpartition(".")
    if module:
        candidates.append((module, attribute))
        candidates.append((f"torch.{module}", attribute))  # "nn.ReLU"
    for module_name, attribute in candidates:
        try:
            found = getattr(importlib.import_module(module_name), attribute, None)
        except ImportError:
            continue
        if isinstance(found, type):
            return found
    import torch

    known = [n for module in (torch.nn, torch.optim) for n, v in vars(module).items() if isinstance(v, type)]
    same = [k for k in known if k.lower() == bare.lower()]  # "Relu" for "ReLU"
    hint = f" Did you mean {same[0]!r}?" if same else did_you_mean(bare, known)
    raise ConfigError(
        f"{where} = {name!r} names no class.{hint} Give a torch.nn or torch.optim class "
        f'by name ("ReLU", "nn.Tanh", "torch.optim.RMSprop") or an importable "package.module.Class".'
    )
