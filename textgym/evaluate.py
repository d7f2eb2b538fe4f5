"""Evaluate any agent on a textgym env, as Stable-Baselines3's ``evaluate_policy`` and ``EvalCallback`` do,
on the native :class:`~textgym.envs.TextGenVectorEnv` (the env an LM agent trains on, ``agent.get_env()``)
as well as on an SB3 ``VecEnv``.

LM agents are evaluated with their KV-cached rollout (``deterministic=True`` is greedy decoding); other
agents step the env with ``predict``. Episode returns are the reward stack's totals.
"""

from __future__ import annotations

import contextlib
import numbers
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from stable_baselines3.common.callbacks import BaseCallback, EventCallback

from textgym.envs import TextGenVectorEnv
from textgym.errors import ConfigError


def check_evaluation_arguments(n_eval_episodes: Any, seed: Any) -> None:
    """Refuse what would fail only inside an evaluation (or, in ``EvalCallback``, after training)."""
    if (
        isinstance(n_eval_episodes, bool)
        or not isinstance(n_eval_episodes, numbers.Integral)
        or n_eval_episodes < 1
    ):
        raise ConfigError(f"n_eval_episodes must be a positive integer, not {n_eval_episodes!r}.")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**32:
        raise ConfigError(f"seed must be an integer in [0, 2**32), not {seed!r}.")


def evaluate_policy(
    model: Any,
    env: Any = None,
    n_eval_episodes: int = 10,
    deterministic: bool = True,
    render: bool = False,
    callback: Callable[[dict[str, Any], dict[str, Any]], None] | None = None,
    reward_threshold: float | None = None,
    return_episode_rewards: bool = False,
    warn: bool = True,
    *,
    seed: int = 0,
) -> tuple[float, float] | tuple[list[float], list[int]]:
    """Mean and std of the return over ``n_eval_episodes`` (or the returns and lengths): SB3's
    ``evaluate_policy``, with its arguments in its order. ``env``: a ``TextGenVectorEnv`` in either autoreset
    mode, or an SB3 ``VecEnv`` (then SB3's own function runs, after ``env.seed(seed)``; sb3-contrib's for
    ``MaskablePPO``; a single env is wrapped in a ``DummyVecEnv`` first, as SB3 does); for an LM agent it
    defaults to ``model.get_env()``. ``seed`` seeds the episodes' prompts and the sampling, on random streams
    of its own: the same seed, the same episodes, and the caller's streams as they were. Under
    ``prompt_order = "sequential"`` the evaluation takes the source's first prompts (on an SB3 ``VecEnv``:
    from the first on, in the order SB3's episodes end and restart), and leaves the env's
    place in the order where it was. ``MaskablePPO`` steps with its action masks, ``RecurrentPPO`` with its
    state. ``render`` and ``callback`` (called with SB3's ``locals()`` at every step) need an SB3
    ``VecEnv`` (``textgym.sb3.make_vec_env``).

    Raises:
        ConfigError: for a mean (or a ``reward_threshold``) on an env whose reward stack sums with
            ``normalize_then_sum``: it standardises each batch of rewards, so their mean is about 0 whatever
            the policy. Its episode returns (``return_episode_rewards=True``) are what the env pays."""
    check_evaluation_arguments(n_eval_episodes, seed)
    from textgym.agent_config import is_lm_agent

    if env is None and not is_lm_agent(type(model)):  # SB3's own evaluate_policy needs an env too
        raise ConfigError(
            "evaluate_policy(model) needs an env for a Stable-Baselines3 model: evaluating on its training env "
            "would reset it under training. Give a separate one, e.g. textgym.sb3.make_vec_env(env_id, "
            "n_envs=4, seed=0)."
        )
    env = env if env is not None else model.get_env()
    if env is None:
        raise ConfigError(
            f"evaluate_policy(model) needs an env: this {type(model).__name__} has none (loaded without one). "
            f"Pass one, evaluate_policy(model, env), or load it with its env, {type(model).__name__}.load(path, env)."
        )
    sources = textgym_episodes(env)
    if not return_episode_rewards or reward_threshold is not None:
        check_mean_reward(sources, "evaluate_policy")
    with prompts_from_the_start(sources):
        return _evaluate(model, env, n_eval_episodes, deterministic, render, callback, reward_threshold,
                         return_episode_rewards, warn, seed)  # fmt: skip


