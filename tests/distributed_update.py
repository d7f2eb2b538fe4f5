"""One update of LM agents on a fixed batch of episodes, in one process or split over several (launched by
``torch.distributed.run``); writes each agent's updated parameters. tests/test_distributed.py compares them.

    python tests/distributed_update.py BATCH.pt OUT AGENT [AGENT ...] [--load DIR] [--save AGENT ...]
    python -m torch.distributed.run --nproc_per_node 2 tests/distributed_update.py BATCH.pt OUT AGENT ...
    ACCELERATE_USE_FSDP=true python -m torch.distributed.run ...   # the same, sharded with FSDP2
    ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE=3 python -m torch.distributed.run ...  # ZeRO-3

Each agent updates in turn, in the same processes, and writes OUT/AGENT.pt (its parameters after the update)
and, for the agents named after --save, its checkpoint OUT/AGENT/; --load DIR starts each agent from the checkpoint DIR/AGENT/.
The agents "*-zoo" load their policy by name (tiny-random-llama, whose embeddings are tied); each process
prints how many times it read a policy's weights.
"""

import argparse
import gc
import sys
from pathlib import Path

import torch
import torch.distributed
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from lm_helpers import char_llama

import textgym.models
from textgym.agents.grpo import GRPO
from textgym.agents.ppo import LMPPO
from textgym.agents.rollout_batch import RolloutBatch
from textgym.agents.sharding import full_tensor
from textgym.launch import end_process_group, exit_process

# one epoch, one minibatch: the same update whatever the split; micro-batches exercise accumulation
PPO = dict(n_epochs=1, n_minibatches=1, micro_batch_size=4, kl_coef=0.05, learning_rate=1e-2)
AGENTS = {
    "lmppo": (LMPPO, PPO),
    "lmppo-lora": (LMPPO, dict(PPO, lora={"r": 4, "target_modules": ["q_proj", "v_proj"]})),
    "lmppo-bf16": (LMPPO, dict(PPO, bf16=True)),
    "lmppo-zoo": (LMPPO, PPO),
    "lmppo-pissa-zoo": (
        LMPPO,
        dict(PPO, lora={"r": 4, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": "pissa"}),
    ),  # tests/test_distributed.py compares it with DDP's split
    "grpo": (
        GRPO,
        dict(
            num_generations=4,
            beta=0.05,
            loss_type="dapo",
            scale_rewards="batch",
            micro_batch_size=4,
            learning_rate=1e-2,
        ),
    ),
}


READS = [0]  # calls that read a policy's weights: a zoo model by name, or a checkpoint's policy/


def counting(load):
    def counted(*args, **kwargs):
        READS[0] += 1
        return load(*args, **kwargs)

    return counted


textgym.models.load_model = counting(textgym.models.load_model)
AutoModelForCausalLM.from_pretrained = counting(AutoModelForCausalLM.from_pretrained)


def update(name: str, full: dict, out: Path, load: Path | None, save: bool) -> None:
    cls, hyperparameters = AGENTS[name]
    READS[0] = 0
    if load is not None:  # the update continues a saved agent: its weights, value head and AdamW state
        agent = cls.load(load / name)
    elif name.endswith("-zoo"):
        agent = cls("tiny-random-llama", None, seed=0, verbose=0, **hyperparameters)
    else:
        agent = cls(char_llama(), None, seed=0, verbose=0, **hyperparameters)
    world, rank = agent.dist.world, agent.dist.rank
    print(f"rank {rank}: {name} read a policy {READS[0]} times")
    n = len(full["scores"]) // world
    rows = {k: v[rank * n : (rank + 1) * n] for k, v in full.items()}  # this process's share of the episodes
    batch = RolloutBatch(**rows, ref_logprobs=None, raw_scores=rows["scores"].clone())
    batch.ref_logprobs = agent.reference_logprobs(batch)
    batch.stats = agent.rollout_stats(batch)
    agent.train(agent.process(batch))
    # sharded: every process gathers the full parameters from the shards
    params = [full_tensor(p) for p in agent.params]
    print(f"rank {agent.dist.rank}: {name} sharded={agent.sharding_engine}")
    if agent.dist.is_main:
        torch.save([p.detach().cpu() for p in params], out / f"{name}.pt")
    if save:  # every process: a sharded agent gathers its checkpoint collectively
        agent.save(out / name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("batch", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("agents", nargs="+", choices=AGENTS)
    parser.add_argument("--load", type=Path)
    parser.add_argument("--save", nargs="+", default=[], choices=AGENTS)
    args = parser.parse_args()
    full = torch.load(args.batch, weights_only=True)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.agents:
        update(name, full, args.out, args.load, name in args.save)
        gc.collect()  # the agent (and its engine, under ZeRO-3) is freed before the next one is built


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # (the one-process reference run has no group)
        torch.distributed.barrier()
    end_process_group()  # as textgym train ends: the agents are freed, then the group (else exit can abort)
    exit_process(0)  # and without the interpreter's teardown, as the textgym command does
