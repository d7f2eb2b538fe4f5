"""`make bench`: run every benchmark and write benchmarks/results/*.json and docs/performance.md.

Each figure is a median over repetitions, and each ratio compares two things measured side by side in the
same run. Nothing here is a test: timings on shared machines vary, so the test suite asserts none.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import WORK, median, write_result  # noqa: E402

PY = sys.executable
TRL_VENV = WORK / "trl-venv"
TRL_VERSION = "1.12.0"


def sh(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("$", " ".join(str(a) for a in args), flush=True)
    return subprocess.run([str(a) for a in args], check=True, cwd=ROOT, **kwargs)


def module(name: str, *args: str) -> None:
    sh([PY, "-m", f"benchmarks.{name}", *args])


def reward_model() -> Path:
    """A reward model for the benchmarks: SmolLM2 with a (seeded, untrained) sequence-classification head."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from textgym.atomic import atomic_build_dir
    from textgym.models import smollm2_dir

    def build(out: Path) -> None:
        import torch

        torch.manual_seed(0)
        AutoModelForSequenceClassification.from_pretrained(smollm2_dir(), num_labels=1).save_pretrained(out)
        AutoTokenizer.from_pretrained(smollm2_dir()).save_pretrained(out)

    return atomic_build_dir(WORK / "rm-smollm2", build)


def prompts_file() -> Path:
    """The 24 shipped chat prompts with the chat template applied, as texts both PPO sides tokenize."""
    from benchmarks.common import chat_prompts
    from textgym.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    path = WORK / "prompts.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([tokenizer.decode(ids) for ids in chat_prompts(tokenizer, 24)]))
    return path


def trl_python() -> Path:
    """TRL in its own virtual environment, made here on first use (torch pinned first, as in the Makefile),
    with the transformers that textgym runs on, so that both sides run the same model code."""
    import transformers

    python = TRL_VENV / "bin" / "python"
    marker = TRL_VENV / f".trl-{TRL_VERSION}-transformers-{transformers.__version__}"
    if not marker.exists():
        sh(["python3.11", "-m", "venv", "--clear", TRL_VENV])
        sh([python, "-m", "pip", "install", "-q", "--upgrade", "pip"])
        sh([python, "-m", "pip", "install", "-q", "torch==2.13.0"])
        sh(
            [
                python,
                "-m",
                "pip",
                "install",
                "-q",
                f"trl=={TRL_VERSION}",
                f"transformers=={transformers.__version__}",
            ]
        )
        marker.touch()
    return python


