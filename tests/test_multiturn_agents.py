"""Agents on multi-turn episodes: environment tokens are observations, never actions (no gradient, no KL,
no value target), and the agents learn a multi-turn task."""

import numpy as np
import pytest
import torch
from lm_helpers import CHARS, char_llama

import textgym
from textgym import TextGenVectorEnv
from textgym.agents.grpo import GRPO
from textgym.agents.ppo import LMPPO
from textgym.agents.ppo_core import agent_first_order, gae, turn_rewards_at
from textgym.agents.rollout_batch import RolloutBatch
from textgym.plugins.echo import echo_prompts


def echo_env(n=16, length=1, alphabet="ab"):
    """Say back each 1-letter word the env says, three turns; the turn rewards are the only reward."""
    return TextGenVectorEnv(
        num_envs=n, model=CHARS, prompts=echo_prompts(64, turns=3, length=length, alphabet=alphabet),
        responder={"name": "echo", "partial": True}, rewards=[], max_turns=3, max_new_tokens=3 * (length + 1) + 2 * length + 2,
        max_prompt_tokens=length, chat_template=False, autoreset_mode="Disabled",
    )  # fmt: skip


def test_agent_first_order_compacts_agent_positions_and_gae_skips_environment_tokens():
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]])
    order = agent_first_order(mask)
    assert order.tolist() == [[0, 1, 4, 2, 3, 5], [0, 1, 2, 3, 4, 5]]  # identity without environment tokens
    x = torch.arange(12.0).view(2, 6)
    torch.testing.assert_close(torch.zeros_like(x).scatter(1, order, x.gather(1, order)), x)
    # Row 0: agent tokens at 0, 1, 4 with values 1, 2, 3 and a score of 1 on the last. With gamma = lambda = 1
    # the advantage of each is 1 - its value: the value after position 1 is position 4's, not an env token's.
    values = torch.tensor([[1.0, 2.0, 9.0, 9.0, 3.0, 0.0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0, 0.0]])
    m, o = mask[:1].float(), order[:1]
    adv, ret = gae(rewards.gather(1, o), values.gather(1, o), m.gather(1, o), gamma=1.0, lam=1.0)
    adv, ret = (torch.zeros_like(x).scatter(1, o, x) for x in (adv, ret))
    torch.testing.assert_close(adv, torch.tensor([[0.0, -1.0, 0.0, 0.0, -2.0, 0.0]]))
    torch.testing.assert_close(ret, m)  # every agent token's return is the score; nothing on env tokens


def test_turn_rewards_sit_on_the_last_agent_token_of_the_turn_that_earned_them():
    # agent turns at [0, 1], [3, 4] and [6, 7]; the third was cut at the budget in row 1 (no reward for it)
    mask = torch.tensor([[1, 1, 0, 1, 1, 0, 1, 1, 0, 0], [1, 1, 0, 1, 1, 0, 1, 1, 1, 1]])
    placed = turn_rewards_at(mask, [[1.0, 0.0, 2.0], [0.5, 0.25]], [[2, 2, 2], [2, 2, 4]])
    assert placed.tolist() == [[0, 1.0, 0, 0, 0, 0, 0, 2.0, 0, 0], [0, 0.5, 0, 0, 0.25, 0, 0, 0, 0, 0]]
    # A reply of no tokens between turns 1 and 2 (an empty reply without a chat template): they touch in the
    # mask, and the runs of 1 alone put turn 2's reward on turn 3 and turn 3's past it
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 1, 1, 0, 0]])
    placed = turn_rewards_at(mask, [[10.0, 20.0, 30.0]], [[2, 2, 2]])
    assert placed.tolist() == [[0, 10.0, 0, 20.0, 0, 0, 0, 30.0, 0, 0]]
    with pytest.raises(ValueError, match=r"agent turns of \[2, 2\] tokens, but 6 agent tokens"):
        turn_rewards_at(mask, [[10.0, 20.0]], [[2, 2]])


