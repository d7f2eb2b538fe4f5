"""``textgym bench``: train every reward design for every seed, evaluate all on the same held-out prompts,
and report means with 95% confidence intervals, rankings, samples and plots.

The designs file is TOML: ``[bench]`` settings, the shared ``[run]``, ``[env]`` and ``[agent]`` tables of
``textgym train``, one ``[[designs]]`` table per reward design (``name``, ``rewards``), and ``[metrics]``:
``rewards`` (reward specs scored on the held-out completions, including "gold" rewards that no design
trains on) and ``builtin`` (``kl``, ``length``, ``distinct_2``, ``eos_rate``). See docs/bench.md.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from textgym import plugin_manager
from textgym.config import apply_override, read_toml, validate
from textgym.errors import ConfigError
from textgym.formatting import applicable_mean
from textgym.reward_functions import resolve_fn_paths
from textgym.rewards import RewardStack, build_reward, check_reward_specs, make_reward
from textgym.scoring import corpus_distinct_n

BUILTIN_METRICS = {"kl": "lower", "length": None, "distinct_2": "higher", "eos_rate": "higher"}
BENCH_DEFAULTS: dict[str, Any] = {
    "output_dir": None,
    "seeds": [0, 1],
    "eval_prompts": None,
    "eval_episodes": 32,
    "samples_in_report": 3,
}
EVAL_FILE = "eval.json"
EVAL_SEED = 1234  # every run is evaluated on the same prompts with the same sampling seed


# -- the designs file ------------------------------------------------------------------------------
def load_designs(path: str | Path | Mapping[str, Any], overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Parse and validate a designs file (or dict). Every reward and metric name is checked here, before
    any training starts."""
    if isinstance(path, Mapping):
        raw, source, base_dir = copy.deepcopy(dict(path)), "the designs", Path.cwd()
    else:
        raw, source, base_dir = read_toml(path, "designs file"), str(path), Path(path).resolve().parent
    for override in overrides:
        apply_override(raw, override)
    bench = {**BENCH_DEFAULTS, **raw.pop("bench", {})}
    unknown = set(bench) - set(BENCH_DEFAULTS)
    if unknown:
        raise ConfigError(
            f"{source}: unknown key bench.{sorted(unknown)[0]}. Keys: {', '.join(BENCH_DEFAULTS)}."
        )
    designs = raw.pop("designs", None)
    metrics = raw.pop("metrics", {})
    if not designs or not isinstance(designs, list):
        raise ConfigError(f"{source}: give at least one [[designs]] table with a name and rewards.")
    names = [d.get("name") for d in designs]
    if any(not isinstance(n, str) or not n for n in names) or len(set(names)) != len(names):
        raise ConfigError(f"{source}: every design needs a unique, non-empty name (got {names}).")
    for design in designs:
        if set(design) - {"name", "rewards"}:
            raise ConfigError(
                f"{source}: design {design['name']!r} has unknown keys {sorted(set(design) - {'name', 'rewards'})}."
            )
        if not design.get("rewards"):
            raise ConfigError(f"{source}: design {design['name']!r} has no rewards.")
        # `fn` files resolve against the designs file, and are stored absolute so training agrees
        design["rewards"] = resolve_fn_paths(design["rewards"], base_dir)
        check_reward_specs(design["rewards"], where=f"design {design['name']!r}")
    if set(metrics) - {"rewards", "builtin"}:
        raise ConfigError(
            f"{source}: [metrics] takes 'rewards' and 'builtin', not {sorted(set(metrics) - {'rewards', 'builtin'})}."
        )
    metric_rewards = [resolve_fn_paths(m, base_dir) for m in metrics.get("rewards", [])]
    check_reward_specs(
        [{k: v for k, v in m.items() if k != "label"} for m in metric_rewards],
        where="[metrics] rewards",
        allow_all_metrics=True,
    )
    labels = [m.get("label", m.get("name", str(m.get("fn")).rpartition(":")[2])) for m in metric_rewards]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"{source}: metric names {labels} repeat; give the metrics distinct `label`s.")
    builtin = metrics.get("builtin", list(BUILTIN_METRICS))
    for name in builtin:
        if name not in BUILTIN_METRICS:
            from textgym.errors import UnknownNameError

            raise UnknownNameError("metric", name, BUILTIN_METRICS)
    if (
        not isinstance(bench["seeds"], list)
        or not bench["seeds"]
        or not all(isinstance(s, int) for s in bench["seeds"])
    ):
        raise ConfigError(
            f"{source}: bench.seeds must be a non-empty list of integers, not {bench['seeds']!r}."
        )
    if "rewards" in raw.get("env", {}):
        raise ConfigError(f"{source}: rewards belong to the designs, not to [env].")
    base = validate(raw, source)  # [run], [env], [agent] as textgym train takes them
    plugin_manager.load_agent(base["agent"]["name"])  # an unknown agent fails now, too
    return {
        "bench": bench,
        "base": base,
        "designs": designs,
        "metric_rewards": metric_rewards,
        "builtin": builtin,
    }


