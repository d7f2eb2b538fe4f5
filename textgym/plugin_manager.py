"""The plugin manager: built-ins, then the ``textgym`` entry-point group, then plugin files.

Everything textgym can name (rewards, envs, agents, prompt sources, models, responders) is registered
through the hooks in :mod:`textgym.hookspecs`, the built-ins exactly like third-party plugins. The
registries (:mod:`textgym.plugin_registry`) are rebuilt from the hooks whenever the set of plugins changes.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import os
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pluggy

from textgym import hookspecs
from textgym.errors import DuplicateNameError, PluginError, did_you_mean
from textgym.plugin_files import import_file, local_imports, plugin_dirs, read_bytes
from textgym.plugin_registry import Entry, Registry, call_impl, register_gym_envs, resolve

DEFAULT_PLUGINS = (
    "textgym.plugins.rm_score",
    "textgym.plugins.fluency",
    "textgym.plugins.safety",
    "textgym.plugins.length_penalty",
    "textgym.plugins.sentiment",
    "textgym.plugins.similarity",
    "textgym.plugins.match",
    "textgym.plugins.math",
    "textgym.plugins.calculator",
    "textgym.plugins.guess_number",
    "textgym.plugins.user_simulator",
    "textgym.plugins.echo",
    "textgym.prompts",
    "textgym.models",
    "textgym.envs.builtin",
    "textgym.agents",
)
ENTRY_POINT_GROUP = "textgym"
DISABLE_AUTOLOAD_VAR = "TEXTGYM_DISABLE_PLUGIN_AUTOLOAD"
# entry points not to load, by name, comma-separated: one broken package alone
BLOCK_VAR = "TEXTGYM_BLOCK_PLUGINS"
PLUGINS_VAR = "TEXTGYM_PLUGINS"

# hook name -> the word used for its names in messages
KINDS = {
    "register_rewards": "reward",
    "register_envs": "env",
    "register_agents": "agent",
    "register_prompt_sources": "prompt source",
    "register_models": "model",
    "register_responders": "responder",
}

pm = pluggy.PluginManager("textgym")
pm.add_hookspecs(hookspecs)

_sources: dict[str, str] = {}  # plugin name -> where it came from
_registries: dict[str, Registry] = {}
_loaded = False


def describe_source(plugin_name: str) -> str:
    return _sources.get(plugin_name, "registered in code")


def _changed() -> None:
    _registries.clear()
    register_gym_envs(registry("register_envs"))


def _duplicate(first: str, later: str) -> str:
    """Which two plugins registered one name, where they came from, and what to do (for :class:`Registry`)."""
    return (
        f"by plugin {first!r} ({describe_source(first)}) and by plugin {later!r} ({describe_source(later)}). "
        f"Rename one of them, or uninstall one plugin{_skip_hint(later, first)}."
    )


def register_plugin(plugin: object, name: str, source: str = "registered in code") -> None:
    """Register ``plugin`` (a module or object with ``@hookimpl`` functions) under ``name``."""
    load_plugins()
    if pm.has_plugin(name):
        raise DuplicateNameError(
            f"a plugin named {name!r} is already registered ({describe_source(name)}); choose another name."
        )
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:  # e.g. a hook whose parameter is not named `register`
        hint = (
            " Every textgym hook takes one parameter, named `register` (and no `self` in a function at a "
            "file's top level)."
            if "Argument(s)" in str(exc)
            else ""
        )
        raise PluginError(f"plugin {name!r} ({source}): {exc}.{hint}") from None
    _check_pending(name, source)
    _sources[name] = source
    _changed()


def _check_pending(name: str | None = None, source: str | None = None) -> None:
    """``check_pending`` with a message that names the plugin (as its ``source``: a file, an entry point),
    the closest hook name and the valid ones."""
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        if name is not None:
            pm.unregister(name=name)
        match = re.match(r"unknown hook '(\w+)'", str(exc))
        if match is None:
            raise PluginError(f"{exc}. textgym's hooks are: {', '.join(KINDS)}.") from exc
        where = source or f"plugin {name or getattr(exc, 'plugin', '?')!r}"
        raise PluginError(
            f"{where} defines a hook textgym does not have, {match[1]!r}.{did_you_mean(match[1], KINDS)} "
            f"textgym's hooks are: {', '.join(KINDS)}."
        ) from exc


def check_decorator_name(name: Any, decorator: str) -> None:
    """Raise TypeError where ``@textgym.reward`` (``decorator``) was used without its name: the bare decorator
    took the function for the name, registered nothing and replaced the function."""
    if callable(name):
        fn = getattr(name, "__name__", "f")
        raise TypeError(
            f"{decorator} takes the plugin's name: write {decorator}({fn!r}) above `def {fn}`, not {decorator} alone."
        )
    if not isinstance(name, str) or not name:
        raise TypeError(f"{decorator}(name): the name must be a non-empty string, not {name!r}.")


def check_decorated(fn: Any, decorator: str, hook: str) -> None:
    """Raise TypeError where ``decorator`` is put on a class: it decorates a batched function."""
    if inspect.isclass(fn):
        raise TypeError(
            f"{decorator} decorates a batched function, not the class {fn.__name__}: register a class from a "
            f"{hook} hook (docs/plugins.md)."
        )


def register_function_plugin(hook: str, name: str, factory: Callable[..., Any], fn: Callable[..., Any],
                             decorator: str) -> None:  # fmt: skip
    """Register ``factory`` as ``name`` under ``hook`` for the decorated function ``fn`` (``@textgym.reward``,
    ``@textgym.responder``). The plugin is named after ``fn``'s file and name, so the same file imported again
    (as a plugin file and as a module) replaces its registration instead of clashing with it."""
    from textgym.hookspecs import hookimpl

    def implementation(register: Callable[..., None]) -> None:
        register(name, factory)

    plugin = type("FunctionPlugin", (), {hook: staticmethod(hookimpl(implementation))})()
    file = inspect.getsourcefile(fn) or fn.__module__
    plugin_name = f"{file}::{fn.__name__}"
    if pm.has_plugin(plugin_name):
        unregister_plugin(plugin_name)
    register_plugin(plugin, name=plugin_name, source=f"{decorator} in {file}")


def unregister_plugin(name: str) -> None:
    """Remove the plugin registered under ``name`` (tests use this to clean up throwaway plugins)."""
    if pm.get_plugin(name) is None:
        raise PluginError(f"no plugin named {name!r} is registered.")
    pm.unregister(name=name)
    _sources.pop(name, None)
    _changed()


def load_plugin_file(path: str | os.PathLike) -> str:
    """Import a Python file as a plugin. It may define ``@hookimpl`` functions or ``@textgym.reward`` ones.

    Returns:
        The plugin name (the resolved path). Loading the same file again is a no-op while it is unchanged; a
        file edited since (in a notebook, between two runs) is imported again and replaces its registrations.
    """
    load_plugins()
    file = Path(path).expanduser().resolve()
    name = str(file)
    if not file.is_file() or file.suffix != ".py":
        if pm.has_plugin(name):
            return name  # (loaded before, and gone since: what was loaded stays)
        raise PluginError(f"plugin file {str(path)!r} does not exist or is not a .py file.")
    helpers = local_imports([file], roots=plugin_dirs)
    # the file and the local modules it imports, as they are now: an edit to either imports it again
    content = b"\0".join([file.read_bytes(), *(read_bytes(h) for h in helpers)])
    if pm.has_plugin(name):
        if _file_contents.get(name) == content:
            return name
        unregister_plugin(name)
    module = import_file(file, helpers, hooks=KINDS)
    register_plugin(module, name=name, source=f"file {name}")
    _file_contents[name] = content
    return name


_file_contents: dict[str, bytes] = {}  # each loaded plugin file's bytes and its local modules', as imported
_load_error: Exception | None = None
_distributions: dict[str, tuple[str, str]] = {}  # an entry-point plugin -> its distribution's name, version
# a plugin an entry point loaded (or its import registered) -> the entry point
_entry_points: dict[str, str] = {}
skipped: dict[str, str] = {}  # the entry points TEXTGYM_BLOCK_PLUGINS skipped -> where they are


def distribution_of(plugin: str) -> tuple[str, str] | None:
    """The installed distribution (name, version) whose entry point loaded ``plugin`` (also a function its
    import registered with ``@textgym.reward``), or None for a built-in, a file or a plugin registered in code."""
    return _distributions.get(plugin)


def entry_point_of(plugin: str) -> str | None:
    """The entry point that loaded ``plugin`` (or whose import registered it, a ``@textgym.reward``
    function), or None for a built-in, a file or a plugin registered in code."""
    return _entry_points.get(plugin)


def _normalised(name: str) -> str:
    """A distribution's name as pip compares them: ``Match_Plug`` is ``match-plug``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _skip_hint(*plugins: str) -> str:
    """How to skip an installed plugin of ``plugins`` (the later first), by the variable that names it."""
    installed = [_entry_points[p] for p in plugins if p in _entry_points]
    return f" (or skip it: {BLOCK_VAR}={installed[0]})" if installed else ""


