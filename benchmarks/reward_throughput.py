"""Samples per second of each built-in reward plugin at batch 64.

The model-based rewards (``fluency``, ``rm_score``, ``similarity``) are also timed in bf16 autocast and,
where they have the option, with ``share_prefix=False``; with ``--baseline`` against the way they scored before (written out below, on the same loaded model):
``fluency`` as a log-softmax over the full vocabulary at every position, all three in batches taken in
arrival order and padded to the batch's longest text, with no shared prefix. The two sides alternate
within each repetition, so the ratio holds under the machine's noise. The first side of a model-based reward
runs in fp32 (the former code's precision), wherever it runs: ``--device cuda`` times them on a GPU.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.common import time_sides, write_result
from textgym import Sample, make_reward
from textgym.prompts import load_prompts

COMPLETIONS = [
    "The sea was calm this morning, and the light on the water made everything feel new.",
    "I would spend the weekend hiking with friends and cooking a big dinner together.",
    "Start with simple recipes, taste as you go, and don't be afraid of salt.",
    "Rainy days are perfect for reading by the window with a cup of tea.",
    "Honestly, a short walk after lunch helps me think more clearly than coffee does.",
    "Most people learn faster when they explain an idea to someone else in their own words.",
    "Yes, but only if you water the plants early, before the afternoon heat arrives.",
    "Clear instructions and a few good examples usually matter more than long explanations.",
]
MODEL_REWARDS = ("similarity", "fluency", "rm_score")
PREFIX_REWARDS = ("fluency", "rm_score")  # those with a share_prefix option
GROUP = 8  # completions per prompt in the group case: GRPO's default num_generations


def sample(prompt: str, i: int, completion: int) -> Sample:
    """Sample ``i``: ``COMPLETIONS[completion]`` with ``i`` after it, so that every completion differs (no
    reward can skip a duplicate)."""
    text = f"{COMPLETIONS[completion % len(COMPLETIONS)]} That is my answer number {i}."
    return Sample(prompt, text, (), tuple(range(24)), "stop", {"reference": COMPLETIONS[0]})


def make_samples(n: int) -> list[Sample]:
    """The shipped chat prompts, cycled. A prompt's samples start their completions differently, as
    sampled replies do: shared completion openings would let a reward that shares prefixes skip work that
    real replies need."""
    prompts = [p.text for p in load_prompts("chat")]
    return [sample(prompts[i % len(prompts)], i, i + i // len(prompts)) for i in range(n)]


def make_group_samples(n: int, group: int = GROUP) -> list[Sample]:
    """``group`` completions of each of ``n // group`` shipped chat prompts, each starting differently, as a
    group method (GRPO, RLOO) scores them."""
    if group > len(COMPLETIONS):
        raise ValueError(f"group {group} is larger than the {len(COMPLETIONS)} completions to draw from.")
    prompts = [p.text for p in load_prompts("chat")]
    return [sample(prompts[i // group % len(prompts)], i, i % group) for i in range(n)]


def batches(items: Sequence[Any], size: int) -> list[Sequence[Any]]:
    return [items[start : start + size] for start in range(0, len(items), size)]


FLUENCY_BATCH_BEFORE = 16  # the former default batch size


def fluency_before(reward: Any, samples: Sequence[Sample]) -> list[float]:
    """``fluency`` before: padded batches of 16 in arrival order, logits and a (B, W, V) log-softmax
    everywhere."""
    import torch

    out: list[float] = []
    for batch in batches(samples, FLUENCY_BATCH_BEFORE):
        pairs = [reward._ids(s) for s in batch]
        width = max(len(p) + len(c) for p, c in pairs)
        ids = torch.full((len(pairs), width), reward.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        target = torch.zeros_like(ids, dtype=torch.bool)
        for row, (p, c) in enumerate(pairs):
            ids[row, : len(p) + len(c)] = torch.tensor(p + c)
            mask[row, : len(p) + len(c)] = 1
            target[row, len(p) : len(p) + len(c)] = True
        with torch.inference_mode():
            logits = reward.model(
                input_ids=ids.to(reward.device), attention_mask=mask.to(reward.device)
            ).logits
        logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (B, W-1, V)
        token_logp = logp.gather(-1, ids[:, 1:, None].to(reward.device)).squeeze(-1).cpu()  # (B, W-1)
        t = target[:, 1:]
        out.extend(((token_logp * t).sum(1) / t.sum(1)).tolist())
    return out


def rm_score_before(reward: Any, samples: Sequence[Sample]) -> list[float]:
    """``rm_score`` before: padded batches in arrival order, every text whole."""
    import torch

    scores: list[float] = []
    for batch in batches(samples, reward.batch_size):
        enc = reward.tokenizer(
            [reward.format(s) for s in batch],
            padding=True,
            truncation=True,
            max_length=reward.max_length,
            return_tensors="pt",
        ).to(reward.device)
        with torch.inference_mode():
            scores.extend(reward.model(**enc).logits.float()[:, reward.label].tolist())
    return scores


def similarity_before(reward: Any, samples: Sequence[Sample]) -> list[float]:
    """``similarity`` before: every completion embedded, padded batches in arrival order."""
    import torch

    chunks = []
    for batch in batches([s.completion for s in samples], reward.batch_size):
        enc = reward.tokenizer(
            list(batch), padding=True, truncation=True, max_length=reward.max_length, return_tensors="pt"
        ).to(reward.device)
        with torch.inference_mode():
            hidden = reward.model(**enc).last_hidden_state  # (B, T, H)
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        chunks.append(torch.nn.functional.normalize(pooled.float(), dim=-1).cpu())
    references = reward.embed([s.meta["reference"] for s in samples])
    return (torch.cat(chunks) * references).sum(-1).tolist()


def fluency_work(reward: Any, samples: Sequence[Sample]) -> dict[str, float]:
    """What a ``fluency`` call computes, before and now: row-tokens through the trunk and positions through
    the LM head (now: counted on one call), and the matmul GFLOPs they add up to (2 per weight per token;
    attention scores left out). The floor: what any exact formula computes, each distinct context once
    (every distinct prefix of a prompt followed by its completion but the last token, through the trunk;
    the distinct ones that predict a completion token, through the head)."""
    pairs = [reward._ids(s) for s in samples]
    before = sum(len(b) * max(len(p) + len(c) for p, c in b) for b in batches(pairs, FLUENCY_BATCH_BEFORE))
    trunk_module, head_module = reward.split
    counts = {"trunk": 0, "head": 0}

    def count_trunk(module: Any, args: tuple, kwargs: dict) -> None:
        counts["trunk"] += kwargs["input_ids"].numel()

    def count_head(module: Any, args: tuple) -> None:
        counts["head"] += args[0].shape[0]

    hooks = [
        trunk_module.register_forward_pre_hook(count_trunk, with_kwargs=True),
        head_module.register_forward_pre_hook(count_head),
    ]
    try:
        reward(samples)
    finally:
        for hook in hooks:
            hook.remove()
    # The floor: every distinct prefix of prompt + completion (its last token predicts nothing) is one
    # position through the trunk; those that predict a completion token, one position through the head.
    rows = [p + c[:-1] for p, c in pairs]
    trunk_floor = len({tuple(row[:end]) for row in rows for end in range(1, len(row) + 1)})
    head_floor = len({tuple(p + c[:k]) for p, c in pairs for k in range(len(c))})
    model = reward.model
    head_params = model.get_output_embeddings().weight.numel()
    trunk_params = sum(p.numel() for n, p in model.base_model.named_parameters() if "embed" not in n)
    return {
        "trunk_tokens_before": before,
        "head_positions_before": before,
        "trunk_tokens": counts["trunk"],
        "head_positions": counts["head"],
        "gflop_before": 2 * before * (trunk_params + head_params) / 1e9,
        "gflop": 2 * (counts["trunk"] * trunk_params + counts["head"] * head_params) / 1e9,
        "trunk_tokens_floor": trunk_floor,
        "head_positions_floor": head_floor,
        "gflop_floor": 2 * (trunk_floor * trunk_params + head_floor * head_params) / 1e9,
    }


BEFORE: dict[str, Callable[[Any, Sequence[Sample]], list[float]]] = {
    "fluency": fluency_before,
    "rm_score": rm_score_before,
    "similarity": similarity_before,
}


def max_difference(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def measure(
    name: str, kwargs: dict[str, Any], samples: list[Sample], args: argparse.Namespace
) -> dict[str, Any]:
    """One row: ``name``'s samples per second on ``samples``, and for the model-based rewards those of bf16,
    of no shared prefix and (with ``--baseline``) of the former code, timed side by side."""
    if name in MODEL_REWARDS:  # in fp32, as the former code ran (bf16 is a side of its own; a GPU's default)
        kwargs = {**kwargs, "bf16": False}
    reward = make_reward(name, **kwargs)
    sides: dict[str, Callable[[], Any]] = {"default": lambda: reward(samples)}
    checks: dict[str, float] = {}
    if name in MODEL_REWARDS:
        kwargs.pop("bf16")
        fast = reward(samples)
        bf16 = make_reward(name, **kwargs, bf16=True)
        sides["bf16"] = lambda: bf16(samples)
        checks["bf16"] = max_difference(fast, bf16(samples))
        if name in PREFIX_REWARDS:
            whole = make_reward(name, **kwargs, bf16=False, share_prefix=False)  # fp32, as the first side
            sides["no_prefix"] = lambda: whole(samples)
            checks["no_prefix"] = max_difference(fast, whole(samples))
        if args.baseline:
            sides["before"] = lambda: BEFORE[name](reward, samples)
            checks["before"] = max_difference(fast, sides["before"]())
    times = time_sides(sides, args.repeats)
    row: dict[str, Any] = {"reward": name, "batch": len(samples)}
    for side, t in times.items():
        suffix = "" if side == "default" else f"_{side}"
        row[f"samples_per_s{suffix}"] = len(samples) / t
        row[f"ms_per_batch{suffix}"] = 1e3 * t
    if "before" in times:
        row["speedup"] = times["before"] / times["default"]  # same precision: fp32
        row["speedup_bf16"] = times["before"] / times["bf16"]
    row.update({f"max_score_difference_{side}": d for side, d in checks.items()})
    if name == "fluency":
        row["work"] = fluency_work(reward, samples)
    return row


def matmul_gflops(size: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of one large fp32 matmul on this process's torch threads: what the CPU does at best in fp32,
    to set the fluency call's own rate against."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    seconds = time_sides({"mm": lambda: a @ b}, repeats)["mm"]
    return 2 * size**3 / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rm-model", required=True, help="a sequence-classification model directory")
    parser.add_argument("--baseline", action="store_true", help="also time the model rewards' former code")
    parser.add_argument("--device", default="cpu", help="where the model-based rewards run (cpu, cuda)")
    parser.add_argument("--fluency-model", default="smollm2-135m-instruct", help="fluency's model")
    parser.add_argument("--similarity-model", default=None, help="similarity's model (default: its own)")
    parser.add_argument("--only", nargs="+", default=None, help="these rewards alone")
    parser.add_argument("--name", default="reward_throughput", help="the result file's name")
    args = parser.parse_args()
    samples = make_samples(args.batch)
    on = {"device": args.device}
    plugins = {
        "sentiment": {},
        "length_penalty": {"target": 16},
        "match": {"mode": "contains"},
        "safety": {},
        "similarity": {**on, "model": args.similarity_model},
        "fluency": {**on, "model": args.fluency_model},
        "rm_score": {**on, "model": args.rm_model},
    }
    unknown = set(args.only or ()) - set(plugins)
    if unknown:
        parser.error(f"--only: no reward {sorted(unknown)} here; choose from {sorted(plugins)}")
    rows = []
    load_before = os.getloadavg()[1]  # other work on the machine: the figures are only as quiet as it was
    for name, kwargs in plugins.items():
        if args.only and name not in args.only:
            continue
        cases: list[tuple[dict[str, str], list[Sample]]] = [({}, samples)]
        if name in PREFIX_REWARDS:  # and a group method's batch, of which they run each prompt once
            cases.append(({"case": f"{GROUP} completions per prompt"}, make_group_samples(args.batch)))
        for case, batch in cases:
            rows.append({**case, **measure(name, kwargs, batch, args)})
            print(rows[-1], flush=True)
    load = {"before": load_before, "after": os.getloadavg()[1]}  # 5-minute load averages
    from textgym.models import load_tokenizer

    tokenizer = load_tokenizer(args.fluency_model)
    lengths = [len(tokenizer.encode(s.completion, add_special_tokens=False)) for s in samples]
    workload = {
        "prompts": len({s.prompt for s in samples}),
        "completion_tokens": [min(lengths), max(lengths)],
    }
    result = {"args": vars(args), "load_average_5min": load, "matmul_gflops": matmul_gflops(), "rows": rows}
    result["workload"] = workload
    write_result(args.name, result)


if __name__ == "__main__":
    main()
