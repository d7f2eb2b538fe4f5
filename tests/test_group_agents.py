"""GRPO and RLOO: the contract every LM agent keeps, their own behaviour, and clear errors."""

import warnings

import gymnasium
import numpy as np
import pytest
import torch
from lm_helpers import char_llama, iterations, make_env
from stable_baselines3.common.callbacks import BaseCallback, EvalCallback
from stable_baselines3.common.evaluation import evaluate_policy

from textgym.agents.grpo import GRPO, GRPOConfig
from textgym.agents.rloo import RLOO
from textgym.errors import ConfigError
from textgym.sb3 import TextGymVecEnv

AGENTS = {
    "grpo": (
        GRPO,
        dict(num_generations=4, beta=0.04, loss_type="dapo", num_iterations=2, steps_per_generation=2),
    ),
    "grpo-no-ref": (GRPO, dict(num_generations=4, beta=0.0, loss_type="grpo", scale_rewards="batch")),
    "rloo": (RLOO, dict(num_generations=4, beta=0.05, num_iterations=2, normalize_advantages=True)),
}
FAST = dict(learning_rate=3e-3, verbose=0, seed=0)


def test_a_group_agents_reward_std_is_the_mean_of_its_groups_std_as_trl_logs_it():
    batch = GRPO(char_llama(), make_env(16), num_generations=4, **FAST).collect_rollouts()
    groups = batch.raw_scores.double().view(-1, 4)
    assert batch.stats["reward_std"] == pytest.approx(float(groups.std(1).mean()))


def agent_of(key, env=None, **extra):
    cls, kwargs = AGENTS[key]
    return cls(char_llama(), make_env() if env is None else env, **{**kwargs, **FAST, **extra})


@pytest.mark.parametrize("key", AGENTS)
def test_ratio_is_one_before_the_first_update(key):
    agent = agent_of(key, temperature=0.7)
    batch = agent.collect_rollouts()
    with torch.no_grad():
        logprobs, _, _ = agent.policy_logprobs(batch)
    mask = batch.response_mask.bool()
    ratio = (logprobs - batch.logprobs).exp()[mask]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)


