"""What sharding changes in an LM agent, on two processes (launched by ``torch.distributed.run`` with
``ACCELERATE_USE_FSDP=true`` for FSDP2, or ``ACCELERATE_USE_DEEPSPEED=true`` for DeepSpeed ZeRO-3, or with
``--ddp`` and neither, for plain data-parallel training; tests/test_distributed.py runs it with each):

- a rollout on every process in lockstep, against the same rollout unsharded: process 0's episodes end after
  2 tokens, process 1's after up to 6, so process 0 must keep stepping its sharded model until process 1 is
  done, and each must get exactly the episodes it gets alone;
- a loss that is not finite on one process only: every process still runs the backward (its reduce-scatter
  needs all) and every process skips the step;
- a weight that is not finite in one process's shard only: every process's health check fails;
- a ``normalize_then_sum`` stack standardises over every process's episodes, as over the whole batch;
- an agent without a reference (GRPO, beta = 0) measures its KL against the policy as loaded, sharded as
  the policy is;
- a checkpoint saved before any optimizer step: the optimizer has no state yet, and the save has none;
- under ZeRO-3, NaN in the padding of a shard (DeepSpeed leaves it uninitialized) is no weight: the save's
  health check passes;
- a policy object whose weights differ per process: the KL reference holds the main process's weights, as
  the policy does, so an unchanged policy's KL is 0 on every process;
- a callback that stops training on one process only stops every process's ``learn`` (the others waited in
  the next rollout's collectives forever);
- data parallel: ``save`` on a process other than the main one writes nothing.

    ACCELERATE_USE_FSDP=true python -m torch.distributed.run --nproc_per_node 2 tests/distributed_sharding.py
"""

import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.distributed

sys.path.insert(0, str(Path(__file__).parent))
from lm_helpers import CHARS, char_llama, make_env, share_of_a

from textgym.agents.grpo import GRPO
from textgym.agents.ppo import LMPPO
from textgym.agents.sharding import local
from textgym.errors import TrainingError
from textgym.launch import end_process_group, exit_process
from textgym.rewards import FunctionReward, RewardStack
from textgym.sampling import rollout


def length(samples):
    return [float(len(s.completion)) for s in samples]


