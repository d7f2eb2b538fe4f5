import numpy as np
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.env_checker import check_env

from textgym.sb3 import TextGymVecEnv, make_vec_env


def mean_episode_reward(vec_env, act, episodes=300):
    obs, rewards = vec_env.reset(), []
    while len(rewards) < episodes:
        obs, reward, done, _ = vec_env.step(act(obs))
        rewards.extend(reward[done])
    return float(np.mean(rewards))


def test_vec_env_follows_sb3_conventions():
    env = make_vec_env("textgym/Copy-v0", n_envs=2, seed=0)
    assert isinstance(env, TextGymVecEnv)
    obs = env.reset()
    assert obs["input_ids"].shape == (2, 7)
    done = np.zeros(2, dtype=bool)
    while not done.any():
        obs, reward, done, infos = env.step(np.array([2, 3]))
    i = int(np.flatnonzero(done)[0])
    assert set(infos[i]) >= {"terminal_observation", "TimeLimit.truncated", "completion", "reward_components"}
    assert infos[i]["TimeLimit.truncated"] and infos[i]["completion"] in ("aaaa", "bbbb")
    assert reward[i] == infos[i]["reward_components"]["match"]


def test_stock_sb3_ppo_learns_the_copy_task_well_beyond_random():
    torch.manual_seed(0)
    env = make_vec_env("textgym/Copy-v0", n_envs=16, seed=0)
    rng = np.random.default_rng(0)
    n_actions = env.action_space.n
    random_reward = mean_episode_reward(
        make_vec_env("textgym/Copy-v0", n_envs=16, seed=1), lambda obs: rng.integers(0, n_actions, 16)
    )
    model = PPO(
        "MultiInputPolicy", env, seed=0, n_steps=128, batch_size=256, ent_coef=0.01, learning_rate=1e-3
    )
    model.learn(60_000)
    trained_reward = mean_episode_reward(
        make_vec_env("textgym/Copy-v0", n_envs=16, seed=1),
        lambda obs: model.predict(obs, deterministic=True)[0],
    )
    print(f"random policy {random_reward:.3f}, PPO after 60k steps {trained_reward:.3f}")
    assert trained_reward > 3 * random_reward and trained_reward > 0.3, (random_reward, trained_reward)


def test_single_env_passes_sb3_check_env():
    import gymnasium

    check_env(gymnasium.make("textgym/Copy-v0").unwrapped)