def load_plugins() -> None:
    """Load built-ins, entry points and ``TEXTGYM_PLUGINS`` files, once. A plugin that fails to load is an
    error here and on every later lookup (``import textgym`` itself does not fail, so the CLI can say why in
    one line)."""
    global _loaded, _load_error
    if _load_error is not None:
        raise _load_error
    if _loaded:
        return
    _loaded = True
    try:
        _load_all()
    except Exception as exc:
        _load_error = exc
        raise


def _load_all() -> None:
    for module_name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
        _sources[module_name] = "built-in"
    if not os.environ.get(DISABLE_AUTOLOAD_VAR):
        blocked = {name.strip() for name in os.environ.get(BLOCK_VAR, "").split(",") if name.strip()}
        installed = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        _warn_unknown_blocked(blocked, installed)
        for ep in installed:
            dist = f"{ep.dist.name} {ep.dist.version}" if ep.dist else "unknown distribution"
            if ep.name in blocked:
                skipped[ep.name] = f"entry point {ep.value} in {dist}"
                continue
            if pm.has_plugin(ep.name):
                continue
            before = {name for name, _ in pm.list_name_plugin()}
            try:
                plugin = ep.load()
            except Exception as exc:
                raise PluginError(
                    f"plugin {ep.name!r} (entry point {ep.value} in {dist}) failed to load: "
                    f"{type(exc).__name__}: {exc}. Fix or uninstall it, or skip it: {BLOCK_VAR}={ep.name}."
                ) from exc
            if isinstance(plugin, type) and (hooks := _instance_hooks(plugin)):
                raise PluginError(
                    f"plugin {ep.name!r} (entry point {ep.value} in {dist}) names the class {plugin.__name__}, whose "
                    f"hooks take self ({', '.join(hooks)}): name a module, or an instance "
                    f"(`plugin = {plugin.__name__}()` in the module, and the entry point `...:plugin`); or uninstall "
                    f"it, or skip it: {BLOCK_VAR}={ep.name}."
                )
            try:
                pm.register(plugin, name=ep.name)
            except pluggy.PluginValidationError as exc:
                raise PluginError(
                    f"plugin {ep.name!r} (entry point {ep.value} in {dist}): {exc}. Fix or uninstall it, or skip "
                    f"it: {BLOCK_VAR}={ep.name}."
                ) from None
            _check_pending(
                ep.name,
                f"plugin {ep.name!r} (entry point {ep.value} in {dist}; fix or uninstall it, or skip it: "
                f"{BLOCK_VAR}={ep.name})",
            )
            _sources[ep.name] = f"entry point {ep.value} in {dist}"
            # (and the @textgym.reward functions its import registered, plugins of their own)
            added = {ep.name} | {name for name, _ in pm.list_name_plugin()} - before
            # (a module still being imported, whose import loaded the plugins: its decorators register later)
            importing = getattr(getattr(plugin, "__spec__", None), "_initializing", False)
            if added == {ep.name} and not pm.get_hookcallers(plugin) and not importing:
                _warn_registers_nothing(ep.name, f"entry point {ep.value} in {dist}", plugin)
            for name in added:
                _entry_points[name] = ep.name
                if ep.dist:
                    _distributions[name] = (ep.dist.name, ep.dist.version)
        _warn_other_groups()
    _check_pending()
    for path in filter(None, os.environ.get(PLUGINS_VAR, "").split(os.pathsep)):
        try:
            load_plugin_file(path)
        except PluginError as exc:
            raise PluginError(
                f"{exc} (it is named in {PLUGINS_VAR}: fix it or remove it from there)"
            ) from exc
    _changed()


