"""Held-out evaluation (textgym.evaluation) and the diagnostics `textgym train` records with an [eval] section."""

import json
import math

import gymnasium
import numpy as np
import pytest
from lm_helpers import csv_rows

from textgym.config import load_config
from textgym.errors import ConfigError, UnknownNameError
from textgym.eval_settings import check_eval_section
from textgym.evaluation import Evaluator, jsonable
from textgym.train import run

COPY = """
[run]
total_timesteps = 280
checkpoint_every = 100
sample_prompts = 2

[env]
id = "textgym/Copy-v0"
num_envs = 16
prompts = "copy-train"
rewards = [{ name = "match", partial = true }, { name = "length_penalty", weight = 0.5, target = 3 }]

[agent]
policy = "tiny-char-llama"
learning_rate = 1e-3
n_epochs = 2
"""
EVAL = """
[eval]
every = 2
prompts = "copy-heldout"
episodes = 12
rewards = [{ name = "match", label = "exact_copy", range = [0, 1] }]
"""


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def config_file(tmp_path, text, name="c.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_train_evaluates_held_out_prompts_and_does_not_change_training(tmp_path, capsys):
    plain = run(config_file(tmp_path, COPY), [f"run.output_dir='{tmp_path / 'plain'}'"])
    capsys.readouterr()
    diag = run(config_file(tmp_path, COPY + EVAL, "e.toml"), [f"run.output_dir='{tmp_path / 'diag'}'"])
    evals = csv_rows(diag / "eval.csv")
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("eval ")]
    assert len(printed) == len(evals)  # each evaluation is said on the console too
    assert printed[0].startswith("eval    0  held out: reward ") and " exact_copy " in printed[0]
    iterations = [int(r["iteration"]) for r in evals]
    last = int(csv_rows(diag / "metrics.csv")[-1]["iteration"])
    assert iterations == [*range(0, last, 2), last] or iterations == list(range(0, last + 1, 2))
    assert list(evals[0]) == ["iteration", "timesteps", "reward", "exact_copy", "kl", "length", "distinct_2",
                              "eos_rate", "reward_se", "exact_copy_se", "reward_n", "exact_copy_n"]  # fmt: skip
    assert {r["reward_n"] for r in evals} == {"12"}  # the episodes each mean is over (the flags' noise)
    for r in evals:
        assert (
            0 <= float(r["exact_copy"]) <= 1
            and 0 <= float(r["eos_rate"]) <= 1
            and 1 <= float(r["length"]) <= 4
        )
    assert (
        abs(float(evals[0]["kl"])) < 1e-4 and float(evals[-1]["kl"]) > 0
    )  # the policy moved off its reference
    assert (diag / "eval.png").stat().st_size > 10_000
    # evaluations have their own prompts, env and random streams: training is the same, number for number
    for a, b in zip(csv_rows(plain / "metrics.csv"), csv_rows(diag / "metrics.csv"), strict=True):
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == {
            k: v for k, v in b.items() if not k.startswith("time/")
        }

    # a resumed run drops evaluation rows past its checkpoint, then goes on
    with (diag / "eval.csv").open("a") as f:
        f.write("99,99999," + ",".join(["0.5"] * 8) + "\n")
    run(resume=diag, overrides=["run.total_timesteps=400"])
    resumed = [int(r["iteration"]) for r in csv_rows(diag / "eval.csv")]
    assert 99 not in resumed and resumed == sorted(set(resumed)) and resumed[-1] > last

    # killed during its final evaluation, after its last checkpoint: the resume, which has no token left to
    # train, still evaluates it
    rows = (diag / "eval.csv").read_text().splitlines(keepends=True)
    (diag / "eval.csv").write_text("".join(rows[:-1]))
    run(resume=diag)
    assert (diag / "eval.csv").read_text().splitlines(keepends=True) == rows


