import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from lm_helpers import csv_rows

from textgym.atomic import is_complete
from textgym.cli import main
from textgym.config import load_config
from textgym.errors import ConfigError
from textgym.train import run

TINY = """
[run]
total_timesteps = 64
checkpoint_every = 2
sample_prompts = 2

[env]
num_envs = 4
max_new_tokens = 8
rewards = [{ name = "sentiment" }, { name = "length_penalty", weight = 0.5, target = 4 }]

[agent]
policy = "tiny-random-llama"
learning_rate = 1e-3
"""


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return path


def test_a_run_writes_the_whole_run_directory(config, tmp_path, capsys):
    run_dir = run(config, [f"run.output_dir='{tmp_path / 'out'}'"])
    out = capsys.readouterr().out
    assert "before training:" in out and "after training:" in out and "reward trend:" in out
    names = {p.name for p in run_dir.iterdir()}
    assert names >= {"config.toml", "metrics.csv", "samples.jsonl", "samples_before.jsonl", "samples_after.jsonl",
                     "reward_kl.png", "checkpoint"}  # fmt: skip
    metrics = csv_rows(run_dir / "metrics.csv")
    assert [int(r["iteration"]) for r in metrics] == list(range(1, len(metrics) + 1))
    assert (
        int(metrics[-1]["timesteps"]) >= 64
        and "objective/kl" in metrics[0]
        and "rewards/sentiment/mean" in metrics[0]
    )
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * len(metrics) and set(samples[0]) >= {
        "iteration",
        "prompt",
        "completion",
        "reward",
    }
    before = [json.loads(x)["prompt"] for x in (run_dir / "samples_before.jsonl").read_text().splitlines()]
    after = [json.loads(x)["prompt"] for x in (run_dir / "samples_after.jsonl").read_text().splitlines()]
    assert (
        before
        == after
        == ["Write one sentence about the sea.", "Describe your ideal weekend in one sentence."]
    )
    assert is_complete(run_dir / "checkpoint")
    resolved = load_config(run_dir / "config.toml")
    assert resolved["agent"]["learning_rate"] == 1e-3 and resolved["env"]["id"] == "textgym/TextGen-v0"


def test_the_reward_trend_names_its_spans(capsys):
    from textgym.train import _print_trend

    _print_trend([{"reward": 0.0}, {"reward": 1.0}], "reward")
    assert "0.000 (first iteration) -> 1.000 (last iteration), 2 iterations" in capsys.readouterr().out
    _print_trend([{"reward": float(i)} for i in range(8)], "reward")
    assert "0.500 (first 2 iterations) -> 6.500 (last 2 iterations), 8 iterations" in capsys.readouterr().out
    _print_trend([{"reward": -0.0001}], "reward")  # one iteration, a tiny negative mean: no "-0.000"
    assert (
        capsys.readouterr().out
        == "reward trend: 0.000 (first iteration) -> 0.000 (last iteration), 1 iteration\n"
    )
    # a Stable-Baselines3 rollout that ended no episode has no reward: "n/a (first 3 iterations)" said nothing
    _print_trend([{"reward": math.nan}] * 6 + [{"reward": r} for r in (0.1, 0.3, 0.5, 0.7)], "sum")
    assert (
        "0.100 (first iteration with episodes) -> 0.700 (last iteration with episodes), 10 iterations"
        in capsys.readouterr().out
    )


def test_tables_show_a_score_that_rounds_to_zero_without_a_minus_sign():
    from textgym.formatting import format_table, number

    assert (number(-0.0001), number(-0.0), number(-0.0006), number(0.25, 8)) == (
        "0.000",
        "0.000",
        "-0.001",
        "   0.250",
    )
    row = {"prompt": "p", "completion": "c", "reward_components": {"kl_like": -0.0002}, "reward": -0.0}
    assert "-0.000" not in format_table([row]) and "0.000" in format_table([row])


