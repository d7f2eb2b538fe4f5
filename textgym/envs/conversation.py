"""How a responder's reply becomes environment tokens, and how a multi-turn episode reads as text."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from textgym.errors import ConfigError
from textgym.formatting import one_line

# Sentinels rendered through the chat template to find where a message's content sits.
_USER, _AGENT, _REPLY = "TEXTGYMUSERTEXT", "TEXTGYMAGENTTEXT", "TEXTGYMREPLYTEXT"


class ReplyFormatter:
    """Token ids of a reply, as the chat template writes it after the agent's message.

    With a chat template, the reply is rendered as the template renders a ``role`` message after an
    assistant message, followed by the generation prompt of the next assistant message: for SmolLM2,
    ``"\\n<|im_start|>tool\\n= 42<|im_end|>\\n<|im_start|>assistant\\n"`` after an agent turn that ended on
    ``<|im_end|>`` (EOS). When the agent's turn ended on a stop string instead, the end of its message
    (``<|im_end|>``) is part of the environment's tokens. Without a chat template the reply's text is encoded
    as it is.
    """

    def __init__(self, tokenizer: Any, chat_template: bool):
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self._parts: dict[str, tuple[str, str, str]] = {}

    def encode(self, role: str, text: str, ending: str | None = None) -> list[int]:
        """The ids of a ``role`` reply ``text`` after an agent turn that ended on ``ending`` (the EOS token's
        text, the stop string, or None)."""
        if not self.chat_template:
            return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []
        return list(self.tokenizer.encode(self._before(role, ending) + text + self.parts(role)[2],
                                          add_special_tokens=False))  # fmt: skip

    def _before(self, role: str, ending: str | None) -> str:
        """The template's text between the agent's message and the reply. When the agent's turn ended on the
        end of its message (the EOS, or a stop string such as ``<|im_end|>`` where EOS is another token), that
        end is not written again."""
        close, head, _ = self.parts(role)
        if ending and close.startswith(ending) and self._leads(ending, close):
            close = close[len(ending) :]
        return close + head

    def _leads(self, ending: str, close: str) -> bool:
        """Whether ``close`` starts with the tokens of ``ending``: a stop string that is only the first
        characters of the end marker's special token (``<`` of ``<|im_end|>``) does not end the message."""
        ids = list(self.tokenizer.encode(ending, add_special_tokens=False))
        return list(self.tokenizer.encode(close, add_special_tokens=False))[: len(ids)] == ids

    def written(self, role: str, ids: list[int], text: str, ending: str | None = None) -> str:
        """The part of a reply ``text`` that ``ids`` (its encoding cut at the token budget) hold."""
        decoded = self.tokenizer.decode(ids)
        if self.chat_template:
            before = self._before(role, ending)
            decoded = decoded[len(before) :] if decoded.startswith(before) else ""
        k = 0
        while k < min(len(text), len(decoded)) and text[k] == decoded[k]:
            k += 1
        return text[:k]

    def parts(self, role: str) -> tuple[str, str, str]:
        """``(end of an assistant message, start of a role message, end of it + the next generation prompt)``
        as the template renders them, found once per role."""
        if role not in self._parts:
            base = [{"role": "user", "content": _USER}, {"role": "assistant", "content": _AGENT}]
            try:
                before = self.tokenizer.apply_chat_template(base, tokenize=False)
                after = self.tokenizer.apply_chat_template(
                    [*base, {"role": role, "content": _REPLY}], tokenize=False, add_generation_prompt=True
                )
            except Exception as exc:
                raise ConfigError(
                    f"the tokenizer's chat template cannot render a {role!r} message after an assistant message "
                    f"({type(exc).__name__}: {exc}); give the responder a role the template knows (e.g. "
                    f"role='user') or make the env with chat_template=False."
                ) from None
            new = after[len(before) :]
            if not after.startswith(before) or _AGENT not in before or new.count(_REPLY) != 1:
                raise ConfigError(
                    f"the tokenizer's chat template does not render a conversation as a prefix of its "
                    f"continuation, so a {role!r} reply cannot be appended token by token; make the env with "
                    f"chat_template=False and format replies in the responder."
                )
            head, _, tail = new.partition(_REPLY)
            self._parts[role] = (before[before.rindex(_AGENT) + len(_AGENT) :], head, tail)
        return self._parts[role]


def format_transcript(episode: Mapping[str, Any], width: int = 100) -> str:
    """A multi-turn episode (an info dict with ``prompt`` and ``turns``) as readable text: one line per turn,
    the agent's marked ``>``, the environment's ``<``, then the finish reason and the reward."""

    def cut(text: str) -> str:
        return one_line(text, width)

    lines = [f"prompt: {cut(episode['prompt'])}"]
    for turn in episode.get("turns", []):
        mark = ">" if turn["role"] == "assistant" else "<"
        lines.append(f"  {mark} {turn['role']:>9}: {cut(turn['text'])}")
    rewards = ", ".join(f"{r:g}" for r in episode.get("turn_rewards", []))
    reward = episode.get("reward")
    lines.append(
        f"  [{episode.get('finish_reason')}"
        + (f"; turn rewards {rewards}" if rewards else "")
        + (f"; reward {reward:.3f}" if reward is not None else "")
        + "]"
    )
    return "\n".join(lines)
