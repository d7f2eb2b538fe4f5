import numpy as np
import torch
from stable_baselines3 import PPO
from stable_baselines3.common.env_checker import check_env

from textgym.sb3 import TextGymVecEnv, make_vec_env


def two_char_episodes(responder, max_new_tokens):
    """An adapted two-sub-env multi-turn env on a character tokenizer, and the tokenizer."""
    from textgym import TextGenVectorEnv
    from textgym.models import CharTokenizer

    tok = CharTokenizer("abcdefgh")
    env = TextGenVectorEnv(num_envs=2, model=tok, prompts=["ab"], rewards=[], responder=responder,
                           max_new_tokens=max_new_tokens, max_prompt_tokens=2, autoreset_mode="SameStep")  # fmt: skip
    return TextGymVecEnv(env), tok


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
    assert infos[i]["completion"] in ("aaaa", "bbbb") and infos[i]["finish_reason"] == "length"
    # cut at max_new_tokens, yet scored whole on this step: nothing to bootstrap (SB3 adds gamma * V(obs)
    # to the reward of an episode marked TimeLimit.truncated)
    assert infos[i]["TimeLimit.truncated"] is False
    assert reward[i] == infos[i]["reward_components"]["match"]
    assert [set(info) for info in env.reset_infos] == [{"prompt"}] * 2
    assert env.reset_infos[i]["prompt"] == env.env.episodes.prompt_text(i)  # the episode that started


def test_sb3_ppo_adds_nothing_to_the_reward_of_an_episode_cut_at_max_new_tokens():
    """With the adapter and with SB3's own vectorisation."""
    from stable_baselines3.common.callbacks import BaseCallback

    class Rewards(BaseCallback):  # the env's rewards of each step, as SB3 got them from step_wait
        def _on_rollout_start(self):
            self.seen = []

        def _on_step(self):
            self.seen.append(self.locals["rewards"].copy())
            return True

    from stable_baselines3.common.env_util import make_vec_env as sb3_make_vec_env

    # every episode is cut at max_new_tokens = 4. SB3's own make_vec_env (a DummyVecEnv of Monitor-wrapped
    # envs, made with render_mode="rgb_array" first) bootstraps where `truncated and not terminated`: the
    # env reports a cut episode as terminated too, since its whole return was paid on that step.
    for env in (
        make_vec_env("textgym/Copy-v0", n_envs=4, seed=0),
        sb3_make_vec_env("textgym/Copy-v0", 4, seed=0),
    ):
        model = PPO("MultiInputPolicy", env, seed=0, n_steps=16, batch_size=64, n_epochs=1)
        model.learn(64, callback=(seen := Rewards()))
        assert model.rollout_buffer.episode_starts[1:].any()  # episodes ended within the rollout
        np.testing.assert_array_equal(model.rollout_buffer.rewards, np.stack(seen.seen))


def test_the_vec_env_passes_on_turn_infos_and_refuses_per_index_attributes():
    import pytest

    from textgym.errors import ConfigError

    env = make_vec_env("textgym/Echo-v0", n_envs=2, seed=0)
    env.reset()
    eos = env.env.eos_token_id
    _, _, _, infos = env.step(np.array([eos, 5]))  # sub-env 0 ends its first turn, sub-env 1 goes on
    assert "turn_reward" in infos[0] and "turn_reward" not in infos[1]
    with pytest.raises(ConfigError, match="share"):
        env.set_attr("max_turns", 1, indices=[0])
    env.set_attr("note", "shared")
    assert env.get_attr("note") == ["shared", "shared"]
    # a method acts on every sub-env: env_method("reset", indices=[0]) reset both
    with pytest.raises(ConfigError, match=r"env_method\('reset', indices=\[0\]\).*call it on all of them"):
        env.env_method("reset", indices=[0])
    assert len(env.env_method("action_masks", indices=[1])) == 1  # reading a row is fine
    # a sub-env's space is the single one, as SB3's VecEnvs give it
    assert env.get_attr("observation_space", indices=[0])[0] == env.observation_space
    # per-sub-env values give each sub-env its own row, as a DummyVecEnv's sub-envs do (each got them all)
    assert env.get_attr("active") == [True, True] and env.get_attr("active", indices=[1]) == [True]
    texts = make_vec_env("textgym/Copy-v0", n_envs=3, seed=0, render_mode="ansi")
    texts.reset()
    rendered = texts.env_method("render")
    assert len(rendered) == 3 and all(isinstance(t, str) for t in rendered)
    assert texts.env_method("render", indices=[1]) == [rendered[1]]


def test_an_entry_only_some_ended_sub_envs_have_is_not_given_to_the_others():
    """An episode cut at the budget on the step another one's turn ended read that one's turn_reward as
    0.0, its vector info's filler."""
    from textgym import Reply

    def done(conversations):
        return [Reply("b", 1.0, True) for _ in conversations]

    env, tok = two_char_episodes(done, max_new_tokens=2)
    env.reset()
    env.step(np.array([2, 2]))
    _, _, dones, infos = env.step(np.array([tok.eos_token_id, 2]))  # 0: its turn ends it; 1: the budget
    assert dones.all() and infos[0]["turn_reward"] == 1.0 and "turn_reward" not in infos[1]
    assert (infos[0]["finish_reason"], infos[1]["finish_reason"]) == ("stop", "length")


