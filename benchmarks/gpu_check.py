"""The GPU check: textgym's rollout against ``model.generate`` and one iteration of each LM agent, on one
device, written as one JSON file.

    python -m benchmarks.gpu_check                       # on the GPU: SmolLM2, batches 64 and 256, bf16
    python -m benchmarks.gpu_check --device cpu --model tiny-random-llama --batches 8 --new-tokens 4

Both sides sample on the device with the same settings (greedy, so they write the same tokens); the env side
keeps the hidden states for the value head, as LMPPO does. With ``--also-fp32-rollout`` both sides also run
without autocast, each repetition running every side in every precision in turn. Per agent: seconds per iteration after a warm-up
one, peak device memory (GPU) or peak resident memory (CPU), and the iteration's logged statistics. On a GPU,
each side also counts the host syncs it forces (``torch.cuda.set_sync_debug_mode``), in a separate untimed
call. ``--random-weights`` takes the architecture and tokenizer of a model directory with fresh weights (for
a machine that cannot install the model's weights; the tokens, not the weights, set the cost), and
``--override`` changes its config (a larger policy of the same family). The LoRA agents (``lmppo-lora``,
``grpo-lora``) also time their bf16 rollout with the adapters folded against through them. A measurement
that fails is recorded with its traceback and the others still run; the file is rewritten after each one.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import shutil
import tempfile
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import textgym
from benchmarks.common import (
    chat_prompts,
    left_padded_prompts,
    machine,
    median,
    peak_rss_mb,
    time_sides,
    timed,
)
from textgym import TextGenVectorEnv
from textgym.sampling import rollout

LORA = {"r": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}
AGENTS = {
    "lmppo": ("textgym.agents.ppo:LMPPO", dict(n_epochs=1, n_minibatches=1, micro_batch_size=32)),
    "grpo": ("textgym.agents.grpo:GRPO", dict(num_generations=8, beta=0.04, micro_batch_size=32)),
    "grpo-beta0": ("textgym.agents.grpo:GRPO", dict(num_generations=8, beta=0.0, micro_batch_size=32)),
    "rloo": ("textgym.agents.rloo:RLOO", dict(num_generations=8, micro_batch_size=32)),
}
DEFAULT_AGENTS = list(AGENTS)
# LoRA: the adapter trains; the reference is the same model with the adapter disabled
AGENTS.update(
    {f"{name}-lora": (AGENTS[name][0], {**AGENTS[name][1], "lora": LORA}) for name in ("lmppo", "grpo")}
)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed_on(device: str, fn: Callable[[], Any]) -> tuple[float, Any]:
    """``common.timed`` for work queued on ``device``: the seconds until it has finished, and its result."""

    def finished() -> Any:
        out = fn()
        sync(device)
        return out

    sync(device)
    return timed(finished)


def count_syncs(fn: Callable[[], Any], device: str) -> int | None:
    """How many synchronizing CUDA operations ``fn`` runs (None off the GPU, where nothing syncs)."""
    if not device.startswith("cuda"):
        return None
    sync(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def with_random_weights(model_dir: str, device: str, override: dict[str, Any], seed: int = 0) -> str:
    """A copy of ``model_dir``'s config (with the fields in ``override`` changed) and tokenizer files, with
    freshly initialised weights (seed ``seed``; initialised on ``device``, which is fast for a large model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    src = Path(model_dir)
    out = Path(tempfile.mkdtemp(prefix="textgym-random-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith((".safetensors", ".bin", ".gguf")):
            shutil.copy(path, out / path.name)
    torch.manual_seed(seed)
    with torch.device(device):
        config = AutoConfig.from_pretrained(src, **override)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    return str(out)


def make_env(model: str, tokenizer, batch: int, new_tokens: int) -> TextGenVectorEnv:
    prompts = [tokenizer.decode(ids) for ids in chat_prompts(tokenizer, batch)]
    return TextGenVectorEnv(
        num_envs=batch, model=model, prompts=prompts, chat_template=False, max_new_tokens=new_tokens,
        rewards=[{"name": "length_penalty", "target": 16}], prompt_order="sequential", autoreset_mode="Disabled",
    )  # fmt: skip


def rollout_vs_generate(args, model, tokenizer, batch: int, precisions: list[bool]) -> list[dict]:
    """One row per precision (bf16 autocast or not). Within each repetition every side in every precision
    runs in turn, so that the machine's drift falls on all of them alike."""
    env = make_env(args.model, tokenizer, batch, args.new_tokens)
    input_ids, mask = left_padded_prompts(env, tokenizer.pad_token_id)
    input_ids, mask = input_ids.to(args.device), mask.to(args.device)
    calls = {}
    for bf16 in precisions:
        autocast = torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=bf16)

        def generate(autocast=autocast):
            with torch.inference_mode(), autocast:
                return model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                      do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                      eos_token_id=tokenizer.eos_token_id)  # fmt: skip

        def env_rollout(autocast=autocast):
            with autocast:
                return rollout(model, env, temperature=0, keep_hidden=True)

        calls[bf16, "generate"], calls[bf16, "rollout"] = generate, env_rollout
    for fn in calls.values():  # warm-up
        fn()
    times: dict[tuple[bool, str], list[float]] = {key: [] for key in calls}
    tokens = {}
    for _ in range(args.repeats):
        for key, fn in calls.items():
            seconds, out = timed_on(args.device, fn)
            times[key].append(seconds)
            if key[1] == "rollout":
                tokens[key[0]] = int(out.response_mask.sum())
    rows = []
    for bf16 in precisions:
        g, r = median(times[bf16, "generate"]), median(times[bf16, "rollout"])
        rows.append({
            "batch": batch,
            "bf16": bf16,
            "interleaved": True,  # with the other precisions' runs, repetition by repetition
            "generate_s": g,
            "rollout_s": r,
            "ratio": r / g,
            "rollout_tokens_per_s": tokens[bf16] / r,
            "tokens": tokens[bf16],
            "syncs": {
                "generate": count_syncs(calls[bf16, "generate"], args.device),
                "rollout": count_syncs(calls[bf16, "rollout"], args.device),
            },
        })  # fmt: skip
    return rows


def agent_iteration(args, name: str, batch: int) -> dict:
    target, hyperparameters = AGENTS[name]
    module, _, attribute = target.partition(":")
    cls = getattr(__import__(module, fromlist=[attribute]), attribute)
    tokenizer = textgym.load_tokenizer(args.model)
    env = make_env(args.model, tokenizer, batch, args.new_tokens)
    gc.collect()  # the agent measured before this one, freed (agents hold reference cycles)
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(args.device)
    hyperparameters = {**hyperparameters, "micro_batch_size": min(args.micro_batch, batch)}
    agent = cls(
        args.model, env, device=args.device, bf16=args.bf16, verbose=0, learning_rate=1e-6, **hyperparameters
    )
    # a warm-up iteration, then the measured one
    times = [timed_on(args.device, lambda: agent.learn(1, reset_num_timesteps=False))[0] for _ in range(2)]
    memory = (
        torch.cuda.max_memory_allocated(args.device) / 2**20
        if args.device.startswith("cuda")
        else peak_rss_mb()
    )
    stats = agent.history[-1]
    weights = list(agent.policy.parameters()) + [p for m in agent.modules.values() for p in m.parameters()]
    syncs = count_syncs(lambda: agent.learn(1, reset_num_timesteps=False), args.device)
    folding = lora_fold_comparison(agent, args.device, args.repeats) if "lora" in name and args.bf16 else {}
    return {
        **folding,
        "agent": name,
        "batch": batch,
        "iteration_s": times[-1],
        "peak_memory_mb": memory,
        "parameters": sum(p.numel() for p in weights),
        "trainable_parameters": sum(p.numel() for p in weights if p.requires_grad),
        "syncs_per_iteration": syncs,
        "breakdown": {k: v for k, v in stats.items() if k.startswith("time/")},
        "stats": {k: v for k, v in stats.items() if not k.startswith("time/")},
    }


def lora_fold_comparison(agent: Any, device: str, repeats: int) -> dict[str, float]:
    """A LoRA agent's rollout (greedy, its precision) as it runs, in bf16 with the adapters folded into
    the weight copy (agents/precision.py), against the same rollout through the adapters (the fold switched
    off here): median seconds of each, the two alternating."""
    from textgym.agents import precision

    fold = precision.foldable_lora_layers

    def rollout_with(choose: Callable[[Any], list]) -> Any:
        precision.foldable_lora_layers = choose
        try:
            return agent.rollout(agent.env, temperature=0)
        finally:
            precision.foldable_lora_layers = fold

    sides = {"folded": lambda: rollout_with(fold), "adapters": lambda: rollout_with(lambda model: [])}
    times = time_sides(sides, repeats, timer=lambda fn: timed_on(device, fn))
    return {f"rollout_{name}_s": seconds for name, seconds in times.items()}


def attempt(fn: Callable[[], Any], **labels: Any) -> Any:
    """``fn()``'s result, or ``labels`` with the error and its traceback (the other measurements still run)."""
    try:
        return fn()
    except Exception as exc:
        traceback.print_exc()
        return {**labels, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--random-weights", action="store_true", help="--model's architecture, fresh weights")
    parser.add_argument(
        "--override",
        type=json.loads,
        default={},
        help="with --random-weights: config fields to change (JSON)",
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--agents", nargs="*", default=DEFAULT_AGENTS, choices=list(AGENTS), help="none: the rollout alone"
    )
    parser.add_argument(
        "--bf16", action=argparse.BooleanOptionalAction, default=None, help="default: on for GPUs"
    )
    parser.add_argument("--also-fp32-rollout", action="store_true", help="rollout vs generate in fp32 too")
    parser.add_argument("--skip-rollout", action="store_true", help="only the agents' iterations")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_check.json"))
    args = parser.parse_args()
    if args.bf16 is None:
        args.bf16 = args.device.startswith("cuda")
    if args.device.startswith("cuda:"):  # the agents run on accelerate's "cuda": the current device
        torch.cuda.set_device(args.device)
    result: dict[str, Any] = {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    result.update(weights="random (seed 0)" if args.random_weights else "trained", rollout=[], agents=[])
    if args.override and not args.random_weights:
        parser.error("--override changes the architecture: it needs --random-weights")
    if args.random_weights:
        args.model = with_random_weights(args.model, args.device, args.override)
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def record(section: str, item: dict) -> None:
        result[section].append(item)
        print({k: v for k, v in item.items() if k != "traceback"}, flush=True)
        args.out.write_text(json.dumps(result, indent=2))

    if not args.skip_rollout:  # (skipped, the process's peak memory is the agents' alone)
        model, tokenizer = textgym.load_model(args.model)
        model.to(args.device)
        precisions = [args.bf16] + ([False] if args.also_fp32_rollout and args.bf16 else [])
        for batch in args.batches:
            rows = attempt(
                lambda: rollout_vs_generate(args, model, tokenizer, batch, precisions), batch=batch
            )
            for row in rows if isinstance(rows, list) else [rows]:
                record("rollout", row)
        del model
    for name in args.agents:
        for batch in args.batches:
            record("agents", attempt(lambda: agent_iteration(args, name, batch), agent=name, batch=batch))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
