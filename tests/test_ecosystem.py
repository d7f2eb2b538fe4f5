"""textgym keeps the conventions of Gymnasium, Stable-Baselines3, TRL and the shell."""

import json
import subprocess
import sys
import warnings
from itertools import chain
from pathlib import Path

import gymnasium
import numpy as np
import pytest
import torch
from lm_helpers import char_llama, csv_rows, make_env
from stable_baselines3.common.callbacks import BaseCallback, CheckpointCallback

import textgym
from textgym import FunctionReward, RewardStack
from textgym.agents.ppo import LMPPO
from textgym.atomic import is_complete
from textgym.cli import main
from textgym.errors import ConfigError, PluginError
from textgym.evaluate import EvalCallback, evaluate_policy
from textgym.rewards import parse_reward_spec
from textgym.sb3 import make_vec_env
from textgym.train import run

EXAMPLES = Path(__file__).parents[1] / "examples"


def quick(*overrides, tmp):
    return [f"run.output_dir='{tmp}'", "run.total_timesteps=256", "run.sample_prompts=2", *overrides]


# -- swapping agents ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("config", "agent"), [("copy-sb3.toml", "a2c"), ("copy.toml", "sb3-ppo"), ("copy.toml", "grpo")]
)
def test_one_flag_swaps_the_agent_of_a_config(tmp_path, config, agent):
    out = tmp_path / agent
    run(EXAMPLES / config, quick("env.num_envs=16", tmp=out), agent_name=agent)
    assert is_complete(out / "checkpoint")
    assert {
        "metrics.csv",
        "samples.jsonl",
        "samples_before.jsonl",
        "samples_after.jsonl",
        "reward_kl.png",
    } <= {p.name for p in out.iterdir()}
    assert textgym.config.load_config(out / "config.toml")["agent"]["name"] == agent


@pytest.mark.parametrize("agent", ["dqn", "qrdqn", "trpo", "ppo", "a2c", "maskableppo", "recurrentppo"])
def test_the_sb3_example_takes_any_sb3_or_sb3_contrib_algorithm_as_it_says(agent):
    """Its shared [agent] table held ent_coef, which DQN, QR-DQN and TRPO do not take."""
    from textgym.agent_config import resolve_agent

    resolve_agent(textgym.config.load_config(EXAMPLES / "copy-sb3.toml", [f"agent.name='{agent}'"])["agent"])


@pytest.mark.parametrize("agent", ["lmppo", "grpo", "rloo", "sb3-ppo"])
def test_the_echo_example_takes_every_agent(agent):
    """LMPPO's n_epochs and kl_coef sat in its shared [agent] table: --agent grpo, rloo or sb3-ppo was
    refused."""
    from textgym.agent_config import resolve_agent

    resolve_agent(
        textgym.config.load_config(EXAMPLES / "multiturn-echo.toml", [f"agent.name='{agent}'"])["agent"]
    )


def test_an_sb3_configs_policy_kwargs_name_their_classes(tmp_path):
    """TOML has no classes: activation_fn = "nn.Tanh" reached SB3 as a string ("'str' object is not callable",
    naming no key)."""
    import torch

    from textgym.agent_config import resolve_agent
    from textgym.sb3 import make_vec_env

    def agent(kwargs):
        overrides = [f"agent.sb3-ppo.policy_kwargs={kwargs}"]
        return resolve_agent(textgym.config.load_config(EXAMPLES / "copy-sb3.toml", overrides)["agent"])

    agent_class, policy, hyperparameters = agent('{activation_fn="nn.Tanh", optimizer_class="RMSprop"}')
    assert hyperparameters["policy_kwargs"] == {
        "activation_fn": torch.nn.Tanh,
        "optimizer_class": torch.optim.RMSprop,
    }
    model = agent_class(policy, make_vec_env("textgym/Copy-v0", n_envs=2), **hyperparameters)
    assert model.policy.activation_fn is torch.nn.Tanh and isinstance(
        model.policy.optimizer, torch.optim.RMSprop
    )
    with pytest.raises(
        ConfigError,
        match=r"\[agent.sb3-ppo\]: policy_kwargs.activation_fn = 'nn.Relu' names no class. Did you mean 'ReLU'\?",
    ):
        agent('{activation_fn="nn.Relu"}')


def test_an_sb3_algorithm_without_a_policy_for_dict_observations_is_refused_before_it_starts():
    """ARS failed after the env was made: "Policy MultiInputPolicy unknown", naming no cause."""
    from textgym.agent_config import resolve_agent

    config = textgym.config.load_config(EXAMPLES / "copy-sb3.toml", ["agent.name='ars'"])
    with pytest.raises(
        ConfigError,
        match=r"ars has no policy for dict observations \(its policies: MlpPolicy, LinearPolicy\)",
    ):
        resolve_agent(config["agent"])


def test_an_sb3_run_counts_every_rollout_as_an_iteration_with_a_sample_std(tmp_path):
    """A2C with one step per rollout: rollouts in which no episode ended were not counted, so metrics.csv said
    iteration 10 at 320 tokens where SB3 had updated 20 times (and eval.csv said 20); reward_std was the
    population std where LM agents log the sample std."""
    out = tmp_path / "a2c"
    run(EXAMPLES / "copy-sb3.toml", quick("env.num_envs=16", "run.total_timesteps=320", "agent.a2c.n_steps=1",
                                          tmp=out), agent_name="a2c")  # fmt: skip
    rows = csv_rows(out / "metrics.csv")
    assert [int(r["iteration"]) for r in rows] == list(range(1, 21))
    assert [int(r["timesteps"]) for r in rows] == [16 * i for i in range(1, 21)]
    idle = [r for r in rows if r["episodes"] == "0"]
    assert idle and all(np.isnan(float(r["reward"])) for r in idle)  # the first rollouts end no episode
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    for r in rows:
        rewards = [s["reward"] for s in samples if s["iteration"] == int(r["iteration"])]
        assert len(rewards) == int(r["episodes"])
        if len(rewards) > 1:
            assert float(r["reward_std"]) == pytest.approx(np.std(rewards, ddof=1), rel=1e-6)
    # one env, one step per rollout: a rollout ends one episode at most, and one return has no spread (it read 0)
    out = tmp_path / "one"
    run(EXAMPLES / "copy-sb3.toml", quick("env.num_envs=1", "run.total_timesteps=16", "agent.a2c.n_steps=1",
                                          tmp=out), agent_name="a2c")  # fmt: skip
    ones = [r for r in csv_rows(out / "metrics.csv") if r["episodes"] == "1"]
    assert ones and all(np.isnan(float(r["reward_std"])) for r in ones)


