"""Samples per second of each built-in reward plugin at batch 64."""

from __future__ import annotations

import argparse

from benchmarks.common import median, timed, write_result
from textgym import Sample, make_reward

COMPLETIONS = [
    "The sea was calm this morning, and the light on the water made everything feel new.",
    "I would spend the weekend hiking with friends and cooking a big dinner together.",
    "Start with simple recipes, taste as you go, and don't be afraid of salt.",
    "Rainy days are perfect for reading by the window with a cup of tea.",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rm-model", required=True, help="a sequence-classification model directory")
    args = parser.parse_args()
    samples = [
        Sample(f"Prompt {i}", COMPLETIONS[i % 4], (), tuple(range(20)), "stop", {"reference": COMPLETIONS[0]})
        for i in range(args.batch)
    ]
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
    for name, kwargs in plugins.items():
        reward = make_reward(name, **kwargs)
        reward(samples)  # warm-up (lazy imports, first forward)
        t = median([timed(lambda: reward(samples))[0] for _ in range(args.repeats)])
        rows.append(
            {"reward": name, "batch": args.batch, "samples_per_s": args.batch / t, "ms_per_batch": 1e3 * t}
        )
        print(rows[-1], flush=True)
    write_result("reward_throughput", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