def test_sample_tables_head_each_component_whole_and_say_the_total_is_weighted():
    """Two components cut to 14 characters were both headed "politeness_sco"; a raw -1.333 beside a total of
    -0.667 did not say which was weighted."""
    from textgym.formatting import format_table

    components = {"politeness_score_v1": 0.5, "politeness_score_v2": math.nan}
    row = {"prompt": "p", "completion": "c", "reward_components": components, "reward": 0.25}
    header, _, line, *_ = format_table([row]).splitlines()
    assert "politeness_score_v1  politeness_score_v2  weighted total" in header
    assert line.endswith("              0.500                  n/a           0.250")


def test_a_sample_tables_columns_line_up_under_wide_and_combining_characters():
    """Widths were counted in characters: a prompt with an emoji or CJK (two columns each) pushed its
    row's scores out of line, and one cut in the middle lost its "…"."""
    from textgym.formatting import display_width, format_table, one_line

    prompts = ["plain", "Héllo 😀 wörld — 你好", "e\u0301" * 20, "你好" * 30]
    rows = [
        {"prompt": p, "completion": p, "reward_components": {"流畅度得分很高的": 0.5}, "reward": 0.5}
        for p in prompts
    ]
    lines = format_table(rows).splitlines()
    assert len({display_width(line) for line in lines if line.strip()}) == 1, "\n".join(lines)
    assert lines[5].startswith("你好" * 7 + "你… ")  # 31 columns, the last one "…", then one to pad to 32
    assert display_width("你好😀e\u0301") == 7
    # marks that take no column still count as characters: a cell is never unbounded
    assert len(one_line("a" + "\u0301" * 5000 + "b" * 10, 40)) == 160


def test_a_multi_turn_sample_table_shows_the_conversation_and_the_return():
    """An Echo episode showed only its last turn ("aaaaa" for five turns), under "weighted total", which
    held the turn rewards too."""
    import gymnasium

    from textgym.formatting import format_table
    from textgym.models import load_model
    from textgym.sampling import sample_episodes

    # an untrained policy's turns end on any of these letters: three turns each
    env = gymnasium.make_vec("textgym/Echo-v0", num_envs=2, autoreset_mode="Disabled", stop=list("abcdefg"),
                             max_new_tokens=24)  # fmt: skip
    rows = sample_episodes(load_model("tiny-char-llama")[0], env, seed=0)
    header, _, *lines = format_table(rows).splitlines()
    assert "conversation" in header and header.endswith("return (total + turns)")
    for row, line in zip(rows, lines):
        said = [t["text"] for t in row["turns"] if t["role"] == "user"]
        assert len(row["turns"]) > 1 and all(f"[user: {s}]" in line for s in said)
        assert line.endswith(f"{sum(row['turn_rewards']):.3f}")


def test_resume_continues_counters_and_history(config, tmp_path, capsys):
    run_dir = run(config, [f"run.output_dir='{tmp_path / 'out'}'"])
    first = csv_rows(run_dir / "metrics.csv")
    run(None, ["run.total_timesteps=128"], resume=run_dir)
    metrics = csv_rows(run_dir / "metrics.csv")
    assert metrics[: len(first)] == first and len(metrics) > len(first)
    assert [int(r["iteration"]) for r in metrics] == list(range(1, len(metrics) + 1))
    assert "nothing to train" not in capsys.readouterr().out
    run(None, resume=run_dir)  # a finished run said "resuming" and printed its tables, as if it trained
    assert "has trained its run.total_timesteps = 128 tokens: nothing to train" in capsys.readouterr().out
    assert csv_rows(run_dir / "metrics.csv") == metrics
    with pytest.raises(ConfigError, match="already holds a run; continue it with `textgym train --resume"):
        run(config, [f"run.output_dir='{run_dir}'"])


