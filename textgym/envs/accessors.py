"""What ``TextGenEnv`` and ``TextGenVectorEnv`` share: the properties agents and tools read about their
episodes (:class:`EnvAccessors`), and the checks of their arguments and reset options."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from textgym.envs.episodes import Episodes
from textgym.errors import ConfigError, RenderModeError


def checked_options(options: Any, valid: Sequence[str]) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"reset options must be a dict, not {type(options).__name__} {options!r}.")
    unknown = sorted(set(options) - set(valid), key=str)
    if unknown:
        raise ConfigError(f"unknown reset option {unknown[0]!r}; valid options: {', '.join(valid)}.")
    return {k: v for k, v in options.items() if v is not None}


def check_render_mode(render_mode: Any) -> None:
    if render_mode not in (None, "ansi"):
        raise RenderModeError(f"render_mode must be None or 'ansi' (text), not {render_mode!r}.")


def check_steps(value: Any) -> int | None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1
    ):
        raise ConfigError(f"max_episode_steps must be a positive integer or None, not {value!r}.")
    return None if value is None else int(value)


def enclosing_time_limit(env: gym.Env) -> int | None:
    """The smallest step limit of the ``gymnasium.wrappers.TimeLimit`` wrappers around ``env`` whose ``reset``
    is calling its own, if any. Gymnasium adds that wrapper outside the env and never tells it the limit;
    looking up the call stack is the one way to truncate (and so score) an episode on the wrapper's last step.
    The whole stack is searched (any number of wrappers may sit between), and only wrappers of this env count.
    """
    import sys

    limits = []
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, gym.wrappers.TimeLimit) and owner.unwrapped is env:
            limits.append(int(owner._max_episode_steps))
        frame = frame.f_back
    return min(limits, default=None)


class EnvAccessors:
    """What agents and tools may read about an env's episodes (nothing outside textgym/envs reads
    ``env.episodes``)."""

    episodes: Episodes

    @property
    def max_prompt_tokens(self) -> int:
        """Prompt positions in an observation (prompts are left-padded into them)."""
        return self.episodes.P

    @property
    def max_new_tokens(self) -> int:
        """The response budget: an episode is truncated after this many tokens (in a multi-turn episode, the
        agent's and the environment's tokens together)."""
        return self.episodes.T

    @property
    def max_turns(self) -> int | None:
        """The most turns the agent gets in an episode (None: only the token budget bounds them)."""
        return self.episodes.max_turns

    @property
    def responder(self) -> Any:
        """The environment's side of multi-turn episodes (None: one turn per episode)."""
        return self.episodes.responder

    @property
    def env_token_mask(self) -> np.ndarray:
        """(num_envs, L) int8, 1 at the observation positions the environment wrote (its replies): those
        tokens are observations, not actions. All 0 without a responder."""
        return self.episodes.env_mask.copy()

    @property
    def pad_token_id(self) -> int:
        return self.episodes.pad_id

    @property
    def eos_token_id(self) -> int | None:
        return self.episodes.eos_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends an episode as EOS: the tokenizer's, and those the model directory declares."""
        return self.episodes.eos_ids

    @property
    def num_prompts(self) -> int:
        """Prompts in the source (reset options index into them)."""
        return self.episodes.n_source

    @property
    def prompt_cursor(self) -> int:
        """The place in ``prompt_order = "sequential"``: prompts drawn so far, modulo their number (checkpoints
        keep it). Unsharded, the index of the next prompt."""
        return self.episodes.cursor

    @prompt_cursor.setter
    def prompt_cursor(self, value: int) -> None:
        self.episodes.cursor = int(value) % self.episodes.n_source

    def shard_prompts(self, process: int, processes: int) -> None:
        """Make this env process ``process``'s of ``processes`` data-parallel ones: its sequential order takes
        every ``processes``-th prompt from ``process`` on, so the processes' batches hold different prompts
        (LM agents call it under ``accelerate``; random order needs nothing, each process has its own seed)."""
        if not 0 <= process < processes:
            raise ConfigError(f"process must be in 0..{processes - 1}, not {process!r}.")
        self.episodes.shard = (int(process), int(processes))

    @property
    def reward_seconds(self) -> float:
        """Seconds spent in the reward stack since the env was made (for agents' time breakdowns)."""
        return self.episodes.reward_seconds

    def take_reward_metrics(self) -> dict[str, tuple[float, int]]:
        """The sum and count of each metric TRL-style reward functions logged (``log_metric``) since the last
        call, by ``rewards/<reward>/<name>``; the record starts anew."""
        metrics, self.episodes.reward_metrics = self.episodes.reward_metrics, {}
        return metrics

    def encode_prompt(self, prompt: int | str) -> np.ndarray:
        """The token ids an episode on ``prompt`` (an index or a text) starts from, template applied (without
        a responder's opening)."""
        return self.episodes.encode_prompt(self.episodes.prompt_option(prompt)).copy()

    def _close(self) -> None:
        self.reward_stack.close()
        self.episodes.end(np.arange(self.episodes.n))  # the episodes still going
        close = getattr(self.episodes.responder, "close", None)
        if callable(close):
            close()