def test_an_sb3_agent_gets_the_same_diagnostics(tmp_path):
    config = """
[run]
total_timesteps = 256
sample_prompts = 2
[env]
id = "textgym/Copy-v0"
num_envs = 8
[agent]
name = "sb3-ppo"
n_steps = 16
batch_size = 64
n_epochs = 1
"""
    out = run(config_file(tmp_path, config + EVAL), [f"run.output_dir='{tmp_path / 'sb3'}'"])
    evals = csv_rows(out / "eval.csv")
    assert [int(r["iteration"]) for r in evals] == [0, 2]  # 256 tokens = 2 rollouts of 8 x 16 steps
    assert evals[0]["kl"] == "" and float(evals[1]["length"]) > 0  # no reference model: no KL


@pytest.mark.parametrize(
    ("section", "match"),
    [
        ("every = 0", "eval.every must be a positive integer"),
        ("every = true", "eval.every must be a positive integer"),
        ("episodes = 0", "eval.episodes must be a positive integer"),
        ("evry = 2", "unknown key eval.evry. Did you mean 'every'?"),
        ("seed = -1", r"eval.seed must be an integer in \[0, 2\*\*32\)"),
        ("seed = 4294967296", r"eval.seed must be an integer in \[0, 2\*\*32\), not 4294967296"),
        ('rewards = [{ name = "match", label = "kl" }]', "label 'kl' clashes with a built-in metric"),
        ('rewards = [{ name = "match" }, { name = "match" }]', "metric name 'match' repeats"),
        ('rewards = [{ name = "match", args = 3 }]', "metric 'match': args = 3 must be a table"),
        ("rewards = [{ partial = true }]", "is not a reward spec"),
        (
            'rewards = { components = ["match"] }',
            r"a stack table .* metrics are measured one by one.*\['match'\]",
        ),
        ('builtin = ["perplexity"]', "eval.builtin: unknown metric 'perplexity'"),
        ("prompts = 3", "eval.prompts must be a prompt source"),
    ],
)
def test_bad_eval_sections_are_refused_when_the_config_loads(tmp_path, section, match):
    path = config_file(tmp_path, COPY + "\n[eval]\n" + section + "\n")
    with pytest.raises((ConfigError, UnknownNameError), match=match):
        load_config(path)


def test_a_metric_passes_its_args_to_the_reward_under_names_the_metric_spec_uses():
    """rm_score's own `label` (the class to read) could not reach it: `label` names the metric."""
    from textgym.eval_settings import metric_reward_args, metric_specs

    [spec] = metric_specs(
        [{"name": "rm_score", "model": "rm", "label": "gold", "args": {"label": 1}}], "[eval]"
    )
    assert spec["label"] == "gold" and metric_reward_args(spec) == {
        "name": "rm_score",
        "model": "rm",
        "label": 1,
    }


def test_an_unknown_metric_reward_fails_before_the_agent_loads(tmp_path, monkeypatch):
    import textgym.agents.ppo

    def no_agent(*args, **kwargs):
        raise AssertionError("the agent was built before the [eval] rewards were checked")

    monkeypatch.setattr(textgym.agents.ppo.LMPPO, "__init__", no_agent)
    path = config_file(tmp_path, COPY + '\n[eval]\nrewards = [{ name = "mtach" }]\n')
    with pytest.raises(UnknownNameError, match="unknown reward 'mtach'. Did you mean 'match'"):
        run(path, [f"run.output_dir='{tmp_path / 'x'}'"])


@pytest.mark.parametrize(
    ("prompts", "match"),
    [("copy-heldot", r"\[eval\] prompts: unknown prompt source 'copy-heldot'. Did you mean 'copy-heldout'"),
     ("held.jsonl", r"\[eval\] prompts: prompt file .*held.jsonl.* does not exist")],
)  # fmt: skip
def test_an_unknown_eval_prompt_source_fails_before_the_agent_loads(tmp_path, monkeypatch, prompts, match):
    """A typo, or a missing file, failed at the first evaluation: after the policy loaded and sampled."""
    import textgym.agents.ppo

    def no_agent(*args, **kwargs):
        raise AssertionError("the agent was built before [eval] prompts were checked")

    monkeypatch.setattr(textgym.agents.ppo.LMPPO, "__init__", no_agent)
    path = config_file(tmp_path, COPY + f'\n[eval]\nprompts = "{prompts}"\n')
    with pytest.raises(ConfigError, match=match):
        run(path, [f"run.output_dir='{tmp_path / 'x'}'"])
    assert not (tmp_path / "x").exists()


