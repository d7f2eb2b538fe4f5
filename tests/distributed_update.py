"""One update of an LM agent on a fixed batch of episodes, in one process or split over several (launched by
``torch.distributed.run``); writes the updated parameters. tests/test_distributed.py compares the two.

    python tests/distributed_update.py AGENT BATCH.pt OUT.pt [--load CHECKPOINT] [--save CHECKPOINT]
    python -m torch.distributed.run --nproc_per_node 2 tests/distributed_update.py AGENT BATCH.pt OUT.pt
    ACCELERATE_USE_FSDP=true python -m torch.distributed.run ...   # the same, sharded with FSDP2
    ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_ZERO_STAGE=3 python -m torch.distributed.run ...  # ZeRO-3
"""

import sys
from pathlib import Path

import torch
import torch.distributed

sys.path.insert(0, str(Path(__file__).parent))
from lm_helpers import char_llama

from textgym.agents.grpo import GRPO
from textgym.agents.ppo import LMPPO
from textgym.agents.rollout_batch import RolloutBatch
from textgym.agents.sharding import full_tensor

# one epoch, one minibatch: the same update whatever the split; micro-batches exercise accumulation
PPO = dict(n_epochs=1, n_minibatches=1, micro_batch_size=4, kl_coef=0.05, learning_rate=1e-2)
AGENTS = {
    "lmppo": (LMPPO, PPO),
    "lmppo-lora": (LMPPO, dict(PPO, lora={"r": 4, "target_modules": ["q_proj", "v_proj"]})),
    "lmppo-bf16": (LMPPO, dict(PPO, bf16=True)),  # tests/test_distributed.py compares it with DDP's split
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


def main() -> None:
    name, batch_path, out, *options = sys.argv[1:]
    options = dict(zip(options[::2], options[1::2]))
    cls, hyperparameters = AGENTS[name]
    if "--load" in options:  # the update continues a saved agent: its weights, value head and AdamW state
        agent = cls.load(options["--load"])
    else:
        agent = cls(char_llama(), None, seed=0, verbose=0, **hyperparameters)
    full = torch.load(batch_path, weights_only=True)
    world, rank = agent.dist.world, agent.dist.rank
    n = len(full["scores"]) // world
    rows = {k: v[rank * n : (rank + 1) * n] for k, v in full.items()}  # this process's share of the episodes
    batch = RolloutBatch(**rows, ref_logprobs=None, raw_scores=rows["scores"].clone())
    batch.ref_logprobs = agent.reference_logprobs(batch)
    batch.stats = agent.rollout_stats(batch)
    agent.train(agent.process(batch))
    # sharded: every process gathers the full parameters from the shards
    params = [full_tensor(p) for p in agent.params]
    print(f"rank {agent.dist.rank}: sharded={agent.sharding_engine}")
    if agent.dist.is_main:
        torch.save([p.detach().cpu() for p in params], out)
    if "--save" in options:  # every process: a sharded agent gathers its checkpoint collectively
        agent.save(options["--save"])


if __name__ == "__main__":
    main()  # returns before the group ends: the agent's DDP modules are freed while it is alive
    if torch.distributed.is_initialized():  # (the one-process reference run has no group)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()  # before exit: a gloo group left to shutdown can abort