def test_unknown_hyperparameters_are_named_with_a_suggestion_for_sb3_agents_too(tmp_path):
    with pytest.raises(
        ConfigError, match=r"\[agent.a2c\]: unknown hyperparameter 'n_step'. Did you mean 'n_steps'"
    ):
        run(EXAMPLES / "copy-sb3.toml", quick("agent.a2c.n_step=5", tmp=tmp_path / "x"), agent_name="a2c")
    with pytest.raises(ConfigError, match=r"\[agent\] grpo: unknown hyperparameter 'kl_coef'.*own table"):
        run(EXAMPLES / "copy.toml", quick("agent.kl_coef=0.1", tmp=tmp_path / "y"), agent_name="grpo")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_a_misnamed_agent_or_agent_table_is_named_as_such():
    """[agent.grpoo] (or a plugin agent's table without its plugin) was "unknown hyperparameter 'grpoo'"; an
    unknown key already in the agent's own table was told to move to its own table; `--agent a2` listed the
    registered agents only, as if Stable-Baselines3's were not there."""
    from textgym.agent_config import find_agent, resolve_agent
    from textgym.errors import UnknownNameError

    with pytest.raises(ConfigError, match=r"^\[agent.grpoo\] names no known agent. Did you mean \[agent.grpo\]\?.*"
                       r"needs the file loaded \(--plugin FILE.py or run.plugins\)"):  # fmt: skip
        resolve_agent({"name": "lmppo", "policy": "tiny-char-llama", "grpoo": {"beta": 0.1}})
    with pytest.raises(ConfigError, match=r"\[agent.lmppo\]: unknown hyperparameter 'n_epoch'") as own:
        resolve_agent({"name": "lmppo", "policy": "tiny-char-llama", "lmppo": {"n_epoch": 2}})
    assert "own table" not in str(own.value)
    # a table-valued hyperparameter misspelt is a hyperparameter, not an agent's table
    with pytest.raises(ConfigError, match=r"unknown hyperparameter 'loar'. Did you mean 'lora'"):
        resolve_agent({"name": "lmppo", "policy": "tiny-char-llama", "loar": {"r": 8}})
    with pytest.raises(
        UnknownNameError, match=r"Did you mean Stable-Baselines3's 'a2c'\?.*named directly too"
    ):
        find_agent("a2")
    assert find_agent("GRPO") is find_agent("grpo")  # as find_agent("A2C") is SB3's A2C
    _, _, hyperparameters = resolve_agent(
        {"name": "GRPO", "policy": "tiny-char-llama", "GRPO": {"beta": 0.1}}
    )
    assert hyperparameters == {"beta": 0.1}


def test_a_message_names_the_agents_table_as_the_config_spells_it():
    """[agent.A2C] (a2c's table under another of its names) was reported as [agent.a2c], a table the config
    does not have."""
    from textgym.agent_config import resolve_agent

    for table, says in [({"name": "a2c", "A2C": {"n_stpes": 4}}, r"^\[agent.A2C\]: unknown hyperparameter 'n_stpes'"),
                        ({"name": "sb3-a2c", "A2C": {"gamma": "x"}}, r"^\[agent.A2C\]: gamma must be a number"),
                        ({"name": "a2c", "A2C": {"learning_rate": -1}}, r"^\[agent.A2C\]: learning_rate must be"),
                        ({"name": "a2c", "A2C": {"seed": 1}}, r"^\[agent.A2C\] sets seed"),
                        ({"name": "a2c", "gamma": "x", "A2C": {}}, r"^\[agent\] a2c: gamma must be a number"),
                        ({"name": "lmppo", "policy": "tiny-char-llama", "LMPPO": {"clip_range": -1}},
                         r"^\[agent.LMPPO\]: clip_range must be")]:  # fmt: skip
        with pytest.raises(ConfigError, match=says):
            resolve_agent(table)


def test_every_agent_table_and_every_lm_hyperparameter_value_is_checked_before_anything_loads(capsys):
    """A typo in another agent's table was copied into the run's config.toml unseen; `num_generations = "4"`
    was a TypeError traceback from the process split; [agent.ppo] and [agent.sb3-ppo] (one algorithm) had
    the last one win silently; GRPO's `kl_coef` and a misspelt `seed` pointed nowhere useful."""
    from textgym.agent_config import resolve_agent

    base = {"name": "lmppo", "policy": "tiny-char-llama"}
    for table, says in [({"grpo": {"bta": 0.1}}, r"\[agent.grpo\]: unknown hyperparameter 'bta'. Did you mean 'beta'"),
                        ({"a2c": {"n_stpes": 4}}, r"\[agent.a2c\]: unknown hyperparameter 'n_stpes'. Did you mean 'n_steps'"),
                        ({"sedd": 3}, r"unknown hyperparameter 'sedd'. Did you mean run.seed"),
                        ({"name": "grpo", "kl_coef": 0.1}, r"grpo: unknown hyperparameter 'kl_coef'. grpo calls it 'beta'"),
                        ({"name": "grpo", "num_generations": "4"}, r"^\[agent\] grpo: num_generations must be"),
                        ({"grpo": {"beta": -1}, "name": "grpo"}, r"^\[agent.grpo\]: beta must be a number >= 0"),
                        ({"name": "ppo", "ppo": {"n_steps": 8}, "sb3-ppo": {"n_steps": 32}},
                         r"\[agent.ppo\] and \[agent.sb3-ppo\] both hold ppo's hyperparameters"),
                        # a bad value in another agent's table too, not only a misspelt name: it trained, and
                        # the value waited in config.toml for the run that reads it (`--agent grpo`)
                        ({"grpo": {"loss_type": "foo"}}, r"^\[agent.grpo\]: loss_type must be one of"),
                        ({"GRPO": {"num_generations": 1}}, r"^\[agent.GRPO\]: num_generations must be"),
                        ({"a2c": {"n_steps": 2.5}}, r"^\[agent.a2c\]: n_steps must be an integer"),
                        # a shared value bad for every agent: named for the run's agent, not another table's
                        ({"learning_rate": True, "grpo": {"beta": 0.0}}, r"^\[agent\] lmppo: learning_rate")]:  # fmt: skip
        with pytest.raises(ConfigError, match=says):
            resolve_agent({**base, **table})
    # with the shared values it takes, as `--agent grpo` would: epsilon_high = 0.25 is fine beside 0.2
    assert resolve_agent({**base, "temperature": 0.7, "grpo": {"epsilon_high": 0.25}})[0].__name__ == "LMPPO"
    args = [
        "train",
        str(EXAMPLES / "copy.toml"),
        "--agent",
        "grpo",
        "--set",
        'agent.grpo.num_generations="4"',
    ]
    assert main(args) == 2 and "num_generations must be" in capsys.readouterr().err