def test_episode_times_are_monitors_seconds_since_the_env_was_made(monkeypatch):
    import types

    import textgym.sb3

    now = [100.0]
    monkeypatch.setattr(textgym.sb3, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    env = make_vec_env("textgym/Copy-v0", n_envs=1, seed=0)
    env.reset()
    times = []
    for clock in (103.0, 107.0):
        done = np.zeros(1, dtype=bool)
        while not done.any():
            now[0] = clock
            _, _, done, infos = env.step(np.array([2]))
        times.append(infos[0]["episode"]["t"])
    assert times == [3.0, 7.0]  # each episode's own duration was written: [3.0, 4.0]


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


def test_actions_that_are_not_one_token_id_per_sub_env_are_refused():
    """Float actions were cut to ints (1.7: the EOS id, which ended the episode); a wrong count was numpy's
    reshape error."""
    import pytest
    from gymnasium.error import InvalidAction

    env = make_vec_env("textgym/Copy-v0", n_envs=3, seed=0)
    env.reset()
    for bad in (np.array([1.7, 2.2, 3.9]), np.array([2, 3])):
        with pytest.raises(InvalidAction, match="actions must be 3 integer token ids, one per sub-env"):
            env.step(bad)
    env.step(np.array([2, 3, 4]))


def test_per_sub_env_reset_options_reach_each_sub_env():
    """SB3's set_options takes one dict per sub-env: every sub-env was reset with the first one's."""
    import pytest

    from textgym.errors import ConfigError

    env = make_vec_env("textgym/Copy-v0", n_envs=3, seed=0)
    prompts = [p.text for p in env.env.episodes.prompts]
    env.set_options([{"prompt": 2}, {"prompt": 0}, {"prompt": 1}])
    env.reset()
    assert [info["prompt"] for info in env.reset_infos] == [prompts[2], prompts[0], prompts[1]]
    env.set_options({"prompts": [1, 1, 0]})  # one dict for all: the vector env's own options
    env.reset()
    assert [info["prompt"] for info in env.reset_infos] == [prompts[1], prompts[1], prompts[0]]
    env.set_options([{"prompt": 0}, {}, {}])
    with pytest.raises(ConfigError, match="set_options gave the sub-envs different options"):
        env.reset()


def test_subproc_vec_env_workers_started_by_spawn_build_textgym_envs_from_the_prefixed_id():
    """A spawned worker imports nothing of the parent's: Gymnasium's `module:` prefix imports textgym there
    (docs/agents.md says so; the plain id fails in the workers)."""
    from stable_baselines3.common.env_util import make_vec_env as sb3_make_vec_env
    from stable_baselines3.common.vec_env import SubprocVecEnv

    env = sb3_make_vec_env("textgym:textgym/Copy-v0", 2, seed=0, vec_env_cls=SubprocVecEnv,
                           vec_env_kwargs={"start_method": "spawn"})  # fmt: skip
    try:
        assert env.reset()["input_ids"].shape[0] == 2
        env.step(np.array([2, 2]))
    finally:
        env.close()


def test_a_partial_reset_keeps_the_running_returns_of_the_sub_envs_it_leaves_alone():
    """A reset with a reset_mask (through set_options) zeroed every sub-env's return so far: an episode that
    went on had its earlier turn rewards dropped from its Monitor return."""
    from textgym import Reply

    def pay(conversations):
        return [Reply("b", 1.0, False) for _ in conversations]

    env, tok = two_char_episodes(pay, max_new_tokens=8)
    env.reset()
    _, rewards, _, _ = env.step(np.array([tok.eos_token_id, 2]))  # sub-env 0's first turn ends: paid 1.0
    paid = [float(rewards[0])]
    env.set_options({"reset_mask": np.array([False, True])})
    env.reset()  # sub-env 1 starts again, sub-env 0's episode goes on
    dones = np.zeros(2, dtype=bool)
    while not dones[0]:
        _, rewards, dones, infos = env.step(np.array([2, 2]))
        paid.append(float(rewards[0]))
    assert paid[0] == 1.0 and infos[0]["episode"]["r"] == sum(paid)


def test_make_vec_env_takes_env_kwargs_as_sb3s_does():
    import pytest

    from textgym.errors import ConfigError

    env = make_vec_env("textgym/Copy-v0", n_envs=2, env_kwargs={"max_new_tokens": 3})
    assert env.env.max_new_tokens == 3
    with pytest.raises(ConfigError, match=r"\['max_new_tokens'\] both as keywords and in env_kwargs"):
        make_vec_env("textgym/Copy-v0", n_envs=2, max_new_tokens=2, env_kwargs={"max_new_tokens": 3})


def test_make_vec_env_refuses_sb3s_vec_env_arguments_by_name_with_what_to_use():
    """They went on to the env, which failed with a TypeError about its own __init__."""
    import pytest

    from textgym.errors import ConfigError

    with pytest.raises(ConfigError, match=r"does not take SB3's monitor_dir: .*VecMonitor\(make_vec_env"):
        make_vec_env("textgym/Copy-v0", n_envs=2, monitor_dir="mon")
    with pytest.raises(ConfigError, match=r"SB3's start_index, vec_env_cls: .*SB3's own make_vec_env"):
        make_vec_env("textgym/Copy-v0", n_envs=2, vec_env_cls=object, start_index=2)