def test_an_evaluation_is_reproducible_and_reads_every_component(tmp_path):
    from textgym.agents.ppo import LMPPO

    config = load_config(config_file(tmp_path, COPY + EVAL))
    import gymnasium

    env = gymnasium.make_vec("textgym/Copy-v0", num_envs=4, vectorization_mode="vector_entry_point",
                             autoreset_mode="Disabled", model="tiny-char-llama", prompts="copy-train")  # fmt: skip
    agent = LMPPO("tiny-char-llama", env, seed=0, verbose=0)
    evaluator = Evaluator(config, config["eval"], config["env"]["rewards"], lm_agent=True)
    first, second = evaluator(agent), evaluator(agent)
    assert first.metrics == second.metrics and len(first.episodes) == 12
    assert [e["prompt"] for e in first.episodes[:3]] == ["aah", "abg", "acf"]  # copy-heldout, in order
    assert set(first.episodes[0]["components"]) == {"match", "length_penalty", "exact_copy"}
    # the reward is the training total: match + 0.5 * length_penalty, per episode
    e = first.episodes[0]
    assert e["reward"] == pytest.approx(e["components"]["match"] + 0.5 * e["components"]["length_penalty"])
    shares = [c["share"] for c in first.components.values()]
    assert sum(shares) == pytest.approx(1.0) and first.components["length_penalty"]["weight"] == 0.5
    # the standard error of each mean: the sample std (n - 1) over sqrt(n), per metric over its episodes
    for name, values in [("exact_copy", [e["components"]["exact_copy"] for e in first.episodes]),
                         ("reward", [e["reward"] for e in first.episodes])]:  # fmt: skip
        assert first.errors[name] == pytest.approx(np.std(values, ddof=1) / math.sqrt(len(values)))


def test_an_lm_agents_evaluation_draws_the_same_random_numbers_every_time_and_leaves_trainings(
    tmp_path, register
):
    """A metric (or responder) that draws from numpy's, torch's or Python's global stream (an LLM judge
    sampling without a generator): the LM path seeded only its own sampling, so the same checkpoint scored
    differently every time, and eval.json disagreed with the curve's last point."""
    import random

    import torch
    from conftest import reward_plugin

    from textgym.agents.ppo import LMPPO

    def noisy(samples):
        return [float(np.random.rand() + torch.rand(()).item() + random.random()) for _ in samples]

    register(reward_plugin("noisy", noisy), "noisy")
    config = load_config(config_file(tmp_path, COPY + EVAL))
    spec = {**config["eval"], "rewards": [{"name": "noisy", "label": "noisy"}]}
    env = gymnasium.make_vec("textgym/Copy-v0", num_envs=4, vectorization_mode="vector_entry_point",
                             autoreset_mode="Disabled", model="tiny-char-llama", prompts="copy-train")  # fmt: skip
    agent = LMPPO("tiny-char-llama", env, seed=0, verbose=0)
    evaluator = Evaluator(config, spec, config["env"]["rewards"], lm_agent=True)
    np.random.seed(5), torch.manual_seed(5), random.seed(5)
    first = evaluator(agent)
    after = np.random.rand(), torch.rand(()).item(), random.random()  # training's streams go on untouched
    np.random.seed(5), torch.manual_seed(5), random.seed(5)
    assert (np.random.rand(), torch.rand(()).item(), random.random()) == after
    np.random.seed(6), torch.manual_seed(6), random.seed(6)
    assert evaluator(agent).metrics == first.metrics