def test_an_sb3_resume_refuses_an_edited_config_and_takes_another_name_of_its_agent(tmp_path, capsys):
    """n_steps edited in an A2C run's config.toml was ignored on resume (SB3's saved value won) while the file
    said otherwise; `--resume RUN --agent sb3-a2c` on an a2c run was refused as another agent."""
    out = tmp_path / "a2c"
    run(EXAMPLES / "copy-sb3.toml", quick("run.total_timesteps=64", tmp=out), agent_name="a2c")
    text = (out / "config.toml").read_text()
    assert "n_steps = 16" in text
    (out / ".config-written.toml").unlink()  # checked against the checkpoint itself, without textgym's copy
    (out / "config.toml").write_text(text.replace("n_steps = 16", "n_steps = 4"))
    assert main(["train", "--resume", str(out), "--set", "run.total_timesteps=128"]) == 2
    assert "no longer says what" in (err := capsys.readouterr().err) and "agent.n_steps: 16 -> 4" in err
    # a hyperparameter config.toml did not give before (its default was trained) is a change too
    (out / "config.toml").write_text(text.replace("n_steps = 16", "n_steps = 16\ngae_lambda = 0.9"))
    assert main(["train", "--resume", str(out), "--set", "run.total_timesteps=128"]) == 2
    assert "agent.gae_lambda: 1.0 -> 0.9" in capsys.readouterr().err
    (out / "config.toml").write_text(text)
    assert (
        main(["train", "--resume", str(out), "--agent", "SB3-A2C", "--set", "run.total_timesteps=128"]) == 0
    )
    assert int(csv_rows(out / "metrics.csv")[-1]["timesteps"]) == 256  # 16 envs x 16 steps per rollout


def test_a_checkpoint_of_another_agent_than_config_toml_names_is_refused_by_name(tmp_path):
    """grpo -> rloo in a run's config.toml was refused for a hyperparameter whose default differs (beta),
    not for the agent."""
    from textgym.agents.rloo import RLOO
    from textgym.resume_checks import check_checkpoint_config
    from textgym.rundir import RunDir

    rd = RunDir(tmp_path)
    rd.checkpoint.mkdir(parents=True)
    (rd.checkpoint / "state.json").write_text(json.dumps({"agent": "grpo", "config": {"beta": 0.0}}))
    with pytest.raises(
        ConfigError, match=r"now names the agent 'rloo', but .* was trained by 'grpo'.*agent.name = 'grpo'"
    ):
        check_checkpoint_config(rd, {"beta": 0.01}, RLOO)


@pytest.mark.parametrize("agent", ["a2c", "lmppo"])
def test_an_env_that_is_not_textgyms_is_one_config_error_for_every_agent(tmp_path, agent):
    with pytest.raises(ConfigError, match=r"\[env\] CartPole-v1"):
        run(EXAMPLES / "copy.toml", quick("env.id='CartPole-v1'", tmp=tmp_path / "x"), agent_name=agent)
    assert not (tmp_path / "x").exists()
    with pytest.raises(ConfigError, match="not a TextGenVectorEnv"):
        make_vec_env("CartPole-v1", n_envs=2)


def test_sb3_contrib_algorithms_are_named_directly(tmp_path):
    pytest.importorskip("sb3_contrib")
    out = tmp_path / "qrdqn"
    run(EXAMPLES / "copy.toml", quick("agent.qrdqn={learning_starts=0}", tmp=out), agent_name="qrdqn")
    assert is_complete(out / "checkpoint")
    from textgym.agent_config import resolve_agent

    # RecurrentPPO's dict-observation policy is MultiInputLstmPolicy, not MultiInputPolicy
    _, policy, _ = resolve_agent({"name": "recurrentppo", "policy": "tiny-char-llama"})
    assert policy == "MultiInputLstmPolicy"


PLUGIN_AGENT = """
import textgym
from textgym.agents.base import LMAgent


class Reinforce(LMAgent):
    name = "reinforce"

    @property
    def uses_reference(self):
        return False

    def train(self, batch):
        self.optimizer.zero_grad()
        logprobs, entropy, _ = self.policy_logprobs(batch)
        mask = batch.response_mask.float()
        loss = -((batch.scores - batch.scores.mean())[:, None] * logprobs * mask).sum() / mask.sum()
        self.backward(loss)
        self.optimizer_step()
        return {"loss": float(loss.detach())}


@textgym.hookimpl
def register_agents(register):
    register("reinforce", Reinforce)
"""


def test_a_third_party_lm_agent_gets_the_same_run_directory(tmp_path):
    (tmp_path / "reinforce.py").write_text(PLUGIN_AGENT)
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "textgym", "train", str(EXAMPLES / "copy.toml"), "--plugin", str(tmp_path / "reinforce.py"),
         "--agent", "reinforce", *chain.from_iterable(["--set", o] for o in quick("env.num_envs=16", tmp=out))],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = (out / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert {"reward", "kl", "entropy", "completions/mean_length", "loss", "time/update"} <= set(header)
    assert {"samples_before.jsonl", "samples_after.jsonl", "reward_kl.png"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "checkpoint" / "state.json").read_text())["agent"] == "reinforce"


