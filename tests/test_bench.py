"""textgym bench end to end on the Copy task with tiny-char-llama (a few seconds per run)."""

import csv
import json
import math
import shutil
import signal

import pytest
import tomli_w
from conftest import reward_plugin

from textgym import bench, bench_identity, bench_records
from textgym.bench_stats import mean_ci
from textgym.cli import main
from textgym.errors import ConfigError

DESIGNS = {
    "bench": {"seeds": [0, 1], "eval_prompts": "copy-heldout", "eval_episodes": 16, "samples_in_report": 2,
              "eval_every": 2},
    "run": {"total_timesteps": 150, "sample_prompts": 2, "checkpoint_every": 100},
    "env": {"id": "textgym/Copy-v0", "num_envs": 16, "prompts": "copy-train"},
    "agent": {"name": "lmppo", "policy": "tiny-char-llama", "learning_rate": 1e-3},
    "designs": [
        {"name": "exact", "rewards": [{"name": "match"}]},
        {"name": "partial", "rewards": [{"name": "match", "partial": True}]},
    ],
    "metrics": {
        "rewards": [{"name": "match", "label": "exact_copy", "range": [0, 1]}, {"name": "length_penalty", "target": 3}],
        "builtin": ["kl", "length", "distinct_2", "eos_rate"],
    },
}  # fmt: skip
METRICS = ["reward", "exact_copy", "length_penalty", "kl", "length", "distinct_2", "eos_rate"]


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def designs(out, **bench_overrides):
    d = json.loads(json.dumps(DESIGNS))
    d["bench"].update(output_dir=str(out), **bench_overrides)
    return d


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One finished bench (2 designs x 2 seeds), shared by the tests that only read it or copy it."""
    out = tmp_path_factory.mktemp("bench") / "out"
    bench.run(designs(out), progress=False)
    return out


@pytest.fixture
def counted(monkeypatch):
    """Counts the runs trained and evaluated."""
    import textgym.train

    calls = {"trained": [], "evaluated": []}
    real_train, real_evaluate = textgym.train.run, bench.evaluate

    def train(*args, **kwargs):
        calls["trained"].append(str(kwargs.get("resume") or kwargs["config"]["run"]["output_dir"]))
        return real_train(*args, **kwargs)

    def evaluate(job, spec):
        calls["evaluated"].append(job.run_id)
        return real_evaluate(job, spec)

    monkeypatch.setattr(textgym.train, "run", train)
    monkeypatch.setattr(bench, "evaluate", evaluate)
    return calls


def test_bench_writes_every_output_and_the_csv_matches_the_jsonl(finished):
    names = {p.name for p in finished.iterdir()}
    assert names >= {"results.jsonl", "summary.csv", "comparisons.csv", "report.md", "report.html", "bench.json",
                     "training_curves.png", "eval_curves.png", "overoptimization.png", "metric_bars.png", "runs"}  # fmt: skip
    assert sorted(p.name for p in (finished / "runs").iterdir()) == [
        "exact-seed0", "exact-seed1", "partial-seed0", "partial-seed1"
    ]  # fmt: skip
    results = [json.loads(line) for line in (finished / "results.jsonl").read_text().splitlines()]
    assert len(results) == 4 * len(METRICS) and {r["metric"] for r in results} == set(METRICS)
    # each design's own proxy is not compared between designs
    with (finished / "comparisons.csv").open() as f:
        compared = {row["metric"] for row in csv.DictReader(f)}
    assert "reward" not in compared and "exact_copy" in compared
    with (finished / "summary.csv").open() as f:
        summary = list(csv.DictReader(f))
    assert len(summary) == 2 * len(METRICS)
    bounds = {
        "exact_copy": (0, 1),
        "kl": (0, math.inf),
        "length": (0, 4),
        "distinct_2": (0, 1),
        "eos_rate": (0, 1),
    }
    for row in summary:
        values = [r["value"] for r in results if (r["design"], r["metric"]) == (row["design"], row["metric"])]
        mean, low, high = mean_ci(values, bounds=bounds.get(row["metric"], (-math.inf, math.inf)))
        assert float(row["mean"]) == pytest.approx(mean) and int(row["n"]) == 2
        assert float(row["ci_low"]) == pytest.approx(low) and float(row["ci_high"]) == pytest.approx(high)
        if row["metric"] in ("eos_rate", "distinct_2", "exact_copy"):
            assert 0 <= float(row["ci_low"]) <= float(row["ci_high"]) <= 1  # clipped to the range
    report = (finished / "report.md").read_text()
    assert "Rankings:" in report and "**kl** (lower is better)" in report and "### partial" in report
    assert "Paired comparisons:" in report and "| exact_copy | exact − partial |" in report
    # the interval is not Holm-corrected as the p beside it is: an interval that excludes 0 beside "not
    # significant" read as a contradiction
    assert (
        "| difference [95% CI, unadjusted] | d_z | p (Holm) |" in report and "the interval is not" in report
    )
    html = (finished / "report.html").read_text()
    assert "difference [95% CI, unadjusted]" in html
    assert "length (tokens, EOS incl.)" in report
    kl = [r["value"] for r in results if r["metric"] == "kl"]
    assert all(math.isfinite(v) for v in kl)


def test_each_final_value_keeps_the_episodes_it_is_a_mean_over(finished):
    """eval.json did not keep them, so the report could not say a value rested on few episodes."""
    for path in finished.glob("runs/*/eval.json"):
        result = json.loads(path.read_text())
        assert set(result["counts"]) >= {"reward", "exact_copy"} and result["counts"]["reward"] > 0


def test_runs_keep_held_out_curves_from_before_training_to_the_end(finished):
    run = finished / "runs" / "partial-seed0"
    with (run / "eval.csv").open() as f:
        rows = list(csv.DictReader(f))
    iterations = [int(r["iteration"]) for r in rows]
    assert iterations[0] == 0 and iterations[1] == 2 and iterations == sorted(iterations)
    assert float(rows[0]["kl"]) == pytest.approx(0.0, abs=1e-4)  # before training: the reference itself
    final = json.loads((run / "eval.json").read_text())
    for key in METRICS:  # the last curve point is the final evaluation: same prompts, same sampling seed
        assert float(rows[-1][key]) == pytest.approx(final["metrics"][key], rel=1e-4, abs=1e-5)
    assert set(final["components"]["match"]) == {"weight", "mean", "std", "share"}


def test_a_second_bench_reuses_finished_runs_and_refuses_a_changed_config(
    finished, counted, capsys, monkeypatch
):
    before = {p: p.stat().st_mtime_ns for p in finished.glob("runs/*/eval.json")}
    digested, digest = [], bench.file_digest
    for module in (bench, bench_records):  # a run's evaluation, and the check of a finished one
        monkeypatch.setattr(module, "file_digest", lambda path: digested.append(str(path)) or digest(path))
    bench.run(designs(finished), progress=False)
    assert counted == {"trained": [], "evaluated": []}
    assert not [p for p in digested if "checkpoint" in p]  # unchanged files (sizes, times): not read again
    bench.run(designs(finished))  # it printed only "report in ...": nothing said the runs were reused
    assert f"textgym: 4 runs in {finished}: 4 reused" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in finished.glob("runs/*/eval.json")} == before
    with pytest.raises(
        ConfigError, match=r"trained with another config \(agent.learning_rate: 0.001 -> 0.5\)"
    ):
        bench.run(designs(finished), ["agent.learning_rate=0.5"], progress=False)
    assert counted["trained"] == []


def test_a_run_directory_changed_by_hand_since_the_bench_recorded_it_is_refused(finished, counted, tmp_path):
    """bench.json still matches, but the run's config.toml (what a resume trains with, its held-out curves
    included, and what an SB3 run loads with) or its checkpoint (what an evaluation reads) is no longer what
    the bench started and evaluated. A deleted checkpoint (disk freed) leaves the results reusable."""
    import tomllib

    def edited(change, name):
        out = tmp_path / name
        shutil.copytree(finished, out)
        path = out / "runs" / "exact-seed0" / "config.toml"
        config = tomllib.loads(path.read_text())
        change(config)
        path.write_text(tomli_w.dumps(config))
        return out

    learning_rate = edited(lambda c: c["agent"].update(learning_rate=0.5), "lr")
    with pytest.raises(ConfigError, match=r"was changed since this bench started the run \(agent.learning_rate: "
                       r"0.001 -> 0.5\)"):  # fmt: skip
        bench.run(designs(learning_rate, eval_episodes=8), progress=False)
    episodes = edited(lambda c: c["eval"].update(episodes=1), "episodes")
    with pytest.raises(ConfigError, match=r"started the run \(eval.episodes: 16 -> 1\)"):
        bench.run(designs(episodes), progress=False)

    swapped = tmp_path / "swapped"
    shutil.copytree(finished, swapped)
    runs = swapped / "runs"
    shutil.rmtree(runs / "exact-seed0" / "checkpoint")
    shutil.copytree(runs / "exact-seed1" / "checkpoint", runs / "exact-seed0" / "checkpoint")
    for kept in (designs(swapped), designs(swapped, eval_episodes=8)):  # reused, or evaluated again
        with pytest.raises(
            ConfigError, match=r"exact-seed0/checkpoint is not the checkpoint this bench evaluated"
        ):
            bench.run(kept, progress=False)

    shutil.rmtree(runs / "exact-seed0" / "checkpoint")  # deleted: reused, not evaluated again
    bench.run(designs(swapped), progress=False)
    with pytest.raises(ConfigError, match=r"exact-seed0/checkpoint is gone, so the run cannot be evaluated"):
        bench.run(designs(swapped, eval_episodes=8), progress=False)
    assert counted == {"trained": [], "evaluated": []}


def test_a_second_bench_in_the_same_directory_is_refused_while_the_first_runs(tmp_path, monkeypatch):
    """Two benches in one directory recorded their runs over each other's in bench.json: one design's run
    could be reported under the other's config."""
    import os

    out = tmp_path / "out"
    first = designs(out, seeds=[0], eval_every=0)
    first["designs"] = first["designs"][:1]
    first["run"]["total_timesteps"] = 32
    second = json.loads(json.dumps(first))
    second["agent"]["learning_rate"] = 0.5
    real_train, refusals = bench._train, []

    def train_while_another_starts(job):
        with pytest.raises(
            ConfigError, match=rf"another textgym bench \(process {os.getpid()}\) is running in"
        ):
            bench.run(second, progress=False)
        refusals.append(job.run_id)
        real_train(job)

    monkeypatch.setattr(bench, "_train", train_while_another_starts)
    bench.run(first, progress=False)
    assert refusals == ["exact-seed0"]
    monkeypatch.setattr(bench, "_train", real_train)
    bench.run(first, progress=False)  # the lock went with the first bench: it is reused
    assert (
        json.loads((out / "bench.json").read_text())["runs"]["exact-seed0"]["config"]["agent"][
            "learning_rate"
        ]
        == 0.001
    )


