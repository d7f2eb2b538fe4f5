"""Samples per second of each built-in reward plugin at batch 64.

The model-based rewards (``fluency``, ``rm_score``, ``similarity``) are also timed in bf16 autocast and,
where they have the option, with ``share_prefix=False``; with ``--baseline`` against the way they scored before (written out below, on the same loaded model):
``fluency`` as a log-softmax over the full vocabulary at every position, all three in batches taken in
arrival order and padded to the batch's longest text, with no shared prefix. The two sides alternate
within each repetition, so the ratio holds under the machine's noise.
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
]
MODEL_REWARDS = ("similarity", "fluency", "rm_score")
PREFIX_REWARDS = ("fluency", "rm_score")  # those with a share_prefix option


def make_samples(n: int) -> list[Sample]:
    """The shipped chat prompts, cycled; every completion differs (so no reward can skip a duplicate)."""
    prompts = [p.text for p in load_prompts("chat")]
    return [
        Sample(
            prompts[i % len(prompts)],
            f"{COMPLETIONS[i % 4]} That is my answer number {i}.",
            (),
            tuple(range(24)),
            "stop",
            {"reference": COMPLETIONS[0]},
        )
        for i in range(n)
    ]


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
    """What a ``fluency`` call computes, before and now: row-tokens through the trunk, positions through the
    LM head, and the matmul GFLOPs they add up to (2 per weight per token; attention scores left out)."""
    from textgym.scoring import length_sorted_batches

    pairs = [reward._ids(s) for s in samples]
    before = sum(len(b) * max(len(p) + len(c) for p, c in b) for b in batches(pairs, FLUENCY_BATCH_BEFORE))
    trunk = head = 0
    for rows in length_sorted_batches([len(p) + len(c) for p, c in pairs], reward.batch_size):
        prefix, ids, _, predicts = reward._layout([pairs[i] for i in rows])
        trunk += ids.numel() + prefix  # the prefix runs once, as one row
        head += int(predicts.sum())
    model = reward.model
    head_params = model.get_output_embeddings().weight.numel()
    trunk_params = sum(p.numel() for n, p in model.base_model.named_parameters() if "embed" not in n)
    work = {
        "trunk_tokens_before": before,
        "head_positions_before": before,
        "trunk_tokens": trunk,
        "head_positions": head,
        "gflop_before": 2 * before * (trunk_params + head_params) / 1e9,
        "gflop": 2 * (trunk * trunk_params + head * head_params) / 1e9,
    }
    return work


BEFORE: dict[str, Callable[[Any, Sequence[Sample]], list[float]]] = {
    "fluency": fluency_before,
    "rm_score": rm_score_before,
    "similarity": similarity_before,
}


def max_difference(a: Sequence[float], b: Sequence[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rm-model", required=True, help="a sequence-classification model directory")
    parser.add_argument("--baseline", action="store_true", help="also time the model rewards' former code")
    args = parser.parse_args()
    samples = make_samples(args.batch)
    plugins = {
        "sentiment": {},
        "length_penalty": {"target": 16},
        "match": {"mode": "contains"},
        "safety": {},
        "similarity": {},
        "fluency": {},
        "rm_score": {"model": args.rm_model},
    }
    rows = []
    load_before = os.getloadavg()[1]  # other work on the machine: the figures are only as quiet as it was
    for name, kwargs in plugins.items():
        reward = make_reward(name, **kwargs)
        sides: dict[str, Callable[[], Any]] = {"default": lambda r=reward: r(samples)}
        checks: dict[str, float] = {}
        if name in MODEL_REWARDS:
            fast = reward(samples)
            bf16 = make_reward(name, **kwargs, bf16=True)
            sides["bf16"] = lambda r=bf16: r(samples)
            checks["bf16"] = max_difference(fast, bf16(samples))
            if name in PREFIX_REWARDS:
                whole = make_reward(name, **kwargs, share_prefix=False)
                sides["no_prefix"] = lambda r=whole: r(samples)
                checks["no_prefix"] = max_difference(fast, whole(samples))
            if args.baseline:
                sides["before"] = lambda r=reward, f=BEFORE[name]: f(r, samples)
                checks["before"] = max_difference(fast, sides["before"]())
        times = time_sides(sides, args.repeats)
        row: dict[str, Any] = {"reward": name, "batch": args.batch}
        for side, t in times.items():
            suffix = "" if side == "default" else f"_{side}"
            row[f"samples_per_s{suffix}"] = args.batch / t
            row[f"ms_per_batch{suffix}"] = 1e3 * t
        if "before" in times:
            row["speedup"] = times["before"] / times["default"]  # same precision (fp32 on the CPU)
            row["speedup_bf16"] = times["before"] / times["bf16"]
        row.update({f"max_score_difference_{side}": d for side, d in checks.items()})
        if name == "fluency":
            row["work"] = fluency_work(reward, samples)
        rows.append(row)
        print(rows[-1], flush=True)
    load = {"before": load_before, "after": os.getloadavg()[1]}  # 5-minute load averages
    write_result("reward_throughput", {"args": vars(args), "load_average_5min": load, "rows": rows})


if __name__ == "__main__":
    main()
