"""Host memory of building an LMPPO agent sharded with FSDP2 over two processes: the policy given by name
(the main process reads it; the others build it on the meta device and get their shards) against the same
policy given as a model object (every process holds it whole, and a whole reference copy, before sharding).
Each way runs in its own ``torchrun`` launch; each process reports how much its peak resident memory grew
while the agent was built.

    python -m benchmarks.fsdp_load_memory [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys

from benchmarks.common import ROOT, write_result
from textgym.agents.sharding import ENGINE_ENVIRONMENT

WAYS = ("name", "object")


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


def worker(model: str, way: str) -> None:
    import torch.distributed as dist

    from textgym.agents.ppo import LMPPO
    from textgym.models import load_model, load_tokenizer

    load_tokenizer(model)  # a converted model directory exists before the peak is read
    before = peak_mib()
    agent = LMPPO(model if way == "name" else load_model(model)[0], None, seed=0, verbose=0)
    print(f"rank {agent.dist.rank}: {peak_mib() - before:.0f} MiB", flush=True)
    dist.barrier()


def launch(model: str, way: str) -> dict[int, float]:
    env = {**os.environ, **ENGINE_ENVIRONMENT["fsdp"], "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "benchmarks.fsdp_load_memory", "--worker", way, "--model", model]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, cwd=ROOT).stdout
    return {int(r): float(mb) for r, mb in re.findall(r"rank (\d+): (\d+) MiB", out)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.model, args.worker)
    from textgym.models import load_model

    parameters = sum(p.numel() for p in load_model(args.model)[0].parameters())
    growth = {way: launch(args.model, way) for way in WAYS}
    print(f"{args.model}, {parameters / 1e6:.0f}M parameters ({parameters * 4 / 2**20:.0f} MiB in fp32), "
          f"FSDP2 over 2 processes: peak resident memory growth while LMPPO is built")  # fmt: skip
    for way in WAYS:
        print(
            f"  policy as {way:6}: "
            + ", ".join(f"process {r}: {mb:.0f} MiB" for r, mb in sorted(growth[way].items()))
        )
    write_result(
        "fsdp_load_memory",
        {"model": args.model, "parameters": parameters, "processes": 2, "growth_mib": growth},
    )


if __name__ == "__main__":
    main()