@pytest.mark.parametrize("cls", [GRPO, RLOO])
def test_one_optimizer_step_per_batch_takes_the_ratio_from_the_updates_own_log_probs(cls):
    """With one pass and one step the policy is the one that sampled the batch: the rollout's log-probs
    agree with the update's only up to rounding (another kernel for another batch shape, on a GPU), and
    RLOO's sequence ratio summed that into clipped sequences on the very first step."""
    kwargs = dict(num_generations=4, num_iterations=1, steps_per_generation=1, micro_batch_size=4, **FAST)
    first, second = cls(char_llama(), make_env(16), **kwargs), cls(char_llama(), make_env(16), **kwargs)
    batch = first.collect_rollouts()
    stats = first.train(batch)
    batch.logprobs = batch.logprobs + 0.3 * torch.randn_like(batch.logprobs)  # rounded otherwise
    assert second.train(batch)["clip_ratio/region_mean"] == stats["clip_ratio/region_mean"] == 0
    for a, b in zip(first.policy.parameters(), second.policy.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("key", AGENTS)
def test_each_prompt_gets_num_generations_consecutive_completions(key):
    batch = agent_of(key).collect_rollouts()
    prompts = [e["prompt"] for e in batch.episodes]
    groups = [prompts[i : i + 4] for i in range(0, 16, 4)]
    assert all(len(set(g)) == 1 for g in groups) and len({g[0] for g in groups}) > 1
    assert batch.advantages.shape == (16,) and torch.isfinite(batch.advantages).all()


@pytest.mark.parametrize("key", AGENTS)
def test_save_load_gives_identical_greedy_actions_and_resume_is_bit_for_bit(key, tmp_path):
    straight = iterations(agent_of(key), 4)
    agent = iterations(agent_of(key), 2)
    agent.save(tmp_path / "ckpt")
    cls = AGENTS[key][0]
    loaded = cls.load(tmp_path / "ckpt", make_env())
    obs, _ = make_env(4).reset(seed=1)
    np.testing.assert_array_equal(
        agent.predict(obs, deterministic=True)[0], loaded.predict(obs, deterministic=True)[0]
    )
    iterations(loaded, 2)
    assert [h["reward"] for h in loaded.history] == [h["reward"] for h in straight.history]
    assert [h["loss"] for h in loaded.history] == [h["loss"] for h in straight.history]
    assert loaded.num_timesteps == straight.num_timesteps


def test_loading_a_checkpoint_with_another_agent_is_a_clear_error(tmp_path):
    iterations(agent_of("grpo"), 1).save(tmp_path / "grpo")
    with pytest.raises(ConfigError, match="checkpoint of agent 'grpo', not 'rloo'"):
        RLOO.load(tmp_path / "grpo", make_env())


class Steps(BaseCallback):
    def __init__(self):
        super().__init__()
        self.steps = []

    def _on_step(self):
        self.steps.append(self.num_timesteps)
        return len(self.steps) < 3


@pytest.mark.parametrize("key", ["grpo", "rloo"])
def test_sb3_callbacks_and_evaluate_policy_work(key, tmp_path):
    agent = agent_of(key)
    steps = Steps()
    eval_env = TextGymVecEnv(make_env(4, autoreset_mode="SameStep"))
    evaluation = EvalCallback(eval_env, n_eval_episodes=4, eval_freq=2, log_path=str(tmp_path), verbose=0)
    agent.learn(100_000, callback=[steps, evaluation])
    assert len(steps.steps) == 3 and steps.steps[-1] == agent.num_timesteps
    assert (tmp_path / "evaluations.npz").is_file()
    mean, std = evaluate_policy(agent, eval_env, n_eval_episodes=8)
    assert 0.0 <= mean <= 1.0 and std >= 0.0


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (GRPO, dict(learning_rate=1e-3, num_generations=8, steps_per_generation=4, num_iterations=2)),
        (
            RLOO,
            dict(
                learning_rate=1e-3,
                num_generations=8,
                steps_per_generation=4,
                num_iterations=2,
                beta=0.01,
                normalize_advantages=True,
            ),
        ),
    ],
)
def test_each_agent_learns_the_copy_task_well_beyond_a_random_policy(cls, kwargs):
    env = gymnasium.make_vec("textgym/Copy-v0", num_envs=64, autoreset_mode="Disabled", prompts="copy-train")
    agent = cls("tiny-char-llama", env, seed=0, verbose=0, **kwargs).learn(64 * 4 * 24)
    rewards = [h["reward"] for h in agent.history]
    assert rewards[0] < 0.15  # a random policy: ~0.12
    assert np.mean(rewards[-4:]) > 0.3, rewards


def test_beta_zero_loads_no_reference_model_at_all():
    agent = agent_of("grpo-no-ref")
    assert agent.ref_policy is None and not agent.uses_reference
    batch = agent.collect_rollouts()
    assert batch.ref_logprobs is None and np.isnan(batch.stats["kl"])
    with_reference = agent_of("grpo")
    assert (
        with_reference.ref_policy is not None
        and batch.stats.keys() == with_reference.collect_rollouts().stats.keys()
    )


def test_mask_truncated_completions_leaves_them_out_of_the_gradient():
    # max_new_tokens=2 with a policy that rarely says EOS: most completions are truncated
    agent = agent_of("grpo", env=make_env(max_new_tokens=2), mask_truncated_completions=True, beta=0.0)
    batch = agent.collect_rollouts()
    assert batch.truncated.any()
    assert batch.loss_mask[batch.truncated].eq(0).all()
    assert batch.loss_mask[~batch.truncated].equal(batch.response_mask[~batch.truncated])
    # the loss's gradient with respect to a truncated completion's log-probs is zero
    logprobs = batch.logprobs.clone().requires_grad_(True)
    totals = {"num_sequences": 16, "num_tokens": batch.loss_mask.sum(), "num_micro_batches": 1,
              "max_completion_length": 2, "world": 1}  # fmt: skip
    loss, _ = agent.loss(batch, logprobs, totals)
    loss.backward()
    assert logprobs.grad[batch.truncated].eq(0).all()


