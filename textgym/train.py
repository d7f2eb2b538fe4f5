"""``textgym train``: one training run of a registered agent, with a run directory a researcher can read.

The run directory holds ``config.toml`` (resolved), ``metrics.csv`` (one row per iteration),
``samples.jsonl`` (every episode, with its iteration), ``samples_before.jsonl`` / ``samples_after.jsonl``
(the same prompts before and after training), ``reward_kl.png`` and ``checkpoint/`` (written atomically
every ``run.checkpoint_every`` iterations and at the end). Ctrl-C stops after the current iteration and
writes the checkpoint; ``textgym train --resume RUN_DIR`` continues from it.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from textgym import plugin_manager
from textgym.config import load_config, validate
from textgym.errors import ConfigError

CHECKPOINT = "checkpoint"


class StopFlag:
    """First Ctrl-C: finish the current iteration, save, exit. Second Ctrl-C: abort at once."""

    def __init__(self) -> None:
        self.stop = False

    def __enter__(self) -> StopFlag:
        self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.stop:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.stop = True
        print(
            "\ntextgym: stopping after this iteration and saving a checkpoint (Ctrl-C again to abort)",
            flush=True,
        )

    def __exit__(self, *exc: Any) -> None:
        signal.signal(signal.SIGINT, self._previous)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_metrics(path: Path, history: Sequence[dict[str, Any]]) -> None:
    columns = list(dict.fromkeys(key for row in history for key in row))
    lines: list[str] = []

    class Sink:
        def write(self, text: str) -> None:
            lines.append(text)

    writer = csv.DictWriter(Sink(), fieldnames=columns)
    writer.writeheader()
    writer.writerows(history)
    _write_atomic(path, "".join(lines))


def plot(path: Path, history: Sequence[dict[str, Any]], score_key: str, kl_key: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["timesteps"] for row in history]
    panels = [(score_key, "reward (mean episode score)")] + (
        [(kl_key, "KL to the reference")] if kl_key else []
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        ax.plot(steps, [row[key] for row in history], marker="o", markersize=3)
        ax.set_title(title)
        ax.set_xlabel("generated tokens")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(
    config_path: str | Path | None = None,
    overrides: Sequence[str] = (),
    resume: str | Path | None = None,
    agent_name: str | None = None,
    config: dict[str, Any] | None = None,
) -> Path:
    """Train as configured (a TOML file, or an already-parsed ``config`` dict); returns the run directory."""
    if config is not None:  # a new run from a parsed config (textgym bench)
        config = validate(config)
        run_dir = Path(config["run"]["output_dir"] or f"runs/run-{time.strftime('%Y%m%d-%H%M%S')}")
        if (run_dir / CHECKPOINT).exists():
            raise ConfigError(f"{run_dir} already holds a run; resume it with --resume {run_dir}.")
    elif resume is not None:
        run_dir = Path(resume)
        if not (run_dir / "config.toml").is_file():
            raise ConfigError(f"{str(run_dir)!r} is not a run directory (it has no config.toml).")
        config = load_config(run_dir / "config.toml", overrides)
    else:
        config = load_config(config_path, overrides)
        if agent_name:
            config["agent"]["name"] = agent_name
        stem = Path(config_path).stem if config_path else "run"
        run_dir = Path(config["run"]["output_dir"] or f"runs/{stem}-{time.strftime('%Y%m%d-%H%M%S')}")
        if (run_dir / CHECKPOINT).exists():
            raise ConfigError(
                f"{run_dir} already holds a run; resume it with --resume {run_dir}, or choose run.output_dir."
            )
    for path in config["run"]["plugins"]:
        plugin_manager.load_plugin_file(path)
    agent_class = plugin_manager.load_agent(config["agent"]["name"])
    hyperparameters = {k: v for k, v in config["agent"].items() if k not in ("name", "policy")}
    check_hyperparameters(config["agent"]["name"], agent_class, hyperparameters)
    run_dir.mkdir(parents=True, exist_ok=True)
    config["run"]["output_dir"] = str(run_dir)
    if resume is None:
        import tomli_w

        _write_atomic(run_dir / "config.toml", tomli_w.dumps(_drop_none(validate(config))))
    if is_lm_agent(agent_class):
        return _run_native(agent_class, config, run_dir, resume is not None)
    return _run_sb3(agent_class, config, run_dir, resume is not None)


def is_lm_agent(agent_class: Any) -> bool:
    """LM agents (subclasses of ``LMAgent``) step the native vector env; others get an SB3 VecEnv."""
    from textgym.agents.base import LMAgent

    return isinstance(agent_class, type) and issubclass(agent_class, LMAgent)


def hyperparameter_names(agent_class: Any) -> list[str] | None:
    """The hyperparameters an agent takes: its config dataclass's fields (LM agents) or its constructor's
    keyword arguments (SB3 algorithms); None when it takes any keyword."""
    import dataclasses
    import inspect

    if is_lm_agent(agent_class):
        return [f.name for f in dataclasses.fields(agent_class.config_class)]
    try:
        params = inspect.signature(agent_class.__init__).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    skip = {"self", "policy", "env"}
    return [
        n for n, p in params.items() if n not in skip and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def check_hyperparameters(name: str, agent_class: Any, hyperparameters: dict[str, Any]) -> None:
    """Every hyperparameter must be one the agent takes: checked before anything loads."""
    import difflib

    valid = hyperparameter_names(agent_class)
    if valid is None:
        return
    for key in hyperparameters:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"[agent] {name}: unknown hyperparameter {key!r}.{hint} {name} takes: {', '.join(sorted(valid))}."
            )


def _drop_none(value: Any) -> Any:  # TOML has no null
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    return value


def _env_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    kwargs = {k: v for k, v in config["env"].items() if k not in ("id", "num_envs")}
    policy = config["agent"]["policy"]
    if "model" not in kwargs and isinstance(policy, str):
        kwargs["model"] = policy  # the env tokenizes with the policy's tokenizer
    return kwargs


def _make_native_env(config: dict[str, Any], num_envs: int, **extra: Any) -> Any:
    import gymnasium

    kwargs = {**_env_kwargs(config), "autoreset_mode": "Disabled", **extra}
    try:
        return gymnasium.make_vec(
            config["env"]["id"], num_envs=num_envs, vectorization_mode="vector_entry_point", **kwargs
        )
    except TypeError as exc:  # an argument the env does not take
        raise ConfigError(f"[env] {config['env']['id']}: {exc}") from exc
    except gymnasium.error.Error as exc:
        raise ConfigError(f"[env] id: {exc}") from exc


def _sample_table(agent: Any, config: dict[str, Any], path: Path) -> list[dict[str, Any]]:
    """The first ``run.sample_prompts`` prompts, sampled with a fixed seed: the same before and after."""
    from textgym.sampling import rollout

    env = _make_native_env(config, config["run"]["sample_prompts"], prompt_order="sequential")
    rows = rollout(agent.policy, env, temperature=agent.config.temperature, seed=config["run"]["seed"]).infos
    _write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))
    return rows


def _run_native(agent_class: Any, config: dict[str, Any], run_dir: Path, resuming: bool) -> Path:
    from stable_baselines3.common.callbacks import BaseCallback
    from tqdm.auto import tqdm

    from textgym.diagnostics import training_callbacks
    from textgym.formatting import format_table

    run, agent_cfg = config["run"], config["agent"]
    diagnostics = training_callbacks(config, run_dir)  # [eval], checked before anything loads
    env = _make_native_env(config, config["env"]["num_envs"])
    hyperparameters = {k: v for k, v in agent_cfg.items() if k not in ("name", "policy")}
    hyperparameters.setdefault("seed", run["seed"])
    hyperparameters.setdefault("verbose", 0)
    if resuming:
        agent = agent_class.load(run_dir / CHECKPOINT, env, **hyperparameters)
        print(f"textgym: resuming {run_dir} at iteration {agent.iteration}, {agent.num_timesteps} tokens")
    else:
        if agent_cfg["policy"] is None:
            raise ConfigError(
                "agent.policy is required: a zoo name (e.g. smollm2-135m-instruct) or a model directory."
            )
        try:
            agent = agent_class(agent_cfg["policy"], env, **hyperparameters)
        except TypeError as exc:  # an unknown hyperparameter
            raise ConfigError(f"[agent] {agent_cfg['name']}: {exc}") from exc
    if not resuming:
        before = _sample_table(agent, config, run_dir / "samples_before.jsonl")
        print("before training:\n" + format_table(before))

    class Recorder(BaseCallback):
        def _on_step(self) -> bool:
            model = self.model
            stats = model.history[-1]
            with (run_dir / "samples.jsonl").open("a", encoding="utf-8") as f:
                for episode in model.last_episodes:
                    f.write(json.dumps({"iteration": model.iteration, **episode}) + "\n")
            write_metrics(run_dir / "metrics.csv", model.history)
            tqdm.write(
                f"iter {model.iteration:4d}  tokens {model.num_timesteps:7d}  reward {stats['reward']:7.3f}"
                f"  kl {stats['kl']:7.3f}  len {stats['completions/mean_length']:5.1f}"
                f"  eos {1 - stats['completions/clipped_ratio']:4.2f}  {stats['time/iteration']:6.1f} s"
            )
            if model.iteration % run["checkpoint_every"] == 0 or flag.stop:
                model.save(run_dir / CHECKPOINT)
            return not flag.stop

    remaining = run["total_timesteps"] - agent.num_timesteps
    with StopFlag() as flag:
        if remaining > 0:
            agent.learn(
                remaining, callback=[Recorder(), *diagnostics], reset_num_timesteps=False, progress_bar=True
            )
    agent.save(run_dir / CHECKPOINT)
    if agent.history:
        plot(run_dir / "reward_kl.png", agent.history, "reward", "kl")
    if flag.stop:
        print(f"textgym: interrupted; checkpoint saved. Continue with: textgym train --resume {run_dir}")
        return run_dir
    after = _sample_table(agent, config, run_dir / "samples_after.jsonl")
    print("after training:\n" + format_table(after))
    _print_trend(agent.history, "reward")
    print(f"textgym: run directory {run_dir}")
    return run_dir


def _print_trend(history: Sequence[dict[str, Any]], key: str) -> None:
    if not history:
        return
    k = max(1, len(history) // 4)
    first, last = np.mean([r[key] for r in history[:k]]), np.mean([r[key] for r in history[-k:]])
    print(
        f"reward trend: {first:.3f} (first {k} iterations) -> {last:.3f} (last {k}), {len(history)} iterations"
    )


def _run_sb3(agent_class: Any, config: dict[str, Any], run_dir: Path, resuming: bool) -> Path:
    """Agents with the SB3 contract on an SB3 VecEnv (e.g. SB3's PPO on the small-vocabulary envs)."""
    from stable_baselines3.common.callbacks import BaseCallback

    from textgym.diagnostics import training_callbacks
    from textgym.sb3 import make_vec_env

    run, agent_cfg = config["run"], config["agent"]
    diagnostics = training_callbacks(config, run_dir)  # [eval], checked before anything loads
    env_kwargs = {k: v for k, v in config["env"].items() if k not in ("id", "num_envs")}
    env = make_vec_env(config["env"]["id"], n_envs=config["env"]["num_envs"], seed=run["seed"], **env_kwargs)
    hyperparameters = {k: v for k, v in agent_cfg.items() if k not in ("name", "policy")}
    hyperparameters.setdefault("seed", run["seed"])
    path = run_dir / f"{CHECKPOINT}.zip"
    if resuming:
        agent = agent_class.load(path, env, **hyperparameters)
    else:
        agent = agent_class(agent_cfg["policy"] or "MultiInputPolicy", env, **hyperparameters)
    state_path = run_dir / "history.json"
    history: list[dict[str, Any]] = (
        json.loads(state_path.read_text()) if resuming and state_path.is_file() else []
    )

    class Recorder(BaseCallback):
        def _on_rollout_start(self) -> None:
            self.episodes: list[dict[str, Any]] = []

        def _on_step(self) -> bool:
            for info, reward in zip(self.locals["infos"], self.locals["rewards"]):
                if "completion" in info:
                    self.episodes.append({"completion": info["completion"], "reward": float(reward)})
            return not flag.stop

        def _on_rollout_end(self) -> None:
            if not self.episodes:
                return
            history.append(
                {
                    "timesteps": self.num_timesteps,
                    "reward": float(np.mean([e["reward"] for e in self.episodes])),
                }
            )
            with (run_dir / "samples.jsonl").open("a", encoding="utf-8") as f:
                f.writelines(json.dumps({"timesteps": self.num_timesteps, **e}) + "\n" for e in self.episodes)
            write_metrics(run_dir / "metrics.csv", history)
            _write_atomic(state_path, json.dumps(history))
            print(f"tokens {self.num_timesteps:8d}  reward {history[-1]['reward']:7.3f}", flush=True)

    remaining = run["total_timesteps"] - agent.num_timesteps
    with StopFlag() as flag:
        if remaining > 0:
            agent.learn(remaining, callback=[Recorder(), *diagnostics], reset_num_timesteps=False)
    tmp = path.with_name(f".{path.name}")
    agent.save(tmp)  # then renamed: an interrupted save never replaces a good checkpoint
    os.replace(tmp, path)
    if history:
        plot(run_dir / "reward_kl.png", history, "reward", None)
        _print_trend(history, "reward")
    print(f"textgym: run directory {run_dir}")
    return run_dir