def test_a_bench_refused_before_writing_leaves_no_directory_and_its_lock_file_is_not_foreign(
    tmp_path, monkeypatch
):
    out = tmp_path / "out"

    def refused(spec, out):
        raise ConfigError("refused")

    monkeypatch.setattr(bench, "plan", refused)
    with pytest.raises(ConfigError, match="refused"):
        bench.run(designs(out), progress=False)
    assert not out.exists()
    out.mkdir()
    (out / bench.LOCK_FILE).write_text("")  # left by a bench killed before it wrote bench.json
    bench._check_owned(out)


def test_changed_evaluation_settings_evaluate_again_without_training(
    finished, counted, tmp_path, monkeypatch, capsys
):
    """And a kill while the new outputs are written leaves the old ones, which agree with each other. The
    bench says what changed, as its refusals do (it said "4 to evaluate again" alone)."""
    import textgym.bench_plots

    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    before = {name: (out / name).read_bytes() for name in ("summary.csv", "results.jsonl", "report.md")}

    def killed(*args):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(textgym.bench_plots, "plot_all", killed)
        with pytest.raises(KeyboardInterrupt):
            bench.run(designs(out, eval_episodes=8))
    assert "4 runs in" in (said := capsys.readouterr().out)
    assert "4 to evaluate again (evaluation.episodes: 16 -> 8)" in said
    assert {name: (out / name).read_bytes() for name in before} == before
    bench.run(designs(out, eval_episodes=8), progress=False)  # (evaluated by the killed bench: reused)
    assert (out / "summary.csv").read_bytes() != before["summary.csv"]
    assert not (out / ".outputs.tmp").exists()
    assert counted["trained"] == [] and len(counted["evaluated"]) == 4
    assert all(len(json.loads(p.read_text())["samples"]) == 2 for p in out.glob("runs/*/eval.json"))
    report = (out / "report.md").read_text()
    assert "held-out curves of 4 runs are not shown" in report  # measured with the old settings
    assert "eval_curves" not in report and not (out / "eval_curves.png").exists()  # (not the old figure)