def _evaluate(
    model: Any,
    env: Any,
    n_eval_episodes: int,
    deterministic: bool,
    render: bool,
    callback: Callable[[dict[str, Any], dict[str, Any]], None] | None,
    reward_threshold: float | None,
    return_episode_rewards: bool,
    warn: bool,
    seed: int,
) -> tuple[float, float] | tuple[list[float], list[int]]:
    from textgym.sb3 import seeded_policy, takes_action_masks

    if not isinstance(env, TextGenVectorEnv):
        from stable_baselines3.common.vec_env import DummyVecEnv, VecEnv

        if takes_action_masks(model):  # MaskablePPO: sb3-contrib's evaluate_policy passes its masks
            from sb3_contrib.common.maskable.evaluation import evaluate_policy as sb3_evaluate
        else:
            from stable_baselines3.common.evaluation import evaluate_policy as sb3_evaluate
        if not isinstance(env, VecEnv):  # as SB3's evaluate_policy wraps it, but seeded
            single = env
            env = DummyVecEnv([lambda: single])
        env.seed(seed)
        with seeded_policy(model, seed):
            return sb3_evaluate(
                model, env, n_eval_episodes, deterministic, render, callback, reward_threshold,
                return_episode_rewards, warn,
            )  # fmt: skip
    if render or callback is not None:
        raise ConfigError(
            f"evaluate_policy(render={render!r}, callback={callback!r}) on a TextGenVectorEnv: render and "
            f"callback need an SB3 VecEnv, e.g. textgym.sb3.make_vec_env(env_id, n_envs=...)."
        )
    rewards: list[float] = []
    lengths: list[int] = []
    round_ = 0
    with seeded_policy(model, seed):
        while len(rewards) < n_eval_episodes:
            # a sequential order goes on where the last batch began plus one batch: under SameStep its
            # sub-envs restarted on the next prompts as their episodes ended, which the batch left unfinished
            for source in textgym_episodes(env):
                source.cursor = round_ * env.num_envs % source.n_source
            for episode in _episodes(model, env, deterministic, round_seed(seed, round_)):
                rewards.append(float(episode["reward"]))
                lengths.append(int(episode["num_tokens"]))
            round_ += 1
    rewards, lengths = rewards[:n_eval_episodes], lengths[:n_eval_episodes]
    mean, std = float(np.mean(rewards)), float(np.std(rewards))
    if reward_threshold is not None and not mean > reward_threshold:
        raise AssertionError(f"Mean reward below threshold: {mean:.2f} < {reward_threshold:.2f}")  # as SB3
    if return_episode_rewards:
        return rewards, lengths
    return mean, std


def round_seed(seed: int, round_: int) -> int:
    """The seed of an evaluation's ``round_``-th batch of episodes: ``seed`` itself for the first, then seeds
    drawn from (seed, round), so that evaluation k's second batch is not evaluation k + 1's first."""
    return seed if round_ == 0 else int(np.random.SeedSequence([seed, round_]).generate_state(1)[0])


def textgym_episodes(env: Any) -> list[Any]:
    """The episode sources (:class:`~textgym.envs.episodes.Episodes`: prompts, reward stack) of the textgym
    envs inside ``env``, through gymnasium wrappers (``env``), SB3 ``VecEnv`` wrappers (``venv``), a
    ``DummyVecEnv``'s envs and :class:`~textgym.sb3.TextGymVecEnv`."""
    from textgym.envs.episodes import Episodes

    found, todo, seen = [], [env], set()
    while todo:
        obj = todo.pop()
        if id(obj) in seen:  # wrappers that refer back to each other
            continue
        seen.add(id(obj))
        attributes = getattr(obj, "__dict__", {})
        if isinstance(attributes.get("episodes"), Episodes):
            found.append(attributes["episodes"])
            continue
        todo += [attributes[name] for name in ("env", "venv") if name in attributes]
        todo += attributes.get("envs") if isinstance(attributes.get("envs"), list) else []
    return found