def test_a_dqn_is_evaluated_without_exploration_and_keeps_its_exploration_rate():
    """Two evaluations differ only by the policy: a DQN's epsilon (1.0 early in training, 0.05 at its end)
    made held-out numbers track the exploration schedule."""
    from stable_baselines3 import DQN

    from textgym.eval_settings import EVAL_DEFAULTS
    from textgym.sb3 import make_vec_env

    model = DQN("MultiInputPolicy", make_vec_env("textgym/Copy-v0", n_envs=2, seed=0), seed=0)
    config = {"env": {"id": "textgym/Copy-v0", "num_envs": 4}, "agent": {"policy": "MultiInputPolicy"}}
    spec = {**EVAL_DEFAULTS, "episodes": 8, "prompts": "copy-heldout", "rewards": [],
            "builtin": ["length", "distinct_2", "eos_rate"]}  # fmt: skip
    evaluator = Evaluator(config, spec, [{"name": "match", "partial": True}], lm_agent=False)
    results = {}
    for rate in (0.0, 1.0):
        model.exploration_rate = rate
        results[rate] = evaluator(model)
        assert model.exploration_rate == rate
    assert results[1.0].metrics == results[0.0].metrics
    assert [e["completion"] for e in results[1.0].episodes] == [
        e["completion"] for e in results[0.0].episodes
    ]


def test_a_metric_named_as_a_training_component_does_not_hide_it_in_the_episodes(tmp_path):
    from textgym.agents.ppo import LMPPO

    metric = '{ name = "length_penalty", target = 1 }]'  # training: length_penalty target 3, weight 0.5
    config = load_config(
        config_file(tmp_path, COPY + EVAL.replace("range = [0, 1] }]", f"range = [0, 1] }}, {metric}"))
    )
    env = gymnasium.make_vec("textgym/Copy-v0", num_envs=4, vectorization_mode="vector_entry_point",
                             autoreset_mode="Disabled", model="tiny-char-llama", prompts="copy-train")  # fmt: skip
    result = Evaluator(config, config["eval"], config["env"]["rewards"], lm_agent=True)(
        LMPPO("tiny-char-llama", env, seed=0, verbose=0)
    )
    assert set(result.episodes[0]["components"]) == {
        "match",
        "length_penalty",
        "exact_copy",
        "length_penalty (metric)",
    }
    for e in result.episodes:
        c = e["components"]
        assert e["reward"] == pytest.approx(c["match"] + 0.5 * c["length_penalty"])
    assert any(
        e["components"]["length_penalty"] != e["components"]["length_penalty (metric)"]
        for e in result.episodes
    )


def test_a_normalize_then_sum_total_is_not_measured_on_held_out_prompts(tmp_path):
    """Standardised over the evaluated episodes themselves, its mean is 0 whatever the policy: not a number
    to compare or to watch rise (the bench's gaming check needs it, and says it did not run)."""
    from textgym.agents.ppo import LMPPO

    components = COPY.split("rewards = ")[1].split("\n")[0]
    text = COPY.replace(components, f'{{ aggregate = "normalize_then_sum", components = {components} }}')
    config = load_config(config_file(tmp_path, text + EVAL))
    env = gymnasium.make_vec("textgym/Copy-v0", num_envs=4, vectorization_mode="vector_entry_point",
                             autoreset_mode="Disabled", model="tiny-char-llama", prompts="copy-train")  # fmt: skip
    evaluator = Evaluator(config, config["eval"], config["env"]["rewards"], lm_agent=True)
    result = evaluator(LMPPO("tiny-char-llama", env, seed=0, verbose=0))
    assert math.isnan(result.metrics["reward"]) and math.isnan(result.errors["reward"])
    assert 0 <= result.metrics["exact_copy"] <= 1 and result.metrics["length"] > 0


