"""Building a registered plugin (a reward, a responder) from the arguments a user wrote: unknown arguments,
text where the factory's annotation wants a number, and a factory's own failures are one-line errors that
name the plugin."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from textgym.config import annotation_mismatch
from textgym.errors import PluginArgumentError, TextgymError, did_you_mean


def check_arguments(
    kind: str,
    name: str,
    factory: Callable[..., Any] | inspect.Signature,
    kwargs: Mapping[str, Any],
    spec_keys: Sequence[str] = (),
) -> None:
    """Raise :class:`PluginArgumentError` if ``factory`` (or a signature) does not take every key of
    ``kwargs``, with the closest valid key (``spec_keys``: the spec's own, e.g. ``weight``, count too)."""
    try:
        params = (
            factory if isinstance(factory, inspect.Signature) else inspect.signature(factory)
        ).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    valid = [p.name for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        own = f" (and the spec's {', '.join(spec_keys)})" if spec_keys else ""
        raise PluginArgumentError(
            f"{kind} {name!r} got unknown argument(s) {', '.join(map(repr, unknown))}."
            f"{did_you_mean(unknown[0], [*valid, *spec_keys])} Valid arguments: {', '.join(valid) or '(none)'}{own}."
        )


def check_value_types(kind: str, name: str, factory: Callable[..., Any], kwargs: Mapping[str, Any]) -> None:
    """Raise :class:`PluginArgumentError` for a value of one of TOML's types whose parameter is annotated as a
    number, a bool, a string or a list and that is not one (``sharp = 2`` for a bool, ``target = [0.3]`` for
    a float; a number where a string goes is the factory's to read, as match's ``reference = 5``), and
    for a text value whose unannotated parameter has a number or a bool as its default: text that TOML could
    not parse stays text (``penalty=two``, ``words=maybe``), and a factory that took it without a word would
    score with it. Called after the factory, whose own errors say more, and when it raised a TypeError, for
    the value that made it raise ("'<' not supported between 'str' and 'int'"): a factory's own ValueError
    says what it takes."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return
    for key, value in kwargs.items():
        # a config's values are TOML's types; from Python anything else (np.int64, a Path, None) is the
        # factory's to take
        if key not in params or type(value) not in (str, bool, int, float, list, dict):
            continue
        annotation, default = params[key].annotation, params[key].default
        if annotation is inspect.Parameter.empty:
            if not isinstance(value, str) or type(default) not in (bool, int, float):
                continue
            annotation = type(default)  # def exclaim(samples, per_mark=1.0): a number, as if annotated
        what = annotation_mismatch(annotation, value)
        if isinstance(default, str) and isinstance(value, str):  # scale: float = "auto" takes a word
            what = None
        if what and what.startswith("a string") and type(value) in (int, float):
            what = None  # a number where text goes (match's `reference = 5`): the factory's to read as text
        if what:
            raise PluginArgumentError(f"{kind} {name!r}: {key} must be {what}, not {value!r}.")


SCORED = (
    "samples",
    "prompts",
    "completions",
    "conversations",
)  # what a scoring function's first parameter is


def _check_not_a_scorer(kind: str, name: str, hook: str, factory: Any) -> None:
    """Raise :class:`PluginArgumentError` for a scoring function registered where its factory belongs (it
    then failed as "missing 1 required positional argument: 'samples'")."""
    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return
    first = next((p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)), None)
    if (
        inspect.isfunction(factory)
        and first is not None
        and first.default is first.empty
        and first.name in SCORED
    ):
        decorator = "@textgym.responder" if hook == "register_responders" else "@textgym.reward"
        raise PluginArgumentError(
            f"{kind} {name!r}: the plugin registered the function {factory.__name__}({first.name}, ...), which scores "
            f"a batch, where a factory belongs (a class, or a function returning the {kind}): register its class, "
            f"or put {decorator}({name!r}) on the function instead."
        )


def build_registered(kind: str, hook: str, name: str, kwargs: dict[str, Any], error: type[Exception]) -> Any:
    """Call the factory registered as ``name`` under ``hook`` (rewards, responders) with ``kwargs``: unknown
    arguments and a factory's TypeError/ValueError are :class:`PluginArgumentError`; what it returns must be
    callable (else ``error``) and carries ``name``, the name users type in configs."""
    from textgym import plugin_manager

    factory = plugin_manager.get(hook, name).value
    _check_not_a_scorer(kind, name, hook, factory)
    check_arguments(kind, name, factory, kwargs)
    try:
        built = factory(**kwargs)
    except PluginArgumentError:
        raise
    except (TypeError, ValueError) as exc:
        if isinstance(exc, TypeError):  # Python's own ("'<' not supported"): the annotation says more
            check_value_types(kind, name, factory, kwargs)
        raise PluginArgumentError(f"{kind} {name!r}: {exc}") from exc
    except TextgymError:
        raise
    except Exception as exc:  # the plugin's own failure (a judge it cannot reach): named, in one line
        raise error(f"{kind} plugin {name!r} could not be built: {type(exc).__name__}: {exc}") from exc
    check_value_types(kind, name, factory, kwargs)
    if not callable(built):
        raise error(f"{kind} plugin {name!r}: its factory returned {built!r}, which is not callable.")
    try:
        built.name = name
    except AttributeError:
        pass
    return built