def test_a_resume_says_which_reward_code_changed_and_names_a_plugin_package_that_is_gone(tmp_path, capsys):
    """A resume trained on with an edited reward file, or an upgraded plugin package, without a word (the bench
    refused the same change), and one whose package was uninstalled said only "unknown reward"."""
    from textgym.atomic import _COMPLETE

    (tmp_path / "rewards.py").write_text(
        "def short(samples):\n    return [-len(s.completion) for s in samples]\n"
    )
    config = tmp_path / "fn.toml"
    config.write_text(
        TINY.replace('rewards = [{ name = "sentiment" }, ', 'rewards = [{ fn = "rewards.py:short" }, ')
    )
    run_dir = run(config, [f"run.output_dir='{tmp_path / 'out'}'"])
    code = json.loads((run_dir / "code.json").read_text())
    assert list(code["code"]) == [str(tmp_path / "rewards.py")] and "textgym" in code["software"]
    capsys.readouterr()
    (tmp_path / "rewards.py").write_text(
        "def short(samples):\n    return [-2 * len(s.completion) for s in samples]\n"
    )
    # a resume that fails its checks leaves code.json as it was: the resume that trains still says it
    marker = run_dir / "checkpoint" / _COMPLETE
    marker.rename(tmp_path / "marker")
    with pytest.raises(ConfigError, match="is incomplete"):
        run(None, ["run.total_timesteps=96"], resume=run_dir)
    assert json.loads((run_dir / "code.json").read_text()) == code
    (tmp_path / "marker").rename(marker)
    capsys.readouterr()
    run(None, ["run.total_timesteps=96"], resume=run_dir)
    out = capsys.readouterr().out
    assert (
        f"warning: the code this run trains with changed since it last started or resumed ({tmp_path}" in out
    )
    run(None, ["run.total_timesteps=128"], resume=run_dir)  # said once: code.json is the code now
    assert "changed since" not in capsys.readouterr().out
    code = json.loads((run_dir / "code.json").read_text())
    code["packages"] = {"textgym-judge-plugin": "0.3.1 (code 3fa2c1d09b7e5a44)"}
    (run_dir / "code.json").write_text(json.dumps(code))
    run(None, ["run.total_timesteps=160"], resume=run_dir)
    out = capsys.readouterr().out
    assert (
        "warning: " + str(run_dir) + " trained with the plugin package(s) textgym-judge-plugin 0.3.1 (code "
        "3fa2c1d09b7e5a44), which this Python does not have (pip install 'textgym-judge-plugin==0.3.1')"
    ) in out
    assert "package textgym-judge-plugin: 0.3.1 (code 3fa2c1d09b7e5a44) -> (none)" in out
    # a resume whose reward file is gone fails to load it; code.json is left as it was (it recorded "missing",
    # and the resume that found the file again said the file had changed)
    before = (run_dir / "code.json").read_text()
    (tmp_path / "rewards.py").rename(tmp_path / "moved.py")
    with pytest.raises(ConfigError, match=r"trains with the reward file .*rewards.py, which is gone. Where the "
                                          r"project moved, edit that path in .*config.toml"):  # fmt: skip
        run(None, ["run.total_timesteps=192"], resume=run_dir)
    assert (run_dir / "code.json").read_text() == before and "warning" not in capsys.readouterr().out
    (tmp_path / "moved.py").rename(tmp_path / "rewards.py")
    (run_dir / "code.json").write_text("[1, 2]")  # unreadable as textgym's: resumed without a word
    run(None, ["run.total_timesteps=192"], resume=run_dir)
    assert "warning" not in capsys.readouterr().out


