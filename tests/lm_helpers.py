"""A tiny character-level LM policy and env shared by the agent tests, and a short Copy-v0 run config."""

import csv

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from textgym import FunctionReward, RewardStack, TextGenVectorEnv
from textgym.models import CharTokenizer

CHARS = CharTokenizer("abcdefgh")


def share_of_a(samples):
    """Toy reward: the share of generated tokens that are "a" (a random policy gets ~0.1)."""
    return [s.completion.count("a") / max(len(s.completion_ids), 1) for s in samples]


def char_llama(vocab_size=None):
    """A tiny random Llama over CHARS' tokens (``vocab_size``: its own, larger vocabulary, padded past them)."""
    config = LlamaConfig(
        vocab_size=vocab_size or len(CHARS), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def make_env(n=16, autoreset_mode="Disabled", reward=share_of_a, **kwargs):
    defaults = dict(
        model=CHARS, prompts="copy", max_new_tokens=6, max_prompt_tokens=3,
        rewards=RewardStack([(FunctionReward(reward.__name__, reward), 1.0)]),
    )  # fmt: skip
    return TextGenVectorEnv(num_envs=n, autoreset_mode=autoreset_mode, **{**defaults, **kwargs})


def iterations(agent, n):
    for _ in range(n):  # learn(1) runs exactly one iteration
        agent.learn(1, reset_num_timesteps=False)
    return agent


def copy_run_config(total_timesteps: int) -> str:
    """A `textgym train` config: LMPPO with tiny-char-llama on Copy-v0, 8 episodes of 4 tokens (32 tokens) per
    iteration, a checkpoint after every iteration."""
    return f"""
[run]
total_timesteps = {total_timesteps}
checkpoint_every = 1
sample_prompts = 2

[env]
id = "textgym/Copy-v0"
num_envs = 8

[agent]
name = "lmppo"
policy = "tiny-char-llama"
n_epochs = 1
learning_rate = 1e-3
"""


def csv_rows(path):
    """The rows of a CSV file (metrics.csv, eval.csv) as dicts."""
    with open(path) as f:
        return list(csv.DictReader(f))
