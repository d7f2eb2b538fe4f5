"""``textgym train``: one training run of an agent, with a run directory a researcher can read and a crash
cannot corrupt.

The run directory holds ``config.toml`` (resolved: absolute paths, the chosen agent), ``metrics.csv`` (one row
per iteration), ``samples.jsonl`` (every episode, with its iteration), ``samples_before.jsonl`` /
``samples_after.jsonl`` (the same prompts before and after training), ``reward_kl.png`` and ``checkpoint/``
(written atomically every ``run.checkpoint_every`` iterations and at the end). Ctrl-C or SIGTERM stops after
the current iteration and writes the checkpoint; a second one aborts at once, keeping the last checkpoint.
``textgym train --resume RUN_DIR`` continues from the last complete checkpoint (see :mod:`textgym.rundir`).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from textgym import plugin_manager
from textgym.agent_config import is_lm_agent, resolve_agent
from textgym.composition import stack_table
from textgym.config import load_config, validate
from textgym.errors import ConfigError
from textgym.formatting import component_keys, headline_scores, number
from textgym.launch import (
    LAUNCHED_VAR,
    check_processes,
    end_process_group,
    follow_the_launcher,
    init_process_group,
    launch,
    on_main,
    rank,
    under_launcher,
    world_size,
)
from textgym.plotting import training_curves
from textgym.resume_checks import (
    check_checkpoint_config,
    check_config_edits,
    check_plugin_packages,
    check_resume_changes,
    check_reward_files,
    record_code,
)
from textgym.rundir import CHECKPOINT, SAMPLES_AFTER, RunDir, crash_point
from textgym.stopping import StopFlag
from textgym.train_env import check_env_id, check_env_keys, check_sb3_rewards, make_env

__all__ = ["CHECKPOINT", "is_lm_agent", "run"]


def run(
    config_path: str | Path | None = None,
    overrides: Sequence[str] = (),
    resume: str | Path | None = None,
    agent_name: str | None = None,
    config: dict[str, Any] | None = None,
    plugins: Sequence[str] = (),
) -> Path:
    """Train as configured (a TOML file, or an already-parsed ``config`` dict); returns the run directory.

    ``plugins`` (``textgym train --plugin FILE.py``) join ``run.plugins``: the run's config names every plugin
    file it needs, for its resumes and for the processes of a ``run.processes = N`` launch.

    Everything is validated before the run directory is touched; a start that fails leaves no directory.
    """
    changed = False  # a resume's --set: written to its config.toml, for the resumes after it
    saved: dict[str, Any] = {}
    if resume is not None:
        run_dir = Path(resume)
        if not run_dir.exists():
            raise ConfigError(f"{str(run_dir)!r} does not exist: --resume takes a run directory.")
        if not (run_dir / "config.toml").is_file():
            raise ConfigError(f"{str(run_dir)!r} is not a run directory (it has no config.toml).")
        check_plugin_packages(run_dir)  # (said before the names it provided are reported unknown)
        config = load_config(run_dir / "config.toml", overrides)
        saved = load_config(run_dir / "config.toml")
        trained_by = saved["run"]["processes"]
        if config["run"]["processes"] != trained_by:  # a --set of it
            raise ConfigError(
                f"{run_dir} was trained by {trained_by} process(es); a resume keeps that number, as the seeds "
                f"and the batch split depend on it: drop run.processes={config['run']['processes']} from --set."
            )
        moved = check_config_edits(run_dir, saved)
        check_resume_changes(run_dir, saved, config, agent_name)
        check_reward_files(run_dir, config)
        changed = config != saved or moved
        if config["run"]["plugins"] and rank() == 0:  # said once, not by every process
            print(
                f"textgym: loading the plugin files of {run_dir}'s config: {', '.join(config['run']['plugins'])}"
            )
    else:
        if config is not None:  # a new run from a parsed config (textgym bench)
            config = validate(config)
        else:
            config = load_config(config_path, overrides)
        if agent_name:
            config["agent"]["name"] = agent_name
        stem = Path(config_path).stem if config_path else "run"
        run_dir = Path(
            config["run"]["output_dir"] or f"runs/{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        ).expanduser()
    for path in plugins:
        path = str(Path(path).expanduser().resolve())
        if path not in config["run"]["plugins"]:
            config["run"]["plugins"].append(path)
            if resume is not None:  # not in the saved config: the launched processes are told
                overrides = [*overrides, f"run.plugins={json.dumps(config['run']['plugins'])}"]
                changed = True
    for path in config["run"]["plugins"]:
        plugin_manager.load_plugin_file(path)
    check_env_id(config["env"]["id"], config["run"]["allow_env_import"])
    check_env_keys(config["env"]["id"], config["env"])
    agent_class, policy, hyperparameters = resolve_agent(config["agent"])
    if not is_lm_agent(agent_class):
        check_sb3_rewards(config)
    config["run"]["output_dir"] = str(run_dir)  # a resumed directory may have moved since it was written
    world = world_size()
    check_processes(config, world, resume is not None, agent_class, hyperparameters)
    if "tensorboard" in config["run"]["report_to"]:  # one TensorBoard run per run directory, resumes included
        from textgym.agents.base import require_tensorboard

        require_tensorboard("run.report_to = ['tensorboard']")
        hyperparameters.setdefault("tensorboard_log", str(run_dir / "tensorboard"))
    if world == 1 and config["run"]["processes"] > 1 and not under_launcher():
        if is_lm_agent(agent_class):
            _check_before_launch(agent_class, policy, hyperparameters)
        return launch(config, run_dir, resume is not None, overrides)
    rd = RunDir(run_dir)
    resuming, created = resume is not None, False
    main = rank() == 0
    if world > 1:
        follow_the_launcher()  # (run.processes = N: stop with a checkpoint should the launching process die)
        init_process_group(hyperparameters.get("device", "auto"))

    def prepare() -> bool:
        """The run directory, on the main process: created (or recovered, on resume) and locked."""
        nonlocal created
        if resuming:
            if not rd.is_run():
                raise ConfigError(f"{run_dir} was not written by textgym train (no .textgym-run marker).")
            rd.lock()
            if rd.recover_checkpoint() is None:
                logged, every = rd.iterations_logged(), saved["run"]["checkpoint_every"]
                # a checkpoint was written, and is damaged or gone: the run is not started over its progress
                if rd.checkpoint.exists() or logged > every:
                    what = (
                        f"{rd.checkpoint} is incomplete (textgym did not write it whole)"
                        if rd.checkpoint.exists()
                        else f"metrics.csv logs {logged} iterations, past the first checkpoint (checkpoint_every "
                        f"= {every}), but {rd.checkpoint} is gone"
                    )
                    raise ConfigError(
                        f"{what}: restore the checkpoint, or delete {run_dir} to train the run again from the "
                        f"beginning. Nothing was removed."
                    )
                if not os.environ.get(LAUNCHED_VAR):
                    print(
                        f"textgym: {run_dir} has no complete checkpoint yet: starting the run from the beginning"
                    )
                rd.clear_progress()
                if changed:
                    rd.write_config(config)
                record_code(run_dir, config, resuming=False)  # (nothing was trained with the old code)
                return False
            if changed:
                rd.write_config(config)
            record_code(run_dir, config, resuming=True)  # (written once the resume's checks have passed)
            return True
        created = rd.create()
        rd.lock()
        try:
            rd.write_config(config)
            record_code(run_dir, config, resuming=False)
        except BaseException:  # a full disk: a start that fails leaves nothing behind
            rd.discard_failed_start(created)
            raise
        return False

    try:
        resuming = on_main(prepare) if world > 1 else prepare()
    except BaseException:
        # a resume refused after the lock (a damaged checkpoint): the directory is free again, in the process
        # that goes on (a notebook's, or a bench's)
        rd.unlock()
        raise
    before, after = saved.get("run", {}).get("total_timesteps"), config["run"]["total_timesteps"]
    follows = _follows_progress(config, agent_class, hyperparameters) if resuming and before != after else []
    if main and follows:  # not said when the run starts over
        print(
            f"textgym: run.total_timesteps {before} -> {after}: what follows the training progress (tokens / "
            f"total: {' and '.join(follows)}) follows the new total from here on, so it steps "
            f"{'back' if after > before else 'forward'} at this resume."
        )
    if is_lm_agent(agent_class):
        trainer = _run_native
    else:
        from textgym.train_sb3 import run_sb3 as trainer
    flag = StopFlag()
    try:
        return trainer(agent_class, policy, hyperparameters, config, rd, resuming, flag)
    except BaseException as exc:
        if main:
            rd.discard_failed_start(created)
            if (rd.path / "metrics.csv").exists():  # it trained: kept, for the caller to name (textgym train)
                exc.kept_run_dir = rd.path  # type: ignore[attr-defined]
        raise
    finally:
        flag.close()
        rd.unlock()
        if world > 1:
            end_process_group()


def _check_before_launch(agent_class: Any, policy: Any, hyperparameters: dict[str, Any]) -> None:
    """What every process of a ``run.processes = N`` run would refuse alike, refused once, here: a device
    or precision this machine cannot give, and a policy that is not there (or a directory without its
    tokenizer). Nothing is loaded but a directory's tokenizer."""
    from textgym.models import check_model_source, load_tokenizer

    agent_class.check_placement(**hyperparameters)
    if isinstance(policy, (str, os.PathLike)):
        check_model_source(policy)
        if Path(policy).expanduser().is_dir():
            load_tokenizer(str(policy))