def _instance_hooks(cls: type) -> list[str]:
    """The hook implementations of a class that are plain methods (they take ``self``: the class itself
    cannot be the plugin)."""
    marker = f"{pm.project_name}_impl"
    hooks = []
    for name in KINDS:
        value = inspect.getattr_static(cls, name, None)  # inherited too; a staticmethod stays one
        if inspect.isfunction(value) and hasattr(value, marker):
            first = next(iter(inspect.signature(value).parameters), None)
            if first == "self":
                hooks.append(name)
    return hooks


def _warn_unknown_blocked(blocked: set[str], installed: Any) -> None:
    """A ``TEXTGYM_BLOCK_PLUGINS`` name that no installed entry point has is said, with the entry point's
    name where a package's was given for it."""
    unknown = sorted(blocked - {ep.name for ep in installed})
    if not unknown or os.environ.get("RANK", "0") != "0":  # (said once, by the main process)
        return
    by_package = {_normalised(ep.dist.name): ep.name for ep in installed if ep.dist}
    hints = [
        f"{name!r} is the package of entry point {by_package[_normalised(name)]!r}"
        for name in unknown
        if _normalised(name) in by_package
    ]
    warnings.warn(
        f"{BLOCK_VAR} names {', '.join(map(repr, unknown))}, which no installed package's '{ENTRY_POINT_GROUP}' "
        f"entry point is called"
        + (
            f" ({'; '.join(hints)}): give the entry point's name."
            if hints
            else " (`textgym plugins` lists them)."
        ),
        stacklevel=3,
    )