def test_lmppo_credits_turn_rewards_to_their_turns_across_replies_of_no_tokens():
    """A responder whose first reply is empty (no chat template: it writes no token), so the agent's first two
    turns touch in the action mask. Each turn's reward still sits on the EOS that ended the turn."""

    def first_reply_empty(conversations):
        return [textgym.Reply("" if c.agent_turns == 1 else "a", reward=float(c.agent_turns), done=c.agent_turns == 3)
                for c in conversations]  # fmt: skip

    env = TextGenVectorEnv(
        num_envs=8, model=CHARS, prompts=["ab"], responder=first_reply_empty, rewards=[], max_new_tokens=24,
        chat_template=False, autoreset_mode="Disabled", allowed_tokens=[*CHARS.encode("ab"), CHARS.eos_token_id],
    )  # fmt: skip
    agent = LMPPO(char_llama(), env, seed=0, temperature=2.0, verbose=0)
    batch = agent.collect_rollouts()
    placed = agent.turn_rewards(batch)
    ended = [b for b, e in enumerate(batch.episodes) if e["turn_rewards"] == [1.0, 2.0, 3.0]]
    assert ended  # episodes that ended their three turns
    for b in ended:
        eos = (
            ((batch.response_ids[b] == CHARS.eos_token_id) & batch.action_mask[b].bool()).nonzero().squeeze(1)
        )
        assert placed[b].nonzero().squeeze(1).tolist() == eos.tolist()
        assert placed[b, eos].tolist() == [1.0, 2.0, 3.0]


def test_lmppo_credits_each_turn_reward_to_its_turn_and_keeps_the_episodes_total():
    """Two episodes with the same tokens, one rewarded on its first turn, one on its last (3 agent turns of
    2 tokens). With gamma = lambda = 1 and no KL, a token's return is the sum of the rewards from it on:
    only the first turn's tokens earn the first episode's reward; every token of the second earns its."""
    agent = LMPPO(char_llama(), echo_env(2), seed=0, verbose=0, kl_coef=0.0, gamma=1.0, gae_lambda=1.0)
    action = torch.tensor([[1, 1, 0, 1, 1, 0, 1, 1, 0, 0]] * 2)
    turns = [{"role": role, "text": "", "tokens": n} for role, n in [("assistant", 2), ("user", 1)] * 2]
    turns += [{"role": "assistant", "text": "", "tokens": 2}]
    batch = RolloutBatch(
        query_ids=torch.tensor([[2], [2]]), query_mask=torch.ones(2, 1, dtype=torch.long),
        response_ids=torch.tensor([[2, 1, 3, 3, 1, 2, 2, 1, 0, 0]] * 2),
        response_mask=torch.tensor([[1] * 8 + [0, 0]] * 2), logprobs=torch.zeros(2, 10),
        ref_logprobs=torch.zeros(2, 10), scores=torch.tensor([1.0, 1.0]), raw_scores=torch.tensor([1.0, 1.0]),
        truncated=torch.zeros(2, dtype=torch.bool), action_mask=action,
        episodes=[{"turn_rewards": [1.0, 0.0, 0.0], "turns": turns}, {"turn_rewards": [0.0, 0.0, 1.0], "turns": turns}],
    )  # fmt: skip
    returns = agent.process(batch).returns
    agent_tokens = action.bool()
    assert returns[0][agent_tokens[0]].tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert returns[1][agent_tokens[1]].tolist() == [1.0] * 6  # the episode's total, as before
    # score_scale 2 and a stack total of 0.5 on top of the turn rewards: the returns from the first token
    # are the shaped scores, whatever the placement
    agent.config.score_scale = 2.0
    batch.scores = (batch.raw_scores + 0.5) * 2.0
    torch.testing.assert_close(agent.process(batch).returns[:, 0], batch.scores)
    assert agent.process(batch).returns[0][agent_tokens[0]].tolist() == [3.0, 3.0, 1.0, 1.0, 1.0, 1.0]


