"""The env's calls of its responder: each reply, opening and end checked, every error naming the responder
(:class:`~textgym.responders.ResponderError`)."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from textgym.conversation import (
    AGENT_ROLE,
    Conversation,
    Reply,
    Responder,
    ResponderError,
    is_environment_role,
)
from textgym.errors import TextgymError, raised_in

__all__ = ["notify_end", "validated_openings", "validated_replies"]


def reply_role(reply: Reply, responder: Responder) -> str:
    """The role a reply is written with: its own, or its responder's (``"user"`` when it names none)."""
    return getattr(responder, "role", "user") if reply.role is None else reply.role


def _label(responder: Responder) -> str:
    return f"responder {getattr(responder, 'name', responder)!r}"


def _call(responder: Responder, method: Callable[..., Any], conversations: Sequence[Conversation],
          where: str = "") -> Any:  # fmt: skip
    """``method(conversations)`` (the responder itself, or its ``start``/``end``); an exception it raises is a
    :class:`ResponderError` that names the responder and ``where`` (``" in start()"``)."""
    try:
        return method(conversations)
    except TextgymError:
        raise
    except Exception as exc:
        raise ResponderError(
            f"{_label(responder)} raised {type(exc).__name__}{where}{raised_in(exc)}: {exc}"
        ) from exc


def validated_replies(responder: Responder, conversations: Sequence[Conversation]) -> list[Reply]:
    """Call ``responder`` and check its output: one :class:`Reply` or string per conversation, with a string
    text, a finite reward or None, and a bool ``done``. Every error names the responder."""
    label = _label(responder)
    out = _call(responder, responder, conversations)
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
        raise ResponderError(
            f"{label} returned {type(out).__name__} {str(out)[:80]!r}; it must return a list with one reply "
            f"(a string or a textgym.Reply) per conversation."
        )
    if len(out) != len(conversations):
        raise ResponderError(
            f"{label} returned {len(out)} replies for {len(conversations)} conversations; it must return exactly "
            f"one per conversation."
        )
    replies = []
    for i, reply in enumerate(out):
        if isinstance(reply, str):
            reply = Reply(reply)
        where = f"for conversation {i} (agent's turn {conversations[i].last[:60]!r})"
        if not isinstance(reply, Reply) or not isinstance(reply.text, str):
            bad = reply.text if isinstance(reply, Reply) else reply
            raise ResponderError(
                f"{label} returned {type(bad).__name__} {bad!r} {where}; a reply must be a string or a "
                f"textgym.Reply whose text is a string."
            )
        # numpy scalars (np.float32, np.bool_) are taken, as from a reward plugin
        reward, done = reply.reward, reply.done
        if reward is not None:
            ok = isinstance(reward, numbers.Real) and not isinstance(reward, (bool, np.bool_))
            try:
                value, shown = (float(reward) if ok else math.nan), repr(reward)[:60]
            except OverflowError:
                value, shown = math.inf, "an int past float's range"
            if not math.isfinite(value):
                raise ResponderError(
                    f"{label} returned reward {shown} {where}; a turn reward must be a finite number or None."
                )
            reward = value
        for flag, value in (("done", done), ("truncated", reply.truncated)):
            if not isinstance(value, (bool, np.bool_)):
                raise ResponderError(f"{label} returned {flag}={value!r} {where}; it must be True or False.")
        if reply.truncated and not done:  # truncated says how an episode ends: alone it would be dropped
            raise ResponderError(
                f"{label} returned truncated=True without done=True {where}; truncated marks an episode the "
                f"reply ends as cut short: give done=True with it."
            )
        role = reply_role(reply, responder)
        if not is_environment_role(role):
            raise ResponderError(
                f"{label} replied with role {role!r} {where}; a reply's role is the environment's (\"user\", "
                f'"tool", ...), never the agent\'s {AGENT_ROLE!r}, whose turns are the ones it generates.'
            )
        replies.append(
            dataclasses.replace(reply, reward=reward, done=bool(done), truncated=bool(reply.truncated))
        )
    return replies


def validated_openings(responder: Responder, conversations: Sequence[Conversation]) -> list[str | None]:
    """Call ``responder.start`` when it has one: a string (appended to the prompt) or None per conversation."""
    start = getattr(responder, "start", None)
    if not callable(start):
        return [None] * len(conversations)
    label = _label(responder)
    out = _call(responder, start, conversations, " in start()")
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence) or len(out) != len(conversations):
        raise ResponderError(
            f"{label}: start() returned {str(out)[:80]!r}; it must return a list with one opening (a string or "
            f"None) per conversation ({len(conversations)})."
        )
    for opening in out:
        if opening is not None and not isinstance(opening, str):
            raise ResponderError(
                f"{label}: start() returned {type(opening).__name__} {opening!r}; an opening must be a string or None."
            )
    return list(out)


def notify_end(responder: Responder, conversations: Sequence[Conversation]) -> None:
    """Call ``responder.end`` when it has one: these episodes are over."""
    end = getattr(responder, "end", None)
    if callable(end):
        _call(responder, end, conversations, " in end()")
