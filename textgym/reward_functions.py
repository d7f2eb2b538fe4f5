"""Plain Python functions as rewards: textgym's ``fn(samples, **kwargs)`` or TRL's reward-function signature
``fn(prompts, completions, completion_ids=None, **kwargs)``, given directly or named in a spec as
``fn = "path/to/file.py:func"`` or ``"module:func"``."""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import inspect
import math
import numbers
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from textgym.errors import ConfigError

if TYPE_CHECKING:
    from textgym.rewards import Reward, Sample

# The columns TRL passes to a reward function besides the dataset's own (TRL's GRPOTrainer._calculate_rewards).
TRL_COLUMNS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


class RewardLog:
    """What TRL-style functions logged while one batch of episodes was scored, through the ``log_metric`` and
    ``log_extra`` callables TRL passes them: per name, the sum and count of the metric's values (an LM agent
    logs their mean as ``rewards/<reward>/<name>``), and per column, each sample's value (by the sample's
    identity: an episode's info carries it as ``reward_extras``)."""

    def __init__(self) -> None:
        self.metrics: dict[str, tuple[float, int]] = {}
        self.extras: dict[str, dict[int, Any]] = {}


def add_to_sums(sums: dict[str, tuple[float, int]], name: str, total: float, count: int) -> None:
    """Add ``count`` values summing to ``total`` to ``name``'s (sum, count) in ``sums``: how a metric's
    values logged by ``log_metric`` are kept, per call, per env and over every process."""
    before_total, before_count = sums.get(name, (0.0, 0))
    sums[name] = (before_total + total, before_count + count)


_reward_log: contextvars.ContextVar[RewardLog | None] = contextvars.ContextVar(
    "textgym_reward_log", default=None
)


class RewardExtras(Mapping[str, Any]):
    """An episode's ``log_extra`` values, ``{"<reward>/<column>": value}``: a read-only mapping, not a ``dict``,
    so that a Gymnasium vector env's info keeps each sub-env's whole (its info arrays take a ``dict``'s
    entries apart into one array per key, typed by its first value: 0.5 after a 1 became 0, and a None after a
    number failed the step). ``dict(extras)`` is plain JSON."""

    def __init__(self, values: Mapping[str, Any]):
        self._values = dict(values)

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"RewardExtras({self._values!r})"


# the stack's name of the reward being called (validated_scores sets it): what its logs are named by
_component: contextvars.ContextVar[str] = contextvars.ContextVar(
    "textgym_reward_component", default="<reward>"
)


@contextlib.contextmanager
def _setting(var: contextvars.ContextVar[Any], value: Any) -> Iterator[Any]:
    """``var`` set to ``value`` within the block (``value`` is what ``with`` gives)."""
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


def reward_component(name: str) -> contextlib.AbstractContextManager[str]:
    return _setting(_component, name)


def reward_log() -> contextlib.AbstractContextManager[RewardLog]:
    """Collect what the TRL-style functions scored inside the block log (see :class:`RewardLog`)."""
    return _setting(_reward_log, RewardLog())


EXTRA_TYPES = (str, int, float, bool, type(None))  # what samples.jsonl holds as it is