def test_a_normalize_then_sum_sample_table_is_standardised_over_the_whole_table(tmp_path):
    """Training standardises each component over the whole batch; the sample tables were scored per step,
    over the episodes that ended on the same step (an episode that ended alone scored 0)."""
    from textgym.composition import standardize

    components = COPY.split("rewards = ")[1].split("\n")[0]
    text = COPY.replace(components, f'{{ aggregate = "normalize_then_sum", components = {components} }}')
    text = text.replace("sample_prompts = 2", "sample_prompts = 16").replace("= 280", "= 60")
    stops = 'stop = ["a", "e", "i", "o", "u"]\nmax_new_tokens = 8'  # replies that end on several steps
    text = text.replace('prompts = "copy-train"', f'prompts = "copy-train"\n{stops}')
    out = run(config_file(tmp_path, text), [f"run.output_dir='{tmp_path / 'run'}'"])
    for name in ("samples_before.jsonl", "samples_after.jsonl"):
        rows = [json.loads(line) for line in (out / name).read_text().splitlines()]
        assert len({r["num_tokens"] for r in rows}) > 2  # the episodes ended on several steps
        column = {c: np.array([r["reward_components"][c] for r in rows]) for c in ("match", "length_penalty")}
        expected = standardize(column["match"]) + 0.5 * standardize(column["length_penalty"])
        np.testing.assert_allclose([r["reward"] for r in rows], expected, atol=1e-9)


def test_evaluate_policy_of_an_lm_agent_standardises_normalize_then_sum_over_its_episodes():
    """evaluate_policy rolls an LM agent out as the sample tables do: its episode rewards were the env's
    per-step totals (0 for an episode that ended alone)."""
    from textgym.agents.ppo import LMPPO
    from textgym.composition import standardize
    from textgym.evaluate import evaluate_policy

    stack = {"aggregate": "normalize_then_sum", "components": [{"name": "match", "partial": True},
             {"name": "length_penalty", "weight": 0.5, "target": 3}]}  # fmt: skip
    env = gymnasium.make_vec("textgym/Copy-v0", num_envs=16, vectorization_mode="vector_entry_point",
                             autoreset_mode="Disabled", model="tiny-char-llama", rewards=stack,
                             stop=["a", "e", "i", "o", "u"], max_new_tokens=8)  # fmt: skip
    agent = LMPPO("tiny-char-llama", env, seed=0, verbose=0)
    rewards, lengths = evaluate_policy(
        agent, env, n_eval_episodes=16, deterministic=False, return_episode_rewards=True, seed=3
    )
    assert len(set(lengths)) > 2  # the episodes ended on several steps
    r = agent.rollout(env, temperature=agent.config.temperature, seed=3)
    column = {c: np.array([e["reward_components"][c] for e in r.infos]) for c in ("match", "length_penalty")}
    expected = standardize(column["match"]) + 0.5 * standardize(column["length_penalty"])
    np.testing.assert_allclose([e["reward"] for e in r.infos], expected, atol=1e-9)
    np.testing.assert_allclose(rewards, expected, atol=1e-9)


def test_every_held_out_total_uses_the_weights_that_end_training(tmp_path):
    """A run whose match weight falls from 1 to 0: every evaluation weighs match 0, the one before training
    too, so two evaluations differ only by the policy. The curve weighed it by the training progress (1 at
    the start), and a proxy that fell by the schedule alone hid a proxy that rose (the bench's gaming check
    reads this curve); the final evaluation weighed it by the rollout before the last (1/12 here)."""
    scheduled = '{ name = "match", partial = true, weight = { start = 1.0, end = 0.0 } }'
    text = COPY.replace('{ name = "match", partial = true }', scheduled)
    gold = '{ name = "match", partial = true, label = "partial" }, { name = "length_penalty", target = 3 }'
    text += EVAL.replace("range = [0, 1] }", f"range = [0, 1] }}, {gold}")
    out = run(config_file(tmp_path, text), [f"run.output_dir='{tmp_path / 'run'}'"])
    rows = csv_rows(out / "eval.csv")
    assert len(rows) >= 3 and rows[0]["iteration"] == "0"
    for row in rows:
        assert float(row["partial"]) > 0  # the weight, not the score, makes match count for nothing
        assert float(row["reward"]) == pytest.approx(0.5 * float(row["length_penalty"]), abs=1e-9)


