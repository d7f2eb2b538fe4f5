"""``textgym bench``: train every reward design with every agent for every seed, evaluate all runs on the
same held-out prompts, and report means with confidence intervals, paired comparisons, significance-aware
rankings, flags, samples and plots (``report.md`` and a self-contained ``report.html``).

The designs file is described in :mod:`textgym.bench_config` and docs/bench.md. Each run is a ``textgym
train`` run directory under ``runs/`` (``runs/<design>-seed<seed>``, or ``runs/<agent>/<design>-seed<seed>``
with an ``[[agents]]`` list). A bench never reports results it did not compute: ``bench.json`` records the
resolved config each run was started with (and a digest of the plugin and reward-function files it uses),
and every ``eval.json`` the config and evaluation settings it was computed for. A finished run is reused
only when both still match; a run whose training config changed is refused, naming what changed; a run whose
evaluation settings changed is evaluated again from its checkpoint, and its held-out curves (measured
during training with the old settings) are left out of the report.

A run that fails does not stop the bench: the others run, the report leaves out the designs (or agents)
whose runs did not all finish, and the bench ends in :class:`~textgym.errors.RunsFailed` naming each failed
run and its log. Running the bench again resumes a failed run, or starts it again when its config changed.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from textgym import bench_rm
from textgym.bench_config import BENCH_DEFAULTS, load_designs
from textgym.bench_identity import file_digest, file_stats
from textgym.bench_numbers import named
from textgym.bench_plan import Job, eval_settings, plan
from textgym.bench_records import (
    EVAL_FILE,
    INDEX_FILE,
    actions,
    add_curve_parts,
    evaluation_changes,
    group_of,
    record_failures,
    record_left_out,
    record_start,
    write_json,
)
from textgym.bench_stats import mean_ci
from textgym.errors import ConfigError, RunsFailed, TextgymError, WriteError
from textgym.eval_settings import BUILTIN_METRICS
from textgym.run_log import logged_to
from textgym.rundir import DISK_FULL

__all__ = [
    "BENCH_DEFAULTS", "BUILTIN_METRICS", "Job", "RunsFailed", "Stopped", "evaluate", "load_designs", "mean_ci", "plan",
    "run",
]  # fmt: skip

LOCK_FILE = ".bench.lock"  # held by the bench that runs in the directory
ACTION_WORDS = {
    "reuse": "reused",
    "evaluate": "to evaluate again",
    "train": "to train",
    "resume": "to resume (interrupted, or failed)",
    "restart": "to train again from the start (a run of their design failed, and its config changed since)",
}


class _Changed(ConfigError):
    """A file the bench planned with changed while it ran: the bench stops."""


class Stopped(KeyboardInterrupt):
    """A Ctrl-C or SIGTERM stopped a run after its checkpoint. The bench stops there, without evaluating the
    half-trained run (an ``eval.json`` would mark it finished): running the bench again resumes it."""


# -- one run -------------------------------------------------------------------------------------------
def _train(job: Job) -> None:
    from textgym import train as training
    from textgym.rundir import RunDir

    with logged_to(job.run_dir / "train.log"):
        if RunDir(job.run_dir).is_run():  # interrupted: resumed (from the start if it has no checkpoint)
            training.run(resume=job.run_dir)
        else:
            training.run(config=copy.deepcopy(job.config))


def evaluate(job: Job, spec: Mapping[str, Any]) -> dict[str, Any]:
    """Score a trained run on the held-out prompts: every metric, component statistics and samples."""
    from textgym.agent_config import find_agent
    from textgym.evaluation import Evaluator
    from textgym.rewards import build_reward_stack
    from textgym.sb3 import load_sb3_run
    from textgym.train import CHECKPOINT

    agent_class = find_agent(job.config["agent"]["name"])
    stack = build_reward_stack(job.config["env"]["rewards"])
    stack.set_progress(1.0)  # scheduled weights as they ended training
    evaluator = Evaluator(job.config, eval_settings(spec), stack, lm_agent=job.agent["lm"])
    load_env = None  # an SB3 agent loads onto an env of its own
    try:
        if job.agent["lm"]:
            agent = agent_class.load(job.run_dir / CHECKPOINT)
        else:  # SB3: loaded without unpickling (the pickled objects come from a fresh agent)
            from textgym.sb3 import make_vec_env

            env_kwargs = {k: v for k, v in job.config["env"].items() if k not in ("id", "num_envs")}
            # as many sub-envs as it trained on: with one, SB3 warned that its batch_size does not divide
            # n_steps * n_envs
            n = job.config["env"]["num_envs"]
            load_env = make_vec_env(job.config["env"]["id"], n_envs=n, **{**env_kwargs, "rewards": stack})
            agent = load_sb3_run(job.run_dir, load_env)
        result = evaluator(agent)
    finally:
        evaluator.close()
        (stack if load_env is None else load_env).close()  # the env closes its responder, then the stack
    return {
        "agent": job.agent["label"],
        "design": job.design["name"],
        "seed": job.seed,
        "config_hash": job.config_hash,
        "eval_hash": job.eval_hash,
        "evaluation": job.evaluation,
        "metrics": result.metrics,
        "errors": result.errors,
        "counts": result.counts,  # the episodes each mean is over (those its metric applied to)
        "components": result.components,
        "samples": result.episodes[: spec["bench"]["samples_in_report"]],
    }


# -- the whole bench -----------------------------------------------------------------------------------
def run(
    designs: str | Path | Mapping[str, Any],
    overrides: Sequence[str] = (),
    progress: bool = True,
    plugins: Sequence[str] = (),
) -> Path:
    """Train and evaluate every agent x design x seed; write results, summary, comparisons, reports and
    plots. Returns the output directory.

    ``plugins`` (``textgym bench --plugin FILE.py``) join every run's ``run.plugins``: so a run's identity
    holds their digests (a changed file is not reused) and each run resumes on its own.

    Everything is checked before the first run trains: the designs file, and every run already in the
    output directory (see the module doc for when a run is reused, evaluated again or refused).
    """
    spec = load_designs(designs, overrides)
    listed = spec["base"]["run"]["plugins"]
    listed += [p for p in (str(Path(f).expanduser().resolve()) for f in plugins) if p not in listed]
    stem = Path(designs).stem if isinstance(designs, (str, os.PathLike)) else "bench"
    out = Path(spec["bench"]["output_dir"] or f"runs/bench-{stem}").expanduser()
    _check_owned(out)
    created = not out.exists()
    lock = _lock(out)  # held to the end: two benches in one directory would record over each other's runs
    try:
        return _run(spec, out, progress)
    finally:
        if created and [p.name for p in out.iterdir()] == [LOCK_FILE]:  # refused before it wrote anything
            shutil.rmtree(out, ignore_errors=True)  # (with the lock held: no other bench is in it)
        os.close(lock)


def _run(spec: Mapping[str, Any], out: Path, progress: bool) -> Path:
    from tqdm.auto import tqdm

    from textgym.rundir import RunDir

    jobs = plan(spec, out)
    add_curve_parts(out, jobs)
    todo = actions(jobs, out)
    said_as = {  # a run to train whose directory is there resumes (an interrupted or a failed one)
        j.run_id: "resume" if todo[j.run_id] == "train" and RunDir(j.run_dir).is_run() else todo[j.run_id]
        for j in jobs
    }
    if progress and any(action != "train" for action in said_as.values()):  # a rerun says what it redoes
        counts = collections.Counter(said_as.values())
        said = []
        for action, what in ACTION_WORDS.items():
            if counts[action]:  # and why the evaluated ones are evaluated again
                why = f" ({evaluation_changes(jobs, todo)})" if action == "evaluate" else ""
                said.append(f"{counts[action]} {what}{why}")
        print(f"textgym: {len(todo)} runs in {out}: {', '.join(said)}")
    bench_rm.pending(spec["reward_models"])  # a proxy model this bench cannot reuse fails now, too
    with _threads(spec["bench"]["threads"]):
        bench_rm.prepare(spec["reward_models"], progress=progress)
        (out / "runs").mkdir(parents=True, exist_ok=True)
        failed: dict[str, dict[str, str]] = {}  # run_id -> its error and log
        # a reused run is finished: a mark from a failed evaluation since is old news
        record_failures(out, {j.run_id: None for j in jobs if todo[j.run_id] == "reuse"})
        with tqdm(total=len(jobs), desc="bench", unit="run", disable=not progress) as bar:
            for job in jobs:
                bar.set_postfix(run=job.run_id)
                if todo[job.run_id] in ("train", "restart"):
                    _check_unchanged(job.identity)
                    if todo[job.run_id] == "restart":
                        shutil.rmtree(job.run_dir)
                    record_start(out, job)
                if todo[job.run_id] != "reuse":
                    try:
                        result = _train_and_evaluate(job, spec, todo[job.run_id] != "evaluate")
                    except Exception as exc:  # (a Ctrl-C is not one: it stops the bench)
                        # a full disk (textgym's own writes or another's), a file edited meanwhile: every run
                        # after it would fail alike, or use other files than its record says
                        full = isinstance(exc, OSError) and exc.errno in DISK_FULL
                        if full or isinstance(exc, (WriteError, _Changed)):
                            raise
                        failed[job.run_id] = _failure(out, job, exc)
                        if progress:
                            tqdm.write(f"textgym: {job.run_id} failed: {failed[job.run_id]['error']}")
                    else:
                        write_json(job.run_dir / EVAL_FILE, result)  # written last: it means "finished"
                        record_failures(out, {job.run_id: None})
                bar.update(1)
        if failed:
            _report_failures(out, spec, jobs, failed)
        from textgym.bench_results import write_outputs

        write_outputs(out, spec, jobs)
        record_left_out(out, [], [])
    return out


def _train_and_evaluate(job: Job, spec: Mapping[str, Any], train: bool) -> dict[str, Any]:
    """Train the run (when ``train``) and evaluate it: its ``eval.json``."""
    from textgym.rundir import RunDir

    if train:
        _train(job)
        total, trained = job.config["run"]["total_timesteps"], RunDir(job.run_dir)
        if not trained.finished(total):  # a signal stopped it and it saved (else it raised)
            raise Stopped(
                f"bench stopped: {job.run_id} saved its checkpoint at {trained.tokens_trained()} "
                f"tokens ({total} to train); the same command continues it"
            )
    _check_unchanged(job.eval_files)
    evaluated = RunDir(job.run_dir).checkpoint  # what a rerun checks (see bench_records.edited_since)
    checkpoint = {"checkpoint": file_digest(evaluated), "checkpoint_files": file_stats(evaluated)}
    with logged_to(job.run_dir / "train.log"):
        return {**evaluate(job, spec), **checkpoint}


def _failure(out: Path, job: Job, exc: Exception) -> dict[str, str]:
    """A run's failure, recorded: its traceback at the end of its log, and its error and log in
    ``bench.json`` (a later bench starts it again when its config changed). Returns the record."""
    import traceback

    from textgym.formatting import one_line
    from textgym.run_log import log_file

    log = log_file(job.run_dir / "train.log")
    with contextlib.suppress(OSError):  # (a full disk: the error below is recorded all the same)
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a", encoding="utf-8") as f:
            f.write("\n" + "".join(traceback.format_exception(exc)))
    error = str(exc) if isinstance(exc, TextgymError) else f"{type(exc).__name__}: {exc}"
    failure = {"error": one_line(error), "log": str(log)}
    record_failures(out, {job.run_id: failure})
    return failure


def _report_failures(
    out: Path, spec: Mapping[str, Any], jobs: Sequence[Job], failed: Mapping[str, Mapping[str, str]]
) -> None:
    """Report the designs (or agents) whose runs all finished, and raise :class:`RunsFailed` naming each run
    that failed. A design with one failed seed is left out whole: its finished seeds alone would compare
    the runs that went well."""
    from textgym.bench_results import write_outputs

    groups = {group_of(job) for job in jobs if job.run_id in failed}
    designs, agents = left_out(
        groups, [a["label"] for a in spec["agents"]], [d["name"] for d in spec["designs"]]
    )
    kept = [j for j in jobs if j.design["name"] not in designs and j.agent["label"] not in agents]
    runs = "; ".join(f"{run_id}: {f['error']} (log: {f['log']})" for run_id, f in list(failed.items())[:3])
    runs += f"; and {len(failed) - 3} more" if len(failed) > 3 else ""
    said = named(designs, agents, repr)
    reduced = {
        **spec,
        "designs": [d for d in spec["designs"] if d["name"] not in designs],
        "agents": [a for a in spec["agents"] if a["label"] not in agents],
    }
    write_outputs(out, reduced, kept, failed=failed, left_out=(designs, agents))
    record_left_out(out, designs, agents)  # (after: until then, the report on disk shows them)
    if kept:
        reported = f"The report in {out / 'report.md'} leaves out {' and '.join(said)}"
    else:
        reported = f"{out / 'report.md'} names the failed runs only: no design had all its runs finish"
    raise RunsFailed(
        f"{len(failed)} of {len(jobs)} runs failed: {runs}. {reported}: {'an agent' if agents else 'a design'} "
        f"is reported only when all its runs finished. Fix what failed and run the bench again: a failed run "
        f"resumes, or trains again from the start where the fix changed its design's config; the other runs "
        f"are reused where their config is unchanged (a fix in a file every run uses, such as a --plugin file, "
        f"changes every run's)."
    )


def left_out(
    failed: set[tuple[str, str]], agents: Sequence[str], designs: Sequence[str]
) -> tuple[list[str], list[str]]:
    """The designs and agents to leave out of the report for the (agent, design) groups that ``failed``:
    the failed designs, or the failed agents where that keeps more groups (one agent failed on every
    design, say). The report's tables stay whole: every design it shows has every agent it shows."""
    by_design = [d for d in designs if any((a, d) in failed for a in agents)]
    by_agent = [a for a in agents if any((a, d) in failed for d in designs)]
    if (len(agents) - len(by_agent)) * len(designs) > len(agents) * (len(designs) - len(by_design)):
        return [], by_agent
    return by_design, []