def test_config_errors_name_the_bad_value(config, tmp_path):
    with pytest.raises(ConfigError, match=r"unknown section \[agnet\]. Did you mean \[agent\]"):
        load_config(None, ["agnet.policy='x'"])
    with pytest.raises(ConfigError, match="unknown key run.total_steps. Did you mean 'total_timesteps'"):
        load_config(config, ["run.total_steps=5"])
    with pytest.raises(ConfigError, match="run.total_timesteps must be a positive integer, not 0"):
        load_config(config, ["run.total_timesteps=0"])
    # the one value given as text is shown as the list it must be
    with pytest.raises(ConfigError, match=r"run.report_to must be a list of 'tensorboard', not 'tensorboard': "
                                          r"report_to = \[\"tensorboard\"\]\.$"):  # fmt: skip
        load_config(config, ["run.report_to=tensorboard"])
    with pytest.raises(ConfigError, match=r"tiny.toml with --set agnet.x=1: unknown section \[agnet\]"):
        load_config(config, ["agnet.x=1"])  # the value came from --set: said so, not only the file's name
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(config, ["learning_rate=3"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match=r"\[agent\] lmppo: .*learnin_rate"):
        run(config, [f"run.output_dir='{tmp_path / 'a'}'", "agent.learnin_rate=1e-3"])
    with pytest.raises(ConfigError, match=r"unknown hyperparameter 'nam'. Did you mean 'name'\?"):
        run(config, [f"run.output_dir='{tmp_path / 'c'}'", "agent.nam='grpo'"])
    with pytest.raises(ConfigError, match=r"\[env\] textgym/TextGen-v0: .*max_new_token"):
        run(config, [f"run.output_dir='{tmp_path / 'b'}'", "env.max_new_token=3"])
    with pytest.raises(ConfigError, match="not a run directory"):
        run(None, resume=tmp_path)
    with pytest.raises(ConfigError, match="'.*nothere' does not exist: --resume takes a run directory"):
        run(None, resume=tmp_path / "nothere")


def test_a_value_refused_after_loading_is_named_with_the_set_that_gave_it(config, tmp_path, capsys):
    """A --set value refused by the agent's or the env's own checks was named without the --set."""
    assert main(["train", str(config), "--set", "agent.learnin_rate=1e-3"]) == 2
    err = capsys.readouterr().err
    assert "unknown hyperparameter 'learnin_rate'" in err
    assert "textgym: the values given with --set: agent.learnin_rate=1e-3" in err
    assert main(["train", str(config), "--set", "agnet.x=1"]) == 2  # named in the error itself: once
    assert capsys.readouterr().err.count("--set") == 1


def test_a_config_that_is_a_directory_or_not_text_is_a_clear_error(config, tmp_path, capsys):
    """A directory was reported as missing, and a binary file raised UnicodeDecodeError with a traceback."""
    run_dir = run(config, [f"run.output_dir='{tmp_path / 'out'}'"])
    (tmp_path / "image.toml").write_bytes(b"\x89PNG\r\n\x1a\n\x00")
    for command in ("train", "bench"):
        assert main([command, str(run_dir)]) == 2
        assert f"'{run_dir}' is a directory, not a TOML file. It is a run directory: continue it with " \
               f"textgym train --resume {run_dir}" in capsys.readouterr().err  # fmt: skip
        assert main([command, str(tmp_path / "image.toml")]) == 2
        assert "image.toml' is not a TOML file: it is not UTF-8 text" in capsys.readouterr().err
    assert main(["train", str(tmp_path)]) == 2
    assert f"'{tmp_path}' is a directory, not a TOML file.\n" in capsys.readouterr().err


@pytest.mark.parametrize(("command", "codes"), [("train", "0 the run trained to its end; 130"),
                                                 ("bench", "0 every run finished; 1 some runs failed")])  # fmt: skip
def test_the_help_of_a_long_command_names_its_exit_codes(command, codes, capsys):
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0 and f"exit codes: {codes}" in " ".join(capsys.readouterr().out.split())


def test_unknown_agent_name_suggests(config, capsys):
    assert main(["train", str(config), "--agent", "lmpo"]) == 2
    assert "unknown agent 'lmpo'. Did you mean 'lmppo'?" in capsys.readouterr().err


def test_sb3_ppo_trains_the_copy_env_through_the_same_command(tmp_path, capsys, monkeypatch):
    temp = tmp_path / "temp"  # SB3's default logger would leave an empty SB3-<time> folder here
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    args = ["train", "--agent", "sb3-ppo", "--set", f"run.output_dir='{tmp_path / 'sb3'}'",
            "--set", "env.id='textgym/Copy-v0'", "--set", "run.total_timesteps=2048",
            "--set", "agent.n_steps=128", "--set", "agent.batch_size=256", "--set", "agent.verbose=0"]  # fmt: skip
    config = tmp_path / "empty.toml"
    config.write_text("")
    assert main([args[0], str(config), *args[1:]]) == 0
    run_dir = tmp_path / "sb3"
    assert is_complete(run_dir / "checkpoint") and (run_dir / "checkpoint" / "model.zip").is_file()
    assert {"reward_kl.png", "samples_before.jsonl", "samples_after.jsonl", "samples.jsonl"} <= {
        p.name for p in run_dir.iterdir()
    }
    assert len(csv_rows(run_dir / "metrics.csv")) == 2  # 8 envs x 128 steps = 1024 per rollout
    assert main(["train", "--resume", str(run_dir), "--set", "run.total_timesteps=4096"]) == 0
    assert len(csv_rows(run_dir / "metrics.csv")) == 4
    assert list(temp.iterdir()) == []


def test_ctrl_c_saves_a_checkpoint_and_exits_with_code_130(config, tmp_path):
    out = tmp_path / "interrupted"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "textgym", "train", str(config), "--set", f"run.output_dir='{out}'",
           "--set", "run.total_timesteps=100000", "--set", "run.checkpoint_every=1000"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.time() + 300
    while not (out / "metrics.csv").is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output  # stopped short of its total: a script must not go on as if done
    assert "interrupted; checkpoint saved. Continue with: textgym train --resume" in output
    assert "tok/s" not in output  # no progress bar in a log: its redraws ran into the iteration lines
    assert is_complete(out / "checkpoint")
    done = len(csv_rows(out / "metrics.csv"))
    state = json.loads((out / "checkpoint" / "state.json").read_text())
    assert state["iteration"] == done and len(state["history"]) == done


@pytest.mark.slow
def test_demo_config_trains_the_embedded_model(tmp_path):
    """The demo's config on the real 135M model, cut to two short iterations."""
    run_dir = run(
        "examples/demo.toml",
        [f"run.output_dir='{tmp_path / 'demo'}'", "run.total_timesteps=40", "env.num_envs=4",
         "env.max_new_tokens=8", "run.sample_prompts=2", "agent.micro_batch_size=2"],
    )  # fmt: skip
    metrics = csv_rows(run_dir / "metrics.csv")
    assert len(metrics) >= 2 and all(float(m["val/ratio"]) > 0 for m in metrics)
    assert {f"rewards/{n}/mean" for n in ("sentiment", "fluency", "safety", "length_penalty")} <= set(
        metrics[0]
    )


def test_a_normalize_then_sum_runs_iteration_lines_and_plot_show_each_components_raw_mean(
    tmp_path, capsys, monkeypatch
):
    """Its total is standardised per batch: "reward 0.000" in every iteration line and a flat plot said
    nothing about training."""
    import textgym.train

    plotted = []
    curves = textgym.train.training_curves
    monkeypatch.setattr(
        textgym.train,
        "training_curves",
        lambda path, history, keys, kl: plotted.append(keys) or curves(path, history, keys, kl),
    )
    config = tmp_path / "nts.toml"
    config.write_text(
        TINY.replace(
            'rewards = [{ name = "sentiment" }, { name = "length_penalty", weight = 0.5, target = 4 }]',
            'rewards = { aggregate = "normalize_then_sum", components = [{ name = "sentiment" }, '
            '{ name = "length_penalty", weight = 0.5, target = 4 }] }',
        )
    )
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the bar is drawn on a terminal only
    run_dir = run(config, [f"run.output_dir='{tmp_path / 'out'}'"])
    captured = capsys.readouterr()
    lines = [line for line in captured.out.splitlines() if line.startswith("iter ")]
    metrics = csv_rows(run_dir / "metrics.csv")
    assert len(lines) == len(metrics) >= 2
    assert "sentiment=" in captured.err and "reward=" not in captured.err  # the progress bar too
    for line, row in zip(lines, metrics):
        assert "reward " not in line
        assert f"sentiment {float(row['rewards/sentiment/mean']):7.3f}" in line
        assert f"length_penalty {float(row['rewards/length_penalty/mean']):7.3f}" in line
    assert plotted == [["rewards/sentiment/mean", "rewards/length_penalty/mean"]]
    assert (run_dir / "reward_kl.png").stat().st_size > 0


def test_the_iteration_line_says_n_a_for_a_kl_without_reference_and_no_minus_zero():
    """GRPO with beta = 0 has no reference: its line read "kl     nan"; a KL of -1e-9 read "kl  -0.000"."""
    from textgym.train import _iteration_line

    stats = {"iteration": 3, "reward": 0.25, "completions/mean_length": 4.0, "completions/clipped_ratio": 0.5,
             "time/iteration": 1.5}  # fmt: skip
    assert "reward   0.250  kl     n/a  len   4.0" in _iteration_line({**stats, "kl": math.nan}, 96)
    assert "kl   0.000  len" in _iteration_line({**stats, "kl": -1e-9}, 96)


def test_the_reward_trend_of_a_normalize_then_sum_run_is_each_components(capsys):
    """Standardised per batch, the total's mean is 0 whatever the policy: the summary shows what moved."""
    from textgym.train import _print_trend

    history = [
        {"reward": 1e-17 * i, "rewards/match/mean": 0.1 * i, "rewards/length_penalty/mean": -1.0 + 0.1 * i}
        for i in range(8)
    ]
    _print_trend(history, "normalize_then_sum")
    out = capsys.readouterr().out
    assert "each component's raw mean, first 2 iterations -> last 2 iterations): match 0.050 -> 0.650" in out
    assert "length_penalty -0.950 -> -0.350, 8 iterations" in out
    _print_trend(history, "sum")
    assert (
        "reward trend: 0.000 (first 2 iterations) -> 0.000 (last 2 iterations), 8 iterations"
        in capsys.readouterr().out
    )


RESOLVED = """
[env]
id = "textgym/Copy-v0"
prompts = "p.txt"
stop = [".", "runs"]
rewards = [{ name = "match", reference = "runs" }]

[eval]
prompts = "held.csv"
"""


def test_config_paths_resolve_against_its_directory_and_texts_that_name_a_directory_stay_texts(
    tmp_path, monkeypatch
):
    """Every string naming an existing file or directory was made absolute: stop = ["."] became the config's
    directory (and "." never ended a turn); [eval] prompts resolved against the working directory."""
    cfg = tmp_path / "cfg"
    (cfg / "runs").mkdir(parents=True)
    (cfg / "p.txt").write_text("ab\n")
    (cfg / "held.csv").write_text("prompt\ncd\n")
    (cfg / "run.toml").write_text(RESOLVED)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(cfg / "run.toml")
    assert config["env"]["prompts"] == str(cfg / "p.txt") and config["eval"]["prompts"] == str(
        cfg / "held.csv"
    )
    assert config["env"]["stop"] == [".", "runs"]
    assert config["env"]["rewards"][0]["reference"] == "runs"


def test_the_after_training_samples_are_scored_with_the_weights_training_ended_with(tmp_path):
    """Both tables were scored at progress 0: a schedule from sentiment to length_penalty showed the
    after-training samples scored by sentiment alone."""
    config = tmp_path / "scheduled.toml"
    config.write_text(
        TINY.replace(
            'rewards = [{ name = "sentiment" }, { name = "length_penalty", weight = 0.5, target = 4 }]',
            'rewards = [{ name = "sentiment", weight = { start = 1.0, end = 0.0 } }, '
            '{ name = "length_penalty", target = 4, weight = { start = 0.0, end = 1.0 } }]',
        )
    )
    run_dir = run(config, [f"run.output_dir='{tmp_path / 'out'}'"])
    for name, scored_by in (("samples_before.jsonl", "sentiment"), ("samples_after.jsonl", "length_penalty")):
        rows = [json.loads(line) for line in (run_dir / name).read_text().splitlines()]
        assert rows and all(r["reward"] == pytest.approx(r["reward_components"][scored_by]) for r in rows), (
            name
        )


def test_the_command_suggested_for_another_agent_on_resume_starts_a_run(config, tmp_path, capsys):
    """It suggested the run's own config.toml, whose output_dir is the run: "already holds a run". A path
    with a space or a quote is quoted for the shell and for TOML."""
    import shlex

    out = tmp_path / "my out's"
    run(config, [f"run.output_dir={json.dumps(str(out))}", "run.total_timesteps=32"])
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--agent", "rloo"]) == 2
    suggested = re.search(r"\(textgym (train .*)\)\.$", capsys.readouterr().err.strip()).group(1)
    args = [
        *shlex.split(suggested),
        "--set",
        "run.total_timesteps=32",
        "--set",
        "agent.rloo.num_generations=2",
    ]
    assert main(args) == 0, capsys.readouterr().err
    assert (tmp_path / "my out's-rloo" / "checkpoint").is_dir()


def test_textgym_version(capsys):
    import textgym

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"textgym {textgym.__version__}"


def test_sb3_runs_follow_weight_schedules_and_score_the_after_table_where_they_ended(tmp_path, monkeypatch):
    """Only LM agents moved the stack's progress: an SB3 run trained with the starting weights throughout."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    config = tmp_path / "sb3.toml"
    config.write_text(
        '[run]\ntotal_timesteps = 2048\nsample_prompts = 2\n[env]\nid = "textgym/Copy-v0"\n'
        'rewards = [{ name = "length_penalty", target = 3, weight = { start = 1.0, end = 0.0 } }, '
        '{ name = "length_penalty", target = 1, weight = { start = 0.0, end = 1.0 } }]\n'
        '[agent]\nname = "sb3-ppo"\nn_steps = 128\nbatch_size = 256\n'
    )
    run_dir = run(config, [f"run.output_dir='{tmp_path / 'out'}'"])
    rows = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    last = [r for r in rows if r["iteration"] == 2]  # 1024 of 2048 tokens trained when it began: 0.5 each
    assert last and all(
        r["reward"] == pytest.approx(0.5 * r["reward_components"]["length_penalty"]
                                     + 0.5 * r["reward_components"]["length_penalty_2"]) for r in last
    )  # fmt: skip
    after = [json.loads(line) for line in (run_dir / "samples_after.jsonl").read_text().splitlines()]
    assert all(r["reward"] == pytest.approx(r["reward_components"]["length_penalty_2"]) for r in after)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("False", r"TOML writes booleans in lower case: env.chat_template=false \(for the text, quote it in "
                  r"TOML: --set \"env.chat_template='False'\"\)"),
        ("None", "TOML has no null value: leave the key out of the config for its default"),
        (".5", r"'.5' is not a TOML number: write env.chat_template=0.5"),
    ],
)  # fmt: skip
def test_a_set_value_in_another_languages_spelling_is_refused(tmp_path, value, message):
    """A bare word was taken as a string: chat_template = "False" turned the chat template on (a non-empty
    string is true), and SB3's normalize_advantage="False" switched normalisation on."""
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"env.chat_template={value}"])
    assert load_config(None, ["env.prompts=chat"])["env"]["prompts"] == "chat"  # a bare word is still text
    with pytest.raises(ConfigError, match="'007' is not a TOML number: write run.seed=7 "):  # not 7.0
        load_config(None, ["run.seed=007"])


