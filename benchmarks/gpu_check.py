"""The GPU check: textgym's rollout against ``model.generate`` and one iteration of each LM agent, on one
device, written as one JSON file.

    python -m benchmarks.gpu_check                       # on the GPU: SmolLM2, batches 64 and 256, bf16
    python -m benchmarks.gpu_check --device cpu --model tiny-random-llama --batches 4 --new-tokens 4

Both sides sample on the device with the same settings (greedy, so they write the same tokens); the env side
keeps the hidden states for the value head, as LMPPO does. Per agent: seconds per iteration after a warm-up
one, and peak device memory (GPU) or peak resident memory (CPU).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import textgym
from benchmarks.common import chat_prompts, left_padded_prompts, machine, median, peak_rss_mb
from textgym import TextGenVectorEnv
from textgym.sampling import rollout

AGENTS = {
    "lmppo": ("textgym.agents.ppo:LMPPO", dict(n_epochs=1, n_minibatches=1, micro_batch_size=32)),
    "grpo": ("textgym.agents.grpo:GRPO", dict(num_generations=8, beta=0.04, micro_batch_size=32)),
    "grpo-beta0": ("textgym.agents.grpo:GRPO", dict(num_generations=8, beta=0.0, micro_batch_size=32)),
    "rloo": ("textgym.agents.rloo:RLOO", dict(num_generations=8, micro_batch_size=32)),
}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_env(model: str, tokenizer, batch: int, new_tokens: int) -> TextGenVectorEnv:
    prompts = [tokenizer.decode(ids) for ids in chat_prompts(tokenizer, batch)]
    return TextGenVectorEnv(
        num_envs=batch, model=model, prompts=prompts, chat_template=False, max_new_tokens=new_tokens,
        rewards=[{"name": "length_penalty", "target": 16}], prompt_order="sequential", autoreset_mode="Disabled",
    )  # fmt: skip


def rollout_vs_generate(args, model, tokenizer, batch: int) -> dict:
    env = make_env(args.model, tokenizer, batch, args.new_tokens)
    input_ids, mask = left_padded_prompts(env, tokenizer.pad_token_id)
    input_ids, mask = input_ids.to(args.device), mask.to(args.device)
    autocast = torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.bf16)

    def generate():
        with torch.inference_mode(), autocast:
            return model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                  do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id)  # fmt: skip

    def env_rollout():
        with autocast:
            return rollout(model, env, temperature=0, keep_hidden=True)

    times = {"generate": [], "rollout": []}
    generate(), env_rollout()  # warm-up
    for _ in range(args.repeats):
        for name, fn in (("generate", generate), ("rollout", env_rollout)):
            sync(args.device)
            start = time.perf_counter()
            out = fn()
            sync(args.device)
            times[name].append(time.perf_counter() - start)
            if name == "rollout":
                tokens = int(out.response_mask.sum())
    g, r = median(times["generate"]), median(times["rollout"])
    return {
        "batch": batch,
        "generate_s": g,
        "rollout_s": r,
        "ratio": r / g,
        "rollout_tokens_per_s": tokens / r,
    }


def agent_iteration(args, name: str, batch: int) -> dict:
    target, hyperparameters = AGENTS[name]
    module, _, attribute = target.partition(":")
    cls = getattr(__import__(module, fromlist=[attribute]), attribute)
    tokenizer = textgym.load_tokenizer(args.model)
    env = make_env(args.model, tokenizer, batch, args.new_tokens)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    hyperparameters = {**hyperparameters, "micro_batch_size": min(args.micro_batch, batch)}
    agent = cls(
        args.model, env, device=args.device, bf16=args.bf16, verbose=0, learning_rate=1e-6, **hyperparameters
    )
    times = []
    for _ in range(2):  # a warm-up iteration, then the measured one
        sync(args.device)
        start = time.perf_counter()
        agent.learn(1, reset_num_timesteps=False)
        sync(args.device)
        times.append(time.perf_counter() - start)
    memory = torch.cuda.max_memory_allocated() / 2**20 if args.device.startswith("cuda") else peak_rss_mb()
    return {"agent": name, "batch": batch, "iteration_s": times[-1], "peak_memory_mb": memory,
            "breakdown": {k: v for k, v in agent.history[-1].items() if k.startswith("time/")}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--agents", nargs="+", default=list(AGENTS))
    parser.add_argument(
        "--bf16", action=argparse.BooleanOptionalAction, default=None, help="default: on for GPUs"
    )
    parser.add_argument("--skip-rollout", action="store_true", help="only the agents' iterations")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_check.json"))
    args = parser.parse_args()
    if args.bf16 is None:
        args.bf16 = args.device.startswith("cuda")
    result = {
        "machine": machine(),
        "args": {k: str(v) for k, v in vars(args).items()},
        "rollout": [],
        "agents": [],
    }
    if not args.skip_rollout:  # (skipped, the process's peak memory is the agents' alone)
        model, tokenizer = textgym.load_model(args.model)
        model.to(args.device)
        for batch in args.batches:
            result["rollout"].append(rollout_vs_generate(args, model, tokenizer, batch))
            print(result["rollout"][-1], flush=True)
        del model
    for name in args.agents:
        for batch in args.batches:
            result["agents"].append(agent_iteration(args, name, batch))
            print(result["agents"][-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
