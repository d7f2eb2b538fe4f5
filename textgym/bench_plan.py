"""What a ``textgym bench`` trains and evaluates: one :class:`Job` per agent, design and seed, with the config it
trains with and the digests that decide whether a finished run is reused, evaluated again or refused
(:mod:`textgym.bench`), and what each column of a run's held-out curve measures (:func:`curve_parts`)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from textgym.bench_identity import _digest, evaluation_files, identity

__all__ = ["EVAL_SEED", "Job", "curve_parts", "eval_settings", "plan"]

EVAL_SEED = 1234  # every run is evaluated on the same prompts with the same sampling seed


@dataclass
class Job:
    """One run of the bench: an agent, a design and a seed, with the config it trains with."""

    agent: dict[str, Any]  # label, table, lm
    design: dict[str, Any]  # name, rewards
    seed: int
    run_dir: Path
    run_id: str  # run_dir relative to the bench's runs/ folder
    config: dict[str, Any]
    identity: dict[str, Any]  # what its training depends on (see identity())
    config_hash: str  # the training: config and code files, without the held-out evaluation settings
    curves_hash: str  # the settings of the held-out curves measured during training ([eval])
    eval_files: dict[str, Any]  # the digests of the evaluation's files (evaluation_files) it was planned with
    evaluation: dict[str, Any]  # the final evaluation's settings and files (eval.json keeps them, to diff)
    curve_parts: dict[str, Any] | None = None  # the curves' columns one by one (curve_parts); None: no curves

    @property
    def eval_hash(self) -> str:
        """A digest of :attr:`evaluation`: equal digests mean the same evaluation."""
        return _digest(self.evaluation)


# -- the plan ------------------------------------------------------------------------------------------
def eval_settings(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The ``[eval]`` settings of the bench's evaluations (the same for every run)."""
    bench = spec["bench"]
    return {
        "every": max(1, bench["eval_every"]),
        "prompts": bench["eval_prompts"],
        "episodes": bench["eval_episodes"],
        "rewards": spec["metric_rewards"],
        "builtin": spec["builtin"],
        "seed": EVAL_SEED,
    }


def _measured(settings: Mapping[str, Any]) -> dict[str, Any]:
    """What an evaluation measures: its settings without ``every`` (when it runs)."""
    return {k: v for k, v in settings.items() if k != "every"}


def curve_parts(spec: Mapping[str, Any]) -> dict[str, Any]:
    """What each column of a held-out curve measures, in digests: ``base``, what every column shares (the
    prompts and their file, the episodes, the sampling seed); ``metrics``, each metric reward's label -> its
    spec and files; ``builtin``, the built-in metrics measured. A finished run whose curve has the same base
    keeps the columns of the metrics that did not change when the metric list does
    (:func:`textgym.bench_results.kept_columns`): adding a metric does not lose every run's curve."""
    settings = _measured(eval_settings(spec))
    shared = {k: v for k, v in settings.items() if k not in ("rewards", "builtin")}
    # (a metric's range only clips intervals, and its weight is ignored: neither changes what it measured)
    metrics = {
        m["label"]: _digest(
            {
                "spec": {k: v for k, v in m.items() if k not in ("range", "weight")},
                **evaluation_files({**spec, "metric_rewards": [m]}),
            }
        )
        for m in spec["metric_rewards"]
    }
    base = _digest({**shared, **evaluation_files({**spec, "metric_rewards": []})})
    return {"base": base, "metrics": metrics, "builtin": sorted(settings["builtin"])}


def plan(spec: Mapping[str, Any], out: Path) -> list[Job]:
    """Every (agent, design, seed) run with its config and hashes, agents outermost."""
    from textgym.config import validate

    jobs = []
    # the metric code and held-out data by content: an edited file gets the runs evaluated again
    files = evaluation_files(spec)
    # `every` spaces the curve points, each measured alike whatever the spacing: a change of it alone
    # neither evaluates the finished runs again nor hides the curves they have
    evaluation = {**_measured(eval_settings(spec)), "samples": spec["bench"]["samples_in_report"], **files}
    reward_models = {e["output"]: e["digest"] for e in spec.get("reward_models", [])}
    # what an LM agent's curves measure, whether or not this plan measures any (eval_every = 0 keeps those
    # that finished runs have; their settings were hashed the same way): the same for every run
    curves_hash, parts = _digest({**_measured(eval_settings(spec)), **files}), curve_parts(spec)
    for agent in spec["agents"]:
        for design in spec["designs"]:
            for seed in spec["bench"]["seeds"]:
                run_id = f"{design['name']}-seed{seed}"
                if spec["agent_axis"]:
                    run_id = f"{agent['label']}/{run_id}"
                run_dir = out / "runs" / run_id
                config = copy.deepcopy(spec["base"])
                config["agent"] = copy.deepcopy(agent["table"])
                config["run"].update(output_dir=str(run_dir), seed=seed)
                config["env"]["rewards"] = copy.deepcopy(design["rewards"])
                if agent["lm"] and spec["bench"]["eval_every"]:  # held-out curves during training
                    config["eval"] = eval_settings(spec)
                config = validate(config, f"run {run_id}")
                ident = identity(config, reward_models)
                lm = agent["lm"]  # (an SB3 agent has no curves)
                hashes = _digest(ident), curves_hash if lm else _digest(None)
                jobs.append(
                    Job(agent, design, seed, run_dir, run_id, config, ident, *hashes, files, evaluation,
                        parts if lm else None)
                )  # fmt: skip
    return jobs
