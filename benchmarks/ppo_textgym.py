"""Seconds per PPO iteration and peak memory of LMPPO (run in its own process; see run.py)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import textgym
from benchmarks.common import peak_rss_mb, ppo_arguments
from textgym import TextGenVectorEnv
from textgym.agents.ppo import LMPPO


def main() -> None:
    parser = argparse.ArgumentParser()
    args = ppo_arguments(parser).parse_args()
    prompts = json.loads(Path(args.prompts).read_text())
    env = TextGenVectorEnv(
        num_envs=args.batch, model="smollm2-135m-instruct", prompts=prompts, chat_template=False,
        rewards=[{"name": "rm_score", "model": args.rm_model, "chat_template": False}],
        max_new_tokens=args.response_length, autoreset_mode="Disabled",
    )  # fmt: skip
    agent = LMPPO(
        "smollm2-135m-instruct", env, learning_rate=3e-5, n_epochs=args.epochs, n_minibatches=args.minibatches,
        micro_batch_size=args.micro_batch, verbose=0, seed=0,
    )  # fmt: skip
    times = []
    for _ in range(args.iterations + 1):  # the first is a warm-up
        start = time.perf_counter()
        agent.learn(1, reset_num_timesteps=False)
        times.append(time.perf_counter() - start)
    breakdown = {k: v for k, v in agent.history[-1].items() if k.startswith("time/")}
    print(json.dumps({"iteration_s": times[1:], "peak_rss_mb": peak_rss_mb(), "breakdown": breakdown,
                      "tokens": [h["completions/mean_length"] * args.batch for h in agent.history[1:]]}))  # fmt: skip


if __name__ == "__main__":
    textgym.plugin_manager.load_plugins()
    main()
