"""Two processes against one at equal total batch: ``textgym train`` with LMPPO on SmolLM2-135M, once in one
process (all cores) and under ``torchrun --nproc_per_node 2`` (half the cores each): data-parallel, sharded
with FSDP2, and sharded with DeepSpeed ZeRO-3. Seconds per iteration from each run's metrics (the first
iteration, a warm-up, left out).

    python -m benchmarks.distributed_speedup [--iterations 4] [--quick]
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import ROOT, median, write_result
from textgym.agents.sharding import ENGINE_ENVIRONMENT

CONFIG = """
[run]
total_timesteps = {tokens}
checkpoint_every = 1000
sample_prompts = 1

[env]
id = "textgym/TextGen-v0"
num_envs = {batch}
prompts = "chat"
max_new_tokens = {length}
rewards = [{{ name = "sentiment" }}, {{ name = "length_penalty", weight = 0.3, target = 16 }}]

[agent]
name = "lmppo"
policy = "{model}"
learning_rate = 3e-5
n_epochs = 2
n_minibatches = 2
micro_batch_size = {micro}
"""


# what `accelerate launch --config_file examples/accelerate/{fsdp,zero3}.yaml` sets
SHARDING = {None: {}, **ENGINE_ENVIRONMENT}  # the environment that asks for each engine


def train(config: Path, out: Path, processes: int, shard: str | None = None) -> list[dict[str, str]]:
    cores = os.cpu_count() or 1
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(max(1, cores // processes))}
    env.update(SHARDING[shard])
    launcher = [sys.executable] if processes == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                        "--standalone", f"--nproc_per_node={processes}"]  # fmt: skip
    cmd = [*launcher, "-m", "textgym", "train", str(config), "--set", f"run.output_dir='{out}'"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    with (out / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="the tiny model, to check that it runs")
    args = parser.parse_args()
    model, batch, length, micro = (
        ("tiny-random-llama", 8, 8, 4) if args.quick else ("smollm2-135m-instruct", 16, 24, 8)
    )
    tokens = batch * length * args.iterations
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "run.toml"
        config.write_text(CONFIG.format(tokens=tokens, batch=batch, length=length, model=model, micro=micro))
        for processes, shard in ((1, None), (2, None), (2, "fsdp"), (2, "zero3")):
            metrics = train(config, Path(tmp) / f"p{processes}{shard}", processes, shard)
            if len(metrics) < 2:
                raise SystemExit(f"{processes} process(es), {shard or 'data-parallel'}: one iteration ran, and the "
                                 "first is a warm-up; raise --iterations")  # fmt: skip
            times = [float(m["time/iteration"]) for m in metrics[1:]]  # the first, a warm-up, left out
            key = shard or processes
            rows[key] = {"iteration_s": median(times), "iterations": len(metrics), "times": times}
            print(key, rows[key], flush=True)
    write_result(
        "distributed_speedup",
        {
            "settings": dict(
                model=model,
                total_batch=batch,
                response_length=length,
                ppo_epochs=2,
                minibatches=2,
                micro_batch=micro,
            ),
            "one_process": rows[1],
            "two_processes": rows[2],
            "two_processes_fsdp2": rows["fsdp"],
            "two_processes_zero3": rows["zero3"],
            "speedup": rows[1]["iteration_s"] / rows[2]["iteration_s"],
        },
    )


if __name__ == "__main__":
    main()
