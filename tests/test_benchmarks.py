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
        row["same_tokens"] == 1.0 and row["steps_env"] == row["steps_generate"] for row in rollout["rows"]
    )
    env = json.loads((tmp_path / "env_overhead.json").read_text())
    assert [row["num_envs"] for row in env["rows"]] == [1, 8]
    report = (tmp_path / "performance.md").read_text()
    assert "## Rollout through the env against `model.generate`" in report and "## The env alone" in report


def test_results_elsewhere_get_their_report_beside_them_not_in_the_docs(tmp_path, monkeypatch):
    from benchmarks.report import write_report

    page = ROOT / "docs" / "performance.md"
    docs = page.read_text()
    monkeypatch.setenv("TEXTGYM_BENCH_RESULTS", str(tmp_path))  # what run.py --results DIR sets
    try:
        assert write_report() == tmp_path / "performance.md" and (tmp_path / "performance.md").exists()
        assert page.read_text() == docs
    finally:  # rewritten only if the test failed: another worker's test may read the page meanwhile
        if page.read_text() != docs:
            page.write_text(docs)


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


def saved_tiny_model(path):
    """tiny-random-llama written to the model directory ``path`` (as ``--model DIR`` takes it); returns it."""
    import textgym

    model, tokenizer = textgym.load_model("tiny-random-llama")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def test_the_gpu_check_runs_on_the_cpu_at_a_tiny_size(tmp_path):
    """As on a machine that cannot install the model's weights: a model directory's architecture and
    tokenizer, with fresh weights (``--random-weights``)."""
    saved_tiny_model(tmp_path / "model")
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


def test_the_gpu_check_builds_a_changed_architecture_and_trains_lora_on_it(tmp_path):
    """--override changes the fresh model's config (how the GPU check builds a policy larger than the
    shipped one); the LoRA agents train the adapter alone, over the whole frozen model. In bf16 (where the
    CPU has it natively) each also times its rollout with the adapters folded and through them."""
    from transformers import AutoModelForCausalLM

    from textgym.agents.base import cpu_has_native_bf16

    model = saved_tiny_model(tmp_path / "model")
    layers = model.config.num_hidden_layers + 1
    out = tmp_path / "gpu_check.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--model", str(tmp_path / "model"),
         "--random-weights", "--override", f'{{"num_hidden_layers": {layers}}}', "--skip-rollout",
         "--agents", "lmppo-lora", "grpo-lora", "--batches", "8", "--new-tokens", "3", "--repeats", "1",
         "--out", str(out), *(["--bf16"] if cpu_has_native_bf16() else [])],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    check = json.loads(out.read_text())
    assert [row["agent"] for row in check["agents"]] == ["lmppo-lora", "grpo-lora"], check["agents"]
    model.config.num_hidden_layers = layers
    frozen = sum(p.numel() for p in AutoModelForCausalLM.from_config(model.config).parameters())
    for row in check["agents"]:
        assert row["parameters"] - row["trainable_parameters"] == frozen  # every base weight, frozen
        assert 0 < row["trainable_parameters"] < frozen / 2
        if cpu_has_native_bf16():
            assert row["rollout_folded_s"] > 0 and row["rollout_adapters_s"] > 0


