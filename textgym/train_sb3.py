"""``textgym train`` for agents with Stable-Baselines3's contract (SB3's and sb3-contrib's algorithms on the
small-vocabulary envs): the same run directory, metrics, checkpoints, [eval] and signals as an LM agent's run
(:mod:`textgym.train`), through SB3's own ``learn`` and callbacks."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from textgym.config import MAX_SEED, iteration_seed
from textgym.errors import ConfigError
from textgym.rundir import RunDir, crash_point
from textgym.stopping import StopFlag
from textgym.train import _finish, _iteration_line, _report, _resumed, _sample_table
from textgym.train_env import env_errors


def run_sb3(
    agent_class: Any,
    policy: Any,
    hyperparameters: dict[str, Any],
    config: dict[str, Any],
    rd: RunDir,
    resuming: bool,
    flag: StopFlag,
) -> Path:
    """Agents with the SB3 contract on an SB3 VecEnv (e.g. SB3's PPO on the small-vocabulary envs). The run
    directory is the same as an LM agent's; metrics are ``reward`` per rollout (no KL: no reference)."""
    from stable_baselines3.common.callbacks import BaseCallback

    from textgym.diagnostics import finish_evaluations, training_callbacks
    from textgym.resume_checks import check_sb3_checkpoint_config
    from textgym.sb3 import load_sb3_checkpoint, make_vec_env, save_sb3_checkpoint, sb3_episodes, sb3_row

    run = config["run"]
    diagnostics = training_callbacks(config, rd.path)  # [eval], checked before anything loads
    env_kwargs = {k: v for k, v in config["env"].items() if k not in ("id", "num_envs")}
    with env_errors(config["env"]["id"]):
        env = make_vec_env(
            config["env"]["id"], n_envs=config["env"]["num_envs"], seed=run["seed"], **env_kwargs
        )
    try:  # a responder's and the rewards' close(): sandboxes, servers, files
        hyperparameters = {"seed": run["seed"], "verbose": 0, **hyperparameters}
        name = config["agent"]["name"]
        try:
            agent = agent_class(policy, env, **hyperparameters)
        except (AssertionError, ValueError, TypeError) as exc:  # SB3 checks its hyperparameters with asserts
            raise ConfigError(f"[agent] {name}: {exc or type(exc).__name__}") from exc
        state = {"iteration": 0, "history": []}
        if resuming:
            check_sb3_checkpoint_config(rd, agent, hyperparameters)
            agent, state = load_sb3_checkpoint(agent, agent_class, rd.checkpoint, env)
            # SB3's load seeds every stream (torch, numpy, the env, the action space) from the run's seed, so
            # a resume replayed the run's first prompts and draws: they go on from (seed, iteration) instead,
            # as an LM agent's rollouts are seeded (SB3 saves no random state to resume them exactly)
            agent.set_random_seed(iteration_seed(run["seed"], state["iteration"]) % MAX_SEED)
            _resumed(rd, state["iteration"], state["history"], agent.num_timesteps, run["total_timesteps"])
        history = state["history"]

        def generate(sample_env: Any, seed: int) -> list[dict[str, Any]]:
            return sb3_episodes(agent, sample_env, seed)

        if not resuming:
            _report(rd, "samples_before.jsonl", _sample_table(generate, config), "before training")

        def save(path: Path) -> None:
            save_sb3_checkpoint(agent, path, {"iteration": state["iteration"], "history": history})

        class StopAfterUpdate(Exception):
            """Raised where SB3's next rollout would begin: the stopped iteration is trained and saved."""

        class Recorder(BaseCallback):
            """Records each rollout when it ends; checkpoints where the next one starts, as SB3 updates the policy
            between the two (a checkpoint written at the rollout's end would lack its iteration's update), and a
            stop (Ctrl-C, SIGTERM) takes effect there, so the rollout it lands in is trained, not dropped."""

            def __init__(self) -> None:
                super().__init__()
                self.saved = state["iteration"]

            def _on_rollout_start(self) -> None:
                self.episodes: list[dict[str, Any]] = []
                # weight schedules follow the tokens trained, as an LM agent's do
                stack = env.env.reward_stack
                if hasattr(stack, "set_progress"):
                    stack.set_progress(min(1.0, self.num_timesteps / run["total_timesteps"]))
                if flag.stop:
                    rd.write_checkpoint(save)
                    raise StopAfterUpdate
                if state["iteration"] > self.saved and state["iteration"] % run["checkpoint_every"] == 0:
                    rd.write_checkpoint(save)
                    self.saved = state["iteration"]

            def _on_step(self) -> bool:
                for info in self.locals["infos"]:
                    # an episode ended: its return (a multi-turn env pays every turn)
                    if "completion" in info:
                        self.episodes.append(sb3_row(info, float(info["episode"]["r"])))
                return True

            def _on_rollout_end(self) -> None:
                # every rollout is an iteration (SB3 updates after each), also one in which no episode ended: its
                # row has no reward. Skipped, the count ran behind eval.csv's and checkpoint_every's meaning.
                state["iteration"] += 1
                rewards = [e["reward"] for e in self.episodes]
                spread = (
                    float(np.std(rewards, ddof=1)) if len(rewards) > 1 else math.nan
                )  # sample std, as LM agents
                history.append({"iteration": state["iteration"], "timesteps": self.num_timesteps,
                                "reward": float(np.mean(rewards)) if rewards else math.nan,
                                "reward_std": spread, "episodes": len(rewards)})  # fmt: skip
                rd.append_samples({"iteration": state["iteration"], **e} for e in self.episodes)
                rd.write_metrics(history)
                crash_point("after-metrics")
                if rewards:
                    print(_iteration_line(history[-1], self.num_timesteps), flush=True)

        remaining = run["total_timesteps"] - agent.num_timesteps
        if agent.tensorboard_log is None:  # SB3's default logger would leave an empty folder in the temp dir
            from textgym.agents.sb3_contract import folderless_logger

            agent.set_logger(folderless_logger(agent.verbose))
        else:  # SB3's own (run_1, as it names it) would keep a resumed run's events past the checkpoint
            agent.set_logger(continued_logger(agent, agent.tensorboard_log, state["iteration"]))
        saved = False
        with flag:
            if remaining > 0:
                try:
                    agent.learn(
                        remaining,
                        callback=[Recorder(), *diagnostics],
                        reset_num_timesteps=False,
                        tb_log_name="run",
                    )
                except StopAfterUpdate:  # SB3's learn ends its callbacks only when it returns
                    saved = True
                    for callback in diagnostics:  # the eval curves' plot, the metric rewards' close()
                        callback.on_training_end()
            else:
                finish_evaluations(diagnostics, agent)
            if not saved:  # within the flag: a first Ctrl-C or SIGTERM during this save lets it finish
                rd.write_checkpoint(save)
        return _finish(rd, history, flag.stop, lambda: _sample_table(generate, config, 1.0), has_kl=False)
    finally:
        env.close()


def continued_logger(agent: Any, tensorboard_log: str, iteration: int) -> Any:
    """The logger SB3 makes for ``tensorboard_log`` (stdout when verbose, TensorBoard events in ``run_1``),
    continuing a resumed run's events: those past its checkpoint, logged before an interruption, are hidden."""
    import os

    from stable_baselines3.common.logger import Logger

    from textgym.agents.sb3_contract import continued_formats, stdout_format

    folder = os.path.join(tensorboard_log, "run_1")
    os.makedirs(folder, exist_ok=True)
    formats = continued_formats(folder, iteration, agent.num_timesteps, csv_output=False)
    return Logger(folder=folder, output_formats=[stdout_format(), *formats] if agent.verbose else formats)