def _warn_registers_nothing(name: str, source: str, plugin: object) -> None:
    """An installed plugin that implements no hook registers nothing: said, rather than its rewards and envs
    being just unknown, with the likely cause when its module is a folder without ``__init__.py``."""
    if os.environ.get("RANK", "0") != "0":
        return
    folders = list(getattr(plugin, "__path__", None) or [])
    cause = ""
    if getattr(plugin, "__file__", None) is None and folders:  # a namespace package
        folder = Path(folders[0]).resolve()
        where = "the current directory" if folder.parent == Path.cwd().resolve() else str(folder.parent)
        cause = (
            f": it imported as the folder {folder.name!r} in {where}, which has no __init__.py; a folder of the "
            f"package's name ahead of it on Python's path (the current directory, a script's) hides it: run from "
            f"another directory"
        )
    hooks = ", ".join(sorted(KINDS))
    warnings.warn(
        f"plugin {name!r} ({source}) implements none of textgym's hooks ({hooks}), so it registers "
        f"nothing{cause}.",
        stacklevel=2,
    )


def _warn_other_groups() -> None:
    """A package that declares its plugin in a group other than ``textgym`` (``textgym.plugins``,
    ``textgym_plugins``) is not loaded: said, rather than a reward that is just not found."""
    if os.environ.get("RANK", "0") != "0":  # said once, by the main process of a multi-process run
        return
    groups = importlib.metadata.entry_points().groups
    for group in sorted(groups):
        key = group.lower().replace("-", "_").replace(".", "_")
        if group != ENTRY_POINT_GROUP and key.startswith(f"{ENTRY_POINT_GROUP}_"):
            found = [f"{ep.name} = {ep.value}" for ep in importlib.metadata.entry_points(group=group)]
            warnings.warn(
                f"entry points in group {group!r} ({'; '.join(found)}) are not loaded: textgym loads the group "
                f"{ENTRY_POINT_GROUP!r} ([project.entry-points.{ENTRY_POINT_GROUP}] in pyproject.toml).",
                stacklevel=2,
            )


def registry(hook_name: str) -> Registry:
    """The registry built from every plugin's ``hook_name`` implementation, in loading order."""
    load_plugins()
    if hook_name not in _registries:
        reg = Registry(KINDS[hook_name], _duplicate)
        # Hook implementations are visited in registration order (pluggy *calls* them LIFO), so built-ins
        # come first and a duplicate is reported against the plugin that was loaded later.
        for impl in getattr(pm.hook, hook_name).get_hookimpls()[::-1]:
            call_impl(impl, reg)
        _registries[hook_name] = reg
    return _registries[hook_name]


def get(hook_name: str, name: str) -> Entry:
    """Shorthand: ``get("register_rewards", "sentiment")``."""
    return registry(hook_name).get(name)


def load_agent(name: str) -> Any:
    """The agent class registered as ``name``."""
    return resolve(get("register_agents", name).value)