def grads_of(agent, batch):
    """Run one update on ``batch`` and return the gradients that reached the logits and last hidden states
    of every forward in it."""
    grads = []
    forward = agent.forward

    def recording(model, mb, hidden=False):
        logits, last_hidden = forward(model, mb, hidden=hidden)
        if logits.requires_grad:
            logits.retain_grad()
            if last_hidden is not None:
                last_hidden.retain_grad()
            grads.append((logits, last_hidden, mb))
        return logits, last_hidden

    agent.forward = recording
    agent.train(batch)
    agent.forward = forward
    return grads


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (LMPPO, dict(n_epochs=1, kl_coef=0.1, vf_coef=0.5)),
        (GRPO, dict(num_generations=4, beta=0.1, loss_type="dapo")),
    ],
    ids=["lmppo", "grpo"],
)
def test_environment_tokens_get_zero_gradient_in_the_loss(cls, kwargs):
    agent = cls(char_llama(), echo_env(), seed=0, temperature=0.7, learning_rate=1e-3, verbose=0, **kwargs)
    batch = agent.collect_rollouts()
    env_tokens = batch.response_mask.bool() & ~batch.action_mask.bool()
    assert env_tokens.sum() > 10
    with torch.no_grad():  # the PPO ratio is 1 before the update, on the agent tokens
        logits, _ = agent.forward(agent.policy, batch)
    new = torch.log_softmax(logits / 0.7, -1).gather(-1, batch.response_ids[..., None]).squeeze(-1)
    ratio = (new - batch.logprobs).exp()[batch.action_mask.bool()]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    assert (batch.ref_logprobs[env_tokens] == 0).all()  # no KL on environment tokens
    if cls is LMPPO:
        assert (batch.advantages[env_tokens] == 0).all() and (batch.returns[env_tokens] == 0).all()
        with torch.no_grad():  # the value head starts at zero, which would pass no gradient to its input
            agent.value_head.linear.weight.normal_(std=0.1)
    grads = grads_of(agent, batch)
    assert grads
    for logits, hidden, mb in grads:
        env = (mb.response_mask.bool() & ~mb.action_mask.bool()).to(logits.device)
        agent_tokens = mb.action_mask.bool()
        assert (logits.grad[env] == 0).all()  # the logits that "predicted" an environment token
        assert logits.grad[agent_tokens].abs().sum() > 0
        if hidden is not None:  # the value head's input: no value target on environment tokens
            assert (hidden.grad[env] == 0).all() and hidden.grad[agent_tokens].abs().sum() > 0


def test_timesteps_count_agent_tokens_only():
    agent = LMPPO(char_llama(), echo_env(8), seed=0, verbose=0)
    agent.learn(1)
    batch_tokens = sum(e["num_tokens"] for e in agent.last_episodes)
    assert agent.num_timesteps == batch_tokens == agent.history[-1]["timesteps"]
    assert agent.history[-1]["completions/mean_length"] == pytest.approx(batch_tokens / 8)


def learning_curve(agent, iterations):
    for _ in range(iterations):
        agent.learn(1, reset_num_timesteps=False)
    return [h["reward"] for h in agent.history]


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (LMPPO, dict(kl_coef=0.0)),
        (GRPO, dict(num_generations=4, beta=0.0, num_iterations=2)),
    ],
    ids=["lmppo", "grpo"],
)
def test_agents_learn_a_multi_turn_task_well_beyond_a_random_policy(cls, kwargs):
    """Echo: the reward is earned turn by turn (up to 3 per episode); the untrained policy earns ~0.1."""
    agent = cls(char_llama(), echo_env(32), seed=0, learning_rate=3e-3, verbose=0, **kwargs)
    rewards = learning_curve(agent, 14)
    start, end = np.mean(rewards[:2]), np.mean(rewards[-3:])
    print(f"{cls.__name__}: mean episode reward {start:.3f} -> {end:.3f}")
    assert end > 3 * start and end > 0.35, rewards


def test_stock_sb3_ppo_runs_on_a_small_vocabulary_multi_turn_env():
    from stable_baselines3 import PPO

    from textgym.sb3 import make_vec_env

    env = make_vec_env("textgym/Echo-v0", n_envs=8, seed=0)
    model = PPO("MultiInputPolicy", env, seed=0, n_steps=32, batch_size=64, n_epochs=2, learning_rate=1e-3)
    model.learn(512)
    assert model.num_timesteps >= 512
    obs, finals = env.reset(), []
    for _ in range(64):
        obs, _, done, infos = env.step(model.predict(obs)[0])
        finals += [infos[i] for i in np.flatnonzero(done)]
    assert finals and all(info["turns"][0]["role"] == "assistant" for info in finals)
    # Monitor's episode return adds up the turn rewards: here every turn's similarity
    assert all(info["episode"]["r"] == pytest.approx(sum(info["turn_rewards"])) for info in finals)
    assert {info["finish_reason"] for info in finals} <= {"stop", "length", "max_turns", "overflow"}