# -- statistics ------------------------------------------------------------------------------------
def mean_ci(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Mean and the two-sided Student-t confidence interval of the mean (NaN bounds for one value)."""
    from scipy import stats

    x = np.asarray([v for v in values if v is not None and not math.isnan(v)], dtype=float)
    if len(x) == 0:
        return math.nan, math.nan, math.nan
    mean = float(x.mean())
    if len(x) < 2:
        return mean, math.nan, math.nan
    half = float(stats.t.ppf((1 + confidence) / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x)))
    return mean, mean - half, mean + half


def metric_directions(metric_names: Sequence[str], builtin: Sequence[str]) -> dict[str, str | None]:
    """Which way is better: rewards higher, KL lower, length unranked."""
    return {**{name: "higher" for name in metric_names}, **{name: BUILTIN_METRICS[name] for name in builtin}}


def summarize(
    results: Sequence[dict[str, Any]], directions: Mapping[str, str | None]
) -> list[dict[str, Any]]:
    """One row per (design, metric): n, mean, 95% CI, and the rank among designs (1 = best)."""
    rows = []
    designs = list(dict.fromkeys(r["design"] for r in results))
    for metric, direction in directions.items():
        stats = {}
        for design in designs:
            values = [r["value"] for r in results if r["design"] == design and r["metric"] == metric]
            if values:
                stats[design] = (len(values), *mean_ci(values))
        order = sorted(
            (d for d in stats if not math.isnan(stats[d][1])),
            key=lambda d: stats[d][1],
            reverse=direction == "higher",
        )
        for design, (n, mean, low, high) in stats.items():
            rank = None
            if direction and design in order:  # competition ranking: ties share the better rank
                better = [stats[d][1] > mean if direction == "higher" else stats[d][1] < mean for d in order]
                rank = 1 + sum(better)
            rows.append(
                {
                    "design": design,
                    "metric": metric,
                    "n": n,
                    "mean": mean,
                    "ci_low": low,
                    "ci_high": high,
                    "rank": rank,
                }
            )
    return rows


def metric_stack(specs: Sequence[Mapping[str, Any]]) -> RewardStack:
    """The metric rewards as a stack of weight-0 rewards, each named by its ``label`` (default: its name)."""
    rewards = []
    for spec in specs:
        reward, _ = build_reward({k: v for k, v in spec.items() if k not in ("weight", "label")})
        reward.name = spec.get("label", reward.name)
        rewards.append((reward, 0.0))
    if not rewards:  # the env needs a stack; nothing of it is reported
        rewards.append((make_reward("length_penalty", target=1), 0.0))
    return RewardStack(rewards)


# -- one run ---------------------------------------------------------------------------------------
def _run_config(spec: dict[str, Any], design: dict[str, Any], seed: int, run_dir: Path) -> dict[str, Any]:
    config = copy.deepcopy(spec["base"])
    config["run"].update(output_dir=str(run_dir), seed=seed)
    config["env"]["rewards"] = design["rewards"]
    return config


def evaluate(run_dir: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """Score a trained run on the held-out prompts: every metric, and a few samples."""
    config = spec["base"]
    agent_class = plugin_manager.load_agent(config["agent"]["name"])
    stack = metric_stack(spec["metric_rewards"])
    n = spec["bench"]["eval_episodes"]
    kwargs = {k: v for k, v in config["env"].items() if k not in ("id", "num_envs")}
    kwargs.update(rewards=stack, prompt_order="sequential")
    if spec["bench"]["eval_prompts"] is not None:
        kwargs["prompts"] = spec["bench"]["eval_prompts"]
    from textgym.train import is_lm_agent

    if is_lm_agent(agent_class):
        kwargs.setdefault("model", config["agent"]["policy"])  # the policy's tokenizer, as in training
        episodes, kls = _evaluate_native(agent_class, run_dir, config, kwargs, n)
    else:
        episodes, kls = _evaluate_sb3(agent_class, run_dir, config, kwargs, n)
    metrics = {
        name: applicable_mean([e["reward_components"][name] for e in episodes])
        for name in (stack.names if spec["metric_rewards"] else [])
    }
    builtin = spec["builtin"]
    if "kl" in builtin:
        metrics["kl"] = float(np.mean(kls)) if kls else math.nan
    if "length" in builtin:
        metrics["length"] = float(np.mean([e["num_tokens"] for e in episodes]))
    if "distinct_2" in builtin:
        metrics["distinct_2"] = corpus_distinct_n([e["tokens"] for e in episodes], 2)
    if "eos_rate" in builtin:
        metrics["eos_rate"] = float(np.mean([e["finish_reason"] == "stop" for e in episodes]))
    samples = [
        {k: v for k, v in e.items() if k != "tokens"} for e in episodes[: spec["bench"]["samples_in_report"]]
    ]
    return {"metrics": metrics, "samples": samples}


def _evaluate_native(
    agent_class: Any, run_dir: Path, config: dict[str, Any], kwargs: dict[str, Any], n: int
) -> tuple[list[dict[str, Any]], list[float]]:
    import gymnasium
    import torch

    from textgym.agents.base import RolloutBatch
    from textgym.sampling import rollout

    num_envs = min(n, config["env"]["num_envs"])
    env = gymnasium.make_vec(
        config["env"]["id"],
        num_envs=num_envs,
        vectorization_mode="vector_entry_point",
        autoreset_mode="Disabled",
        **kwargs,
    )
    agent = agent_class.load(run_dir / "checkpoint", env)
    episodes: list[dict[str, Any]] = []
    kls: list[float] = []
    for round_ in range(math.ceil(n / num_envs)):
        r = rollout(agent.policy, env, temperature=agent.config.temperature, seed=EVAL_SEED + round_)
        with torch.no_grad():
            kls.extend(agent.sequence_kl(RolloutBatch.from_rollout(r)).tolist())
        for row, info in enumerate(r.infos):
            info["tokens"] = r.response_ids[row][r.response_mask[row].bool()].tolist()
            episodes.append(info)
    return episodes[:n], kls[:n]


def _evaluate_sb3(
    agent_class: Any, run_dir: Path, config: dict[str, Any], kwargs: dict[str, Any], n: int
) -> tuple[list[dict[str, Any]], list[float]]:
    from textgym.sb3 import make_vec_env

    env = make_vec_env(
        config["env"]["id"], n_envs=min(n, config["env"]["num_envs"]), seed=EVAL_SEED, **kwargs
    )
    from textgym.train import load_sb3_run

    agent = load_sb3_run(run_dir, env)
    obs, episodes = env.reset(), []
    while len(episodes) < n:
        obs, _, dones, infos = env.step(agent.predict(obs, deterministic=False)[0])
        for i in np.flatnonzero(dones):
            infos[i]["tokens"] = env.env.tokenizer.encode(infos[i]["completion"])
            episodes.append(infos[i])
    return episodes[:n], []


# -- the whole bench -------------------------------------------------------------------------------
def run(
    designs: str | Path | Mapping[str, Any], overrides: Sequence[str] = (), progress: bool = True
) -> Path:
    """Train and evaluate every design for every seed; write results, summary, report and plots.

    Finished runs (with an ``eval.json``) are not redone; a run that was interrupted in training resumes
    from its checkpoint. Returns the output directory.
    """
    from tqdm.auto import tqdm

    from textgym.rundir import RunDir
    from textgym.train import run as train

    spec = load_designs(designs, overrides)
    stem = Path(designs).stem if isinstance(designs, (str, os.PathLike)) else "bench"
    out = Path(spec["bench"]["output_dir"] or f"runs/bench-{stem}")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    jobs = [(d, s) for d in spec["designs"] for s in spec["bench"]["seeds"]]
    with tqdm(total=len(jobs), desc="bench", unit="run", disable=not progress) as bar:
        for design, seed in jobs:
            run_dir = out / "runs" / f"{design['name']}-seed{seed}"
            bar.set_postfix(run=run_dir.name)
            if not (run_dir / EVAL_FILE).is_file():
                log = io.StringIO()
                with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                    try:
                        if (run_dir / "config.toml").is_file():
                            train(resume=run_dir)
                        else:
                            train(config=_run_config(spec, design, seed, run_dir))
                    finally:  # a start that failed left no run directory: its log goes next to it
                        where = (
                            run_dir / "train.log" if RunDir(run_dir).is_run() else run_dir.with_suffix(".log")
                        )
                        with where.open("a", encoding="utf-8") as f:
                            f.write(log.getvalue())
                result = {"design": design["name"], "seed": seed, **evaluate(run_dir, spec)}
                tmp = run_dir / f".{EVAL_FILE}.tmp"
                tmp.write_text(json.dumps(result, indent=2))
                os.replace(tmp, run_dir / EVAL_FILE)  # written last: its presence means "finished"
            bar.update(1)
    write_outputs(out, spec)
    return out


def write_outputs(out: Path, spec: dict[str, Any]) -> None:
    evals = []
    for design in spec["designs"]:
        for seed in spec["bench"]["seeds"]:
            evals.append(json.loads((out / "runs" / f"{design['name']}-seed{seed}" / EVAL_FILE).read_text()))
    results = [
        {"design": e["design"], "seed": e["seed"], "metric": m, "value": v}
        for e in evals
        for m, v in e["metrics"].items()
    ]
    with (out / "results.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in results)
    metric_names = [m for m in evals[0]["metrics"] if m not in BUILTIN_METRICS]
    directions = metric_directions(metric_names, [m for m in spec["builtin"]])
    summary = summarize(results, directions)
    with (out / "summary.csv").open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=["design", "metric", "n", "mean", "ci_low", "ci_high", "rank"])
        writer.writeheader()
        writer.writerows(summary)
    from textgym.bench_report import plot_all, write_report

    write_report(out / "report.md", spec, summary, directions, evals)
    plot_all(out, spec, summary, results)
