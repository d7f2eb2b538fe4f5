"""``user_simulator``: a scripted user who asks the follow-up questions stored in a prompt's metadata.

After the agent's k-th turn the user says the k-th follow-up (role ``user``); after the last one the episode
ends. The reward stack scores the whole conversation at the end (``Sample.turns``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from textgym import Reply, hookimpl
from textgym.responders import Conversation


class UserSimulator:
    """A user who asks each prompt's follow-up questions in order, then ends the conversation.

    Args:
        key: the metadata key holding the list of follow-ups (a prompt without it ends after one turn).
    """

    name = "user_simulator"
    role = "user"

    def __init__(self, key: str = "followups"):
        self.key = key

    def __call__(self, conversations: Sequence[Conversation]) -> list[Reply]:
        replies = []
        for c in conversations:
            followups = c.meta.get(self.key) or []
            if not isinstance(followups, (list, tuple)) or not all(isinstance(f, str) for f in followups):
                raise ValueError(f"metadata {self.key!r} must be a list of strings, not {followups!r}.")
            k = c.agent_turns
            replies.append(Reply(followups[k - 1]) if k <= len(followups) else Reply("", done=True))
        return replies


@hookimpl
def register_responders(register: Callable[..., None]) -> None:
    register("user_simulator", UserSimulator)


@hookimpl
def register_prompt_sources(register: Callable[..., None]) -> None:
    from textgym.prompts import DATA_DIR, read_prompt_file

    register("followups", lambda: read_prompt_file(DATA_DIR / "followups.jsonl"))