def test_a_changed_eval_every_alone_keeps_the_finished_runs_evaluations_and_curves(
    finished, counted, tmp_path
):
    """Every curve point is measured alike whatever their spacing: a new eval_every evaluated every run
    again and hid every curve, so the gaming and drift checks stopped without a change of what they read."""
    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    every = DESIGNS["bench"]["eval_every"]
    bench.run(designs(out, eval_every=every + 1), progress=False)
    assert counted["trained"] == [] and counted["evaluated"] == []
    report = (out / "report.md").read_text()
    assert "curves of" not in report
    # the spacing the curves were measured at, not the setting now (it said "every 0 iterations" below)
    assert f"during training every {every} iterations" in report
    # eval_every = 0 (no curves measured from here on) neither: the report said they were measured with
    # other settings and the final evaluations recomputed, neither of which was so
    bench.run(designs(out, eval_every=0), progress=False)
    assert counted["trained"] == [] and counted["evaluated"] == []
    report = (out / "report.md").read_text()
    assert "curves of" not in report and f"during training every {every} iterations" in report


def test_a_run_resumed_after_the_evaluation_settings_changed_keeps_its_curves_out(tmp_path, monkeypatch):
    """An interrupted run resumes with the [eval] of its own config.toml: its held-out curves are measured
    with the settings it started with, not the bench's new ones, so the report must not show them as current."""
    from textgym.rundir import RunDir

    d = designs(tmp_path / "out", seeds=[0])
    d["designs"] = d["designs"][:1]

    def interrupted(job):  # started (its run directory and config written), then stopped
        RunDir(job.run_dir).create()
        RunDir(job.run_dir).write_config(job.config)
        raise KeyboardInterrupt

    real_train = bench._train
    monkeypatch.setattr(bench, "_train", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench.run(d, progress=False)
    monkeypatch.setattr(bench, "_train", real_train)
    bench.run(
        designs(tmp_path / "out", seeds=[0], eval_episodes=8) | {"designs": d["designs"]}, progress=False
    )
    assert "held-out curves of 1 runs are not shown" in (tmp_path / "out" / "report.md").read_text()


def test_a_killed_bench_resumes_without_redoing_finished_runs(tmp_path, counted, monkeypatch):
    d = designs(tmp_path / "out", eval_every=0)
    d["designs"] = d["designs"][:1]
    real_evaluate, calls = bench.evaluate, []

    def killed_on_second(job, spec):
        calls.append(job.run_id)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_evaluate(job, spec)

    monkeypatch.setattr(bench, "evaluate", killed_on_second)
    with pytest.raises(KeyboardInterrupt):
        bench.run(d, progress=False)
    assert len(counted["trained"]) == 2
    finished = {p.parent.name: p.stat().st_mtime_ns for p in (tmp_path / "out" / "runs").glob("*/eval.json")}
    assert sorted(finished) == ["exact-seed0"]

    counted["trained"].clear()
    monkeypatch.setattr(bench, "evaluate", real_evaluate)
    bench.run(d, progress=False)
    assert counted["trained"] == [
        str(tmp_path / "out" / "runs" / "exact-seed1")
    ]  # resumed from its checkpoint
    assert (tmp_path / "out" / "runs" / "exact-seed0" / "eval.json").stat().st_mtime_ns == finished[
        "exact-seed0"
    ]


@pytest.mark.parametrize("total", [150, 16], ids=["mid-run", "in-the-last-iteration"])
def test_a_ctrl_c_stops_the_bench_after_the_runs_checkpoint_and_the_bench_continues_it(
    tmp_path, counted, register, capsys, total
):
    """The run stops and saves; the bench neither evaluates it (its eval.json would mark it finished, and the
    report would show a half-trained run as trained) nor goes on to the next run. With 16 tokens the first
    iteration is the last: the run has every token, but it stopped before it finished."""
    calls = []

    def ctrl_c_once(samples):
        calls.append(len(samples))
        if len(calls) == 2:  # in the first run's first iteration (after its samples before training)
            signal.raise_signal(signal.SIGINT)
        return [0.0] * len(samples)

    register(reward_plugin("ctrl_c_once", ctrl_c_once), "ctrl-c-once")
    d = designs(tmp_path / "out", eval_every=0)
    d["designs"] = [{"name": "stops", "rewards": [{"name": "ctrl_c_once"}]}]
    d["run"]["total_timesteps"] = total
    path = tmp_path / "designs.toml"
    path.write_text(tomli_w.dumps(d))
    runs = tmp_path / "out" / "runs"
    assert main(["bench", str(path)]) == 130
    err = capsys.readouterr().err
    assert "bench stopped: stops-seed0 saved its checkpoint at" in err and f"({total} to train)" in err
    assert counted["evaluated"] == [] and not (runs / "stops-seed0" / "eval.json").exists()
    assert not (runs / "stops-seed1").exists()

    assert main(["bench", str(path)]) == 0
    assert counted["trained"][1:] == [
        str(runs / "stops-seed0"),
        str(runs / "stops-seed1"),
    ]  # resumed, then new
    assert all((runs / f"stops-seed{seed}" / "eval.json").is_file() for seed in (0, 1))


def test_a_failing_reward_leaves_its_design_out_and_the_bench_reports_the_others(tmp_path, register, capsys):
    """A design whose reward raised stopped the whole bench with no report: the designs that had trained
    were not reported until the failing one was fixed or removed."""
    state = {"broken": True}

    def flaky(samples):
        if state["broken"]:
            raise ValueError("the reward broke")
        return [1.0] * len(samples)

    register(reward_plugin("flaky", flaky), "flaky")
    d = designs(tmp_path / "out", eval_every=0)
    d["designs"] = [d["designs"][0], {"name": "breaks", "rewards": [{"name": "flaky"}]}]
    path = tmp_path / "designs.toml"
    path.write_text(tomli_w.dumps(d))
    out, runs = tmp_path / "out", tmp_path / "out" / "runs"
    assert main(["bench", str(path)]) == 1  # (2: an error that stopped the bench)
    err = capsys.readouterr().err
    assert "textgym: error: 2 of 4 runs failed: breaks-seed0: " in err and "the reward broke" in err
    assert f"(log: {runs / 'breaks-seed0.log'})" in err  # a failed start leaves its log beside its run
    assert f"The report in {out / 'report.md'} leaves out design 'breaks'" in err
    assert "ValueError: the reward broke" in (runs / "breaks-seed1.log").read_text()  # the traceback
    report = (out / "report.md").read_text()
    assert "## Failed runs" in report and "leaves out design `breaks`" in report
    assert "- `breaks-seed0`: " in report and "the reward broke" in report
    assert "<h2>Failed runs</h2>" in (out / "report.html").read_text()
    with (out / "summary.csv").open() as f:
        assert {r["design"] for r in csv.DictReader(f)} == {"exact"}
    index = json.loads((out / "bench.json").read_text())["runs"]
    assert (
        "the reward broke" in index["breaks-seed1"]["failed"]["error"]
        and "failed" not in index["exact-seed0"]
    )

    state["broken"] = False  # fixed: the same command trains the failed design, reuses the others
    assert main(["bench", str(path)]) == 0
    assert "2 reused, 2 to train" in capsys.readouterr().out
    report = (out / "report.md").read_text()
    assert "Failed runs" not in report and "| breaks |" in report
    assert not any("failed" in r for r in json.loads((out / "bench.json").read_text())["runs"].values())


def test_a_design_with_one_failed_seed_is_left_out_whole_and_starts_again_when_its_config_changes(
    tmp_path, counted, monkeypatch, capsys
):
    """Its finished seed alone would compare the run that went well. Once its config is changed (the fix),
    its runs train again from the start: none of them was reported, so none is refused as changed."""
    import textgym.train

    trained = textgym.train.run

    def crashes_on_exact_seed1(*args, **kwargs):
        run_dir = trained(*args, **kwargs)
        if str(kwargs.get("resume") or kwargs["config"]["run"]["output_dir"]).endswith("exact-seed1"):
            raise RuntimeError("the machine hiccuped")
        return run_dir

    monkeypatch.setattr(textgym.train, "run", crashes_on_exact_seed1)
    d = designs(tmp_path / "out", eval_every=0)
    with pytest.raises(bench.RunsFailed, match=r"1 of 4 runs failed: exact-seed1: RuntimeError: the machine"):
        bench.run(d, progress=False)
    out = tmp_path / "out"
    assert (out / "runs" / "exact-seed0" / "eval.json").is_file()  # finished, and kept for a rerun
    with (out / "summary.csv").open() as f:
        assert {r["design"] for r in csv.DictReader(f)} == {"partial"}
    assert "leaves out design `exact`" in (out / "report.md").read_text()

    monkeypatch.setattr(textgym.train, "run", trained)
    counted["trained"].clear()
    d["designs"][0]["rewards"][0]["weight"] = 2.0  # the design changed: its finished seed is not refused
    bench.run(d)
    assert "2 reused, 2 to train again from the start" in capsys.readouterr().out
    assert counted["trained"] == [str(out / "runs" / f"exact-seed{seed}") for seed in (0, 1)]
    with (out / "summary.csv").open() as f:
        assert {r["design"] for r in csv.DictReader(f)} == {"exact", "partial"}


def test_a_failed_evaluation_of_every_design_leaves_a_report_of_the_failures_only(
    finished, counted, tmp_path, monkeypatch
):
    """No design finished: the error said no report was written, but the earlier report, its tables and
    plots stayed beside it and read as current. Once the evaluation works again, the runs' failed marks go
    with it, the reused runs' too: a mark left on a reported run let a later config change delete it."""
    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    real_evaluate = bench.evaluate

    def broken(job, spec):
        raise RuntimeError("the evaluation broke")

    monkeypatch.setattr(bench, "evaluate", broken)
    with pytest.raises(bench.RunsFailed, match=r"4 of 4 runs failed: .* names the failed runs only"):
        bench.run(designs(out, eval_episodes=8), progress=False)
    report = (out / "report.md").read_text()
    assert (
        "No design had all its runs finish" in report
        and "- `exact-seed1`: RuntimeError: the evaluation" in report
    )
    assert "## Results" not in report and "No design had all" in (out / "report.html").read_text()
    assert not [p.name for p in out.iterdir() if p.suffix in (".csv", ".jsonl", ".png")]
    index = json.loads((out / "bench.json").read_text())
    assert index["left_out"] == {"designs": ["exact", "partial"], "agents": []}
    assert all("failed" in r for r in index["runs"].values())

    monkeypatch.setattr(bench, "evaluate", real_evaluate)
    bench.run(designs(out), progress=False)  # the old settings: every run is reused, and reported
    index = json.loads((out / "bench.json").read_text())
    assert "left_out" not in index and not any("failed" in r for r in index["runs"].values())
    assert counted["trained"] == [] and (out / "summary.csv").is_file()
    with pytest.raises(ConfigError, match="trained with another config"):  # reported: refused, not replaced
        bench.run(designs(out), ["agent.learning_rate=0.5"], progress=False)


def test_a_reported_run_is_refused_not_replaced_when_the_bench_stopped_before_its_failures_report(
    finished, tmp_path, monkeypatch
):
    """A failed evaluation marks the run at once, its report comes at the end: a bench stopped in between
    left the old report, which shows the design, and a config change then deleted runs it shows."""
    out = tmp_path / "copy"
    shutil.copytree(finished, out)
    calls, real_evaluate = [], bench.evaluate

    def fails_then_stops(job, spec):
        calls.append(job.run_id)
        raise RuntimeError("the evaluation broke") if len(calls) == 1 else KeyboardInterrupt

    monkeypatch.setattr(bench, "evaluate", fails_then_stops)
    with pytest.raises(KeyboardInterrupt):
        bench.run(designs(out, eval_episodes=8), progress=False)
    assert "failed" in json.loads((out / "bench.json").read_text())["runs"]["exact-seed0"]
    monkeypatch.setattr(bench, "evaluate", real_evaluate)
    changed = designs(out)
    changed["designs"][0]["rewards"][0]["weight"] = 2.0
    with pytest.raises(ConfigError, match="exact-seed0 was trained with another config"):
        bench.run(changed, progress=False)


def test_a_full_disk_outside_textgyms_own_writes_stops_the_bench(finished, tmp_path, monkeypatch):
    import errno

    out = tmp_path / "copy"
    shutil.copytree(finished, out)

    def full(job, spec):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(bench, "evaluate", full)
    with pytest.raises(OSError, match="No space left"):
        bench.run(designs(out, eval_episodes=8), progress=False)
    assert not any("failed" in r for r in json.loads((out / "bench.json").read_text())["runs"].values())


def test_a_run_keeps_its_failed_mark_until_it_finishes_and_a_left_out_design_restarts_under_every_agent(
    tmp_path,
):
    """A resume (or a restart) that a Ctrl-C cut dropped the mark, and the next bench refused the design's
    changed runs; the report leaves a design out under every agent, but only the agent whose run failed was
    restarted: the other agent's runs of it, never reported, were refused."""
    from textgym.bench_config import load_designs

    d = designs(tmp_path / "out")
    del d["agent"]["name"]
    d["agents"] = [{"name": "grpo", "num_generations": 4}, {"name": "rloo", "num_generations": 4}]
    out = tmp_path / "out"
    jobs = bench.plan(load_designs(d), out)
    for job in jobs:
        job.run_dir.mkdir(parents=True)
        bench_records.record_start(out, job)
    failed_job = next(j for j in jobs if j.run_id == "grpo/exact-seed0")
    bench_records.record_failures(out, {failed_job.run_id: {"error": "it broke", "log": "x.log"}})
    bench_records.record_start(out, failed_job)  # resumed
    assert (
        json.loads((out / "bench.json").read_text())["runs"]["grpo/exact-seed0"]["failed"]["error"]
        == "it broke"
    )

    bench_records.record_left_out(out, ["exact"], [])
    d["designs"][0]["rewards"][0]["weight"] = 2.0
    todo = bench_records.actions(bench.plan(load_designs(d), out), out)
    assert {k for k, v in todo.items() if v == "restart"} == {
        f"{agent}/exact-seed{seed}" for agent in ("grpo", "rloo") for seed in (0, 1)
    }


@pytest.mark.parametrize(
    ("failed", "left_out"),
    [
        ({("a", "x")}, (["x"], [])),
        ({("a", "x"), ("a", "y")}, ([], ["a"])),  # one agent failed every design: the agent goes
        ({("a", "x"), ("b", "y")}, (["x", "y"], [])),
    ],
)
def test_the_report_leaves_out_the_failed_designs_or_the_failed_agent_whichever_keeps_more(failed, left_out):
    assert bench.left_out(failed, ["a", "b"], ["x", "y", "z"]) == left_out


# the evaluation loads the SB3 agent on as many sub-envs as it trained on: on one, SB3 warned of its batch size
@pytest.mark.filterwarnings("error:You have specified a mini-batch size:UserWarning")
def test_agents_are_a_bench_axis_and_an_sb3_agent_completes(tmp_path):
    d = designs(tmp_path / "out", eval_every=1)
    d["designs"] = d["designs"][1:]
    del d["agent"]["name"]
    d["agents"] = [
        {"name": "grpo", "num_generations": 4},
        {"name": "sb3-ppo", "policy": "MultiInputPolicy", "n_steps": 8, "batch_size": 32, "n_epochs": 1},
    ]
    out = bench.run(d, progress=False)
    assert sorted(str(p.relative_to(out / "runs")) for p in out.glob("runs/*/*-seed*")) == [
        "grpo/partial-seed0", "grpo/partial-seed1", "sb3-ppo/partial-seed0", "sb3-ppo/partial-seed1"
    ]  # fmt: skip
    sb3 = json.loads((out / "runs" / "sb3-ppo" / "partial-seed0" / "eval.json").read_text())
    assert sb3["metrics"]["kl"] is None and isinstance(sb3["samples"][0]["num_tokens"], int)
    assert (out / "runs" / "grpo" / "partial-seed0" / "eval.csv").is_file()
    report = (out / "report.md").read_text()
    assert "## Designs under agent `grpo`" in report and "## Agents under design `partial`" in report
    assert "| reward | grpo − sb3-ppo |" in report  # agents compared on the design's own reward
    with (out / "summary.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert {r["agent"] for r in rows} == {"grpo", "sb3-ppo"} and all(
        r["agent_rank"] for r in rows if r["metric"] == "reward"
    )


def test_a_bench_trains_its_runs_with_several_processes(tmp_path, capfd):
    """And a run that fails there is named with its process's own error, which went to the run's log: the
    message said "see above", and nothing above said why."""
    broken = tmp_path / "broken.py"
    broken.write_text("def reward(samples):\n    raise ValueError('the reward broke')\n")
    d = designs(tmp_path / "out")
    d["bench"].update(seeds=[0], eval_every=0)
    d["run"].update(processes=2, total_timesteps=64)
    d["env"]["num_envs"] = 8
    d["designs"] = [d["designs"][1], {"name": "breaks", "rewards": [{"fn": f"{broken}:reward"}]}]
    with pytest.raises(bench.RunsFailed) as failed:
        bench.run(d, progress=False)
    assert "breaks-seed0: the 2-process run of" in str(failed.value) and "see above" not in str(failed.value)
    assert "raised ValueError" in str(failed.value) and "the reward broke" in str(failed.value)
    out = tmp_path / "out"
    run_dir = out / "runs" / "partial-seed0"
    assert "processes = 2" in (run_dir / "config.toml").read_text()
    with (run_dir / "metrics.csv").open() as f:
        assert [int(r["timesteps"]) for r in csv.DictReader(f)] == [32, 64]  # both processes' tokens
    assert json.loads((run_dir / "eval.json").read_text())["metrics"]["exact_copy"] is not None
    console = capfd.readouterr()
    assert "after training:" not in console.out + console.err  # the processes' output is the run's log
    assert "after training:" in (run_dir / "train.log").read_text()


PLUGIN = """
import textgym


@textgym.reward("shortness")
def shortness(samples):
    return [-len(s.completion) * SCALE for s in samples]


SCALE = 1.0
"""

PLUGIN_DESIGNS = """
[bench]
seeds = [0]
eval_episodes = 8
eval_every = 0
output_dir = "out"

[run]
total_timesteps = 32

[env]
id = "textgym/Copy-v0"
num_envs = 16
prompts = "copy-train"

[agent]
name = "lmppo"
policy = "tiny-char-llama"

[[designs]]
name = "short"
rewards = [{ name = "shortness" }]

[metrics]
rewards = [{ name = "shortness", label = "short" }]
builtin = ["length"]
"""


def test_a_bench_plugin_file_is_part_of_every_runs_identity_and_config(tmp_path, monkeypatch, capsys):
    """`textgym bench --plugin FILE.py`: the runs' configs did not list the file (a run could not resume on
    its own) and its digest was not in their identity (an edited file was reused as if unchanged)."""
    from textgym.cli import main
    from textgym.config import load_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "designs.toml").write_text(PLUGIN_DESIGNS)
    (tmp_path / "shortness.py").write_text(PLUGIN)
    assert main(["bench", "designs.toml", "--plugin", "shortness.py"]) == 0, capsys.readouterr().err
    (run_dir,) = (tmp_path / "out" / "runs").iterdir()
    assert load_config(run_dir / "config.toml")["run"]["plugins"] == [str(tmp_path / "shortness.py")]
    assert main(["bench", "designs.toml", "--plugin", "shortness.py"]) == 0  # unchanged: reused
    (tmp_path / "shortness.py").write_text(PLUGIN.replace("SCALE = 1.0", "SCALE = 10.0"))
    capsys.readouterr()
    assert main(["bench", "designs.toml", "--plugin", "shortness.py"]) == 2
    assert (
        f"trained with another config (code.{tmp_path / 'shortness.py'}: changed)" in capsys.readouterr().err
    )
    # a run recorded without the file's digest (a bench from before --plugin joined run.plugins) is refused:
    # nothing shows which content it trained with, and the refusal says the digest was added, not changed
    assert bench_records.config_changes({"code": {}}, {"code": {"shortness.py": "x"}}) == [
        "code.shortness.py: added"
    ]


