"""The env of a ``textgym train`` config: its id checked, made as a ``TextGenVectorEnv``, its errors as
one-line :class:`~textgym.errors.ConfigError` s."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from textgym.errors import ConfigError, did_you_mean

__all__ = ["check_env_id", "check_env_keys", "check_sb3_rewards", "env_errors", "make_env"]


def check_env_id(env_id: str, allow_import: bool) -> None:
    """Only registered env ids: Gymnasium imports the module of a ``"module:Env-v0"`` id, which would run
    code the user never named as a plugin (``run.allow_env_import = true`` opts in)."""
    import gymnasium

    if ":" in env_id and not allow_import:
        raise ConfigError(
            f"env.id {env_id!r} would import module {env_id.split(':')[0]!r}: textgym only makes registered envs. "
            f"Register the env through a plugin (run.plugins), or set run.allow_env_import = true to allow it."
        )
    if ":" not in env_id and env_id not in gymnasium.registry:
        from textgym.errors import UnknownNameError

        raise UnknownNameError(
            "env", env_id, [k for k in gymnasium.registry if k.startswith("textgym/") or "/" in k]
        )


def check_sb3_rewards(config: dict[str, Any]) -> None:
    rewards = config["env"].get("rewards")
    if isinstance(rewards, dict) and rewards.get("aggregate", "sum") != "sum":
        raise ConfigError(
            "aggregate = 'normalize_then_sum' standardises rewards over a batch of episodes; Stable-Baselines3 "
            "agents score episodes step by step (a batch is whatever ends on one step): use 'sum', or an LM agent."
        )


def _env_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    kwargs = {k: v for k, v in config["env"].items() if k not in ("id", "num_envs")}
    policy = config["agent"]["policy"]
    if "model" not in kwargs and isinstance(policy, str):
        kwargs["model"] = policy  # the env tokenizes with the policy's tokenizer
    return kwargs


def make_env(config: dict[str, Any], num_envs: int, **extra: Any) -> Any:
    """The run's ``TextGenVectorEnv`` (``autoreset_mode="Disabled"``, for LM agents and sampling)."""
    import gymnasium

    kwargs = {**_env_kwargs(config), "autoreset_mode": "Disabled", **extra}
    with env_errors(config["env"]["id"]):
        env = gymnasium.make_vec(
            config["env"]["id"], num_envs=num_envs, vectorization_mode="vector_entry_point", **kwargs
        )
    from textgym.envs import TextGenVectorEnv

    if not isinstance(env, TextGenVectorEnv):
        raise ConfigError(
            f"[env] {config['env']['id']} made a {type(env).__name__}; textgym trains on envs whose vector entry "
            f"point is a TextGenVectorEnv."
        )
    return env


@contextlib.contextmanager
def env_errors(env_id: str) -> Iterator[None]:
    """Making the env of ``[env] id``: its errors as one-line ConfigErrors."""
    import gymnasium

    try:
        yield
    except TypeError as exc:  # an argument the env does not take
        raise ConfigError(f"[env] {env_id}: {exc}{_closest_env_key(env_id, str(exc))}") from exc
    except gymnasium.error.Error as exc:
        raise ConfigError(f"[env] id: {exc}") from exc
    except (ImportError, AttributeError) as exc:  # a plugin registered an entry point that does not import
        raise ConfigError(f"[env] {env_id} cannot be made: {type(exc).__name__}: {exc}") from exc


def check_env_keys(env_id: str, env: dict[str, Any]) -> None:
    """Every ``[env]`` key is an argument the env's entry point takes (when it names them), of the plain type
    its annotation names (``chat_template: bool | None``: the text "no" would count as true): what making the
    env would refuse or misread, said before anything loads or trains."""
    from textgym.config import annotation_mismatch

    params = _entry_parameters(env_id)
    if params is None:
        return
    for key, value in env.items():
        if key in ("id", "num_envs"):
            continue
        if key not in params:
            raise ConfigError(f"[env] {env_id}: unknown key {key!r}.{did_you_mean(key, list(params))}")
        if what := annotation_mismatch(params[key], value):
            raise ConfigError(f"[env] {env_id}: {key} must be {what}, not {value!r}.")


def _entry_parameters(env_id: str, registered: bool = True) -> dict[str, Any] | None:
    """The keyword arguments the env's (vector) entry point takes, with its registered ones (unless not
    ``registered``), and their annotations; None where it takes any, or cannot be read."""
    import importlib
    import inspect

    import gymnasium

    try:
        spec = gymnasium.spec(env_id)
        entry = spec.vector_entry_point or spec.entry_point
        if isinstance(entry, str):
            module, _, name = entry.partition(":")
            entry = getattr(importlib.import_module(module), name)
        params = inspect.signature(entry).parameters
    except Exception:
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return {
        **dict.fromkeys(spec.kwargs if registered else (), inspect.Parameter.empty),
        **{n: p.annotation for n, p in params.items()},
    }


def _closest_env_key(env_id: str, message: str) -> str:
    """ " Did you mean 'max_new_tokens'?" for an unexpected keyword argument the env's entry point lacks; a
    key the env's registration gave it (a plugin's register_envs) is said to come from there."""
    import re

    import gymnasium

    bad = re.search(r"unexpected keyword argument '(\w+)'", message)
    known = _entry_parameters(env_id, registered=False)
    if known is None or bad is None:
        return ""
    hint = did_you_mean(bad.group(1), list(known))
    if bad.group(1) in gymnasium.spec(env_id).kwargs:
        return (
            f" (the env's registration passes it, not [env]).{hint} Fix the plugin that registers {env_id}."
        )
    return f".{hint}" if hint else ""