ONE_PER_TURN = """
import textgym


@textgym.responder("one_per_turn", role="user")
def one_per_turn(conversations):
    return [textgym.Reply("a", reward=1.0, done=c.agent_turns >= 3) for c in conversations]
"""


def test_an_sb3_run_records_each_episodes_return_not_its_last_steps_reward(tmp_path, monkeypatch):
    """`textgym train` with an SB3 agent on a multi-turn env: metrics.csv and samples.jsonl hold each
    episode's return (a responder that pays 1 per turn for three turns: 3), not its last turn's reward (1)."""
    import json
    import tempfile

    from lm_helpers import csv_rows

    from textgym.cli import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # SB3's default logger makes a folder there
    (tmp_path / "one_per_turn.py").write_text(ONE_PER_TURN)
    every_token_ends_a_turn = list("abcdefghijklmnopqrstuvwxyz .,!?")
    (tmp_path / "echo.toml").write_text(f"""
[run]
total_timesteps = 512
sample_prompts = 2
output_dir = "{tmp_path / "run"}"
plugins = ["one_per_turn.py"]
[env]
id = "textgym/Echo-v0"
num_envs = 8
responder = "one_per_turn"
stop = {json.dumps(every_token_ends_a_turn)}
max_turns = 3
max_new_tokens = 10
[agent]
name = "sb3-ppo"
[agent.sb3-ppo]
n_steps = 32
batch_size = 64
n_epochs = 1
verbose = 0
""")
    assert main(["train", str(tmp_path / "echo.toml")]) == 0
    metrics = csv_rows(tmp_path / "run" / "metrics.csv")
    assert len(metrics) == 2 and all(float(row["reward"]) == 3.0 for row in metrics), metrics
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert samples and {row["reward"] for row in samples} == {3.0}


CLOSING = """
import textgym


class Closing:
    name, role = "closing", "user"

    def __init__(self, log):
        self.log = log
        with open(log, "a") as f:
            f.write("made\\n")

    def __call__(self, conversations):
        return [textgym.Reply("a", reward=1.0, done=c.agent_turns >= 2) for c in conversations]

    def close(self):
        with open(self.log, "a") as f:
            f.write("closed\\n")


@textgym.hookimpl
def register_responders(register):
    register("closing", Closing)
"""


def test_textgym_train_closes_every_env_it_makes(tmp_path, monkeypatch):
    """A responder's close() (a sandbox, a server: documented as called when the env closes) was never called
    by `textgym train`: neither its training env nor its sample-table and evaluation envs were closed."""
    import json
    import tempfile

    from textgym.cli import main

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # SB3's default logger makes a folder there
    (tmp_path / "closing.py").write_text(CLOSING)
    for agent in ("lmppo", "sb3-ppo"):
        log = tmp_path / f"{agent}.log"
        settings = ('policy = "tiny-char-llama"\n' if agent == "lmppo" else
                    '[agent.sb3-ppo]\nn_steps = 16\nbatch_size = 32\nn_epochs = 1\n')  # fmt: skip
        (tmp_path / f"{agent}.toml").write_text(f"""
[run]
total_timesteps = 64
sample_prompts = 2
output_dir = "{tmp_path / agent}"
plugins = ["closing.py"]
[env]
id = "textgym/Echo-v0"
num_envs = 4
responder = {{ name = "closing", log = {json.dumps(str(log))} }}
stop = ["a", "b", "c", " "]
max_new_tokens = 10
[eval]
episodes = 4
[agent]
name = "{agent}"
{settings}""")
        assert main(["train", str(tmp_path / f"{agent}.toml")]) == 0
        lines = log.read_text().split()
        # the training env, the two sample tables' (before and after training) and the evaluations'
        assert lines.count("made") >= 4 and lines.count("closed") == lines.count("made"), (agent, lines)


def test_textgym_sample_closes_its_env_when_it_refuses_the_model(tmp_path, capsys):
    from textgym.cli import main

    (tmp_path / "closing.py").write_text(CLOSING)
    log = tmp_path / "sample.log"
    code = main(["sample", "--plugin", str(tmp_path / "closing.py"), "--model", "chars", "--prompts", "echo",
                 "--no-chat-template", "--responder", f"closing log={log}", "--num", "2"])  # fmt: skip
    assert code != 0 and "is a tokenizer without weights" in capsys.readouterr().err
    assert log.read_text().split() == ["made", "closed"]