# -- Stable-Baselines3 edges -------------------------------------------------------------------------
def test_evaluate_policy_and_eval_callback_work_on_the_native_env_without_warnings(tmp_path):
    agent = LMPPO(char_llama(), make_env(), verbose=0, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mean, std = evaluate_policy(agent, agent.get_env(), n_eval_episodes=20)
        assert 0 <= mean <= 1 and std >= 0
        rewards, lengths = evaluate_policy(agent, n_eval_episodes=5, return_episode_rewards=True)
        assert len(rewards) == len(lengths) == 5
        assert len(evaluate_policy(agent, n_eval_episodes=np.int64(3), return_episode_rewards=True)[0]) == 3
        for bad in (0, -1, 2.5):  # SB3 would return nan with numpy's "mean of empty slice"
            with pytest.raises(ConfigError, match=f"n_eval_episodes must be a positive integer, not {bad}"):
                evaluate_policy(agent, n_eval_episodes=bad)
        for bad in (None, -1, 1.5, 2**32, True):  # a bare TypeError or numpy's casting error, mid-evaluation
            with pytest.raises(
                ConfigError, match=r"seed must be an integer in \[0, 2\*\*32\), not " + str(bad)
            ):
                evaluate_policy(agent, n_eval_episodes=2, seed=bad)
            with pytest.raises(ConfigError, match=r"seed must be an integer"):  # not after an iteration
                EvalCallback(make_env(2), seed=bad)
        with pytest.raises(ConfigError, match="n_eval_episodes must be a positive integer, not 0"):
            EvalCallback(make_env(2), n_eval_episodes=0)
        evaluation = EvalCallback(make_env(8), n_eval_episodes=8, eval_freq=1, log_path=str(tmp_path),
                                  best_model_save_path=str(tmp_path / "best"), verbose=0)  # fmt: skip
        agent.learn(16 * 6 * 2, callback=evaluation)
    assert np.load(tmp_path / "evaluations.npz")["results"].shape == (agent.iteration, 8)
    assert is_complete(tmp_path / "best" / "best_model")


def test_stock_sb3_callbacks_read_the_iterations_episodes_and_logs(tmp_path):
    """SB3's callbacks read `dones` and `infos` in on_step, and LogEveryNTimesteps calls dump_logs(): they
    crashed, and a custom callback saw the previous iteration's locals."""
    from stable_baselines3.common.callbacks import LogEveryNTimesteps, StopTrainingOnMaxEpisodes
    from stable_baselines3.common.logger import configure

    class Seen(BaseCallback):
        def __init__(self):
            super().__init__()
            self.rows = []

        def _on_step(self):
            infos = self.locals["infos"]
            self.rows.append((self.locals["stats"]["iteration"], len(infos), self.locals["dones"].all(),
                              [i["episode"]["r"] for i in infos], list(self.locals["rewards"])))  # fmt: skip
            return True

    agent = LMPPO(char_llama(), make_env(4), verbose=0, seed=0, n_epochs=1)
    agent.set_logger(configure(str(tmp_path), ["csv"]))
    seen = Seen()
    callbacks = [seen, StopTrainingOnMaxEpisodes(max_episodes=2, verbose=0), LogEveryNTimesteps(n_steps=1)]
    agent.learn(10_000, callback=callbacks, log_interval=0)  # the rows come from LogEveryNTimesteps alone
    assert agent.iteration == 2  # 4 episodes an iteration
    assert [row[:3] for row in seen.rows] == [(1, 4, True), (2, 4, True)]
    episodes = [e["reward"] for e in agent.last_episodes]
    assert seen.rows[-1][3] == pytest.approx(episodes) and seen.rows[-1][4] == pytest.approx(episodes)
    rows = (tmp_path / "progress.csv").read_text().splitlines()
    assert len(rows) == 3 and "reward" in rows[0].split(",")


def test_a_logger_set_by_set_logger_takes_the_place_of_tensorboard_log_as_in_sb3(tmp_path):
    """learn() made its own logger under tensorboard_log and dropped the user's: its CSV stayed empty."""
    from stable_baselines3.common.logger import configure

    agent = LMPPO(
        char_llama(), make_env(4), verbose=0, seed=0, n_epochs=1, tensorboard_log=str(tmp_path / "tb")
    )
    custom = configure(str(tmp_path / "custom"), ["csv"])
    agent.set_logger(custom)
    agent.learn(8)
    assert (
        agent.logger is custom and len(csv_rows(tmp_path / "custom" / "progress.csv")) == agent.iteration > 0
    )
    assert not (tmp_path / "tb").exists()


def test_textgyms_eval_callback_logs_each_evaluation_at_its_own_step(tmp_path):
    """The agent writes its iteration's row before calling back: an evaluation that did not write its own
    went out with the next iteration's row, and the last one never."""
    from stable_baselines3.common.logger import configure

    agent = LMPPO(char_llama(), make_env(4), verbose=0, seed=0, n_epochs=1)
    agent.set_logger(configure(str(tmp_path), ["csv"]))
    agent.learn(10_000, callback=[EvalCallback(make_env(4), n_eval_episodes=4, eval_freq=1, verbose=0),
                                  StopAfterIterations(3)])  # fmt: skip
    rows = csv_rows(tmp_path / "progress.csv")
    evaluated = [
        (r["time/total_timesteps"], r["eval/mean_reward"]) for r in rows if r.get("eval/mean_reward")
    ]
    assert [int(t) for t, _ in evaluated] == [
        h["timesteps"] for h in agent.history
    ]  # 3 of 3, each at its step


class StopAfterIterations(BaseCallback):
    def __init__(self, iterations):
        super().__init__()
        self.iterations = iterations

    def _on_step(self):
        return self.model.iteration < self.iterations


def test_textgyms_eval_callback_drives_sb3s_stopping_callbacks():
    from stable_baselines3.common.callbacks import (
        StopTrainingOnNoModelImprovement,
        StopTrainingOnRewardThreshold,
    )

    agent = LMPPO(char_llama(), make_env(), verbose=0, seed=0)
    stop = StopTrainingOnRewardThreshold(reward_threshold=-1.0, verbose=0)  # any evaluation beats it
    agent.learn(16 * 6 * 50, callback=EvalCallback(make_env(4), callback_on_new_best=stop, verbose=0))
    assert agent.iteration == 1
    agent = LMPPO(char_llama(), make_env(), verbose=0, seed=0)
    patience = StopTrainingOnNoModelImprovement(max_no_improvement_evals=0, verbose=0)
    evaluation = EvalCallback(make_env(4), callback_after_eval=patience, n_eval_episodes=4, verbose=0)
    agent.learn(16 * 6 * 50, callback=evaluation)  # stops at the first evaluation that does not improve
    assert 2 <= agent.iteration < 50 and patience.parent is evaluation


def test_evaluate_policy_takes_sb3s_arguments_in_sb3s_order_and_seeds_an_sb3_vec_env():
    agent = LMPPO(char_llama(), make_env(), verbose=0, seed=0)
    rewards, lengths = evaluate_policy(agent, agent.get_env(), 4, True, False, None, None, True, True)
    assert len(rewards) == len(lengths) == 4
    with pytest.raises(AssertionError, match="Mean reward below threshold"):
        evaluate_policy(agent, agent.get_env(), 4, reward_threshold=2.0)  # a reward is at most 1
    with pytest.raises(ConfigError, match="render and callback need an SB3 VecEnv"):
        evaluate_policy(agent, agent.get_env(), 4, callback=lambda local, global_: None)
    env = make_vec_env("textgym/Copy-v0", n_envs=4, seed=0)
    prompts = []
    evaluate_policy(
        agent, env, 8, seed=3, callback=lambda local, global_: prompts.append(local["observations"])
    )
    again = []
    evaluate_policy(
        agent, env, 8, seed=3, callback=lambda local, global_: again.append(local["observations"])
    )
    assert prompts and all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(prompts, again))


