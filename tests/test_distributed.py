"""Data-parallel training on two CPU processes (gloo), as `torchrun --nproc_per_node 2 -m textgym train` runs it."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lm_helpers import char_llama, copy_run_config, make_env

from textgym.agents.ppo import LMPPO
from textgym.cli import main
from textgym.config import load_config

HERE = Path(__file__).parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
COPY = copy_run_config(total_timesteps=96)
# Summation order differs between one process and an all-reduce over two. AdamW's first step moves each
# weight by lr * g / (|g| + eps), so where a gradient entry is near eps its float32 rounding changes that
# weight's step noticeably (seen: 1.1e-5 on one weight of 2048). The bound is 1% of one step (lr = 1e-2);
# every other weight agrees to ~1e-7.
TOLERANCE = 1e-4


def run_cmd(cmd, **kwargs):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, **kwargs)


@pytest.mark.parametrize("agent", ["lmppo", "grpo"])
def test_one_update_split_over_two_processes_equals_one_process_on_the_whole_batch(tmp_path, agent):
    batch, _ = LMPPO(char_llama(), make_env(16), seed=3, verbose=0).generate()
    fields = ("query_ids", "query_mask", "response_ids", "response_mask", "logprobs", "scores", "truncated")
    torch.save({k: getattr(batch, k) for k in fields}, tmp_path / "batch.pt")
    script = [str(HERE / "distributed_update.py"), agent, str(tmp_path / "batch.pt")]
    single = run_cmd([sys.executable, *script, str(tmp_path / "one.pt")])
    assert single.returncode == 0, single.stderr
    split = run_cmd([*TORCHRUN, *script, str(tmp_path / "two.pt")])
    assert split.returncode == 0, split.stderr
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    initial = [p.detach() for p in char_llama().parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(one, initial))  # the update changed the weights
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, atol=TOLERANCE, rtol=0)


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "copy.toml"
    path.write_text(COPY)
    return path


def test_a_two_process_run_writes_one_run_directory_with_statistics_over_all_episodes(config, tmp_path):
    out = tmp_path / "run"
    result = run_cmd([*TORCHRUN, "-m", "textgym", "train", str(config), "--set", f"run.output_dir='{out}'"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert load_config(out / "config.toml")["run"]["processes"] == 2
    with open(out / "metrics.csv") as f:
        metrics = list(csv.DictReader(f))
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 * len(metrics)  # both processes' episodes: 4 each per iteration
    first = [s for s in samples if s["iteration"] == 1]
    assert float(metrics[0]["reward"]) == pytest.approx(sum(s["reward"] for s in first) / 8, abs=1e-6)
    assert result.stdout.count("after training:") == 1  # only the main process reports
    resumed = run_cmd(
        [sys.executable, "-m", "textgym", "train", "--resume", str(out), "--set", "run.total_timesteps=200"]
    )
    assert resumed.returncode == 0, resumed.stderr  # run.processes = 2: relaunched with two processes
    again = run_cmd([*TORCHRUN, "-m", "textgym", "train", "--resume", str(out), "--set", "run.processes=1"])
    assert again.returncode != 0


def test_resuming_with_another_number_of_processes_is_refused(config, tmp_path):
    out = tmp_path / "run"
    assert (
        run_cmd(
            [*TORCHRUN, "-m", "textgym", "train", str(config), "--set", f"run.output_dir='{out}'"]
        ).returncode
        == 0
    )
    three = [*TORCHRUN[:-1], "--nproc_per_node=4", "-m", "textgym", "train", "--resume", str(out)]
    result = run_cmd(three)
    assert (
        result.returncode != 0
        and "resume it with the same number (torchrun --nproc_per_node 2)" in result.stderr
    )


FAILS_ON_RANK_1 = """
import os

import textgym


@textgym.reward("flaky")
def flaky(samples):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("the judge is down")
    return [0.0] * len(samples)
"""


def test_a_reward_failing_on_one_process_stops_every_process_with_its_name(config, tmp_path):
    (tmp_path / "flaky.py").write_text(FAILS_ON_RANK_1)
    out = tmp_path / "run"
    result = run_cmd([*TORCHRUN, "-m", "textgym", "train", str(config), "--set", f"run.output_dir='{out}'",
                      "--set", "run.sample_prompts=1", "--set", f"run.plugins=['{tmp_path / 'flaky.py'}']",
                      "--set", "env.rewards=[{name='flaky'}]"])  # fmt: skip
    assert result.returncode != 0
    assert "reward function 'flaky'" in result.stderr or "reward plugin 'flaky'" in result.stderr
    assert (
        "the judge is down" in result.stderr and "process 1 failed, so every process stops" in result.stderr
    )


def test_a_batch_that_does_not_split_over_the_processes_is_refused(config, tmp_path, capsys):
    assert (
        main(
            ["train", str(config), "--set", "run.processes=3", "--set", f"run.output_dir='{tmp_path / 'x'}'"]
        )
        == 2
    )
    assert "env.num_envs=8 does not split evenly over 3 processes" in capsys.readouterr().err
    (tmp_path / "grpo.toml").write_text(COPY.replace("n_epochs = 1", "num_generations = 8"))
    assert main(["train", str(tmp_path / "grpo.toml"), "--agent", "grpo", "--set", "run.processes=2",
                 "--set", f"run.output_dir='{tmp_path / 'y'}'"]) == 2  # fmt: skip
    assert "not a multiple of num_generations=8" in capsys.readouterr().err
