"""Diagnostics during training: with an ``[eval]`` section, ``textgym train`` evaluates the policy on held-out
prompts before the first iteration, every ``every`` iterations, and after the last one (see
:mod:`textgym.evaluation` for what is measured).

```toml
[eval]
every = 10                  # iterations between evaluations
prompts = "copy-heldout"    # held-out prompt source (default: the training prompts)
episodes = 64               # completions per evaluation (same prompts and sampling seed every time)
rewards = [{ name = "match", label = "exact_copy", range = [0, 1] }]   # gold metrics (weight ignored)
builtin = ["kl", "length", "distinct_2", "eos_rate"]
```

Each evaluation is one row of ``eval.csv`` in the run directory (``iteration``, ``timesteps``, ``reward``,
every metric, ``<name>_se`` standard errors and ``<name>_n`` episode counts), is logged under ``eval/<name>`` (TensorBoard when the agent
logs there), and ``eval.png`` plots the curves at the end. Evaluations use their own prompts, env and
random streams: a run with ``[eval]`` trains exactly as the same run without it. On ``--resume``, rows past
the checkpoint are dropped, so no iteration appears twice.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from stable_baselines3.common.callbacks import BaseCallback
from tqdm.auto import tqdm

from textgym.eval_settings import REWARD, check_metric_specs
from textgym.evaluation import Evaluator
from textgym.rundir import RunDir

EVAL_CSV = "eval.csv"
EVAL_PLOT = "eval.png"


def finish_evaluations(callbacks: Sequence[BaseCallback], model: Any) -> None:
    """See :meth:`EvalCallback.complete`."""
    for callback in callbacks:
        if isinstance(callback, EvalCallback):
            callback.complete(model)


def training_callbacks(config: Mapping[str, Any], run_dir: Path) -> list[BaseCallback]:
    """The callbacks that ``textgym train`` adds for the run's ``[eval]`` section (none without one). The
    metric rewards are checked here, before the agent loads (plugin files are loaded by then)."""
    spec = config.get("eval")
    if not spec:
        return []
    check_metric_specs(spec["rewards"], "[eval] rewards: metric")
    if spec["prompts"] is not None:  # a typo or a missing file fails now, not after the policy loaded
        from textgym.errors import ConfigError, TextgymError
        from textgym.prompts import load_prompts

        try:
            load_prompts(spec["prompts"])
        except TextgymError as exc:
            raise ConfigError(f"[eval] prompts: {exc}") from None
    return [EvalCallback(config, spec, run_dir)]


class EvalCallback(BaseCallback):
    """Evaluates the policy every ``spec["every"]`` iterations and writes ``eval.csv``; see the module doc.

    Works with LM agents (one iteration = one batch of episodes) and SB3 agents (one iteration = one rollout).
    """

    def __init__(self, config: Mapping[str, Any], spec: Mapping[str, Any], run_dir: Path):
        super().__init__(verbose=0)
        self.config, self.spec, self.run_dir = config, spec, Path(run_dir)
        self.rows: list[dict[str, Any]] = []
        self.evaluator: Evaluator | None = None
        self._rollouts = 0

    # -- when ----------------------------------------------------------------------------------------
    def _iteration(self) -> int:
        model = self.model
        if hasattr(model, "iteration"):  # LM agents count their iterations
            return int(model.iteration)
        from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm
        from stable_baselines3.common.type_aliases import TrainFrequencyUnit

        if isinstance(model, OnPolicyAlgorithm):  # one rollout of n_steps per sub-env per update
            return int(model.num_timesteps // (model.n_steps * model.n_envs))
        # off-policy (DQN): a rollout is train_freq steps of every sub-env; its n_steps is the n-step return
        train_freq = getattr(model, "train_freq", None)
        if getattr(train_freq, "unit", None) == TrainFrequencyUnit.STEP:
            return int(model.num_timesteps // (train_freq.frequency * model.n_envs))
        return self._rollouts

    def _on_training_start(self) -> None:
        from textgym.agents.base import LMAgent

        self.lm_agent = lm_agent = isinstance(self.model, LMAgent)
        env = self.model.env if lm_agent else self.model.get_env()
        stack = env.reward_stack if lm_agent else env.get_attr("reward_stack")[0]
        evaluator, error = None, None
        try:  # a metric built on one process only (its plugin fails there): every process stops, naming it
            evaluator = Evaluator(self.config, self.spec, stack, lm_agent=lm_agent)
        except Exception as exc:
            error = exc
        self._agree(error)
        self.evaluator = evaluator
        self.main = self.model.accelerator.is_main_process if lm_agent else True
        path = self.run_dir / EVAL_CSV
        if path.is_file():  # a resumed run: keep the rows up to its checkpoint
            iteration = self._iteration()
            self.rows = [r for r in read_rows(path) if r["iteration"] <= iteration]

    def _agree(self, error: Exception | None) -> None:
        """Every process evaluates, each on its own: one that failed stops all (the others would wait in
        their next collective), each naming the failure."""
        if self.lm_agent:
            self.model.dist.agree(error)
        elif error is not None:
            raise error

    def _on_rollout_start(self) -> None:
        iteration = self._iteration()
        if iteration % self.spec["every"] == 0:
            self._evaluate(iteration)

    def _on_rollout_end(self) -> None:
        self._rollouts += 1

    def _on_step(self) -> bool:
        return True

    def _on_training_end(self) -> None:
        total = self.locals.get("total_timesteps")
        if total is not None and self.model.num_timesteps >= total:  # finished, not interrupted
            self._evaluate(self._iteration())
        if self.main and self.rows:
            plot_eval(self.run_dir / EVAL_PLOT, self.rows)
        if self.evaluator is not None:
            self.evaluator.close()

    def complete(self, model: Any) -> None:
        """A resume that finds every token trained has nothing for ``learn`` to do, which runs the final
        evaluation: here it runs, if the run was cut (a kill) before it wrote it."""
        self.init_callback(model)
        path = self.run_dir / EVAL_CSV
        if path.is_file() and any(r["iteration"] == self._iteration() for r in read_rows(path)):
            return
        self.on_training_start({"total_timesteps": model.num_timesteps}, {})
        self.on_training_end()

    # -- what ----------------------------------------------------------------------------------------
    def _evaluate(self, iteration: int) -> None:
        if self.evaluator is None or any(r["iteration"] == iteration for r in self.rows):
            return
        evaluation, error = None, None
        try:
            evaluation = self.evaluator(self.model)
        except Exception as exc:  # a metric failing on one process only: every process stops, naming it
            error = exc
        self._agree(error)
        row = {"iteration": iteration, "timesteps": int(self.model.num_timesteps), **evaluation.row()}
        self.rows.append(row)
        if not self.main:
            return
        RunDir(self.run_dir).write_file(EVAL_CSV, rows_csv(self.rows))  # (a full disk: one line)
        tqdm.write(eval_line(iteration, evaluation.metrics))
        logger = self.model.logger
        if logger is not None:
            for key, value in evaluation.metrics.items():
                logger.record(f"eval/{key}", value)
            logger.dump(step=int(self.model.num_timesteps))


def eval_line(iteration: int, metrics: Mapping[str, float]) -> str:
    """An evaluation as one console line, under the training's iteration lines (eval.csv has its errors)."""
    from textgym.formatting import number

    return f"eval {iteration:4d}  held out: " + "  ".join(f"{k} {number(v)}" for k, v in metrics.items())


