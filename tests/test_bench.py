import csv
import json
import math

import pytest

from textgym import bench
from textgym.bench import load_designs, mean_ci, summarize
from textgym.cli import main
from textgym.errors import UnknownNameError

DESIGNS = {
    "bench": {"seeds": [0, 1], "eval_prompts": "copy-heldout", "eval_episodes": 16, "samples_in_report": 2},
    "run": {"total_timesteps": 100, "sample_prompts": 2, "checkpoint_every": 100},
    "env": {"id": "textgym/Copy-v0", "num_envs": 16, "prompts": "copy-train"},
    "agent": {"name": "lmppo", "policy": "tiny-char-llama", "learning_rate": 1e-3},
    "designs": [
        {"name": "exact", "rewards": [{"name": "match"}]},
        {"name": "partial", "rewards": [{"name": "match", "partial": True}]},
    ],
    "metrics": {
        "rewards": [{"name": "match", "label": "exact_copy"}, {"name": "length_penalty", "target": 3}],
        "builtin": ["kl", "length", "distinct_2", "eos_rate"],
    },
}


def designs(tmp_path, **bench_overrides):
    d = json.loads(json.dumps(DESIGNS))
    d["bench"].update(output_dir=str(tmp_path / "bench"), **bench_overrides)
    return d


def test_confidence_interval_matches_a_hand_computation():
    mean, low, high = mean_ci([1.0, 2.0, 3.0])
    # sd = 1, t(0.975, df=2) = 4.302653, half-width = 4.302653 / sqrt(3) = 2.484138
    assert (
        mean == 2.0
        and low == pytest.approx(2 - 2.484138, abs=1e-6)
        and high == pytest.approx(2 + 2.484138, abs=1e-6)
    )
    assert mean_ci([5.0])[0] == 5.0 and math.isnan(mean_ci([5.0])[1])


def test_ranking_per_direction_with_ties():
    results = [
        {"design": d, "seed": s, "metric": m, "value": v}
        for d, s, m, v in [("a", 0, "r", 1.0), ("b", 0, "r", 2.0), ("c", 0, "r", 2.0),
                           ("a", 0, "kl", 3.0), ("b", 0, "kl", 1.0), ("c", 0, "kl", 2.0),
                           ("a", 0, "length", 9.0), ("b", 0, "length", 1.0), ("c", 0, "length", 5.0)]
    ]  # fmt: skip
    ranks = {
        (r["design"], r["metric"]): r["rank"]
        for r in summarize(results, {"r": "higher", "kl": "lower", "length": None})
    }
    assert (ranks["b", "r"], ranks["c", "r"], ranks["a", "r"]) == (1, 1, 3)
    assert (ranks["b", "kl"], ranks["c", "kl"], ranks["a", "kl"]) == (1, 2, 3)
    assert ranks["a", "length"] is None


def test_bench_writes_every_output_and_the_csv_matches_the_jsonl(tmp_path):
    out = bench.run(designs(tmp_path), progress=False)
    names = {p.name for p in out.iterdir()}
    assert names >= {
        "results.jsonl",
        "summary.csv",
        "report.md",
        "training_curves.png",
        "metrics_vs_kl.png",
        "metric_bars.png",
        "runs",
    }
    runs = sorted(p.name for p in (out / "runs").iterdir())
    assert runs == ["exact-seed0", "exact-seed1", "partial-seed0", "partial-seed1"]
    results = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    metrics = ["exact_copy", "length_penalty", "kl", "length", "distinct_2", "eos_rate"]
    assert len(results) == 4 * len(metrics) and {r["metric"] for r in results} == set(metrics)
    with (out / "summary.csv").open() as f:
        summary = list(csv.DictReader(f))
    assert len(summary) == 2 * len(metrics)
    for row in summary:
        values = [
            r["value"] for r in results if r["design"] == row["design"] and r["metric"] == row["metric"]
        ]
        mean, low, high = mean_ci(values)
        assert float(row["mean"]) == pytest.approx(mean) and int(row["n"]) == 2
        assert float(row["ci_low"]) == pytest.approx(low) and float(row["ci_high"]) == pytest.approx(high)
    report = (out / "report.md").read_text()
    assert "## Rankings" in report and "**kl** (lower is better)" in report and "### partial" in report
    kl = [r["value"] for r in results if r["metric"] == "kl"]
    assert all(math.isfinite(v) for v in kl)


def test_a_killed_bench_resumes_without_redoing_finished_runs(tmp_path, monkeypatch):
    import textgym.train

    trained, evaluated = [], []
    real_train, real_evaluate = textgym.train.run, bench.evaluate

    def counting_train(*args, **kwargs):
        trained.append(kwargs.get("resume") or kwargs["config"]["run"]["output_dir"])
        return real_train(*args, **kwargs)

    def killed_on_third(run_dir, spec):
        evaluated.append(run_dir.name)
        if len(evaluated) == 3:
            raise KeyboardInterrupt
        return real_evaluate(run_dir, spec)

    monkeypatch.setattr(textgym.train, "run", counting_train)
    monkeypatch.setattr(bench, "evaluate", killed_on_third)
    with pytest.raises(KeyboardInterrupt):
        bench.run(designs(tmp_path), progress=False)
    assert len(trained) == 3
    finished = {
        p.parent.name: p.stat().st_mtime_ns for p in (tmp_path / "bench" / "runs").glob("*/eval.json")
    }
    assert sorted(finished) == ["exact-seed0", "exact-seed1"]

    trained.clear()
    monkeypatch.setattr(bench, "evaluate", real_evaluate)
    bench.run(designs(tmp_path), progress=False)
    assert [str(t).rsplit("/", 1)[-1] for t in trained] == ["partial-seed0", "partial-seed1"]
    assert trained[0] == tmp_path / "bench" / "runs" / "partial-seed0"  # resumed from its checkpoint
    for name, mtime in finished.items():
        assert (tmp_path / "bench" / "runs" / name / "eval.json").stat().st_mtime_ns == mtime


def test_unknown_reward_or_metric_names_fail_before_any_training(tmp_path, capsys):
    bad = designs(tmp_path)
    bad["designs"][1]["rewards"] = [{"name": "parital_match"}]
    with pytest.raises(UnknownNameError, match="unknown reward 'parital_match'"):
        bench.run(bad, progress=False)
    bad = designs(tmp_path)
    bad["metrics"]["builtin"] = ["kl", "perplexity"]
    with pytest.raises(UnknownNameError, match="unknown metric 'perplexity'"):
        bench.run(bad, progress=False)
    bad = designs(tmp_path)
    bad["metrics"]["rewards"] = [{"name": "fluency", "modle": "x"}]
    with pytest.raises(Exception, match="'modle'"):
        load_designs(bad)
    assert not (tmp_path / "bench").exists()
    path = tmp_path / "d.toml"
    path.write_text('[[designs]]\nname = "a"\nrewards = [{ name = "sentimnt" }]\n')
    assert main(["bench", str(path)]) == 2
    assert "Did you mean 'sentiment'" in capsys.readouterr().err