def check_mean_reward(sources: list[Any], who: str) -> None:
    """Refuse a mean return on an env whose total is standardised over each batch (``normalize_then_sum``)."""
    if any(e.stack.aggregate == "normalize_then_sum" for e in sources):
        raise ConfigError(
            f"{who}: the env's reward stack sums with aggregate = 'normalize_then_sum', which standardises each "
            f"batch of rewards: their mean is about 0 whatever the policy, so it cannot tell policies apart. "
            f"Evaluate on an env with the same rewards and aggregate = 'sum', or compare each component's "
            f"mean (textgym train's [eval])."
        )


@contextlib.contextmanager
def prompts_from_the_start(sources: list[Any]) -> Iterator[None]:
    """Sequential prompt orders from their first prompt, and back where they were after: an evaluation on
    the training env neither skips training prompts nor depends on where training was."""
    cursors = [e.cursor for e in sources]
    for e in sources:
        e.cursor = 0
    try:
        yield
    finally:
        for e, cursor in zip(sources, cursors):
            e.cursor = cursor


def _episodes(model: Any, env: TextGenVectorEnv, deterministic: bool, seed: int) -> list[dict[str, Any]]:
    """One episode per sub-env."""
    from textgym.agent_config import is_lm_agent

    if is_lm_agent(type(model)) and env.autoreset_mode.value == "Disabled":
        temperature = 0.0 if deterministic else model.config.temperature
        return model.rollout(env, temperature=temperature, seed=seed).infos
    from textgym.sb3 import Predictor

    obs, _ = env.reset(seed=seed)
    done = np.zeros(env.num_envs, dtype=bool)
    returns = np.zeros(env.num_envs)  # every step's reward: a multi-turn env pays one per turn
    episodes: list[dict[str, Any]] = [{} for _ in range(env.num_envs)]
    predict = Predictor(model, env.num_envs)  # with MaskablePPO's masks and RecurrentPPO's state
    while not done.all():
        actions = predict(obs, env, deterministic)
        obs, rewards, terminated, truncated, infos = env.step(np.asarray(actions, dtype=np.int64))
        predict.ended(terminated | truncated)
        returns += np.where(done, 0.0, rewards)
        ended = (terminated | truncated) & ~done
        final = infos.get("final_info", infos)  # SameStep mode: the ended episode's info moved here
        for i in np.flatnonzero(ended):
            episodes[i] = {"reward": float(returns[i]), "num_tokens": int(final["num_tokens"][i])}
        done |= ended
    return episodes


