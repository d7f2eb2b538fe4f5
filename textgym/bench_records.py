"""What a bench records and what a rerun does with each run it finds. ``bench.json`` in the output directory
holds, for each run the bench started, its resolved config (the run's identity, with code and data digests)
and the curve settings it started with, and marks a run that failed; each run's ``eval.json`` is its
finished evaluation. From them :func:`actions` decides, before anything trains, whether a run is reused,
evaluated again, trained (or resumed), trained again from the start, or refused (see :mod:`textgym.bench`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from textgym.bench_identity import _settings, file_digest, file_stats
from textgym.bench_plan import Job
from textgym.errors import ConfigError
from textgym.evaluation import jsonable

EVAL_FILE = "eval.json"
INDEX_FILE = "bench.json"


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_json(path: Path, value: Any) -> None:
    from textgym.rundir import write_atomic

    write_atomic(path, json.dumps(jsonable(value), indent=2, allow_nan=False))


def actions(jobs: Sequence[Job], out: Path) -> dict[str, str]:
    """What each run needs: ``"train"`` (or resume), ``"evaluate"`` (trained with this config, evaluated
    with other settings), ``"reuse"``, or ``"restart"`` (a run of a design that a failed run left out of the
    report, whose config changed since: trained again from the start). Raises :class:`ConfigError`, before
    anything trains, for runs this bench did not start or that were trained with another config."""
    recorded = read_json(out / INDEX_FILE) or {}
    index = recorded.get("runs", {})
    todo, problems = {}, []
    # runs that no written report can show: an unfinished run of a design (under an agent) with a failed
    # run, and the designs and agents the last report written left out. (A finished run of a failed design
    # is shown by the report on disk until a report that leaves it out is written: a bench stopped between
    # the failure and its report left the old one.)
    failed = {group_of(j) for j in jobs if (index.get(j.run_id) or {}).get("failed")}
    left = recorded.get("left_out") or {}

    def unreported(job: Job) -> bool:
        unfinished = not (job.run_dir / EVAL_FILE).is_file()
        return (
            (unfinished and group_of(job) in failed)
            or job.design["name"] in left.get("designs", [])
            or job.agent["label"] in left.get("agents", [])
        )

    for job in jobs:
        record = index.get(job.run_id)
        if not job.run_dir.exists():
            todo[job.run_id] = "train"
        elif record is None:
            problems.append(
                f"{job.run_dir} exists, but {out / INDEX_FILE} has no record of this bench starting it"
            )
        elif unreported(job) and record.get("config_hash") != job.config_hash:
            todo[job.run_id] = "restart"  # changed since it or its design failed: no report shows it
        elif record.get("config_hash") != job.config_hash:
            changes = config_changes(record.get("config", {}), job.identity)
            problems.append(
                f"{job.run_id} was trained with another config ({'; '.join(changes[:4]) or 'code files'})"
            )
        elif edited := edited_since(job, record):
            problems.append(edited)
        else:
            done = read_json(job.run_dir / EVAL_FILE)
            if done and done.get("config_hash") == job.config_hash:
                todo[job.run_id] = "reuse" if done.get("eval_hash") == job.eval_hash else "evaluate"
            else:
                todo[job.run_id] = "train"  # interrupted: resumes from its checkpoint
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ConfigError(
            f"{out} already holds runs this bench cannot reuse: {'; '.join(problems[:3])}{more}. A bench never "
            f"reports results it did not compute: give this bench its own bench.output_dir, or move those run "
            f"directories away to train them again."
        )
    return todo


def group_of(job: Job) -> tuple[str, str]:
    return job.agent["label"], job.design["name"]


def evaluation_changes(jobs: Sequence[Job], todo: Mapping[str, str]) -> str:
    """What changed in the evaluation of the runs evaluated again, as refusals name a changed config:
    ``evaluation.episodes: 16 -> 8``. An eval.json written before it kept its settings says less."""
    changes: list[str] = []
    for job in jobs:
        if todo[job.run_id] == "evaluate":
            before = (read_json(job.run_dir / EVAL_FILE) or {}).get("evaluation")
            found = config_changes(before, job.evaluation, "evaluation.") if before is not None else []
            changes += [c for c in found or ["the evaluation settings or files changed"] if c not in changes]
    return "; ".join(changes[:4]) + (f" and {len(changes) - 4} more" if len(changes) > 4 else "")


def edited_since(job: Job, record: Mapping[str, Any]) -> str | None:
    """What changed in a run directory since the bench recorded it, or None. Its ``config.toml`` is what a
    resume trains with (held-out curves included) and what an SB3 run is loaded with; its checkpoint, what
    an evaluation reads: both must still be what the bench started and evaluated (a hand edit, or another
    run's checkpoint copied in, changes them without changing ``bench.json``). A finished run's checkpoint
    may be deleted (to free the disk): its results are reused, and only evaluating it again is refused."""
    from textgym.config import load_config
    from textgym.rundir import RunDir

    path = job.run_dir / "config.toml"
    if path.is_file():
        try:
            saved = load_config(path)
        except ConfigError as exc:
            return f"{path} cannot be read ({exc})"
        changes = config_changes(_settings(job.config), _settings(saved))
        if "eval" in record:  # (recorded since bench.json keeps it)
            changes += config_changes({"eval": record["eval"]}, {"eval": saved.get("eval")})
        if changes:
            return f"{path} was changed since this bench started the run ({'; '.join(changes[:4])})"
    done = read_json(job.run_dir / EVAL_FILE) or {}
    evaluated = RunDir(job.run_dir).checkpoint
    unchanged = "checkpoint_files" in done and file_stats(evaluated) == done["checkpoint_files"]
    if "checkpoint" in done and not unchanged and (digest := file_digest(evaluated)) != done["checkpoint"]:
        if digest != "missing":
            return f"{evaluated} is not the checkpoint this bench evaluated (its files changed since)"
        if done.get("eval_hash") != job.eval_hash:
            return f"{evaluated} is gone, so the run cannot be evaluated with the new evaluation settings"
    return None


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """What differs between two configs, down to the single value (``env.rewards[1].weight: 0.5 -> 0.6``)."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key, "(unset)"), new.get(key, "(unset)")
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            out += config_changes(a, b, f"{prefix}{key}.")
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                if isinstance(x, Mapping) and isinstance(y, Mapping):
                    out += config_changes(x, y, f"{prefix}{key}[{i}].")
                elif jsonable(x) != jsonable(y):
                    out.append(f"{prefix}{key}[{i}]: {_short(x)} -> {_short(y)}")
        elif jsonable(a) != jsonable(b):
            digests = prefix.endswith(("code.", "data.", "reward_models."))  # (evaluation.code. too)
            digest = "added" if key not in old else "removed" if key not in new else "changed"
            out.append(f"{prefix}{key}: {digest if digests else f'{_short(a)} -> {_short(b)}'}")
    return out


def _short(value: Any) -> str:
    text = json.dumps(jsonable(value), default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def record_start(out: Path, job: Job) -> None:
    """Record what the run is trained with, before it trains. A run that resumes keeps the curve settings it
    recorded when it started: it resumes with the [eval] of its own config.toml, whatever the bench's are now."""
    from textgym.rundir import RunDir

    path = out / INDEX_FILE
    index = read_json(path) or {}
    runs = index.setdefault("runs", {})
    started = {"curves_hash": job.curves_hash, "curve_parts": job.curve_parts, "eval": job.config.get("eval")}
    if RunDir(job.run_dir).is_run():  # resumed: its config.toml's [eval], as it started
        before = runs.get(job.run_id, {})
        started = {"curves_hash": before.get("curves_hash", job.curves_hash)}
        if "curve_parts" in before:
            started["curve_parts"] = before["curve_parts"]
        if "eval" in before:  # (a record from before bench.json kept it has none)
            started["eval"] = before["eval"]
    failed = runs.get(job.run_id, {}).get("failed")  # until the run finishes: a restart is no success
    runs[job.run_id] = {"config_hash": job.config_hash, **started, "config": job.identity}
    if failed:
        runs[job.run_id]["failed"] = failed
    write_json(path, index)


def add_curve_parts(out: Path, jobs: Sequence[Job]) -> None:
    """Give a run recorded before ``curve_parts`` were kept the plan's, where its curves' digest shows that
    they measured what the plan measures: a later change of the metric list then keeps their columns."""
    path = out / INDEX_FILE
    index = read_json(path)
    runs = (index or {}).get("runs", {})
    added = False
    for job in jobs:
        record = runs.get(job.run_id)
        if record and "curve_parts" not in record and record.get("curves_hash") == job.curves_hash:
            record["curve_parts"], added = job.curve_parts, True
    if added:
        write_json(path, index)


def record_left_out(out: Path, designs: Sequence[str], agents: Sequence[str]) -> None:
    """Record, once the report is written, the designs and agents it leaves out for failed runs (none: the
    report is whole): their runs, shown by no report, train again from the start when their config changes,
    rather than being refused."""
    path = out / INDEX_FILE
    index = read_json(path) or {}
    left = {"designs": list(designs), "agents": list(agents)} if designs or agents else None
    if _put(index, "left_out", left):
        write_json(path, index)


def record_failures(out: Path, failures: Mapping[str, Mapping[str, str] | None]) -> None:
    """Mark each run (by its run_id) failed in ``bench.json`` with its error and log, or, with None, no
    longer failed: one read and at most one write for them all."""
    path = out / INDEX_FILE
    index = read_json(path) or {}
    runs = index.get("runs", {})
    changed = [
        _put(runs[run_id], "failed", None if failure is None else dict(failure))
        for run_id, failure in failures.items()
        if run_id in runs
    ]
    if any(changed):
        write_json(path, index)


def _put(mapping: dict[str, Any], key: str, value: Any) -> bool:
    """``mapping[key] = value``, or no ``key`` for None; whether that changed ``mapping``."""
    if mapping.get(key) == value:
        return False
    if value is None:
        del mapping[key]
    else:
        mapping[key] = value
    return True
