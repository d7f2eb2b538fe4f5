"""What a multi-turn episode's responder sees and answers: a :class:`Conversation` (one episode when the
agent's turn ends), a :class:`Reply` to it, the :class:`Responder` protocol, and a batched function as a
responder. :mod:`textgym.responders` adapts other tools' envs and builds responders from specs."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from textgym.errors import TextgymError
from textgym.rewards import Turn

__all__ = [
    "AGENT_ROLE", "Conversation", "FunctionResponder", "Reply", "Responder", "ResponderError",
    "is_environment_role",
]  # fmt: skip

AGENT_ROLE = "assistant"


def is_environment_role(role: Any) -> bool:
    """Whether ``role`` may be a reply's role: a name, never the agent's (whose turns it generates)."""
    return isinstance(role, str) and bool(role) and role != AGENT_ROLE


class ResponderError(TextgymError):
    """A responder raised, or returned something other than one reply per conversation."""


@dataclass(frozen=True)
class Conversation:
    """What a responder sees of one episode when the agent's turn ends.

    Attributes:
        prompt: the prompt text (with the responder's opening, if ``start`` gave one).
        meta: whatever the prompt source attached to the prompt (a secret number, follow-up questions, ...):
            the episode's own copy, so what a responder changes in it stays in the episode.
        turns: every turn so far, the agent's latest last (:class:`~textgym.rewards.Turn`; the agent's role
            is ``"assistant"``). Before the first turn (in ``start``) it is empty.
        state: a dict that belongs to the responder for this episode (fresh at every episode start): where a
            stateful responder keeps e.g. its game or tool instance.
        last_turn: True when this is the agent's last allowed turn (``max_turns``, a TimeLimit's last step
            ended it, or the token budget is used up): the episode ends after it whatever the reply says, and
            the reply's text is not shown (its reward still counts).
        seed: this episode's seed, drawn from the env's generator: a responder with randomness (a game's
            secret) seeds from it, so that the env's ``reset(seed=...)`` replays the same episodes. The
            completions of one prompt in a group (``group_size``) share it.
    """

    prompt: str
    meta: Mapping[str, Any] = field(default_factory=dict)
    turns: tuple[Turn, ...] = ()
    state: dict[str, Any] = field(default_factory=dict)
    last_turn: bool = False
    seed: int | None = None

    @property
    def last(self) -> str:
        """The text of the agent's latest turn ("" before the first)."""
        return next((t.text for t in reversed(self.turns) if t.role == AGENT_ROLE), "")

    @property
    def agent_turns(self) -> int:
        """How many turns the agent has ended so far (its latest included)."""
        return sum(t.role == AGENT_ROLE for t in self.turns)


@dataclass(frozen=True)
class Reply:
    """A responder's answer to one conversation.

    Attributes:
        text: what the environment says next (tool result, game feedback, user message).
        reward: the reward of the agent's turn that just ended (None: 0). It arrives on the step that ended
            the turn; the reward stack still scores the whole conversation when the episode ends.
        done: end the episode now (the text is then not shown).
        role: the role of this reply in the chat template (default: the responder's ``role``).
        truncated: with ``done``, the episode is cut short, not finished (a wrapped env's time limit): it
            ends ``truncated`` with ``finish_reason = "max_turns"``, as the env's own turn limit ends one.
    """

    text: str
    reward: float | None = None
    done: bool = False
    role: str | None = None
    truncated: bool = False


@runtime_checkable
class Responder(Protocol):
    """Anything with a ``name`` that answers a batch of conversations: one :class:`Reply` or string each.
    May also have ``role``, ``start(conversations)``, ``end(conversations)`` and ``close()`` (see
    :mod:`textgym.responders`)."""

    name: str

    def __call__(self, conversations: Sequence[Conversation]) -> Sequence[Reply | str]: ...


class FunctionResponder:
    """A batched function ``fn(conversations, **kwargs) -> replies`` as a responder."""

    def __init__(
        self, name: str, fn: Callable[..., Sequence[Reply | str]], role: str = "user", **kwargs: Any
    ):
        self.name, self.fn, self.role, self.kwargs = name, fn, role, kwargs

    def __call__(self, conversations: Sequence[Conversation]) -> Sequence[Reply | str]:
        return self.fn(conversations, **self.kwargs)

    def __repr__(self) -> str:
        return f"FunctionResponder({self.name!r}, role={self.role!r})"