def test_the_local_modules_a_plugin_file_imports_are_part_of_a_runs_identity(tmp_path):
    """A plugin file's directory joins sys.path, so `import helpers` beside it runs helpers.py: an edit there
    changes the rewards, and a run trained before it must not be reused as if nothing changed."""
    files = {
        "plugin.py": "import os.path\nimport numpy\nimport helpers\nfrom pkg.sub import thing\nfrom pkg import other\n",
        "helpers.py": "import deeper\n",
        "deeper.py": "SCALE = 1.0\n",
        "unused.py": "",
        "pkg/__init__.py": "",
        "pkg/sub.py": "thing = 1\n",
        "pkg/other.py": "from .sibling import y\nfrom .. import up_too_far\n",
        "pkg/sibling.py": "y = 2\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    plugin = str(tmp_path / "plugin.py")
    found = bench_identity.with_local_imports([plugin])
    assert found[0] == plugin
    assert sorted(found[1:]) == sorted(
        str(tmp_path / n) for n in files if n not in ("plugin.py", "unused.py")
    )

    config = {"run": {"plugins": [plugin]}, "env": {"rewards": []}, "agent": {}}
    before = bench_identity.identity(config)
    (tmp_path / "deeper.py").write_text("SCALE = 10.0\n")
    assert bench_records.config_changes(before, bench_identity.identity(config)) == [
        f"code.{tmp_path / 'deeper.py'}: changed"
    ]


def test_an_fn_reward_named_by_module_counts_by_its_file_or_its_packages_version(tmp_path, monkeypatch):
    """`fn = "package.module:func"` was not in a run's identity at all: an edited module was reused."""
    import importlib.metadata

    tag = tmp_path.name.replace("-", "_")
    (tmp_path / f"scores_{tag}.py").write_text(
        f"import helper_{tag}\ndef score(samples):\n    return [1.0]\n"
    )
    (tmp_path / f"helper_{tag}.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = {"run": {}, "agent": {},
              "env": {"rewards": [{"fn": f"scores_{tag}:score"}, "fn=numpy.linalg:norm weight=0"]}}  # fmt: skip
    ident = bench_identity.identity(config)
    assert set(ident["code"]) == {str(tmp_path / f"scores_{tag}.py"), str(tmp_path / f"helper_{tag}.py")}
    assert ident["packages"] == {"numpy": bench_identity.installed_package("numpy")}
    assert ident["packages"]["numpy"].startswith(f"{importlib.metadata.version('numpy')} (code ")
    (tmp_path / f"helper_{tag}.py").write_text("X = 2\n")
    assert bench_records.config_changes(ident, bench_identity.identity(config)) == [
        f"code.{tmp_path / f'helper_{tag}.py'}: changed"
    ]