def test_distinct_2_of_an_sb3_policy_reads_the_tokens_it_chose_as_for_an_lm_agent(monkeypatch):
    """Both paths give distinct-2 the policy's own tokens, EOS included; the SB3 path re-encoded the
    completion text (no EOS, a stop string cut off, a multi-turn episode's last turn only)."""
    import textgym.scoring
    from textgym.eval_settings import EVAL_DEFAULTS

    read = []
    distinct = textgym.scoring.corpus_distinct_n
    monkeypatch.setattr(textgym.scoring, "corpus_distinct_n", lambda t, n: read.extend(t) or distinct(t, n))
    tokenizer = gymnasium.make("textgym/Copy-v0", model="tiny-char-llama").unwrapped.tokenizer
    word = [*tokenizer.encode("ab"), tokenizer.eos_token_id]

    class Spells:  # an SB3-style policy: "ab", then EOS
        step = 0

        def predict(self, obs, deterministic=False):
            self.step += 1
            return np.array([word[(self.step - 1) % len(word)]]), None

    config = {"env": {"id": "textgym/Copy-v0", "num_envs": 4}, "agent": {"policy": "tiny-char-llama"}}
    spec = {**EVAL_DEFAULTS, "episodes": 4, "rewards": [], "builtin": ["distinct_2", "length"]}
    result = Evaluator(config, spec, [{"name": "match"}], lm_agent=False)(Spells())
    assert read == [word] * 4 and result.metrics["length"] == 3
    assert result.metrics["distinct_2"] == pytest.approx(2 / 8)  # (a, b) and (b, EOS), 4 times each


def paid(conversations):  # every agent turn earns 1: an episode's return is its number of turns
    from textgym import Reply

    return [Reply("a", reward=1.0) for _ in conversations]


gymnasium.register(
    "tests/PaidTurns-v0", entry_point="textgym.envs:TextGenEnv", vector_entry_point="textgym.envs:TextGenVectorEnv",
    kwargs=dict(model="chars", prompts="echo", responder=paid, max_turns=3, max_new_tokens=60, max_prompt_tokens=1,
                chat_template=False, rewards=[]),
)  # fmt: skip


def test_a_multi_turn_evaluation_counts_the_turn_rewards_and_only_the_policys_tokens(monkeypatch):
    """The turn rewards are the whole reward here (the stack is empty, as Echo-v0's is): the held-out reward
    is the episodes' returns, as in training; distinct-2 reads the policy's tokens, not the replies."""
    import textgym.scoring
    from textgym.agents.ppo import LMPPO
    from textgym.eval_settings import EVAL_DEFAULTS

    read = []
    distinct = textgym.scoring.corpus_distinct_n
    monkeypatch.setattr(textgym.scoring, "corpus_distinct_n", lambda t, n: read.extend(t) or distinct(t, n))
    config = {"env": {"id": "tests/PaidTurns-v0", "num_envs": 8}, "agent": {"policy": "tiny-char-llama"}}
    env = gymnasium.make_vec("tests/PaidTurns-v0", num_envs=8, vectorization_mode="vector_entry_point",
                             autoreset_mode="Disabled")  # fmt: skip
    spec = {**EVAL_DEFAULTS, "episodes": 8, "rewards": [], "builtin": ["length", "distinct_2", "eos_rate"]}
    result = Evaluator(config, spec, env.reward_stack, lm_agent=True)(
        LMPPO("tiny-char-llama", env, verbose=0)
    )
    rewards = [e["reward"] for e in result.episodes]
    assert set(rewards) <= {0.0, 1.0, 2.0, 3.0} and max(rewards) >= 2  # the turns each episode completed
    assert result.metrics["reward"] == pytest.approx(sum(rewards) / 8)
    assert sum(map(len, read)) == sum(e["num_tokens"] for e in result.episodes)
    assert len(read) == sum(
        min(3, int(r) + (e["finish_reason"] == "length")) for r, e in zip(rewards, result.episodes)
    )
    # an episode stopped by its turn limit ended its last turn on EOS: eos_rate counted only "stop"
    reasons = [e["finish_reason"] for e in result.episodes]
    assert "max_turns" in reasons
    assert result.metrics["eos_rate"] == pytest.approx(sum(r != "length" for r in reasons) / 8)


