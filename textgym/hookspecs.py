"""Every extension point of textgym: one ``register_*`` hook each.

A plugin implements any of these with ``@textgym.hookimpl`` and calls ``register`` once per thing it adds.
Names are global: registering a name that another plugin already registered is an error naming both.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

hookspec = pluggy.HookspecMarker("textgym")
hookimpl = pluggy.HookimplMarker("textgym")


@hookspec
def register_rewards(register: Callable[..., None]) -> None:
    """Register reward plugins.

    Args:
        register: ``register(name, factory)``. ``factory(**kwargs)`` builds a reward: an object with ``name``
            and ``__call__(samples) -> list[float]``. The keyword arguments are the keys of a reward spec
            other than ``name`` and ``weight``, e.g. ``{name = "length_penalty", target = 64}``.
    """


@hookspec
def register_envs(register: Callable[..., None]) -> None:
    """Register environments; each is also registered with Gymnasium under the same id.

    Args:
        register: ``register(env_id, entry_point, vector_entry_point=None, **defaults)``. ``env_id`` looks like
            ``"myproject/MyTask-v0"``; ``defaults`` become the env's default keyword arguments.
    """


@hookspec
def register_agents(register: Callable[..., None]) -> None:
    """Register agents.

    Args:
        register: ``register(name, agent_class)``. The class follows the Stable-Baselines3 contract:
            ``agent_class(policy, env, **hyperparameters)``, ``learn``, ``predict``, ``save`` and ``load``.
    """


@hookspec
def register_prompt_sources(register: Callable[..., None]) -> None:
    """Register named prompt sets.

    Args:
        register: ``register(name, factory)``. ``factory()`` returns a list of prompts: strings, or dicts with
            a ``prompt`` key and any metadata (``reference``, ``topic``, ...).
    """


@hookspec
def register_models(register: Callable[..., None]) -> None:
    """Register named models for the model zoo.

    Args:
        register: ``register(name, loader, tokenizer_loader=None)``. ``loader()`` returns ``(model, tokenizer)``;
            ``tokenizer_loader()``, when given, returns the tokenizer alone without loading weights.
    """


@hookspec
def register_responders(register: Callable[..., None]) -> None:
    """Register responders: the environment's side of multi-turn episodes (tool results, game feedback, a
    user's next message).

    Args:
        register: ``register(name, factory)``. ``factory(**kwargs)`` builds a responder: an object with ``name``
            and ``__call__(conversations) -> list[Reply | str]``, one reply per conversation, and optionally
            ``role``, ``start(conversations)`` and ``close()`` (see :mod:`textgym.responders`). The keyword
            arguments are the keys of a responder spec other than ``name``, e.g.
            ``{name = "guess_number", turn_penalty = 0.2}``.
    """