def _follows_progress(config: dict[str, Any], agent_class: Any, hyperparameters: dict[str, Any]) -> list[str]:
    """What in this run follows the training progress (tokens trained / run.total_timesteps)."""
    from textgym.agent_config import hyperparameter_names
    from textgym.composition import stack_table
    from textgym.rewards import parse_reward_spec

    rewards = config["env"].get("rewards")
    components = stack_table(rewards)["components"] if rewards is not None else []
    specs = [parse_reward_spec(c) if isinstance(c, str) else c for c in components]
    scheduled = [
        s.get("name") or s.get("fn")
        for s in specs
        if isinstance(s, Mapping) and isinstance(s.get("weight"), Mapping)
    ]
    follows = ["lr_schedule = 'linear'"] if hyperparameters.get("lr_schedule") == "linear" else []
    if "exploration_fraction" in (hyperparameter_names(agent_class) or []):  # DQN's epsilon-greedy
        follows.append("the exploration rate (exploration_fraction)")
    return follows + ([f"the weight schedule of {', '.join(map(str, scheduled))}"] if scheduled else [])


def _sample_table(generate: Any, config: dict[str, Any], progress: float = 0.0) -> list[dict[str, Any]]:
    """The first ``run.sample_prompts`` prompts with a fixed seed: the same before and after training, scored
    with the reward weights of training's ``progress`` (0 before, 1 after: where weight schedules were)."""
    env = make_env(config, config["run"]["sample_prompts"], prompt_order="sequential")
    try:
        if hasattr(env.reward_stack, "set_progress"):
            env.reward_stack.set_progress(progress)
        return generate(env, config["run"]["seed"])
    finally:
        env.close()