def rows_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    """``rows`` as a CSV text (empty cells for missing values)."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    writer.writerows(
        {k: ("" if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows
    )
    return buffer.getvalue()


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of an ``eval.csv``: ``iteration``, ``timesteps`` and the ``<name>_n`` episode counts as ints,
    the rest as floats (NaN = empty)."""
    with path.open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    out = []
    for row in rows:
        parsed: dict[str, Any] = {}
        for key, value in row.items():
            if key in ("iteration", "timesteps"):
                parsed[key] = int(value)
            elif value in ("", None):
                parsed[key] = math.nan
            else:  # (an older run's metric label may end in _n: only whole counts are read as ints)
                number = float(value)
                parsed[key] = int(number) if key.endswith("_n") and number.is_integer() else number
        out.append(parsed)
    return out


def plot_eval(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    """:func:`eval_figure` of ``rows``, saved to ``path``."""
    from textgym.plotting import save_figure

    save_figure(eval_figure(rows), Path(path), dpi=90)


def eval_figure(rows: Sequence[Mapping[str, Any]]) -> Any:
    """One panel per metric against generated tokens, with ±1 standard error where there is one."""
    from textgym.plotting import fit, pyplot

    plt = pyplot()
    columns = dict.fromkeys(k for r in rows for k in r)  # a metric may join after the first row
    names = [k for k in columns if k not in ("iteration", "timesteps") and not k.endswith(("_se", "_n"))]
    names.sort(key=lambda k: k != REWARD)
    cols = min(3, len(names))
    nrows = math.ceil(len(names) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.2 * nrows), squeeze=False)
    x = [r["timesteps"] for r in rows]
    for ax, name in zip(axes.flat, names):
        y = [r.get(name, math.nan) for r in rows]
        ax.plot(x, y, marker="o", markersize=3)
        if all(math.isnan(v) for v in y):  # an empty panel, its axis from -0.04 to 0.04, read as a plot
            ax.text(0.5, 0.5, "no value in any evaluation", transform=ax.transAxes, ha="center", va="center")
            ax.set_yticks([])
        se = [r.get(f"{name}_se", math.nan) for r in rows]
        if any(not math.isnan(s) for s in se):
            ax.fill_between(x, [a - b for a, b in zip(y, se)], [a + b for a, b in zip(y, se)], alpha=0.2)
        ax.set_title(name if name != REWARD else "reward (training total, held-out)")
        ax.set_xlabel("generated tokens")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(names) :]:
        ax.set_visible(False)
    fit(fig)
    return fig