def ppo_side(python: Path | str, script: str, args: list[str]) -> dict:
    out = sh(
        [python, script, *args], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def ppo_vs_trl(model_dir: Path, rm_dir: Path, prompts: Path, quick: bool) -> None:
    common = ["--prompts", prompts, "--rm-model", rm_dir, "--batch", "16", "--response-length", "24",
              "--epochs", "2", "--minibatches", "2", "--micro-batch", "8", "--iterations", "1" if quick else "3"]  # fmt: skip
    trl = trl_python()
    textgym_side = ppo_side(PY, "benchmarks/ppo_textgym.py", common)
    trl_side = ppo_side(trl, "benchmarks/ppo_trl.py", ["--model", model_dir, *common])
    t, r = median(textgym_side["iteration_s"]), median(trl_side["iteration_s"])
    write_result(
        "ppo_vs_trl",
        {
            "settings": {
                "batch": 16,
                "response_length": 24,
                "ppo_epochs": 2,
                "minibatches": 2,
                "micro_batch": 8,
            },
            "textgym": textgym_side,
            "trl": trl_side,
            "trl_version": TRL_VERSION,
            "time_ratio": t / r,
            "memory_ratio": textgym_side["peak_rss_mb"] / trl_side["peak_rss_mb"],
        },
    )


def scaling(rm_dir: Path, prompts: Path, quick: bool) -> None:
    rows = []
    points = [(4, 24), (8, 24), (16, 24), (32, 24), (16, 12), (16, 48)] if not quick else [(4, 8), (8, 8)]
    for batch, length in points:
        args = ["--prompts", prompts, "--rm-model", rm_dir, "--batch", batch, "--response-length", length,
                "--epochs", "2", "--minibatches", "2", "--micro-batch", min(8, batch), "--iterations", "1"]  # fmt: skip
        side = ppo_side(PY, "benchmarks/ppo_textgym.py", [str(a) for a in args])
        s = median(side["iteration_s"])
        tokens = side["tokens"][-1]
        rows.append({"batch": batch, "response_length": length, "iteration_s": s, "generated_tokens": tokens,
                     "ms_per_generated_token": 1e3 * s / tokens, "breakdown": side["breakdown"]})  # fmt: skip
        print(rows[-1], flush=True)
    write_result("scaling", {"rows": rows})


def agents(quick: bool) -> None:
    """One iteration of each LM agent on this CPU, each in its own process so that its peak resident memory
    is its own (benchmarks/gpu_check.py without the rollout part)."""
    from benchmarks.common import results_dir, write_result
    from benchmarks.gpu_check import DEFAULT_AGENTS  # the LoRA variants are for the GPU's larger policies

    size = ["--model", "tiny-random-llama", "--batches", "8", "--new-tokens", "4", "--micro-batch", "4"]
    if not quick:
        size = ["--batches", "16", "--new-tokens", "24", "--micro-batch", "8"]
    rows = []
    for name in DEFAULT_AGENTS:
        out = results_dir() / f".agent_{name}.json"
        module("gpu_check", "--device", "cpu", "--skip-rollout", "--agents", name, *size, "--out", str(out))
        rows += json.loads(out.read_text())["agents"]
        out.unlink()
    write_result("agents_cpu", {"settings": size, "rows": rows})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--only",
        nargs="+",
        default=["env", "rewards", "rollout", "multiturn", "ppo", "scaling", "agents", "distributed", "bf16"],
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to check that everything runs")
    parser.add_argument(
        "--results", type=Path, help="where the JSON and its report go (default benchmarks/results and docs/)"
    )
    args = parser.parse_args()
    if args.results or args.quick:  # a quick check never overwrites the real results
        os.environ["TEXTGYM_BENCH_RESULTS"] = str(args.results or WORK / "quick-results")
    start = time.time()
    q = args.quick
    if "env" in args.only:
        module("env_overhead", *(["--envs", "1", "8", "--steps", "40", "--repeats", "1"] if q else []))
    if "rewards" in args.only:
        quick = ["--batch", "8", "--repeats", "1"] if q else []
        module("reward_throughput", "--rm-model", str(reward_model()), "--baseline", *quick)
    if "rollout" in args.only:
        module(
            "rollout_vs_generate",
            *(["--batches", "1", "2", "--new-tokens", "4", "--repeats", "1"] if q else []),
        )
    if "multiturn" in args.only:
        quick = [
            "--model",
            "tiny-random-llama",
            "--batches",
            "1",
            "2",
            "--new-tokens",
            "24",
            "--repeats",
            "1",
            "--stop",
            "\n",  # the tiny random model writes newlines, never a full stop
        ]
        # the settings of the recorded run, which docs/performance.md states
        module("multiturn_rollout", *(quick if q else ["--batches", "1", "8", "--repeats", "2"]))
    if "ppo" in args.only:
        from textgym.models import smollm2_dir

        ppo_vs_trl(smollm2_dir(), reward_model(), prompts_file(), q)
    if "scaling" in args.only:
        scaling(reward_model(), prompts_file(), q)
    if "agents" in args.only:
        agents(q)
    if "distributed" in args.only:
        module("distributed_speedup", *(["--quick", "--iterations", "2"] if q else []))
    if "bf16" in args.only:
        module("bf16_cpu", *(["--quick", "--repeats", "1"] if q else []))
    from benchmarks.report import write_report

    report = write_report(quick=q)
    print(f"benchmarks done in {time.time() - start:.0f} s; see {report}", flush=True)


if __name__ == "__main__":
    main()