def _loggers(samples: Sequence[Sample]) -> dict[str, Callable[..., None]]:
    """TRL's ``log_metric(name, value)`` and ``log_extra(column, values)`` for one call of a reward function
    (outside an episode's scoring, e.g. a stack called directly, what they are given is checked and dropped).
    Their errors are named with the reward by :func:`~textgym.reward_checks.validated_scores`."""
    from textgym.errors import RewardError

    log, reward = _reward_log.get(), _component.get()

    def log_metric(name: str, value: float) -> None:
        # (rewards/<x>/mean and /std are a reward component's columns, which headlines and plots read)
        if not isinstance(name, str) or not name or name.rsplit("/", 1)[-1] in ("mean", "std"):
            raise RewardError(
                f"log_metric({name!r}, ...) needs a name (a non-empty string that does not end in 'mean' or "
                f"'std' after its last /: textgym logs every reward's as rewards/{reward}/mean and /std)."
            )
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if not ok or not math.isfinite(float(value)):
            raise RewardError(f"log_metric({name!r}, {value!r}): the value must be a finite number.")
        if log is not None:
            add_to_sums(log.metrics, f"rewards/{reward}/{name}", float(value), 1)

    def log_extra(column: str, values: Sequence[Any]) -> None:
        if not isinstance(column, str) or not column:
            raise RewardError(f"log_extra({column!r}, ...) needs a column name (a string).")
        if (
            isinstance(values, (str, bytes))
            or not isinstance(values, Sequence)
            or len(values) != len(samples)
        ):
            raise RewardError(
                f"log_extra({column!r}, ...) got {str(values)[:60]!r}; give a list of one value per completion "
                f"({len(samples)})."
            )
        bad = next(
            (
                v
                for v in values
                if not isinstance(v, EXTRA_TYPES) or (isinstance(v, float) and not math.isfinite(v))
            ),
            None,
        )
        if bad is not None:  # (samples.jsonl holds them: JSON has no NaN or infinity)
            raise RewardError(
                f"log_extra({column!r}, ...) got a {type(bad).__name__} ({str(bad)[:40]!r}); each value must be "
                f"a string, a finite number, a bool or None."
            )
        if log is not None:
            log.extras.setdefault(f"{reward}/{column}", {}).update(
                {id(sample): value for sample, value in zip(samples, values)}
            )

    return {"log_metric": log_metric, "log_extra": log_extra}


class TRLCall:
    """The arguments TRL gave an exported reward function (:mod:`textgym.integrations.trl`), by row: a TRL-style
    function in the stack gets them as TRL gave them (conversational messages, ``trainer_state``,
    ``log_metric``), not rebuilt from the samples made of them."""

    def __init__(
        self, samples: Sequence[Sample], rows: Mapping[str, Sequence[Any]], other: Mapping[str, Any]
    ):
        self.row_of = {id(sample): i for i, sample in enumerate(samples)}
        self.samples = samples  # (kept alive: their ids are the keys)
        self.rows, self.other = rows, other

    def arguments(self, samples: Sequence[Sample]) -> dict[str, Any] | None:
        """TRL's arguments for ``samples`` (the rows they were made from), or None for other samples."""
        rows = [self.row_of.get(id(sample)) for sample in samples]
        if None in rows:
            return None
        return {**{key: [values[r] for r in rows] for key, values in self.rows.items()}, **self.other}


_trl_call: contextvars.ContextVar[TRLCall | None] = contextvars.ContextVar("textgym_trl_call", default=None)


def trl_call(call: TRLCall) -> contextlib.AbstractContextManager[TRLCall]:
    """While scoring the samples of one TRL call: TRL-style functions get TRL's own arguments."""
    return _setting(_trl_call, call)


class FunctionReward:
    """A reward made from a plain function: textgym's ``fn(samples, **kwargs)``, or TRL's reward-function
    signature ``fn(prompts, completions, completion_ids=None, **kwargs)`` (recognised by :func:`is_trl_style`),
    which receives lists and each metadata key as a keyword column (see :func:`trl_columns`), and
    ``trainer_state=None``; called through a stack exported to TRL, it gets TRL's own arguments instead.
    ``kwargs`` are fixed arguments passed on every call.
    """

    source: str | None = None  # where the function came from, for error messages ("file.py:func")

    def __init__(self, name: str, fn: Callable[..., Sequence[float | None]], **kwargs: Any):
        call = None if inspect.isfunction(fn) else type(fn).__dict__.get("__call__")  # a callable object's
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call):
            # (called, it returns a coroutine, which failed only at the first batch, as "not a list of scores")
            example = (  # in the function's own signature
                f"def {name}(prompts, completions, **kwargs): return asyncio.run(my_async(prompts, completions, "
                f"**kwargs))"
                if is_trl_style(fn)
                else f"def {name}(samples): return asyncio.run(my_async(samples))"
            )
            raise ConfigError(
                f"reward function {name!r} is async (async def): textgym calls rewards synchronously. Give a "
                f"plain function that runs it, e.g. {example}."
            )
        self.name, self.fn, self.kwargs = name, fn, kwargs
        self.trl_style = is_trl_style(fn)
        if self.trl_style:
            params = inspect.signature(fn).parameters
            self._accepts_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
            self._accepted = set(params)
            # a column the function requires by name, which a batch may lack (no sample has that key): TRL
            # always passes its dataset's columns, so it gets one of None, not a TypeError on some batches
            self._required = [
                n for n, p in params.items()
                if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            ]  # fmt: skip

    def __call__(self, samples: Sequence[Sample]) -> Sequence[float | None]:
        if not self.trl_style:
            return self.fn(samples, **self.kwargs)
        call = _trl_call.get()
        given = call.arguments(samples) if call is not None else None
        # trainer_state: TRL's training state, which textgym's own training has no equivalent of
        own = {**trl_columns(samples), "trainer_state": None, **_loggers(samples)}
        arguments = {**(given if given is not None else own), **self.kwargs}
        for name in self._required:
            arguments.setdefault(name, [None] * len(samples))
        if not self._accepts_any:
            arguments = {k: v for k, v in arguments.items() if k in self._accepted}
        return self.fn(**arguments)

    def __repr__(self) -> str:
        fn = getattr(self.fn, "__qualname__", repr(self.fn))
        return f"FunctionReward({self.name!r}, {fn}, **{self.kwargs!r})"


