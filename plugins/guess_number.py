"""``guess_number``: a guessing game with feedback every turn, and a reward for solving it in few turns.

Each prompt's metadata holds the ``secret`` number. The agent guesses one number per turn; the responder
answers "Higher." or "Lower.", or "Correct!" and ends the episode. Solving on turn k is worth
``solve_reward - turn_penalty * (k - 1)`` (at least 0) as that turn's reward; a turn that does not hold
exactly one whole number (none, "7.5", "between 1 and 10: 7") gets ``invalid_reward`` and a reminder.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

from textgym import Reply, hookimpl
from textgym.responders import Conversation

# a number as written: thousands separated by commas, decimals, an exponent; a guess is one that is whole
NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?")
WHOLE = re.compile(r"-?\d{1,3}(?:,\d{3})+|-?\d+")


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
        values = {
            "solve_reward": solve_reward,
            "turn_penalty": turn_penalty,
            "invalid_reward": invalid_reward,
        }
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{key} must be a finite number, not {value!r}.")
        if turn_penalty < 0:  # a later solve would pay more
            raise ValueError(f"turn_penalty must be >= 0 (fewer turns pay more), not {turn_penalty}.")
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
        secret = _whole(c.meta[self.secret_key])
        if secret is None:
            raise ValueError(
                f"prompt {c.prompt[:50]!r}: its {self.secret_key!r} must be a whole number, not "
                f"{c.meta[self.secret_key]!r}."
            )
        numbers = NUMBER.findall(c.last)
        if len(numbers) != 1 or not WHOLE.fullmatch(numbers[0]):  # "7.5" was read as 7, "1 and 10: 7" as 1
            return Reply("Please answer with one whole number.", reward=self.invalid_reward)
        guess = int(numbers[0].replace(",", ""))
        if guess == secret:
            reward = max(0.0, self.solve_reward - self.turn_penalty * (c.agent_turns - 1))
            return Reply("Correct!", reward=reward, done=True)
        return Reply("Higher." if guess < secret else "Lower.")


def _whole(value: object) -> int | None:
    """``value`` (7, 7.0, "7") as an int, exactly (a float holds integers up to 2^53 only); None for anything
    else (7.9 was cut to 7)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    text = str(value).strip()
    if WHOLE.fullmatch(text):
        return int(text.replace(",", ""))
    try:
        number = float(text)
    except ValueError:
        return None
    return int(number) if math.isfinite(number) and number.is_integer() else None


@hookimpl
def register_responders(register: Callable[..., None]) -> None:
    register("guess_number", GuessNumber)


@hookimpl
def register_prompt_sources(register: Callable[..., None]) -> None:
    from textgym.prompts import DATA_DIR, read_prompt_file

    register("guess_number", lambda: read_prompt_file(DATA_DIR / "guess_number.jsonl"))