def test_distinct_2_of_replies_without_bigrams_is_not_measured_not_perfect():
    from textgym.scoring import corpus_distinct_n

    assert math.isnan(corpus_distinct_n([[1]] * 8, 2))  # a policy that collapsed to bare EOS: it was 1.0
    assert math.isnan(corpus_distinct_n([[], []], 2))
    assert corpus_distinct_n([[2, 3, 4], [2, 3, 4], [2, 3, 5]], 2) == pytest.approx(3 / 6)


def test_check_eval_section_fills_defaults_and_jsonable_is_strict():
    resolved = check_eval_section({"rewards": ["match partial=true"]}, "c")
    assert (
        resolved["every"] == 10 and resolved["episodes"] == 32 and resolved["rewards"][0]["label"] == "match"
    )
    value = {"n": np.int64(3), "x": np.float32(0.5), "bad": math.nan, "a": np.array([1, 2])}
    assert jsonable(value) == {"n": 3, "x": 0.5, "bad": None, "a": [1, 2]}
    # a value that blew up is not one that was not measured; float() reads it back
    assert jsonable({"kl": np.float64(math.inf), "low": -math.inf}) == {"kl": "inf", "low": "-inf"}
    assert float(jsonable(math.inf)) == math.inf


def test_a_dqn_runs_evaluations_are_labelled_by_iteration_and_leave_its_training_as_it_was(tmp_path):
    """An off-policy algorithm's n_steps is its n-step return (1): iterations were counted as env steps (the
    evaluation of iteration 5 was labelled 20), and its epsilon-greedy draws from numpy's global stream,
    which an evaluation moved: the same run with [eval] trained differently."""
    config = """
[run]
total_timesteps = 320
sample_prompts = 2
[env]
id = "textgym/Copy-v0"
num_envs = 16
[agent]
name = "dqn"
learning_starts = 0
"""
    eval_every_2 = EVAL.replace("episodes = 12", "episodes = 4")
    plain = run(config_file(tmp_path, config), [f"run.output_dir='{tmp_path / 'plain'}'"])
    diag = run(
        config_file(tmp_path, config + eval_every_2, "e.toml"), [f"run.output_dir='{tmp_path / 'diag'}'"]
    )
    metrics = csv_rows(diag / "metrics.csv")
    # train_freq = 4 steps of 16 sub-envs: 64 tokens a rollout, 5 iterations
    assert [int(r["iteration"]) for r in metrics] == [1, 2, 3, 4, 5]
    assert [int(r["iteration"]) for r in csv_rows(diag / "eval.csv")] == [0, 2, 4, 5]
    for a, b in zip(csv_rows(plain / "metrics.csv"), metrics, strict=True):
        assert {k: v for k, v in a.items() if not k.startswith("time/")} == {
            k: v for k, v in b.items() if not k.startswith("time/")
        }


def test_eval_png_says_where_a_metric_has_no_value_and_plots_a_metric_that_joins_later():
    """A normalize_then_sum run's held-out total is n/a in every row: its panel was empty, an axis from -0.04
    to 0.04; a metric missing from the first row was left out."""
    from textgym.diagnostics import eval_figure

    rows = [
        {"iteration": 0, "timesteps": 0, "reward": math.nan, "kl": 0.0},
        {"iteration": 2, "timesteps": 64, "reward": math.nan, "kl": 0.5, "exact": 0.25},
    ]
    axes = {ax.get_title(): ax for ax in eval_figure(rows).axes if ax.get_visible()}
    assert set(axes) == {"reward (training total, held-out)", "kl", "exact"}
    assert [t.get_text() for t in axes["reward (training total, held-out)"].texts] == [
        "no value in any evaluation"
    ]
    assert not axes["kl"].texts