def test_a_set_inline_table_replaces_the_table(tmp_path):
    """`--set agent.lora='{r = 8}'` kept the file's other LoRA keys (pissa init, alpha), and a dotted key
    could never take one away; a dotted key still sets one key of it."""
    config = tmp_path / "c.toml"
    config.write_text('[agent]\nlora = { r = 4, lora_alpha = 32, init_lora_weights = "pissa" }\n')
    assert load_config(config, ["agent.lora={r = 8}"])["agent"]["lora"] == {"r": 8}
    assert load_config(config, ["agent.lora.r=8"])["agent"]["lora"] == {
        "r": 8, "lora_alpha": 32, "init_lora_weights": "pissa"
    }  # fmt: skip


def test_a_set_inline_table_at_a_quoted_dotted_key_replaces_that_table():
    """The key's depth was counted by its dots, so env."a.b"={...} merged into the table below it."""
    from textgym.config import apply_override

    config = {"env": {"a.b": {"y": 2}}}
    apply_override(config, 'env."a.b"={x = 1}')
    assert config == {"env": {"a.b": {"x": 1}}}
    # the whole-list advice keeps the quotes (env.a.b=[...] would set another key)
    config = {"env": {"a.b": [1, 2]}}
    with pytest.raises(ConfigError, match=r"""e.g. --set 'env."a.b"=\[...\]'"""):
        apply_override(config, 'env."a.b".0=3')


