"""Typed exceptions. Every message names the bad value and says what to do instead."""

from __future__ import annotations

import difflib
import sys
from collections.abc import Iterable


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``" Did you mean 'x'?"`` for the known name closest to ``name``, or ``""``."""
    close = difflib.get_close_matches(str(name), list(known), n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def raised_in(exc: BaseException) -> str:
    """``" (at FILE:LINE in FUNCTION)"``: where user code raised ``exc``, for an error that wraps it in one
    line (a reward or responder that failed): the innermost frame outside textgym and the installed
    packages, else the innermost frame. ``""`` when ``exc`` carries no traceback."""
    import os
    import sysconfig
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    here = os.path.dirname(os.path.abspath(__file__))
    library = {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}

    def ours(path: str) -> bool:  # textgym's own code, Python's or an installed package's
        path = os.path.abspath(path)
        return path.startswith(here + os.sep) or any(path.startswith(p + os.sep) for p in library)

    frame = next((f for f in reversed(frames) if not ours(f.filename)), frames[-1])
    return f" (at {frame.filename}:{frame.lineno} in {frame.name})"


class TextgymError(Exception):
    """Base class of every error textgym raises on purpose."""


class UnknownNameError(TextgymError, LookupError):
    """A reward, env, agent, model, prompt-source or responder name that no plugin registered."""

    def __init__(self, kind: str, name: str, known: Iterable[str], where: str = ""):
        self.kind, self.name, self.known = kind, name, sorted(known)
        message = f"{where + ': ' if where else ''}unknown {kind} {name!r}."
        close = difflib.get_close_matches(str(name), self.known, n=1, cutoff=0.5)
        if close:
            message += f" Did you mean {close[0]!r}?"
        message += f" Known {kind}s: {', '.join(self.known) or '(none)'}."
        if kind in ("reward", "agent", "env", "prompt source", "model", "responder"):
            message += (
                " Run `textgym plugins` to see what each installed plugin registers; one defined in a plugin "
                "file is known once the file is loaded (--plugin FILE.py, or run.plugins in a config)."
            )
        super().__init__(message)

    def __str__(self) -> str:  # LookupError would quote the message like a KeyError
        return self.args[0]


class DuplicateNameError(TextgymError):
    """Two plugins registered the same name."""


class PluginError(TextgymError):
    """A plugin failed to load, or a plugin file is not usable."""


class PluginArgumentError(TextgymError, TypeError):
    """A plugin was built with an argument it does not take, or with a bad value."""


class RewardError(TextgymError):
    """A reward plugin raised, or returned something other than one finite float per sample."""


class PromptError(TextgymError, ValueError):
    """A prompt source is empty, unreadable, or a prompt does not fit."""


class ModelError(TextgymError):
    """A model or tokenizer cannot be loaded or is unusable as it is."""


class ConfigError(TextgymError, ValueError):
    """A configuration value is invalid."""


class RenderModeError(ConfigError, TypeError):
    """An env was asked for a render mode it lacks. A TypeError too, as for a keyword an env does not take:
    callers that try ``render_mode="rgb_array"`` first (SB3's ``make_vec_env``) catch it and go on without."""


class PairsError(TextgymError, ValueError):
    """A preference-pairs file is missing or unreadable, or one of its rows is unusable."""


class TrainingError(TextgymError):
    """Training cannot go on safely: an absurd reward, non-finite weights, a diverged update."""


class WriteError(TrainingError):
    """A run's file could not be written (a full disk, a directory that is not writable): the runs after it
    would fail alike, so a bench stops at it."""


class RunsFailed(TextgymError):
    """Runs of a bench failed: the bench ran the others and reported the designs whose runs all finished."""


class AnotherProcessFailed(TextgymError):
    """Mixed into the error a process of a several-process run raises because another process failed (it
    names that one): textgym's launcher (``run.processes = N``) blames the process that failed first for
    itself, not one that only followed it (see ``launch.FOLLOWED_EXIT``)."""


def user_stacklevel() -> int:
    """The ``stacklevel`` for a warning raised in textgym that points at the first caller outside textgym:
    the line of user code that made an agent, whatever the depth of the calls within textgym between."""
    frame, level = sys._getframe(1), 1  # the function that warns
    while frame.f_back is not None and frame.f_globals.get("__name__", "").startswith("textgym."):
        frame, level = frame.f_back, level + 1
    return level