def _resumed(rd: RunDir, iteration: int, history: list[dict[str, Any]], tokens: int, total: int) -> None:
    """A resume's run directory cut back to its checkpoint (of ``iteration``, with ``history``), and said so;
    with ``tokens`` at ``total`` (run.total_timesteps) already, that nothing is left to train."""
    dropped = rd.truncate_samples(iteration)
    rd.write_metrics(history)
    (rd.path / SAMPLES_AFTER).unlink(missing_ok=True)  # a finished run's: this one writes its own at its end
    print(
        f"textgym: resuming {rd.path} at iteration {iteration}, {tokens} tokens"
        + (f" ({dropped} sample rows after the checkpoint dropped)" if dropped else "")
    )
    if tokens >= total:
        print(
            f"textgym: {rd.path} has trained its run.total_timesteps = {total} tokens: nothing to train (to "
            f"train on, resume with --set run.total_timesteps=N, N > {tokens})"
        )


def _report(rd: RunDir, name: str, rows: list[dict[str, Any]], title: str) -> None:
    from textgym.formatting import format_table

    rd.write_jsonl(name, rows)
    print(f"{title}:\n" + format_table(rows))


def _iteration_line(stats: dict[str, Any], tokens: int, aggregate: str = "sum") -> str:
    line = f"iter {stats['iteration']:4d}  tokens {tokens:7d}  "
    line += "  ".join(
        f"{name} {number(value, 7)}" for name, value in headline_scores(stats, aggregate).items()
    )
    if "kl" in stats:
        line += f"  kl {number(stats['kl'], 7)}  len {stats['completions/mean_length']:5.1f}"
        line += f"  eos {1 - stats['completions/clipped_ratio']:4.2f}  {stats['time/iteration']:6.1f} s"
    return line


