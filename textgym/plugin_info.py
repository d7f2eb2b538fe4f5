"""What the loaded plugins register, for ``textgym plugins``: one row per plugin, and what one name is."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from textgym.agent_config import is_lm_agent, registered_agent, sb3_algorithm
from textgym.errors import UnknownNameError
from textgym.plugin_manager import KINDS, describe_source, load_plugins, pm, registry, resolve


def plugins_report() -> list[dict[str, Any]]:
    """One dict per plugin: its name, where it came from, and the names it registered per hook."""
    load_plugins()
    rows: dict[str, dict[str, Any]] = {
        name: {"name": name, "source": describe_source(name), "registers": {}}
        for name, _ in pm.list_name_plugin()
    }
    for hook_name, kind in KINDS.items():
        for entry in registry(hook_name):
            rows[entry.plugin]["registers"].setdefault(kind, []).append(entry.name)
    return list(rows.values())


def describe(name: str) -> list[dict[str, Any]]:
    """What ``name`` is, per kind it is registered as (a reward and a responder may share one): the plugin
    and its source, the arguments it takes (its factory's or class's signature; an env's defaults as
    registered) and its docstring. Raises :class:`UnknownNameError` (with the closest names) for a name
    registered as nothing."""
    load_plugins()
    if not any(name in registry(h) for h in KINDS):
        name = registered_agent(name) or name  # `--agent GRPO` trains grpo: it is described too
    out = []
    for hook_name, kind in KINDS.items():
        if name not in registry(hook_name):
            continue
        entry = registry(hook_name).get(name)
        target = resolve(entry.value)
        try:
            signature = str(inspect.signature(target))
        except (TypeError, ValueError):  # (a builtin without one)
            signature = None
        # an env's registered defaults (a reward's or responder's extras are not arguments)
        defaults = (
            {k: v for k, v in entry.extra.items() if k != "vector_entry_point"} if kind == "env" else {}
        )
        if kind == "agent" and is_lm_agent(target):  # its hyperparameters: its config dataclass's fields
            # (seed is run.seed in a config: a bench seeds each of its runs)
            defaults = {
                f.name: _default(f) for f in dataclasses.fields(target.config_class) if f.name != "seed"
            }
        out.append({
            "kind": kind, "name": name, "plugin": entry.plugin, "source": describe_source(entry.plugin),
            "signature": signature, "defaults": defaults, "doc": inspect.getdoc(target) if callable(target) else None,
        })  # fmt: skip
    if not out and (algorithm := sb3_algorithm(name)) is not None:  # `--agent a2c` works: so does this
        out.append({
            "kind": "agent", "name": name, "plugin": algorithm.__module__.split(".")[0],
            "source": f"Stable-Baselines3 algorithm {algorithm.__module__}.{algorithm.__name__}",
            "signature": str(inspect.signature(algorithm.__init__)).replace("(self, ", "("), "defaults": {},
            "doc": (inspect.getdoc(algorithm) or "").split("\n\n")[0] or None,
        })  # fmt: skip
    if not out:
        every = {n: None for hook_name in KINDS for n in registry(hook_name).names()}
        raise UnknownNameError("plugin name", name, every)
    return out


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return "(required)"