def test_a_pad_tokens_log_prob_after_a_completion_never_reaches_the_k3_kl():
    """Past a completion's end the policy's log-prob of the pad token can be below -88.7 (a low temperature,
    an unlikely pad token), where exp() overflows float32: neither the loss, its gradient nor the KL statistic
    may see it."""
    agent = agent_of("grpo", beta=0.04)
    batch = agent.collect_rollouts()
    mask = batch.loss_mask.bool()
    assert (~mask).any() and mask.any(1).all()
    totals = {"num_sequences": 16, "num_tokens": batch.loss_mask.sum(), "num_micro_batches": 1,
              "max_completion_length": 6, "world": 1}  # fmt: skip

    def loss_with(padding):
        logprobs = torch.where(mask, batch.logprobs, torch.tensor(padding)).requires_grad_(True)
        loss, stats = agent.loss(batch, logprobs, totals)
        loss.backward()
        return loss.detach(), stats["kl_k3_per_token"][0], logprobs.grad

    assert all(torch.equal(a, b) for a, b in zip(loss_with(0.0), loss_with(-100.0)))


def test_a_constant_reward_gives_zero_advantages_and_a_finite_update():
    agent = agent_of("grpo", env=make_env(reward=lambda samples: [1.0] * len(samples)))
    batch = agent.collect_rollouts()
    assert batch.advantages.eq(0).all() and batch.stats["frac_reward_zero_std"] == 1.0
    assert all(np.isfinite(v) for v in agent.train(batch).values())
    # 77.7 is not exact in float32: the group mean came out a few ulps off, and divided by std + 1e-4 gave
    # every completion an advantage of -0.076 and the update a gradient
    agent = agent_of("grpo", env=make_env(reward=lambda samples: [77.7] * len(samples)), num_generations=8)
    batch = agent.collect_rollouts()
    assert batch.advantages.eq(0).all() and batch.stats["frac_reward_zero_std"] == 1.0


@pytest.mark.parametrize("key", ["grpo", "rloo"])
def test_frac_reward_zero_std_counts_the_groups_of_the_scores_the_advantages_see(key):
    """With missing_eos_penalty a constant reward still gives different scores to cut and ended completions:
    it said every group had no signal while every completion had an advantage."""
    env = make_env(reward=lambda samples: [0.0] * len(samples), max_new_tokens=2)
    agent = agent_of(key, env=env, missing_eos_penalty=1.0, beta=0.0)
    batch = agent.collect_rollouts()
    groups = batch.truncated.view(-1, 4)
    mixed = float((groups.any(1) & ~groups.all(1)).double().mean())
    assert mixed > 0 and batch.stats["frac_reward_zero_std"] == pytest.approx(1 - mixed)
    assert batch.raw_scores.eq(0).all() and batch.advantages.ne(0).any()


def test_an_unset_epsilon_high_follows_an_epsilon_given_when_loading(tmp_path):
    """It was fixed to epsilon when the config was made: a load overriding epsilon kept the old upper bound,
    or refused one above it, naming a value the user never gave."""
    iterations(agent_of("grpo"), 1).save(tmp_path / "ckpt")
    loaded = GRPO.load(tmp_path / "ckpt", make_env(), epsilon=0.3)
    assert loaded.config.epsilon_high is None and loaded.config.clip_high == 0.3
    assert GRPOConfig(epsilon=0.2, epsilon_high=0.28).clip_high == 0.28