def _lock(out: Path) -> int:
    """The bench's lock on its output directory (see :func:`textgym.rundir.hold_lock`)."""
    from textgym.rundir import hold_lock

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create bench.output_dir {str(out)!r}: {exc.strerror or exc}; choose a writable place."
        ) from None
    return hold_lock(
        out / LOCK_FILE,
        in_use=lambda holder: (
            f"another textgym bench (process {holder}) is running in {out}: two benches in one directory "
            f"would train and record runs over each other. Wait for it to finish, or give this bench its own "
            f"bench.output_dir."
        ),
        unwritable=f"cannot lock bench.output_dir {str(out)!r}",
    )


def _check_owned(out: Path) -> None:
    """Refuse an output directory that holds anything but a bench's own files: a bench writes its reports,
    plots and CSVs there, over files of the same names."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"bench.output_dir {str(out)!r} is a file, not a directory.")
    found = sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE) if out.is_dir() else []
    started = (out / INDEX_FILE).is_file() or (found == ["runs"] and not any((out / "runs").iterdir()))
    if found and not started:
        shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
        raise ConfigError(
            f"bench.output_dir {str(out)!r} holds files no bench wrote ({shown}; no {INDEX_FILE}): a bench "
            f"writes its reports there over files of the same names, so it never writes into a directory it "
            f"does not own. Give it a new or empty bench.output_dir."
        )


def _check_unchanged(recorded: Mapping[str, Any]) -> None:
    """Every file in ``recorded["code"]`` and ``recorded["data"]`` still has the digest the bench planned
    with: a file edited while the bench runs would train (or evaluate) the next runs with other code or data
    than their record says."""
    for kind in ("code", "data"):
        for path, digest in recorded.get(kind, {}).items():
            if file_digest(path) != digest:
                raise _Changed(
                    f"{path} changed while the bench was running, and the runs before this one used it as it "
                    f"was. Run the bench again: it checks every run against the {kind} as it is now."
                )


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads for the bench (None: torch's default). Small models run fastest on one: their
    ops are too small to split, and on a busy machine extra threads mostly wait for each other."""
    import torch

    if n is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