def test_sb3_evaluate_policy_reads_true_returns_without_a_monitor_warning():
    from stable_baselines3 import PPO
    from stable_baselines3.common.evaluation import evaluate_policy as sb3_evaluate

    env = make_vec_env("textgym/Copy-v0", n_envs=4, seed=0)
    model = PPO("MultiInputPolicy", env, n_steps=16, batch_size=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rewards, lengths = sb3_evaluate(model, env, n_eval_episodes=8, return_episode_rewards=True)
    assert all(1 <= n <= 4 for n in lengths) and all(0 <= r <= 1 for r in rewards)


def test_checkpoint_callback_directories_are_not_named_zip(tmp_path):
    agent = LMPPO(char_llama(), make_env(), verbose=0)
    agent.learn(
        16 * 6 * 2, callback=CheckpointCallback(save_freq=1, save_path=str(tmp_path), name_prefix="lmppo")
    )
    names = sorted((p.name for p in tmp_path.iterdir()), key=lambda n: int(n.split("_")[1]))
    assert names and all(not n.endswith(".zip") and is_complete(tmp_path / n) for n in names)
    assert LMPPO.load(tmp_path / f"{names[0]}.zip").iteration == 1  # SB3's name for it loads too


def test_tensorboard_logs_continue_across_resume_and_missing_tensorboard_is_an_error(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    run(EXAMPLES / "copy.toml", quick("run.report_to=['tensorboard']", "env.num_envs=16", tmp=out))
    run(None, ["run.total_timesteps=512"], resume=out)
    assert [p.name for p in (out / "tensorboard").iterdir()] == ["run_1"]
    assert len(list((out / "tensorboard" / "run_1").glob("events.out.tfevents.*"))) == 2
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ConfigError, match=r"pip install 'textgym\[tensorboard\]'"):
        LMPPO(char_llama(), make_env(), tensorboard_log=str(tmp_path / "tb")).learn(1)


def test_maskable_ppo_never_chooses_a_masked_token():
    pytest.importorskip("sb3_contrib")
    from sb3_contrib import MaskablePPO

    env = make_vec_env("textgym/Copy-v0", n_envs=4, seed=0, allowed_tokens="abc")
    assert env.action_masks().sum(1).tolist() == [4, 4, 4, 4]  # a, b, c and EOS
    model = MaskablePPO("MultiInputPolicy", env, n_steps=32, batch_size=64, seed=0)
    model.learn(128)
    obs = env.reset()
    for _ in range(12):
        actions, _ = model.predict(obs, action_masks=env.action_masks())
        assert set(actions.tolist()) <= {1, 2, 3, 4}
        obs, *_ = env.step(actions)


def test_a_maskable_ppo_is_evaluated_and_sampled_with_its_action_masks():
    """Without the masks, evaluations and sample tables sampled the tokens MaskablePPO never takes."""
    pytest.importorskip("sb3_contrib")
    from sb3_contrib import MaskablePPO

    from textgym.sb3 import sb3_episodes

    seen = []

    def spy(samples):
        seen.extend(s.completion for s in samples)
        return [0.0] * len(samples)

    kwargs = dict(allowed_tokens="abc", rewards=RewardStack([(FunctionReward("spy", spy), 1.0)]))
    model = MaskablePPO(
        "MultiInputPolicy", make_vec_env("textgym/Copy-v0", n_envs=4, seed=0, **kwargs), seed=0
    )
    native = gymnasium.make_vec("textgym/Copy-v0", num_envs=4, autoreset_mode="Disabled", **kwargs)
    rows = sb3_episodes(model, native, seed=0)
    evaluate_policy(model, native, n_eval_episodes=8, deterministic=False)
    evaluate_policy(model, make_vec_env("textgym/Copy-v0", n_envs=2, seed=1, **kwargs), n_eval_episodes=4)
    assert len(seen) >= 16 and all(set(text) <= set("abc") for text in seen)
    assert all(set(r["completion"]) <= set("abc") for r in rows)


def test_a_recurrent_ppos_state_is_carried_through_an_evaluation_and_restarted_per_episode():
    """Its LSTM restarted at every token: predict was called without state or episode_start."""
    pytest.importorskip("sb3_contrib")
    from sb3_contrib import RecurrentPPO

    calls = []

    class Recording(RecurrentPPO):
        def predict(self, observation, state=None, episode_start=None, deterministic=False):
            calls.append((state is not None, None if episode_start is None else episode_start.tolist()))
            return super().predict(observation, state, episode_start, deterministic)

    native = gymnasium.make_vec("textgym/Copy-v0", num_envs=2, autoreset_mode="Disabled", max_new_tokens=3)
    model = Recording(
        "MultiInputLstmPolicy", make_vec_env("textgym/Copy-v0", n_envs=2, seed=0, max_new_tokens=3), seed=0
    )
    evaluate_policy(model, native, n_eval_episodes=2)
    assert calls[0] == (False, [True, True]) and all(carried for carried, _ in calls[1:])
    assert all(starts == [False, False] for _, starts in calls[1:])


def test_evaluate_policy_with_a_seed_is_repeatable_and_leaves_the_global_random_streams_alone():
    from stable_baselines3 import PPO

    model = PPO("MultiInputPolicy", make_vec_env("textgym/Copy-v0", n_envs=2, seed=0), seed=0)
    native = gymnasium.make_vec("textgym/Copy-v0", num_envs=4, autoreset_mode="Disabled")
    vec = make_vec_env("textgym/Copy-v0", n_envs=2, seed=0)
    for env in (native, vec):
        torch.manual_seed(7)
        np.random.seed(7)
        first = evaluate_policy(model, env, 8, deterministic=False, return_episode_rewards=True, seed=3)
        after = (torch.rand(1).item(), np.random.rand())
        torch.manual_seed(7)
        np.random.seed(7)
        assert (torch.rand(1).item(), np.random.rand()) == after  # the evaluation drew nothing from them
        assert (
            evaluate_policy(model, env, 8, deterministic=False, return_episode_rewards=True, seed=3) == first
        )
    with pytest.raises(
        ConfigError, match=r"evaluate_policy\(model\) needs an env for a Stable-Baselines3 model"
    ):
        evaluate_policy(model)


def test_evaluate_policy_of_an_lm_agent_loaded_without_an_env_says_to_pass_one(tmp_path):
    agent = LMPPO(char_llama(), make_env(2), verbose=0, seed=0)
    agent.save(tmp_path / "agent")
    loaded = LMPPO.load(tmp_path / "agent")
    with pytest.raises(ConfigError, match=r"needs an env: this LMPPO has none .*LMPPO.load\(path, env\)"):
        evaluate_policy(loaded)  # SB3's DummyVecEnv([lambda: None]) spoke of OpenAI Gym
    assert len(evaluate_policy(loaded, make_env(2), 2, return_episode_rewards=True)[0]) == 2


def test_a_dqns_exploring_evaluation_with_a_seed_is_repeatable_and_leaves_its_exploration_stream_alone():
    """A DQN's random actions come from its action space's own generator, which the seed did not reach."""
    from stable_baselines3 import DQN

    model = DQN("MultiInputPolicy", make_vec_env("textgym/Copy-v0", n_envs=2, seed=0), seed=0)
    model.exploration_rate = 0.9  # early in its schedule: most actions are random
    env = make_vec_env("textgym/Copy-v0", n_envs=2, seed=0)
    model.action_space.seed(11)
    first = evaluate_policy(model, env, 8, deterministic=False, return_episode_rewards=True, seed=3)
    after = model.action_space.sample()
    model.action_space.seed(11)
    assert model.action_space.sample() == after  # training's exploration draws go on untouched
    assert evaluate_policy(model, env, 8, deterministic=False, return_episode_rewards=True, seed=3) == first


def test_evaluate_policy_repeats_on_a_single_env_and_in_sequential_order_and_leaves_the_order_alone():
    """A single gymnasium env was wrapped by SB3 unseeded (the same seed gave other episodes); in sequential
    order an evaluation went on from wherever training was, and moved the training env past the prompts it
    evaluated on."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.monitor import Monitor

    from textgym.evaluate import round_seed

    model = PPO("MultiInputPolicy", make_vec_env("textgym/Copy-v0", n_envs=2, seed=0), seed=0)
    single = Monitor(gymnasium.make("textgym/Copy-v0"))
    sequential = gymnasium.make_vec("textgym/Copy-v0", num_envs=4, autoreset_mode="Disabled",
                                    prompt_order="sequential")  # fmt: skip
    for env, cursors in ((single, [0, 0]), (sequential, [5, 9])):
        results = []
        for cursor in cursors:
            sequential.prompt_cursor = cursor
            results.append(evaluate_policy(model, env, 8, False, return_episode_rewards=True, seed=3))
            assert sequential.prompt_cursor == cursor
        assert results[0] == results[1]
    # 8 episodes on 4 sub-envs: two batches, the second not the next seed's first
    assert round_seed(3, 0) == 3 and round_seed(3, 1) not in (3, 4)


def test_evaluate_policy_takes_the_first_prompts_in_sequential_order_in_either_autoreset_mode():
    """Under SameStep an ended episode restarted on the next prompts, so each batch after the first skipped
    one batch's worth of them: 6 episodes on 4 sub-envs ran prompts 0-3 and 8-9, where Disabled ran 0-5."""

    def prompt_number(samples):  # the reward says which prompt the episode ran on
        return [float(PROMPTS.index(s.prompt)) for s in samples]

    agent = LMPPO(char_llama(), make_env(4), seed=0, verbose=0)
    for mode in ("Disabled", "SameStep"):
        env = make_env(4, mode, prompt_number, prompts=PROMPTS, prompt_order="sequential")
        rewards, _ = evaluate_policy(agent, env, 6, return_episode_rewards=True)
        assert rewards == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], mode


