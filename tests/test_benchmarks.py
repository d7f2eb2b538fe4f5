"""The benchmarks run (at tiny sizes); they assert no timings, which belong in docs/performance.md."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_quick_benchmarks_run_and_write_results_and_a_report(tmp_path):
    result = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick", "--only", "env", "rollout", "--results", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rollout = json.loads((tmp_path / "rollout_vs_generate.json").read_text())
    assert [row["batch"] for row in rollout["rows"]] == [1, 2]
    assert all(
        row["steps_env"] == row["steps_generate"] for row in rollout["rows"]
    )  # same tokens, same steps
    env = json.loads((tmp_path / "env_overhead.json").read_text())
    assert [row["num_envs"] for row in env["rows"]] == [1, 8]
    report = (tmp_path / "performance.md").read_text()
    assert "## Rollout through the env against `model.generate`" in report and "## The env alone" in report


def test_quick_multiturn_benchmark_runs_and_reports(tmp_path):
    result = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick", "--only", "multiturn", "--results", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads((tmp_path / "multiturn_rollout.json").read_text())["rows"]
    assert [row["batch"] for row in rows] == [1, 2]
    assert all(row["turns"] > row["batch"] and row["env_tokens"] > 0 for row in rows)  # several turns each
    assert all(row["same_tokens"] == 1.0 for row in rows)  # greedy on both sides: the same agent tokens
    report = (tmp_path / "performance.md").read_text()
    assert "## Multi-turn rollout against `model.generate` turn by turn" in report


def test_the_gpu_check_runs_on_the_cpu_at_a_tiny_size(tmp_path):
    """As on a machine that cannot install the model's weights: a model directory's architecture and
    tokenizer, with fresh weights (``--random-weights``)."""
    import textgym

    model, tokenizer = textgym.load_model("tiny-random-llama")
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--model", str(tmp_path / "model"),
         "--random-weights", "--batches", "8", "--new-tokens", "4", "--repeats", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    check = json.loads(out.read_text())
    assert check["weights"] == "random (seed 0)" and check["args"]["random_weights"] == "True"
    assert not [row for row in check["rollout"] + check["agents"] if "error" in row]
    assert [row["batch"] for row in check["rollout"]] == [8] and check["rollout"][0]["ratio"] > 0
    assert {row["agent"] for row in check["agents"]} == {"lmppo", "grpo", "grpo-beta0", "rloo"}
    assert all(row["peak_memory_mb"] > 0 and row["iteration_s"] > 0 for row in check["agents"])


def test_the_gpu_checks_precisions_alternate_within_each_repetition(tmp_path):
    """--also-fp32-rollout times bf16 and fp32 in the same repetitions (bf16 autocast runs on any CPU,
    emulated where it is not native; the agents, which refuse that, are left out)."""
    out = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--model", "tiny-random-llama",
         "--bf16", "--also-fp32-rollout", "--agents", "--batches", "2", "--new-tokens", "3", "--repeats", "2",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    check = json.loads(out.read_text())
    assert [(row["batch"], row["bf16"], row["interleaved"]) for row in check["rollout"]] == [
        (2, True, True), (2, False, True)
    ]  # fmt: skip
    assert check["agents"] == [] and all(row["tokens"] > 0 for row in check["rollout"])
