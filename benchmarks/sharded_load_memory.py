"""Host memory of building an LMPPO agent sharded over two processes, with FSDP2 and with DeepSpeed ZeRO-3:
the policy given by name (the main process reads it; the others build it on the meta device and get their
shards) against the same policy given as a model object (every process holds it whole, and a whole
reference copy, before sharding). Each engine and way runs in its own ``torchrun`` launch; each process
reports how much its peak resident memory grew while the agent was built, and under ZeRO-3 also until the
training engine started: the engine then allocates its own buffers (fp32 partitions, gradients) on the
device, which on a CPU is this same memory, and on a GPU is not.

    python -m benchmarks.sharded_load_memory [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys

from benchmarks.common import ROOT, write_result
from textgym.agents.sharding import ENGINE_ENVIRONMENT

WAYS = ("name", "object")
ENGINES = {"fsdp": "FSDP2", "zero3": "DeepSpeed ZeRO-3"}


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


def worker(model: str, way: str) -> None:
    import torch.distributed as dist

    from textgym.agents.ppo import LMPPO
    from textgym.models import load_model, load_tokenizer

    load_tokenizer(model)  # a converted model directory exists before the peak is read
    before = peak_mib()
    sharded = [None]  # the peak when the training engine (ZeRO-3's, with the optimizer) starts
    if os.environ.get("ACCELERATE_USE_DEEPSPEED"):
        import deepspeed

        start = deepspeed.initialize

        def initialize(*args, **kwargs):
            if kwargs.get("optimizer") is not None:
                sharded[0] = peak_mib() - before
            return start(*args, **kwargs)

        deepspeed.initialize = initialize
    agent = LMPPO(model if way == "name" else load_model(model)[0], None, seed=0, verbose=0)
    growth = {
        "built": round(peak_mib() - before),
        "sharded": None if sharded[0] is None else round(sharded[0]),
    }
    print(f"rank {agent.dist.rank}: {json.dumps(growth)}", flush=True)
    dist.barrier()


def launch(model: str, engine: str, way: str) -> dict[int, dict[str, float | None]]:
    env = {**os.environ, **ENGINE_ENVIRONMENT[engine], "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "benchmarks.sharded_load_memory", "--worker", way, "--model", model]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    out = subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, cwd=ROOT).stdout
    return {int(r): json.loads(growth) for r, growth in re.findall(r"rank (\d+): (\{[^}]*\})", out)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--worker", choices=WAYS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.model, args.worker)
    from textgym.models import load_model

    parameters = sum(p.numel() for p in load_model(args.model)[0].parameters())
    growth = {engine: {way: launch(args.model, engine, way) for way in WAYS} for engine in ENGINES}
    print(f"{args.model}, {parameters / 1e6:.0f}M parameters ({parameters * 4 / 2**20:.0f} MiB in fp32), "
          f"2 processes: peak resident memory growth while LMPPO is built (under ZeRO-3: [until the "
          f"training engine starts])")  # fmt: skip
    for engine, name in ENGINES.items():
        for way in WAYS:
            print(
                f"  {name:16} policy as {way:6}: "
                + ", ".join(
                    f"process {r}: {mb['built']:.0f} MiB"
                    + (f" [{mb['sharded']:.0f} MiB]" if mb["sharded"] is not None else "")
                    for r, mb in sorted(growth[engine][way].items())
                )
            )
    write_result(
        "sharded_load_memory",
        {"model": args.model, "parameters": parameters, "processes": 2, "growth_mib": growth},
    )


if __name__ == "__main__":
    main()