PROMPTS = ["ab", "ba", "cd", "dc", "ef", "fe", "gh", "hg", "aa", "bb"]


def test_a_mean_return_under_normalize_then_sum_is_refused_and_eval_callback_repeats_its_seed(tmp_path):
    """normalize_then_sum standardises each batch of rewards: evaluate_policy's mean was ~1e-17 for every
    policy, and EvalCallback chose its best model and stopped on that. Its evaluations ran on seeds 1, 2, 3..
    (the callback's step count): each on other prompts, so the best model was chosen on unequal terms."""
    from stable_baselines3.common.vec_env import VecNormalize

    stack = {"aggregate": "normalize_then_sum", "components": [{"name": "match", "partial": True},
             {"name": "length_penalty", "target": 3}]}  # fmt: skip
    from stable_baselines3 import PPO

    native = make_env(4, rewards=stack)
    vec = VecNormalize(make_vec_env("textgym/Copy-v0", n_envs=4, seed=0, rewards=stack), norm_reward=False)
    agents = (LMPPO(char_llama(), make_env(), verbose=0, seed=0), PPO("MultiInputPolicy", vec, seed=0))
    for agent, env in zip(agents, (native, vec)):
        with pytest.raises(ConfigError, match=r"evaluate_policy: the env's reward stack sums with aggregate = "
                           r"'normalize_then_sum'.*about 0 whatever the policy"):  # fmt: skip
            evaluate_policy(agent, env, 8)
        with pytest.raises(ConfigError, match="normalize_then_sum"):
            evaluate_policy(agent, env, 8, return_episode_rewards=True, reward_threshold=0.0)
        rewards, _ = evaluate_policy(agent, env, 8, return_episode_rewards=True)  # what the env paid
        assert len(rewards) == 8
        with pytest.raises(ConfigError, match="EvalCallback: the env's reward stack sums with aggregate"):
            EvalCallback(env)
    frozen = LMPPO(char_llama(), make_env(), verbose=0, seed=0)
    for group in frozen.optimizer.param_groups:
        group["lr"] = 0.0  # the policy does not change
    evaluation = EvalCallback(make_env(8), n_eval_episodes=8, eval_freq=1, deterministic=False,
                              log_path=str(tmp_path / "frozen"), verbose=0, seed=5)  # fmt: skip
    frozen.learn(16 * 6 * 3, callback=evaluation)
    results = np.load(tmp_path / "frozen" / "evaluations.npz")["results"]
    assert len(results) >= 3 and (results == results[0]).all()  # an unchanged policy, the same evaluation


