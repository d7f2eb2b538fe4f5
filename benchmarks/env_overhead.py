"""The env's own cost: TextGenVectorEnv steps per second with a random agent and no model."""

from __future__ import annotations

import argparse

import numpy as np

from benchmarks.common import median, timed, write_result
from textgym import TextGenVectorEnv


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--envs", type=int, nargs="+", default=[1, 64, 512])
    parser.add_argument("--steps", type=int, default=320, help="vector steps per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for n in args.envs:
        env = TextGenVectorEnv(
            num_envs=n, model="smollm2-135m-instruct", prompts="chat", max_new_tokens=32,
            rewards=[{"name": "length_penalty", "target": 16}],
        )  # fmt: skip
        rng = np.random.default_rng(0)
        # Random token ids, but never EOS: every episode runs its 32 steps, then autoresets.
        actions = rng.integers(3, env.single_action_space.n, size=(args.steps, n))
        env.reset(seed=0)

        def run():
            for a in actions:
                env.step(a)

        run()  # warm-up: first-call costs (tokenizer caches, allocations) out of the timings
        times = [timed(run)[0] for _ in range(args.repeats)]
        t = median(times)
        rows.append({"num_envs": n, "vector_steps_per_s": args.steps / t, "env_steps_per_s": args.steps * n / t,
                     "us_per_env_step": 1e6 * t / (args.steps * n)})  # fmt: skip
        print(rows[-1], flush=True)
    write_result("env_overhead", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