def test_with_mask_truncated_completions_the_entropy_is_over_the_tokens_in_the_loss():
    agent = agent_of("grpo", env=make_env(max_new_tokens=2), mask_truncated_completions=True, beta=0.0,
                     num_iterations=1, steps_per_generation=1)  # fmt: skip
    batch = agent.collect_rollouts()
    assert batch.truncated.any() and not batch.truncated.all()
    with torch.no_grad():
        _, entropy, _ = agent.policy_logprobs(batch)  # the update's first (and only) forward
    expected = float((entropy * batch.loss_mask).sum() / batch.loss_mask.sum())
    assert agent.train(batch)["entropy"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_generations=1), "num_generations must be an integer >= 2"),
        (dict(loss_type="ppo"), "loss_type must be one of grpo, dr_grpo, dapo, bnpo, not 'ppo'"),
        (dict(scale_rewards="std"), "scale_rewards must be one of group, batch, none, not 'std'"),
        # TRL's booleans: the message said "must be a string", not which strings
        (
            dict(scale_rewards=False),
            "scale_rewards must be one of group, batch, none, not false: TRL's false is 'none'",
        ),
        (dict(beta=-0.1), "beta must be a number >= 0"),
        (dict(epsilon=0.2, epsilon_high=0.1), r"epsilon_high must be >= epsilon \(0.2\)"),
        (dict(num_iterations=0), "num_iterations must be a positive integer"),
        (dict(temperature=0), "temperature must be a finite number > 0"),
        (dict(temperature=float("inf")), "temperature must be a finite number > 0"),
        (dict(learning_rate=-1), "learning_rate must be a positive number"),
    ],
)
def test_bad_hyperparameters_are_clear_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(**kwargs)


def test_steps_per_generation_is_the_number_of_optimizer_steps_per_pass():
    from test_ppo_agent import optimizer_steps

    agent = agent_of("grpo", env=make_env(8), steps_per_generation=3)  # 8 episodes: 3, 3 and 2
    assert optimizer_steps(agent) == 2 * 3  # num_iterations = 2
    with pytest.raises(ConfigError, match=r"^steps_per_generation=9 splits a batch of 8 episodes"):
        agent_of("grpo", env=make_env(8), steps_per_generation=9)


def test_a_batch_that_does_not_split_into_groups_is_refused():
    with pytest.raises(ConfigError, match=r"num_envs=6\) must be a multiple of num_generations=4"):
        agent_of("grpo", env=make_env(6))


def test_an_env_with_another_tokenizer_is_refused():
    env = gymnasium.make_vec("textgym/Copy-v0", num_envs=4, autoreset_mode="Disabled")  # characters
    with pytest.raises(ConfigError, match="does not match the policy"):
        GRPO("tiny-random-llama", env, num_generations=2)


@pytest.mark.parametrize(("cls", "beta"), [(GRPO, 0.0), (RLOO, 0.0), (RLOO, 0.05)])
def test_a_reward_that_never_tells_a_groups_completions_apart_is_warned_of_once(cls, beta):
    """frac_reward_zero_std = 1 on every iteration (an all-or-nothing reward no completion earns): every
    advantage is 0 and nothing is learnt, which only a logged 1.0 showed. RLOO with a KL penalty counted
    the groups after it: the KL of a policy still at its reference is float noise, the share read 0.75 and
    then 0, and the warning never came."""
    env = make_env(8, reward=lambda samples: [0.0] * len(samples))
    agent = cls(char_llama(), env, num_generations=4, beta=beta, verbose=0)
    with pytest.warns(
        UserWarning, match=r"every group of 4 completions of a prompt got equal rewards"
    ) as seen:
        iterations(agent, 4)
    [warning] = [str(w.message) for w in seen if "equal rewards" in str(w.message)]
    # RLOO's KL penalty is in its reward: its advantages are not 0, and the warning said they were
    kl_only = "the advantages came from the KL penalty alone (beta = 0.05)"
    assert (kl_only in warning) == (beta > 0) and ("every advantage was 0" in warning) == (beta == 0)
    assert [h["frac_reward_zero_std"] for h in agent.history] == [1.0] * 4
    told_apart = cls(char_llama(), make_env(8), num_generations=4, beta=beta, verbose=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*equal rewards")
        iterations(told_apart, 3)


def test_a_checkpoint_trained_without_a_reference_says_so_when_loaded_with_one(tmp_path):
    """GRPO at beta = 0 from a policy object saves no reference; loading it with beta > 0 read a missing
    directory and called the checkpoint corrupt."""
    GRPO(char_llama(), make_env(8), num_generations=4, verbose=0).save(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match=r"holds no KL reference.*beta = 0.04.*Load it with beta = 0"):
        GRPO.load(tmp_path / "ckpt", make_env(8), beta=0.04)
    assert GRPO.load(tmp_path / "ckpt", make_env(8)).config.beta == 0