def test_a_pad_token_setting_for_tokenizers_that_pad_with_eos():
    from textgym.models import CharTokenizer

    class EosPads(CharTokenizer):
        pad_token_id = 1  # the same as EOS

        def get_vocab(self):
            return {"<pad>": 0, "<eos>": 1}

        @property
        def pad_token(self):
            return "<eos>"

        @pad_token.setter
        def pad_token(self, value):
            self.pad_token_id = self.get_vocab()[value]

    with pytest.raises(textgym.errors.ModelError, match="uses the same token"):
        textgym.TextGenEnv(model=EosPads(), prompts=["ab"])
    env = textgym.TextGenEnv(model=EosPads(), prompts=["ab"], pad_token="<pad>")
    assert env.pad_token_id == 0 and env.eos_token_id == 1
    with pytest.raises(textgym.errors.ModelError, match="is not a token of"):
        textgym.TextGenEnv(model=EosPads(), prompts=["ab"], pad_token="<nope>")
    # a tokenizer's own pad token asked for by name: it said "'<pad>' is not a token of CharTokenizer's vocabulary"
    assert textgym.TextGenEnv(model="chars", prompts=["ab"], pad_token="<pad>").pad_token_id == 0


# -- paths and the command line ----------------------------------------------------------------------
def test_paths_in_a_config_resolve_against_its_file_and_resume_works_from_anywhere(tmp_path):
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "words.txt").write_text("abc\nbad\n")
    (project / "helper.py").write_text(
        "def score(samples):\n    return [float('a' in s.completion) for s in samples]\n"
    )
    (project / "rewards.py").write_text(
        "import textgym\nfrom helper import score\n\n@textgym.reward('has_a')\ndef has_a(samples):\n    return score(samples)\n"
    )
    (project / "run.toml").write_text(
        '[run]\ntotal_timesteps = 64\nsample_prompts = 2\nplugins = ["rewards.py"]\n'
        '[env]\nid = "textgym/Copy-v0"\nnum_envs = 8\nprompts = "data/words.txt"\nrewards = [{ name = "has_a" }]\n'
        '[agent]\npolicy = "tiny-char-llama"\nn_epochs = 1\n'
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "textgym", "train"]
    first = subprocess.run([*cmd, str(project / "run.toml"), "--set", f"run.output_dir='{out}'"], cwd=elsewhere,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert first.returncode == 0, first.stderr
    saved = textgym.config.load_config(out / "config.toml")
    assert saved["env"]["prompts"] == str(project / "data" / "words.txt")
    assert saved["run"]["plugins"] == [str(project / "rewards.py")]
    again = subprocess.run([*cmd, "--resume", str(out), "--set", "run.total_timesteps=128"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=600)  # fmt: skip
    assert again.returncode == 0, again.stderr
    # the data moved: config.toml's absolute path is edited to follow it, and that edit is accepted (once
    # said); pointing a path that still exists at another file is an edit of what the run trains on
    (project / "moved").mkdir()
    (project / "data" / "words.txt").rename(project / "moved" / "words.txt")
    text = (out / "config.toml").read_text()
    (out / "config.toml").write_text(text.replace(str(project / "data"), str(project / "moved")))
    resume = [*cmd, "--resume", str(out), "--set", "run.total_timesteps=192"]
    moved = subprocess.run(resume, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert moved.returncode == 0, moved.stderr
    assert f"env.prompts: {project / 'data' / 'words.txt'} is gone; the run resumes with" in moved.stdout
    (project / "other.txt").write_text("abc\n")
    text = (out / "config.toml").read_text()
    (out / "config.toml").write_text(
        text.replace(str(project / "moved" / "words.txt"), str(project / "other.txt"))
    )
    other = subprocess.run(resume, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert other.returncode == 2 and "was edited since textgym wrote it (env.prompts:" in other.stderr


def test_reward_specs_parse_with_quotes_and_brackets():
    spec = parse_reward_spec("keyword_bonus keywords=['thank you', \"please\"] weight=0.5 note='a b'")
    assert spec == {
        "name": "keyword_bonus",
        "keywords": ["thank you", "please"],
        "weight": 0.5,
        "note": "a b",
    }
    with pytest.raises(ConfigError, match="unclosed quote or bracket"):
        parse_reward_spec("x keywords=['thank you'")


def test_a_register_function_without_hookimpl_is_named(tmp_path):
    (tmp_path / "forgot.py").write_text("def register_rewards(register):\n    register('x', object)\n")
    with pytest.raises(PluginError, match=r"defines register_rewards\(\) without @textgym.hookimpl"):
        textgym.plugin_manager.load_plugin_file(tmp_path / "forgot.py")


def test_importing_a_reward_module_that_is_also_a_plugin_file_is_not_a_duplicate(tmp_path, monkeypatch):
    (tmp_path / "twice_rewards.py").write_text(
        "import textgym\n\n@textgym.reward('twice')\ndef twice(samples):\n    return [2.0] * len(samples)\n"
    )
    textgym.plugin_manager.load_plugin_file(tmp_path / "twice_rewards.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    import twice_rewards  # noqa: F401  (a second import of the same file, under its module name)

    assert textgym.build_reward_stack(["twice"]).score([textgym.Sample("p", "c")])[0].tolist() == [2.0]


def test_importing_a_responder_module_that_is_also_a_plugin_file_is_not_a_duplicate(tmp_path, monkeypatch):
    (tmp_path / "twice_responders.py").write_text(
        "import textgym\n\n@textgym.responder('again')\n"
        "def again(conversations):\n    return [textgym.Reply('ok', done=True) for _ in conversations]\n"
    )
    textgym.plugin_manager.load_plugin_file(tmp_path / "twice_responders.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    import twice_responders  # noqa: F401  (a second import of the same file, under its module name)

    assert textgym.make_responder({"name": "again"}).name == "again"


def test_a_trl_style_reward_function_works_without_a_wrapper():
    def correct(prompts, completions, reference, **kwargs):
        return [None if r is None else float(c.strip() == r) for c, r in zip(completions, reference)]

    env = gymnasium.make(
        "textgym/TextGen-v0", model="chars", chat_template=False, prompts=[{"prompt": "ab", "reference": "c"}],
        rewards=[correct], max_new_tokens=1, max_prompt_tokens=2,
    )  # fmt: skip
    env.reset(seed=0)
    _, reward, *_, info = env.step(4)  # "c"
    assert reward == 1.0 and info["reward_components"] == {"correct": 1.0}


def test_time_limit_scoring_through_the_registry():
    env = gymnasium.make("textgym/Copy-v0", max_episode_steps=2)
    env.reset(seed=0)
    env.step(2)
    *_, truncated, info = env.step(2)
    assert truncated and "reward_components" in info  # scored on the truncating step


def test_eval_callback_gives_a_vecnormalize_eval_env_the_training_envs_statistics():
    """SB3's EvalCallback syncs them before each evaluation; textgym's evaluated with the eval env's own,
    which never update (training=False)."""
    from stable_baselines3 import PPO
    from stable_baselines3.common.vec_env import VecNormalize

    train_env = VecNormalize(make_vec_env("textgym/Copy-v0", n_envs=2, seed=0), norm_obs_keys=["input_ids"])
    eval_env = VecNormalize(make_vec_env("textgym/Copy-v0", n_envs=2, seed=1), norm_obs_keys=["input_ids"],
                            training=False)  # fmt: skip
    model = PPO("MultiInputPolicy", train_env, n_steps=16, batch_size=32, seed=0)
    model.learn(32, callback=EvalCallback(eval_env, n_eval_episodes=2, eval_freq=16, verbose=0))
    np.testing.assert_array_equal(eval_env.obs_rms["input_ids"].mean, train_env.obs_rms["input_ids"].mean)
    assert eval_env.obs_rms["input_ids"].mean.any()


def test_a_seed_in_the_agent_table_is_refused_for_run_seed(tmp_path):
    """[agent] seed won over run.seed: runs with run.seed 0 and 5 trained the same, and a bench's seeds were
    copies of one run (their intervals and paired tests built on copies)."""
    from textgym.agent_config import resolve_agent

    for agent in ({"name": "lmppo", "policy": "tiny-char-llama", "seed": 3},
                  {"name": "a2c", "a2c": {"seed": 3}}):  # fmt: skip
        with pytest.raises(
            ConfigError, match=r"\] sets seed, but a run is seeded by run.seed \(a bench sets it"
        ):
            resolve_agent(agent)
    d = {"bench": {"seeds": [0, 1], "output_dir": str(tmp_path / "b")}, "env": {"id": "textgym/Copy-v0"},
         "agent": {"name": "lmppo", "policy": "tiny-char-llama", "seed": 7},
         "designs": [{"name": "exact", "rewards": [{"name": "match"}]}]}  # fmt: skip
    from textgym.bench import load_designs

    with pytest.raises(ConfigError, match=r"\[agent\] sets seed, but a run is seeded by run.seed"):
        load_designs(d)


def test_an_sb3_hyperparameter_of_the_wrong_type_is_refused_before_training(tmp_path):
    """SB3 read batch_size = 32.0 only in its first update (a TypeError after the first rollout, and a run
    directory left that refused the corrected command), and a string for a bool counted as true."""
    from textgym.agent_config import resolve_agent

    for agent, match in [
        ({"name": "sb3-ppo", "batch_size": 32.0}, r"\[agent\] sb3-ppo: batch_size must be an integer, not 32.0"),
        ({"name": "a2c", "a2c": {"normalize_advantage": "no"}},
         r"\[agent.a2c\]: normalize_advantage must be true or false, not 'no'"),
        ({"name": "dqn", "gamma": "0.9"}, r"gamma must be a number, not '0.9'"),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            resolve_agent(agent)
    assert (
        resolve_agent({"name": "a2c", "ent_coef": 0, "policy_kwargs": {"net_arch": [8]}})[2]["ent_coef"] == 0
    )
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="batch_size must be an integer"):
        run(EXAMPLES / "copy.toml", quick("agent.sb3-ppo.batch_size=32.0", tmp=out), agent_name="sb3-ppo")
    assert not out.exists()
