import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from textgym import FunctionReward, RewardStack, TextGenVectorEnv
from textgym.agents.ppo import LMPPO
from textgym.models import CharTokenizer

CHARS = CharTokenizer("abcdefgh")


def share_of_a(samples):
    """Toy reward: the share of generated tokens that are "a" (a random policy gets ~0.1)."""
    return [s.completion.count("a") / max(len(s.completion_ids), 1) for s in samples]


def char_llama():
    config = LlamaConfig(
        vocab_size=len(CHARS), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def make_env():
    return TextGenVectorEnv(
        num_envs=16, model=CHARS, prompts="copy", max_new_tokens=6, max_prompt_tokens=3,
        rewards=RewardStack([(FunctionReward("share_of_a", share_of_a), 1.0)]), autoreset_mode="Disabled",
    )  # fmt: skip


def run():
    agent = LMPPO(char_llama(), make_env(), learning_rate=3e-3, kl_coef=0.0, seed=0)
    agent.learn(total_timesteps=16 * 6 * 8)
    return [h["objective/scores"] for h in agent.history]


def test_seeded_ppo_raises_a_toy_reward_and_is_reproducible_bit_for_bit():
    scores = run()
    print(scores)
    assert np.mean(scores[-2:]) > scores[0] + 0.3
    assert run() == scores


def test_ratio_is_one_before_the_first_update():
    agent = LMPPO(char_llama(), make_env(), temperature=0.7, seed=0)
    b = agent.collect_rollouts()
    from textgym.agents.ppo_core import logprobs_from_logits

    with torch.no_grad():
        logits, _ = agent._forward(agent.policy, b, hidden=False)
    new = logprobs_from_logits(logits, b["response_ids"], 0.7) * b["response_mask"]
    ratio = (new - b["logprobs"]).exp()[b["response_mask"].bool()]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    assert (b["values"] == 0).all()  # zero-initialised value head


def test_bad_hyperparameters_are_clear_errors():
    import pytest

    from textgym.agents.ppo import LMPPOConfig
    from textgym.errors import ConfigError

    with pytest.raises(ConfigError, match="temperature must be > 0 for PPO, not 0"):
        LMPPOConfig(temperature=0)
    with pytest.raises(ConfigError, match="n_minibatches must be a positive integer, not 0"):
        LMPPOConfig(n_minibatches=0)
    with pytest.raises(ConfigError, match="kl_estimator must be 'k1' or 'k3', not 'k2'"):
        LMPPOConfig(kl_estimator="k2")
    with pytest.raises(TypeError, match="learnin_rate"):
        LMPPOConfig(learnin_rate=1e-3)
