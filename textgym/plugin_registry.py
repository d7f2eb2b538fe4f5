"""The registries built from the plugins' hooks: one :class:`Registry` of :class:`Entry` per kind (rewards,
envs, agents, ...), each name checked as a plugin registers it; the envs handed on to Gymnasium; and
:func:`resolve` for things registered as ``"module:attribute"``. :mod:`textgym.plugin_manager` loads the
plugins and builds a registry from their hooks when one is asked for.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pluggy

from textgym.errors import DuplicateNameError, PluginError, UnknownNameError

__all__ = ["Entry", "Registry", "call_impl", "register_gym_envs", "resolve"]

# the keyword arguments each kind's register() takes (None: any, an env's defaults), and those it also
# takes by position, after the name and the value
EXTRAS: dict[str, set[str] | None] = {"env": None, "model": {"tokenizer_loader"}}
POSITIONAL: dict[str, tuple[str, ...]] = {"env": ("vector_entry_point",), "model": ("tokenizer_loader",)}
SPEC_KINDS = ("reward", "responder")  # named in spec strings ('NAME key=value ...'), which split on spaces


@dataclass(frozen=True)
class Entry:
    """One registered name: the thing itself, the plugin that registered it, and extra keyword arguments."""

    name: str
    value: Any
    plugin: str
    extra: dict[str, Any] = field(default_factory=dict)


class Registry:
    """Names of one kind (e.g. rewards) -> :class:`Entry`, with duplicate detection."""

    def __init__(self, kind: str, duplicate: Callable[[str, str], str] | None = None):
        self.kind = kind
        self._entries: dict[str, Entry] = {}
        # what to say of a name two plugins registered: which, where they came from, what to do
        self._duplicate = duplicate or (lambda first, later: f"by plugin {first!r} and by plugin {later!r}.")

    def add(self, name: str, value: Any, plugin: str, **extra: Any) -> None:
        spaced = (
            self.kind in SPEC_KINDS and isinstance(name, str) and any(c.isspace() or c == "=" for c in name)
        )
        if not isinstance(name, str) or not name or spaced:
            raise PluginError(
                f"plugin {plugin!r} registered a {self.kind} with an invalid name {name!r}: a {self.kind}'s name is "
                f"a non-empty string without spaces or '=' (a spec such as 'NAME weight=2' splits on them)."
            )
        if self.kind == "reward" and name.startswith("_"):  # (a spec naming it was refused, not the plugin)
            raise PluginError(
                f"plugin {plugin!r} registered the reward {name!r}: a reward's name cannot start with '_', which "
                f"Gymnasium's vector infos keep for their own masks; register it without the underscore."
            )
        allowed = EXTRAS.get(self.kind, set())
        unknown = sorted(extra.keys() - allowed) if allowed is not None else []
        if unknown:  # a register("x", X, weight=2) would otherwise be dropped without a word
            takes = f" takes only {', '.join(sorted(allowed))}" if allowed else " takes none"
            raise PluginError(
                f"plugin {plugin!r} registered {self.kind} {name!r} with {', '.join(unknown)}: a {self.kind}'s "
                f"register(){takes} (weights and arguments belong in the reward specs of a config)."
            )
        if self.kind in SPEC_KINDS and (takes := _object_not_factory(value)):
            cls = type(value).__name__
            raise PluginError(
                f"plugin {plugin!r} registered {self.kind} {name!r} as an instance of {cls}, which takes ({takes}): "
                f"register what makes one, called with a spec's arguments: register({name!r}, {cls}) (the class), "
                f"or a function that returns one."
            )
        if name in self._entries:
            first = self._entries[name].plugin
            raise DuplicateNameError(
                f"{self.kind} {name!r} is registered twice: {self._duplicate(first, plugin)}"
            )
        self._entries[name] = Entry(name, value, plugin, extra)

    def get(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise UnknownNameError(self.kind, name, self._entries) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries.values())


def _object_not_factory(value: Any) -> str | None:
    """The required positional parameters of a callable object (not a class or function) registered as a
    reward or responder: the reward itself, taking ``samples``, where its factory was meant. None otherwise."""
    if isinstance(value, type) or inspect.isroutine(value) or isinstance(value, functools.partial):
        return None
    try:
        params = inspect.signature(value).parameters.values()
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p.name for p in params if p.kind in positional and p.default is p.empty]
    return ", ".join(required) or None


def call_impl(impl: pluggy.HookImpl, reg: Registry) -> None:
    plugin = impl.plugin_name

    def register(name: str, value: Any, *args: Any, **extra: Any) -> None:
        names = POSITIONAL.get(reg.kind, ())
        if len(args) > len(names):
            raise PluginError(
                f"plugin {plugin!r} registered {reg.kind} {name!r} with {len(args)} more positional argument(s) "
                f"than a {reg.kind}'s register() takes: register(name, value"
                + "".join(f", {n}=None" for n in names)
                + ")."
            )
        for key, arg in zip(names, args):
            if key in extra:
                raise PluginError(f"plugin {plugin!r} registered {reg.kind} {name!r} with {key} given twice.")
            extra[key] = arg
        reg.add(name, value, plugin, **extra)

    try:
        impl.function(register=register)
    except (DuplicateNameError, PluginError):
        raise
    except Exception as exc:
        raise PluginError(f"plugin {plugin!r} failed in {impl.function.__name__}: {exc}") from exc


_gym_registered: set[str] = set()


def register_gym_envs(envs: Registry) -> None:
    """Register every env of ``envs`` (the env registry) with Gymnasium, once per id, and remove those no
    longer in it."""
    import gymnasium

    for env_id in sorted(_gym_registered - set(envs.names())):  # their plugin was unregistered
        gymnasium.registry.pop(env_id, None)
        _gym_registered.discard(env_id)
    for entry in envs:
        if entry.name in _gym_registered:
            continue
        try:
            gymnasium.envs.registration.parse_env_id(entry.name)
        except gymnasium.error.Error as exc:
            raise PluginError(
                f"plugin {entry.plugin!r} registered env id {entry.name!r}, which Gymnasium cannot parse ({exc}); "
                f"env ids look like 'myproject/MyTask-v0'."
            ) from None
        extra = dict(entry.extra)
        vector_entry_point = extra.pop("vector_entry_point", None)
        for point in (entry.value, vector_entry_point):
            if point is not None and not callable(point) and (not isinstance(point, str) or ":" not in point):
                raise PluginError(
                    f"plugin {entry.plugin!r} registered env {entry.name!r} with entry point {point!r}; give a "
                    f"class or a 'module:Class' string."
                )
        gymnasium.register(
            id=entry.name, entry_point=entry.value, vector_entry_point=vector_entry_point, kwargs=extra
        )
        _gym_registered.add(entry.name)


def resolve(value: Any) -> Any:
    """A registered thing, importing it first when it was registered as ``"module:attribute"`` (so that
    registering an agent does not import torch or Stable-Baselines3 at start-up)."""
    if isinstance(value, str) and ":" in value:
        module, _, attribute = value.partition(":")
        try:
            return getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as exc:
            raise PluginError(f"cannot import {value!r}: {exc}") from exc
    return value