def test_a_total_that_no_reward_applied_to_is_not_measured_as_0(tmp_path, register):
    """A design whose reward applied to no held-out completion showed reward 0.000 [0.000, 0.000] over all
    its episodes, as if measured: training paid those episodes 0 because no reward scored them."""
    from conftest import reward_plugin

    from textgym.agents.ppo import LMPPO

    register(reward_plugin("never", lambda samples: [None] * len(samples)), "never")
    register(
        reward_plugin("on_a", lambda ss: [1.0 if s.prompt.startswith("a") else None for s in ss]), "on-a"
    )
    env = gymnasium.make_vec("textgym/Copy-v0", num_envs=4, vectorization_mode="vector_entry_point",
                             autoreset_mode="Disabled", model="tiny-char-llama", prompts="copy-train")  # fmt: skip
    agent = LMPPO("tiny-char-llama", env, seed=0, verbose=0)
    results = {}
    # a gate on a weight-0 component pays the episodes it fails (cap -1) though no weighted reward applies
    gated = ('{ components = [{ name = "never" }, { name = "length_penalty", weight = 0, target = 3 }], '
             'gates = [{ component = "length_penalty", min = 0, action = "cap", cap = -1.0 }] }')  # fmt: skip
    for name, rewards in (
        ("never", '[{ name = "never" }]'),
        ("on_a", '[{ name = "on_a" }]'),
        ("gated", gated),
    ):
        text = COPY.replace('[{ name = "match", partial = true }, { name = "length_penalty", weight = 0.5, '
                            'target = 3 }]', rewards)  # fmt: skip
        config = load_config(config_file(tmp_path, text + EVAL.replace("episodes = 12", "episodes = 24")))
        evaluator = Evaluator(config, config["eval"], config["env"]["rewards"], lm_agent=True)
        results[name] = evaluator(agent)
    never, on_a = results["never"], results["on_a"]
    assert math.isnan(never.metrics["reward"]) and never.counts["reward"] == 0
    assert all(row["reward"] == 0.0 for row in never.episodes)  # each episode shows what training paid it
    # where it applied to some, the mean is over every episode, as training paid them (the episodes a policy
    # makes its reward not apply to are not left out of its proxy)
    applied = sum(row["prompt"].startswith("a") for row in on_a.episodes)
    assert 0 < applied < len(on_a.episodes) and on_a.counts["reward"] == len(on_a.episodes)
    assert on_a.metrics["reward"] == pytest.approx(applied / len(on_a.episodes))
    capped = [row["reward"] for row in results["gated"].episodes]
    assert -1.0 in capped and results["gated"].metrics["reward"] == pytest.approx(sum(capped) / len(capped))


def test_an_sb3_policys_total_that_no_reward_applied_to_is_not_measured_either(register):
    from conftest import reward_plugin
    from stable_baselines3 import A2C

    from textgym.eval_settings import EVAL_DEFAULTS
    from textgym.sb3 import make_vec_env

    register(reward_plugin("never_sb3", lambda samples: [None] * len(samples)), "never-sb3")
    model = A2C("MultiInputPolicy", make_vec_env("textgym/Copy-v0", n_envs=1, seed=0), seed=0)
    config = {"env": {"id": "textgym/Copy-v0", "num_envs": 4}, "agent": {"policy": "MultiInputPolicy"}}
    spec = {**EVAL_DEFAULTS, "episodes": 4, "prompts": "copy-heldout", "rewards": [], "builtin": ["length"]}
    result = Evaluator(config, spec, [{"name": "never_sb3"}], lm_agent=False)(model)
    assert math.isnan(result.metrics["reward"]) and result.counts["reward"] == 0
    assert all("turn_rewards" not in e for e in result.episodes)  # one turn: no responder paid anything
