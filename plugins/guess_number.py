"""``guess_number``: a guessing game with feedback every turn, and a reward for solving it in few turns.

Each prompt's metadata holds the ``secret`` number. The agent guesses one number per turn; the responder
answers "Higher." or "Lower.", or "Correct!" and ends the episode. Solving on turn k is worth
``solve_reward - turn_penalty * (k - 1)`` (at least 0) as that turn's reward; a turn without a number gets
``invalid_reward`` and a reminder.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from textgym import Reply, hookimpl
from textgym.responders import Conversation

NUMBER = re.compile(r"-?\d+")


class GuessNumber:
    """The responder of the guessing game.

    Args:
        solve_reward: the reward for a correct guess on the first turn.
        turn_penalty: subtracted from ``solve_reward`` for every earlier turn.
        invalid_reward: the reward of a turn that holds no number.
        secret_key: the metadata key holding the secret number.
    """

    name = "guess_number"
    role = "user"

    def __init__(
        self,
        solve_reward: float = 1.0,
        turn_penalty: float = 0.1,
        invalid_reward: float = 0.0,
        secret_key: str = "secret",
    ):
        self.solve_reward, self.turn_penalty = float(solve_reward), float(turn_penalty)
        self.invalid_reward, self.secret_key = float(invalid_reward), secret_key

    def __call__(self, conversations: Sequence[Conversation]) -> list[Reply]:
        return [self.reply(c) for c in conversations]

    def reply(self, c: Conversation) -> Reply:
        if self.secret_key not in c.meta:
            raise ValueError(
                f"prompt {c.prompt[:50]!r} has no {self.secret_key!r} in its metadata; give each prompt the "
                f"secret number (e.g. the shipped 'guess_number' prompts)."
            )
        secret = int(c.meta[self.secret_key])
        found = NUMBER.search(c.last)
        if found is None:
            return Reply("Please answer with a whole number.", reward=self.invalid_reward)
        guess = int(found.group())
        if guess == secret:
            reward = max(0.0, self.solve_reward - self.turn_penalty * (c.agent_turns - 1))
            return Reply("Correct!", reward=reward, done=True)
        return Reply("Higher." if guess < secret else "Lower.")


@hookimpl
def register_responders(register: Callable[..., None]) -> None:
    register("guess_number", GuessNumber)


@hookimpl
def register_prompt_sources(register: Callable[..., None]) -> None:
    from textgym.prompts import DATA_DIR, read_prompt_file

    register("guess_number", lambda: read_prompt_file(DATA_DIR / "guess_number.jsonl"))