def test_a_set_into_a_list_or_of_broken_toml_says_so(tmp_path):
    """`env.rewards[1].target=0.4` was refused as "'0.4' is not a TOML number: write ...=0.4", exactly what
    was typed; `env.rewards.1.target=0.4` replaced the list with a table; a list with a TOML error became a
    string, then "reward spec {'[{name': ...} has no 'name'"."""
    config = tmp_path / "c.toml"
    config.write_text('[env]\nrewards = [{ name = "sentiment" }, { name = "length_penalty", target = 4 }]\n')
    with pytest.raises(ConfigError, match=r"a key cannot index a list \(env.rewards\[1\].target\); give the whole "
                                          r"list, e.g. --set 'env.rewards=\[...\]'"):  # fmt: skip
        load_config(config, ["env.rewards[1].target=0.4"])
    with pytest.raises(ConfigError, match=r"env.rewards is a list, and a key cannot reach into one"):
        load_config(config, ["env.rewards.1.target=0.4"])
    with pytest.raises(ConfigError, match=r"the value is not valid TOML \("):
        load_config(config, ['env.rewards=[{name="length_penalty",target=high}]'])
    # text that starts like a list is told how to be text (it was text before TOML values were checked)
    with pytest.raises(ConfigError, match=r"or each text of a list: --set 'env.stop=\[\"a\", \"b\"\]'"):
        load_config(config, ["env.stop=[a, b]"])
    with pytest.raises(ConfigError, match=r"\(Invalid value at character 2\); for text, quote it: "
                                          r"--set 'env.stop=\"\[/INST\]\"'"):  # fmt: skip
        load_config(config, ["env.stop=[/INST]"])
    # a key TOML cannot read was blamed on the value ("'1' is not a TOML number: write env.my+key=1")
    with pytest.raises(ConfigError, match=r"env.my\+key is not a TOML key: .* quoted, as in the file: "
                                          r"env.\"my\+key\"=\.\.\."):  # fmt: skip
        load_config(config, ["env.my+key=1"])
    # a bare word is text whatever its characters (an emoji was refused as "'env.stop' is not a valid key")
    assert load_config(config, ["env.stop=\N{GRINNING FACE}"])["env"]["stop"] == "\N{GRINNING FACE}"
    assert load_config(config, ['env.rewards=[{name="length_penalty",target=2}]'])["env"]["rewards"] == [
        {"name": "length_penalty", "target": 2}
    ]


def test_a_plot_is_written_whole_or_not_at_all(tmp_path):
    """reward_kl.png, eval.png and the bench's figures were written in place: a kill mid-write left a cut
    PNG where every other file of a run directory is replaced atomically."""
    from textgym.plotting import pyplot, save_figure

    path = tmp_path / "reward_kl.png"
    path.write_bytes(b"the last plot")
    fig = pyplot().figure()

    def cut(target, **kwargs):
        target.write_bytes(b"\x89PNG half")
        raise KeyboardInterrupt

    fig.savefig = cut
    with pytest.raises(KeyboardInterrupt):
        save_figure(fig, path, dpi=50)
    assert path.read_bytes() == b"the last plot" and [p.name for p in tmp_path.iterdir()] == ["reward_kl.png"]
    save_figure(pyplot().figure(), path, dpi=50)
    assert path.read_bytes().startswith(b"\x89PNG") and [p.name for p in tmp_path.iterdir()] == [
        "reward_kl.png"
    ]
