"""``echo``: a small-vocabulary multi-turn task: say back each word the environment says.

Each prompt's metadata holds ``words``; the prompt is the first. After each agent turn the responder rewards
it (1 for an exact echo, or the string similarity with ``partial``) and says the next word; after the last
word the episode ends. The agent has to read the environment's tokens to do well, so it is the smallest
task on which a multi-turn agent visibly learns (``textgym/Echo-v0``, ``chars`` vocabulary).
"""

from __future__ import annotations

import difflib
import random
from collections.abc import Callable, Sequence
from typing import Any

from textgym import Reply, hookimpl
from textgym.responders import Conversation


class Echo:
    """Say back the last word.

    Args:
        partial: reward the string similarity in [0, 1] (difflib's ratio) instead of 1/0 for an exact echo.
        key: the metadata key holding the words (the prompt is the first).
    """

    name = "echo"
    role = "user"

    def __init__(self, partial: bool = False, key: str = "words"):
        self.partial, self.key = partial, key

    def __call__(self, conversations: Sequence[Conversation]) -> list[Reply]:
        replies = []
        for c in conversations:
            words = c.meta.get(self.key)
            if not words or isinstance(words, str):
                raise ValueError(
                    f"prompt {c.prompt[:40]!r} needs a list of words in its metadata {self.key!r}."
                )
            k = c.agent_turns
            target = words[min(k, len(words)) - 1]
            said = c.last.strip()
            if self.partial:
                reward = difflib.SequenceMatcher(None, said, target, autojunk=False).ratio()
            else:
                reward = float(said == target)
            done = k >= len(words)
            replies.append(Reply("" if done else words[k], reward=reward, done=done))
        return replies


def echo_prompts(
    n: int = 64, turns: int = 3, length: int = 1, alphabet: str = "abcd", seed: int = 0
) -> list[dict[str, Any]]:
    """``n`` prompts of ``turns`` random words of ``length`` letters each; the prompt is the first word."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        words = ["".join(rng.choice(alphabet) for _ in range(length)) for _ in range(turns)]
        prompts.append({"prompt": words[0], "words": words})
    return prompts


@hookimpl
def register_responders(register: Callable[..., None]) -> None:
    register("echo", Echo)


@hookimpl
def register_prompt_sources(register: Callable[..., None]) -> None:
    register("echo", echo_prompts)
