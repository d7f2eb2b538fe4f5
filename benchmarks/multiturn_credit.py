"""LMPPO's turn credit on Echo, the figure in docs/environments.md: each turn reward on the last agent token
of its turn, against the whole return on the episode's last token (``turn_rewards`` returning zeros).

The setup of tests/test_multiturn_agents.py (``echo_env(32)``, the tiny character-level Llama,
``learning_rate = 3e-3``, ``kl_coef = 0``), 14 iterations per seed; each line is the mean episode reward of
the first 2 and of the last 3 iterations.

    python benchmarks/multiturn_credit.py   # 16 s on 2 CPU cores
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' own helpers
from lm_helpers import char_llama
from test_multiturn_agents import echo_env, learning_curve

from textgym.agents.ppo import LMPPO


class WholeReturn(LMPPO):
    """LMPPO crediting the whole return at the episode's last agent token."""

    def turn_rewards(self, batch):
        return torch.zeros(batch.action_mask.shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--iterations", type=int, default=14)
    args = parser.parse_args()
    for cls, label in ((LMPPO, "turn credit"), (WholeReturn, "whole return at the end")):
        ends = []
        for seed in args.seeds:
            agent = cls(char_llama(), echo_env(32), seed=seed, learning_rate=3e-3, kl_coef=0.0, verbose=0)
            rewards = learning_curve(agent, args.iterations)
            ends.append(np.mean(rewards[-3:]))
            print(f"{label}, seed {seed}: {np.mean(rewards[:2]):.2f} -> {ends[-1]:.2f}", flush=True)
        print(f"{label}: mean of the last 3 iterations over the seeds {np.mean(ends):.2f}", flush=True)


if __name__ == "__main__":
    main()