class EvalCallback(EventCallback):
    """SB3's ``EvalCallback`` for textgym envs, with its arguments: every ``eval_freq`` callback steps
    (iterations, for LM agents), evaluate on ``eval_env`` (a ``TextGenVectorEnv`` or an SB3 ``VecEnv``), log
    ``eval/mean_reward`` and ``eval/mean_ep_length``, append to ``log_path/evaluations.npz`` (SB3's format),
    save the best model to ``best_model_save_path/best_model``, call ``callback_on_new_best`` on a new best
    (e.g. SB3's ``StopTrainingOnRewardThreshold``) and ``callback_after_eval`` after every evaluation (e.g.
    ``StopTrainingOnNoModelImprovement``). Every evaluation uses the same ``seed`` (the same prompts and
    sampling draws), so two evaluations differ only by the policy and the best model is chosen on equal terms
    (SB3's runs each on wherever its eval env's random streams are). ``eval_freq`` counts callback steps:
    iterations for LM agents, env steps for Stable-Baselines3 agents (as SB3's). A ``VecNormalize`` eval env
    gets the training env's statistics before each evaluation, as in SB3. An eval env whose reward stack sums
    with ``normalize_then_sum`` is refused (:func:`evaluate_policy`: its mean is about 0)."""

    def __init__(
        self,
        eval_env: Any,
        callback_on_new_best: BaseCallback | None = None,
        callback_after_eval: BaseCallback | None = None,
        n_eval_episodes: int = 5,
        eval_freq: int = 1,
        log_path: str | None = None,
        best_model_save_path: str | None = None,
        deterministic: bool = True,
        render: bool = False,
        verbose: int = 1,
        warn: bool = True,
        *,
        seed: int = 0,
    ):
        super().__init__(callback_after_eval, verbose=verbose)
        check_evaluation_arguments(n_eval_episodes, seed)
        check_mean_reward(textgym_episodes(eval_env), "EvalCallback")
        self.seed = seed
        self.eval_env, self.callback_on_new_best = eval_env, callback_on_new_best
        if callback_on_new_best is not None:
            callback_on_new_best.parent = self  # SB3's stopping callbacks read the best reward here
        self.n_eval_episodes, self.eval_freq, self.deterministic = n_eval_episodes, eval_freq, deterministic
        self.render, self.warn = render, warn
        self.log_path = os.path.join(log_path, "evaluations") if log_path else None
        self.best_model_save_path = best_model_save_path
        self.best_mean_reward, self.last_mean_reward = -np.inf, -np.inf
        self.evaluations_timesteps: list[int] = []
        self.evaluations_results: list[list[float]] = []
        self.evaluations_length: list[list[int]] = []

    def _init_callback(self) -> None:
        if self.callback_on_new_best is not None:
            self.callback_on_new_best.init_callback(self.model)
        for folder in (self.best_model_save_path, self.log_path and os.path.dirname(self.log_path)):
            if folder:
                Path(folder).mkdir(parents=True, exist_ok=True)

    def _on_step(self) -> bool:
        if self.eval_freq <= 0 or self.n_calls % self.eval_freq:
            return True
        from stable_baselines3.common.vec_env import VecEnv, sync_envs_normalization

        if isinstance(self.training_env, VecEnv) and isinstance(self.eval_env, VecEnv):
            # a VecNormalize's running statistics, as SB3's EvalCallback copies them before each evaluation
            sync_envs_normalization(self.training_env, self.eval_env)
        rewards, lengths = evaluate_policy(
            self.model, self.eval_env, self.n_eval_episodes, self.deterministic, self.render,
            return_episode_rewards=True, warn=self.warn, seed=self.seed,
        )  # fmt: skip
        if self.log_path:
            self.evaluations_timesteps.append(self.num_timesteps)
            self.evaluations_results.append(list(rewards))
            self.evaluations_length.append(list(lengths))
            np.savez(
                self.log_path,
                timesteps=self.evaluations_timesteps,
                results=self.evaluations_results,
                ep_lengths=self.evaluations_length,
            )
        mean = float(np.mean(rewards))
        self.last_mean_reward = mean
        self.logger.record("eval/mean_reward", mean)
        self.logger.record("eval/mean_ep_length", float(np.mean(lengths)))
        # written now, at this step, as SB3's EvalCallback does: the agent dumped its iteration's row before
        # calling back, so the evaluation went out with the next iteration's (and the last one never)
        self.logger.record("time/total_timesteps", self.num_timesteps, exclude="tensorboard")
        self.logger.dump(self.num_timesteps)
        if self.verbose:
            print(
                f"Eval num_timesteps={self.num_timesteps}, episode_reward={mean:.3f} +/- {np.std(rewards):.3f}"
            )
        keep_training = True
        if mean > self.best_mean_reward:
            self.best_mean_reward = mean
            if self.best_model_save_path:
                self.model.save(os.path.join(self.best_model_save_path, "best_model"))
            if self.callback_on_new_best is not None:
                keep_training = self.callback_on_new_best.on_step()
        if self.callback is not None:
            keep_training = keep_training and self._on_event()
        return keep_training