def main() -> None:
    agent = LMPPO(char_llama(), None, seed=0, verbose=0)
    if not agent.sharded and "--ddp" not in sys.argv:
        raise SystemExit("the policy is not sharded: run under torchrun with ACCELERATE_USE_FSDP=true")
    print(f"rank {agent.dist.rank}: sharded with {agent.sharding_engine}", flush=True)
    if agent.zero3 is not None:
        padded = 0
        with torch.no_grad():
            for p in agent.params:  # a shard's elements past the parameter's own are padding
                shard, start = p.ds_tensor, agent.dist.rank * p.ds_tensor.numel()
                if start + shard.numel() > p.ds_numel:
                    shard[max(0, p.ds_numel - start) :].fill_(float("nan"))
                    padded += 1
        assert sum(agent.dist.gather_objects([padded])) > 0  # some parameter has an odd size
        print(f"rank {agent.dist.rank}: padding filled with NaN", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(agent.dist.gather_objects([tmp])[0]) / "before"  # the main process's: only it writes
        agent.save(path)  # every process: the gather is collective
        if agent.dist.is_main:
            assert torch.load(path / "optimizer.pt", weights_only=True)["state"] == {}
        torch.distributed.barrier()  # the main process's directory stays until every process is done
    print(f"rank {agent.dist.rank}: saved before any step", flush=True)
    rank = agent.dist.rank
    tokens = 2 if rank == 0 else 6  # the episodes end on different steps

    def episodes(model, lockstep):
        return rollout(
            model, make_env(4, max_new_tokens=tokens), seed=11 + rank, keep_hidden=True, lockstep=lockstep
        )

    sharded = episodes(agent.rollout_model, agent.lockstep)
    alone = episodes(char_llama(), None)
    assert sharded.infos == alone.infos, (sharded.infos, alone.infos)
    assert torch.equal(sharded.response_ids, alone.response_ids)
    torch.testing.assert_close(sharded.logprobs, alone.logprobs)
    torch.testing.assert_close(sharded.hidden, alone.hidden)
    print(f"rank {rank}: {len(sharded.infos)} episodes of up to {tokens} tokens, as unsharded", flush=True)

    stack = RewardStack(
        [(FunctionReward("a", share_of_a), 1.0), (FunctionReward("len", length), 1.0)],
        aggregate="normalize_then_sum",
    )
    agent.set_env(make_env(4, rewards=stack))
    batch, _ = agent.generate()
    episodes = agent.last_episodes  # every process's
    whole = stack.combine({k: [e["reward_components"][k] for e in episodes] for k in stack.names})
    torch.testing.assert_close(
        agent.dist.gather(batch.raw_scores), torch.as_tensor(whole, dtype=torch.float32)
    )
    halves = [stack.combine({k: [e["reward_components"][k] for e in episodes[h : h + 4]] for k in stack.names})
              for h in (0, 4)]  # fmt: skip
    assert not np.allclose(np.concatenate(halves), whole)  # each process's half alone would give other totals
    print(f"rank {rank}: normalize_then_sum standardised over every process's episodes", flush=True)
    seconds = agent.dist.gather(torch.tensor([batch.stats["time/rollout"] + batch.stats["time/reward"]]))
    tokens = float(agent.dist.gather(batch.action_mask.sum()[None]).sum())
    assert math.isclose(batch.stats["time/tokens_per_s"], tokens / float(seconds.max()), rel_tol=1e-6)
    print(f"rank {rank}: tokens per second over every process's tokens", flush=True)
    with tempfile.TemporaryDirectory() as tmp:  # an agent without a reference measures a KL against its
        source = agent.dist.gather_objects([tmp])[0]  # policy as loaded, sharded as the policy is
        if agent.dist.is_main:
            char_llama().save_pretrained(source)
            CHARS.save_pretrained(source)
        torch.distributed.barrier()
        grpo = GRPO(source, None, beta=0.0, seed=0, verbose=0)
        kl = grpo.sequence_kl(batch)  # LMPPO's batch: its policy has not moved, so the KL is 0
        torch.distributed.barrier()  # the main process's directory stays until every process has read it
    torch.testing.assert_close(kl, torch.zeros_like(kl), atol=1e-4, rtol=0)
    whole = [getattr(p, "ds_numel", p.numel()) for p in grpo._kl_reference.parameters()]
    if grpo.sharded and sum(local(p).numel() for p in grpo._kl_reference.parameters()) < sum(whole):
        print(f"rank {rank}: the KL reference is sharded as the policy", flush=True)
    del grpo
    weights = [local(p).clone() for p in agent.params]
    with agent.accumulating(last=True):
        logprobs, _, _ = agent.policy_logprobs(batch)
        finite = agent.backward(logprobs.sum() * (float("nan") if rank == 1 else 1.0))
    assert finite == (rank == 0)
    assert not agent.optimizer_step() and agent.skipped_steps == 1
    assert all(torch.equal(w, local(p)) for w, p in zip(weights, agent.params))
    print(f"rank {rank}: step skipped", flush=True)

    with torch.no_grad():
        if rank == 1:
            local(agent.params[0]).fill_(float("nan"))  # a row of the embeddings in its shard only
    try:
        agent.check_health(batch)
    except TrainingError:
        print(f"rank {rank}: not healthy", flush=True)


def reference_and_callbacks() -> None:
    model = char_llama()
    with torch.no_grad():  # another random policy on each process
        generator = torch.Generator().manual_seed(100 + torch.distributed.get_rank())
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.1)
    agent = LMPPO(model, make_env(4), seed=0, verbose=0, n_epochs=1)
    rank = agent.dist.rank
    batch, _ = agent.generate()
    kl = (batch.logprobs - batch.ref_logprobs) * batch.action_mask
    torch.testing.assert_close(kl, torch.zeros_like(kl), atol=1e-5, rtol=0)
    print(f"rank {rank}: the reference holds the main process's policy", flush=True)

    def stop_on_main(locals_, globals_):  # e.g. a deadline or a file only the main process reads
        return not (agent.dist.is_main and agent.iteration >= 1)

    agent.learn(10_000, callback=stop_on_main)
    print(
        f"rank {rank}: a callback on one process stopped learn after {agent.iteration} iteration", flush=True
    )
    if agent.sharded:
        return
    with tempfile.TemporaryDirectory() as tmp:
        agent.save(Path(tmp) / "checkpoint")
        if (Path(tmp) / "checkpoint").exists() == agent.dist.is_main:
            print(f"rank {rank}: data parallel, saved by the main process only", flush=True)


if __name__ == "__main__":
    main()
    reference_and_callbacks()
    torch.distributed.barrier()
    end_process_group()  # as textgym train ends: the agent is freed, then the group (else exit can abort)
    exit_process(0)  # and without the interpreter's teardown, as the textgym command does