def test_the_gpu_check_refuses_an_override_without_random_weights(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--device", "cpu", "--model", "tiny-random-llama",
         "--override", '{"num_hidden_layers": 3}', "--out", str(tmp_path / "x.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and "--override" in result.stderr and "--random-weights" in result.stderr


def gpu_run(agents=(), rollout=(), override=None):
    return {"args": {"override": str(override or {})}, "agents": list(agents), "rollout": list(rollout)}


def test_the_gpu_report_on_larger_policies_says_what_its_files_show():
    from benchmarks.report_gpu import larger_policies

    breakdown = {"time/rollout": 1.0, "time/reference": 0.1, "time/update": 0.4}
    lora = {"agent": "lmppo-lora", "batch": 64, "iteration_s": 1.5, "peak_memory_mb": 50 * 1024,
            "parameters": 6_500_000_000 + 11_000_000, "trainable_parameters": 11_000_000,
            "rollout_folded_s": 0.8, "rollout_adapters_s": 1.2, "breakdown": breakdown}  # fmt: skip
    full = {"agent": "lmppo", "batch": 64, "error": "OutOfMemoryError: CUDA out of memory. Tried..."}
    lines = larger_policies(
        [gpu_run([lora, full], override={"hidden_size": 4096})],
        [gpu_run([lora], override={"hidden_size": 4096})],
    )
    text = "\n".join(lines)
    assert (
        "6.50B parameters, Llama-3-8B's depth, width and MLP with SmolLM2's 64-wide attention heads" in text
    )
    assert "| 6.50B | LMPPO, LoRA | 11.0M | 1.50 | 1.00 | 0.10 | 0.40 | 50.0 |" in text
    assert "| 6.50B | LMPPO | all | out of memory |" in text
    assert "make 121 GiB of the GPU's 140 before any activation" in text  # 20 bytes per parameter
    assert "does not show that it cannot fit alone" in text  # the run before it had not freed its agents
    assert "LMPPO, LoRA at 6.50B, 0.80 s against 1.20 s (1.50x)" in text


def test_the_gpu_report_says_bf16_did_not_pay_when_no_size_gained():
    from benchmarks.report_gpu import gpu_section

    def row(batch, bf16, generate_s):
        return {"batch": batch, "bf16": bf16, "interleaved": True, "generate_s": generate_s,
                "rollout_s": generate_s, "ratio": 1.0, "syncs": {"generate": 71, "rollout": 70}}  # fmt: skip

    machine = {"cuda": "GPU", "torch": "t", "transformers": "x", "python": "3", "cpu_count": 1}
    g = {"machine": machine, "args": {"device": "cuda", "new_tokens": "32", "repeats": "3", "bf16": "True",
         "micro_batch": "32"}, "rollout": [row(64, True, 1.0), row(64, False, 1.05)], "agents": []}  # fmt: skip
    text = "\n".join(gpu_section(g))
    assert "SmolLM2-135M at batch 64, 1.00 s against 1.05 s" in text
    assert "bf16 did not pay at these sizes" in text and "bf16 paid only" not in text
    g["rollout"][1]["generate_s"] = 1.8
    assert "bf16 paid only where matrix products, not kernel launches, set the pace: 1.80x" in "\n".join(
        gpu_section(g)
    )


def recorded(name):
    return json.loads((ROOT / "benchmarks" / "results" / f"{name}.json").read_text())


def test_the_reward_report_calls_scores_the_same_only_within_its_tolerance():
    from benchmarks.report_rewards import reward_section

    w = recorded("reward_throughput")
    fluency = next(r for r in w["rows"] if r["reward"] == "fluency" and "speedup" in r and "case" not in r)
    assert "with the same scores (fp32" in "\n".join(reward_section(w))
    fluency.update(speedup=12.0, max_score_difference_before=0.9)  # fast, but the scores moved
    text = "\n".join(reward_section(w))
    assert "but with other scores (fp32, largest difference 9.0e-01, above 0.0001)" in text
    assert "with the same scores: missed in fp32" in text


def test_the_agents_report_shows_a_failed_agent_instead_of_failing():
    from benchmarks.report import agents_section

    a = recorded("agents_cpu")
    a["rows"].append({"agent": "rloo", "batch": 16, "error": "OutOfMemoryError: out of memory"})
    assert "| rloo | 16 | failed: OutOfMemoryError: out of memory | | | |" in agents_section(a)


def test_the_distributed_report_counts_the_measured_iterations_not_the_warm_up():
    from benchmarks.report import distributed_section

    d = recorded("distributed_speedup")
    one = d["one_process"]
    assert one["iterations"] == len(one["times"]) + 1  # the run's iterations: the warm-up and those timed
    assert f"| 1 | {one['iteration_s']:.1f} | {len(one['times'])} |" in distributed_section(d)
