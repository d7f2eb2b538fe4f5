"""Importing a plugin file (:func:`import_file`), and the local modules it imports: found by reading its
imports (:func:`local_imports`, which a bench digests too), and imported again when one was edited since (a
plugin file loaded twice in one process, as in a notebook, would otherwise run the new file on the old modules
that ``sys.modules`` keeps)."""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterable, Sequence
from pathlib import Path

from textgym.errors import PluginError

__all__ = ["forget_edited", "import_file", "local_imports", "plugin_dirs", "read_bytes", "track_imported"]

plugin_dirs: list[Path] = []  # the directories plugin files were loaded from: on sys.path, in that order


def import_file(file: Path, helpers: Sequence[Path], hooks: Iterable[str]) -> types.ModuleType:
    """Import the plugin ``file`` (resolved) as a module, first forgetting the local ``helpers`` it imports
    that were edited since; refuse one that defines a hook function (one of ``hooks``) without
    ``@textgym.hookimpl``, which pluggy would never call."""
    name = str(file)
    forget_edited(helpers)
    # one name per file in every process (hash() differs per process), and in sys.modules while it runs:
    # dataclasses (with postponed annotations) and pickle look a class's module up there
    module_name = f"textgym_plugin_{hashlib.sha256(name.encode()).hexdigest()[:16]}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise PluginError(f"plugin file {name!r} cannot be imported as a Python module.")
    module = importlib.util.module_from_spec(spec)
    if str(file.parent) not in sys.path:  # the file may import modules that sit next to it, as a script can
        sys.path.append(str(file.parent))
    if file.parent not in plugin_dirs:
        plugin_dirs.append(file.parent)
    before = set(sys.modules)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise PluginError(f"plugin file {name!r} failed to import: {type(exc).__name__}: {exc}") from exc
    finally:
        track_imported(before, helpers)
    for hook in hooks:
        function = getattr(module, hook, None)
        if callable(function) and not hasattr(function, "textgym_impl"):
            raise PluginError(
                f"plugin file {name!r} defines {hook}() without @textgym.hookimpl, so textgym would never call it: "
                f"put @textgym.hookimpl on the line above `def {hook}`."
            )
    return module


def forget_edited(helpers: Sequence[Path]) -> None:
    """Before a plugin file is imported (again): drop the modules among its ``helpers`` that were edited
    since a plugin file imported them, so that its import runs them as they are now."""
    for key, (origin, imported) in list(_helper_modules.items()):
        if key in _helper_modules and origin in helpers and read_bytes(origin) != imported:
            _forget_module(key)


def track_imported(before: set[str], helpers: Sequence[Path]) -> None:
    """After a plugin file's import: remember the local modules it brought in (not textgym, not what was
    imported before), with the bytes imported."""
    for key in set(sys.modules) - before:
        origin = getattr(sys.modules.get(key), "__file__", None)
        if origin and Path(origin).resolve() in helpers:
            _helper_modules[key] = Path(origin).resolve(), read_bytes(Path(origin))


# the sys.modules keys that plugin files imported first, with their files and the bytes imported
_helper_modules: dict[str, tuple[Path, bytes]] = {}


def _forget_module(key: str) -> None:
    """Drop a local module from ``sys.modules`` so that the next import runs it as it is now, with its whole
    local package: a package dropped without its submodules would be imported again without them (``import
    pkg.sub`` finds ``pkg.sub`` cached and never sets ``pkg.sub`` on the new ``pkg``), and a submodule
    dropped while its package stays is still served as the package's attribute (``from pkg import sub``)."""
    top = key.split(".")[0]
    root = top if top in _helper_modules else key  # (a namespace package has no file to track)
    for name in [n for n in sys.modules if n == root or n.startswith(root + ".")]:
        sys.modules.pop(name, None)
        _helper_modules.pop(name, None)
    parent, _, child = root.rpartition(".")
    if parent in sys.modules:
        with contextlib.suppress(AttributeError):
            delattr(sys.modules[parent], child)


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def local_imports(files: Sequence[str | os.PathLike], roots: Sequence[Path] = ()) -> list[Path]:
    """The local modules that plugin (or ``fn``) ``files`` import, at any depth: the ``.py`` files (and
    packages' ``__init__.py``) that their ``import`` statements name, found as Python finds them once the
    files are loaded: in each file's directory, which joins ``sys.path``, and in ``roots`` (other plugin
    files' directories, on ``sys.path`` too); relative imports from a package's directory. Read from the
    source (``ast``); installed packages are not looked for, nor a name given to ``importlib`` at run time."""
    given = [Path(f).expanduser().resolve() for f in files]
    dirs = list(dict.fromkeys([*(g.parent for g in given), *(Path(r).resolve() for r in roots)]))
    seen: set[Path] = set()
    found: list[Path] = []

    def visit(file: Path) -> None:
        if file in seen or not file.is_file():
            return
        seen.add(file)
        if file not in given:
            found.append(file)
        try:
            tree = ast.parse(file.read_bytes())
        except (OSError, SyntaxError, ValueError, RecursionError, MemoryError):  # (loading it says why)
            return
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [(base, alias.name.split(".")) for alias in node.names for base in dirs]
            elif isinstance(node, ast.ImportFrom):
                module = node.module.split(".") if node.module else []
                if not node.level:
                    bases = dirs
                elif node.level <= len(file.parents):
                    bases = [file.parents[node.level - 1]]
                else:
                    continue
                # (an imported name may be a module of the package)
                targets = [(base, [*module, alias.name]) for alias in node.names for base in bases]
            else:
                continue
            for base, parts in targets:
                # importing a.b.c runs a/__init__.py, a/b/__init__.py, a/b/c
                for i in range(1, len(parts) + 1):
                    place = base.joinpath(*parts[:i])
                    visit(place.with_name(place.name + ".py"))
                    visit(place / "__init__.py")

    for path in given:
        visit(path)
    return found