def _run_native(
    agent_class: Any,
    policy: Any,
    hyperparameters: dict[str, Any],
    config: dict[str, Any],
    rd: RunDir,
    resuming: bool,
    flag: StopFlag,
) -> Path:
    from stable_baselines3.common.callbacks import BaseCallback
    from tqdm.auto import tqdm

    from textgym.agents.checkpoint import gather_checkpoint
    from textgym.diagnostics import finish_evaluations, training_callbacks

    run = config["run"]
    diagnostics = training_callbacks(config, rd.path)  # [eval], checked before anything loads
    env = make_env(config, config["env"]["num_envs"] // run["processes"])  # this process's share
    try:  # a responder's and the rewards' close(): sandboxes, servers, files
        hyperparameters = {"seed": run["seed"], "verbose": 0, **hyperparameters}
        if resuming:
            check_checkpoint_config(rd, hyperparameters, agent_class)
            agent = agent_class.load(rd.checkpoint, env, **hyperparameters)
        else:
            agent = agent_class(policy, env, **hyperparameters)
        crash_point("start-up")  # the model and the env are loaded; training has not begun
        dist = agent.dist  # with one process every collective below is a no-op
        if agent.sharded:
            dist.on_main(
                lambda: print(
                    f"textgym: the policy is sharded over {dist.world} process{'es' * (dist.world > 1)} "
                    f"({agent.sharding_engine})"
                )
            )
        trained = getattr(agent, "trained_sharding", None)
        if resuming and trained != agent.sharding_engine:  # the checkpoint resumes either way: say which
            dist.on_main(
                lambda: print(
                    f"textgym: {rd.path} was last trained {f'sharded with {trained}' if trained else 'unsharded'}; this "
                    f"resume is {f'sharded with {agent.sharding_engine}' if agent.sharded else 'not sharded'} "
                    f"({SHARDING_HOW})"
                )
            )

        def generate(sample_env: Any, seed: int) -> list[dict[str, Any]]:
            return agent.rollout(sample_env, temperature=agent.config.temperature, seed=seed).infos

        def samples(progress: float) -> Any:
            """The sample table, for the main process to write. Sharded, every process rolls it out (each
            forward gathers the weights from all) and the function returns it; else the main process alone."""
            rows = _sample_table(generate, config, progress) if agent.sharded else None
            return lambda: rows if rows is not None else _sample_table(generate, config, progress)

        if resuming:
            dist.on_main(
                lambda: _resumed(
                    rd, agent.iteration, agent.history, agent.num_timesteps, run["total_timesteps"]
                )
            )
        else:
            before = samples(0.0)
            dist.on_main(lambda: _report(rd, "samples_before.jsonl", before(), "before training"))

        # the iteration of the checkpoint on disk: the final save skips an iteration the Recorder just saved
        saved = [agent.iteration if resuming else None]

        class Recorder(BaseCallback):
            def _on_step(self) -> bool:
                model = self.model
                stop = dist.any(flag.stop)  # every process stops after the same iteration
                checkpoint = model.iteration % run["checkpoint_every"] == 0 or stop
                if checkpoint:
                    gather_checkpoint(model)  # sharded: every process gathers the weights (else nothing)
                    saved[0] = model.iteration

                def record() -> None:
                    rd.append_samples({"iteration": model.iteration, **e} for e in model.last_episodes)
                    rd.write_metrics(model.history)
                    crash_point("after-metrics")
                    tqdm.write(_iteration_line(model.history[-1], model.num_timesteps, aggregate))
                    if checkpoint:
                        rd.write_checkpoint(model.save)

                dist.on_main(record)
                # a signal during the writes above (a checkpoint can take a minute) stops here too, not after
                # one more iteration; the checkpoint after learn() then saves this one if it was not saved
                return not (stop or dist.any(flag.stop))

        aggregate = stack_table(config["env"].get("rewards", []), "env.rewards")["aggregate"]
        remaining = run["total_timesteps"] - agent.num_timesteps
        with flag:
            if remaining > 0:
                agent.learn(
                    remaining,
                    callback=[Recorder(), *diagnostics],
                    reset_num_timesteps=False,
                    # on a terminal or in a notebook: in a log file, its redraws would run into the iteration lines
                    progress_bar=sys.stderr.isatty() or "ipykernel" in sys.modules,
                    tb_log_name="run",
                )
            else:
                finish_evaluations(diagnostics, agent)
            # within the flag: a first Ctrl-C or SIGTERM during this save (a job's time limit) lets it finish
            if saved[0] != agent.iteration:
                gather_checkpoint(agent)
                dist.on_main(lambda: rd.write_checkpoint(agent.save))
        stopped = dist.any(flag.stop)
        after = samples(1.0) if not stopped else None

        def finish() -> Path:
            return _finish(
                rd,
                agent.history,
                stopped,
                after,
                has_kl=True,
                sharding=agent.sharding_engine,
                aggregate=aggregate,
            )

        return dist.on_main(finish) or rd.path
    finally:
        env.close()


SHARDING_HOW = (
    "sharding follows the launch: the same accelerate launch --config_file, or ACCELERATE_USE_FSDP=true or "
    "ACCELERATE_USE_DEEPSPEED=true in the environment (with one process, under a launcher: torchrun "
    "--nproc_per_node 1 or accelerate launch --num_processes 1); see docs/distributed.md"
)


def _finish(
    rd: RunDir,
    history: list[dict[str, Any]],
    stopped: bool,
    samples: Any,
    has_kl: bool,
    sharding: str | None = None,
    aggregate: str = "sum",
) -> Path:
    """The plot and, unless ``stopped``, the after-training sample table (``samples()``) and summary."""
    if history:
        # a normalize_then_sum total has mean ~0 in every batch: the components' raw means show what moved
        keys = component_keys(history[-1]) if aggregate == "normalize_then_sum" else []
        training_curves(rd.path / "reward_kl.png", history, keys or ["reward"], "kl" if has_kl else None)
    if stopped:
        again = f" (sharded with {sharding}: {SHARDING_HOW})" if sharding else ""
        print(
            f"textgym: interrupted; checkpoint saved. Continue with: textgym train --resume {shlex.quote(str(rd.path))}{again}"
        )
        return rd.path
    _report(rd, SAMPLES_AFTER, samples(), "after training")
    _print_trend(history, aggregate)
    print(f"textgym: run directory {rd.path}")
    return rd.path


def _print_trend(history: Sequence[dict[str, Any]], aggregate: str = "sum") -> None:
    """The reward's first and last quarter of the run. A ``normalize_then_sum`` total is standardised over
    each batch, so its mean is 0 whatever the policy: then each component's raw mean instead."""
    if not history:
        return
    count = "1 iteration" if len(history) == 1 else f"{len(history)} iterations"

    def mean(rows: Sequence[dict[str, Any]], key: str) -> float:
        values = [float(v) for r in rows if (v := r.get(key)) is not None and not math.isnan(float(v))]
        return float(np.mean(values)) if values else math.nan

    # the iterations that ended episodes (an SB3 rollout may end none: its reward is nan), or all of them
    ended = [r for r in history if not math.isnan(mean([r], "reward"))]
    history, which = (ended, " with episodes") if 0 < len(ended) < len(history) else (history, "")
    k = max(1, len(history) // 4)
    span = f"iteration{which}" if k == 1 else f"{k} iterations{which}"
    if aggregate != "normalize_then_sum":
        first, last = mean(history[:k], "reward"), mean(history[-k:], "reward")
        print(f"reward trend: {number(first)} (first {span}) -> {number(last)} (last {span}), {count}")
        return
    keys = component_keys(history[-1])
    moves = ", ".join(
        f"{key[8:-5]} {number(mean(history[:k], key))} -> {number(mean(history[-k:], key))}" for key in keys
    )
    print(
        f"reward trend (normalize_then_sum: the total is standardised per batch, so each component's raw mean, "
        f"first {span} -> last {span}): {moves}, {count}"
    )


# -- Stable-Baselines3 agents ------------------------------------------------------------------------