def function_reward(
    fn: Callable, name: str | None = None, source: str | None = None, **kwargs: Any
) -> FunctionReward:
    """``fn`` as a reward named ``name`` (default its ``__name__``); errors will name ``source``."""
    reward = FunctionReward(name or getattr(fn, "__name__", type(fn).__name__), fn, **kwargs)
    reward.source = (
        source or f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"
    )
    return reward


def as_reward(obj: Any) -> Reward:
    """A reward object as it is; a plain callable (no ``name``) wrapped and named from ``__name__``."""
    if callable(obj) and not hasattr(obj, "name"):
        return function_reward(obj)
    if not callable(obj) or not isinstance(getattr(obj, "name", None), str):
        raise ConfigError(
            f"{obj!r} is not a reward: give a function fn(samples) or fn(prompts, completions, **kwargs), "
            f"or an object with a `name` and `__call__(samples)`."
        )
    return obj


# -- loading functions named in specs -------------------------------------------------------------
def _is_file_target(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def load_function(ref: Any, base_dir: str | os.PathLike | None = None, where: str = "rewards") -> Callable:
    """The function named by ``"path/to/file.py:func"`` or ``"module:func"``.

    A relative file path resolves against ``base_dir`` (default: the current directory). The file is loaded
    like a ``--plugin`` file, once per process (again when it was edited since), so a file that also defines
    ``@textgym.reward`` functions or hooks is not imported twice.
    """
    form = "'path/to/file.py:function' or 'module:function'"
    if not isinstance(ref, str):
        raise ConfigError(f"{where}: fn = {ref!r} must be a function or a string, {form}.")
    target, _, attribute = ref.rpartition(":")
    if not target or not attribute:
        raise ConfigError(f"{where}: fn = {ref!r} must look like {form}.")
    if _is_file_target(target):
        module, what = _load_file(ref, target, base_dir, where), f"file {target!r}"
    else:
        what = f"module {target!r}"
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ConfigError(
                f"{where}: fn = {ref!r}: cannot import module {target!r} ({exc}). Name a module this Python "
                f"can import, or a .py file ('path/to/file.py:{attribute}')."
            ) from None
        except Exception as exc:
            raise ConfigError(
                f"{where}: fn = {ref!r}: module {target!r} failed to import: {type(exc).__name__}: {exc}"
            ) from exc
    obj: Any = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            defined = sorted(
                name
                for name, value in vars(module).items()
                if inspect.isfunction(value)
                and value.__module__ == module.__name__
                and not name.startswith("_")
            )
            raise ConfigError(
                f"{where}: fn = {ref!r}: {what} has no {attribute!r}. Functions defined there: "
                f"{', '.join(defined) or '(none)'}."
            )
        obj = getattr(obj, part)
    if inspect.isclass(obj) or not callable(obj):
        raise ConfigError(
            f"{where}: fn = {ref!r} is {'a class' if inspect.isclass(obj) else type(obj).__name__}, not a "
            f"function. Point fn at a function fn(samples) or fn(prompts, completions, **kwargs); a reward "
            f"class is registered as a plugin instead (docs/plugins.md)."
        )
    return obj


def _load_file(ref: str, target: str, base_dir: str | os.PathLike | None, where: str) -> Any:
    from textgym import plugin_manager
    from textgym.errors import PluginError

    base = Path(base_dir) if base_dir is not None else Path.cwd()
    path = Path(target).expanduser()
    file = (path if path.is_absolute() else base / path).resolve()
    if not file.is_file() or file.suffix != ".py":
        resolved = "" if path.is_absolute() else f" (relative paths resolve against {str(base.resolve())!r})"
        raise ConfigError(
            f"{where}: fn = {ref!r}: file {str(file)!r} does not exist or is not a .py file{resolved}."
        )
    try:
        name = plugin_manager.load_plugin_file(file)
    except PluginError as exc:
        raise ConfigError(f"{where}: fn = {ref!r}: {exc}") from exc
    return plugin_manager.pm.get_plugin(name)


def resolve_fn_paths(specs: Any, base_dir: str | os.PathLike) -> Any:
    """A copy of a stack spec with every relative ``fn`` file path made absolute against ``base_dir``, so
    the spec means the same from any working directory."""

    from textgym.rewards import parse_reward_spec

    def component(spec: Any) -> Any:
        if isinstance(spec, str) and "fn=" in spec:  # "fn=file.py:name weight=0.5": as a table, resolved
            parsed = parse_reward_spec(spec)
            resolved = component(parsed)
            return resolved if resolved != parsed else spec
        if isinstance(spec, Mapping) and isinstance(spec.get("fn"), str):
            return {**spec, "fn": resolve_file_ref(spec["fn"], base_dir)}
        return spec

    if isinstance(specs, Mapping) and isinstance(specs.get("components"), list):
        return {**specs, "components": [component(c) for c in specs["components"]]}
    if isinstance(specs, list):
        return [component(c) for c in specs]
    return component(specs)


def resolve_file_ref(ref: Any, base_dir: str | os.PathLike) -> Any:
    """``"path/to/file.py:name"`` with a relative file made absolute against ``base_dir``; a module reference
    (``"package.module:name"``), an absolute one, or anything else as it is."""
    target, sep, attribute = ref.rpartition(":") if isinstance(ref, str) else ("", "", "")
    if sep and _is_file_target(target) and not Path(target).expanduser().is_absolute():
        return f"{(Path(base_dir) / target).resolve()}:{attribute}"
    return ref


def is_trl_style(fn: Callable) -> bool:
    """True for a function with TRL's reward-function signature: it names ``prompts``, ``completions`` or
    ``completion_ids``, or takes nothing but ``**kwargs`` (it cannot take textgym's ``samples``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    only_kwargs = bool(params) and all(p.kind is p.VAR_KEYWORD for p in params.values())
    return only_kwargs or any(name in params for name in ("prompts", "completions", "completion_ids"))


def fixed_signature(fn: Callable) -> inspect.Signature | None:
    """The arguments a spec may fix for ``fn`` (all keyword-only): after ``samples`` for textgym's
    ``fn(samples, ...)``, all but TRL's own columns for a TRL-style function. None if it has no signature."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if is_trl_style(fn):
        params = [p for p in params if p.name not in TRL_COLUMNS]
    else:
        params = params[1:]
    return inspect.Signature(
        [
            p if p.kind is p.VAR_KEYWORD else p.replace(kind=p.KEYWORD_ONLY)
            for p in params
            if p.kind is not p.VAR_POSITIONAL
        ]
    )


def trl_columns(samples: Sequence[Sample]) -> dict[str, list[Any]]:
    """What TRL passes a reward function, built from textgym samples: ``prompts`` and ``completions`` as
    plain text (TRL's form for non-conversational data), ``completion_ids`` as lists of ints, and every
    metadata key of any sample as a column (one value per sample, None where a sample lacks the key)."""
    columns: dict[str, list[Any]] = {
        "prompts": [s.prompt for s in samples],
        "completions": [s.completion for s in samples],
        "completion_ids": [list(s.completion_ids) for s in samples],
    }
    for key in dict.fromkeys(k for s in samples for k in s.meta):
        # (TRL leaves a dataset's prompt, completion and completion_ids columns out of the keywords)
        if key not in TRL_COLUMNS and key not in ("prompt", "completion"):
            columns[key] = [s.meta.get(key) for s in samples]
    return columns
