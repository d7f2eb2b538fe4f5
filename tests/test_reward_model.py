"""textgym train-rm and textgym label-pairs: reward models from preference pairs, pairs from a gold stack."""

import json
import math
import os
import random
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from tests.conftest import reward_plugin
from textgym import Sample, make_reward
from textgym.atomic import is_complete
from textgym.cli import main
from textgym.errors import (
    ConfigError,
    ModelError,
    PairsError,
    PluginArgumentError,
    RewardError,
    TrainingError,
    UnknownNameError,
)
from textgym.pairs import label_pairs, read_pairs
from textgym.reward_model import REPORT, train_reward_model
from textgym.rm_scoring import format_text

WORDS = [
    "the",
    "a",
    "cat",
    "dog",
    "sun",
    "rain",
    "tree",
    "river",
    "house",
    "blue",
    "green",
    "quick",
    "slow",
    "small",
    "big",
    "red",
    "old",
    "new",
]


def marker_pairs(n, seed=0):
    """A separable preference: the chosen completion says "banana" somewhere, the rejected one never does."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = rng.choices(WORDS, k=6)
        words.insert(rng.randrange(7), "banana")
        rows.append(
            {
                "prompt": f"Tell me about thing {i % 5}.",
                "chosen": " ".join(words),
                "rejected": " ".join(rng.choices(WORDS, k=6)),
                "note": "extra keys are ignored",
            }
        )
    return rows


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def rm_score_margins(directory, pairs):
    """r(chosen) - r(rejected) of each pair under the rm_score reward loading ``directory`` as users do."""
    rm = make_reward("rm_score", model=str(directory), batch_size=4)
    chosen = rm([Sample(p["prompt"], p["chosen"], (), (), "stop", {}) for p in pairs])
    rejected = rm([Sample(p["prompt"], p["rejected"], (), (), "stop", {}) for p in pairs])
    return [c - r for c, r in zip(chosen, rejected)]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A reward model trained on the marker preference (tiny model, seconds), its pairs and report."""
    tmp = tmp_path_factory.mktemp("toy")
    rows = marker_pairs(64)
    pairs = write_jsonl(tmp / "pairs.jsonl", rows)
    report = train_reward_model(
        pairs, tmp / "rm", model="tiny-random-llama", epochs=4, learning_rate=1e-3, eval_fraction=0.25
    )
    return tmp / "rm", rows, report


def test_train_rm_learns_a_separable_preference(toy):
    out, _, report = toy
    assert report.eval_pairs == 16 and report.train_pairs == 48
    assert report.after.accuracy >= 0.9
    assert report.after.loss < report.before.loss / 2
    assert report.after.mean_margin > report.before.mean_margin + 1
    assert report.train_loss[-1] < report.train_loss[0]
    saved = json.loads((out / REPORT).read_text())
    assert saved["after"] == {"accuracy": report.after.accuracy, "mean_margin": report.after.mean_margin,
                              "loss": report.after.loss}  # fmt: skip
    assert saved["settings"]["chat_template"] is True and saved["eval_lines"] == report.eval_lines
    # the split is by pair: the report counts the held-out pairs whose prompt training also saw
    rows = [json.loads(line) for line in (out.parent / "pairs.jsonl").read_text().splitlines()]
    trained = {rows[i]["prompt"] for i in range(len(rows)) if i + 1 not in report.eval_lines}
    seen = sum(rows[line - 1]["prompt"] in trained for line in report.eval_lines)
    assert report.eval_prompts_seen == seen == saved["eval_prompts_seen"]
    assert (f"; {seen} of them on prompts also in training pairs" in report.summary()) == (seen > 0)


def test_the_saved_directory_scores_in_rm_score_as_the_trainer_did(toy, tokenizer):
    from transformers import AutoConfig

    out, rows, report = toy
    assert is_complete(out)
    config = AutoConfig.from_pretrained(out)
    assert config.num_labels == 1
    assert config.pad_token_id == tokenizer.pad_token_id != tokenizer.eos_token_id  # <|endoftext|>, not EOS
    held_out = [rows[line - 1] for line in report.eval_lines]
    margins = rm_score_margins(out, held_out)
    assert sum(m > 0 for m in margins) / len(margins) == report.after.accuracy >= 0.9
    assert sum(margins) / len(margins) == pytest.approx(report.after.mean_margin, abs=1e-4)


def test_the_trainer_formats_texts_as_rm_score_does(toy):
    out, rows, _ = toy
    rm = make_reward("rm_score", model=str(out))
    sample = Sample(rows[0]["prompt"], rows[0]["chosen"], (), (), "stop", {})
    assert format_text(rm.tokenizer, True, sample.prompt, sample.completion) == rm.format(sample)
    with pytest.warns(UserWarning, match=r"trained by textgym train-rm on texts formatted otherwise: "
                                         r"chat_template=False \(trained with True\)"):  # fmt: skip
        plain = make_reward("rm_score", model=str(out), chat_template=False)
    assert format_text(rm.tokenizer, False, sample.prompt, sample.completion) == plain.format(sample)
    # scored otherwise than trained, unsaid, the scores moved (a ranking could flip)
    with pytest.warns(UserWarning, match=r"max_length=8 \(trained with \d+\)"):
        make_reward("rm_score", model=str(out), max_length=8)
    with pytest.warns(UserWarning, match=r"template='Q: \{prompt\} A: \{completion\}' \(trained on"):
        make_reward("rm_score", model=str(out), chat_template=False, template="Q: {prompt} A: {completion}")


def test_rm_score_reads_a_bf16_checkpoint_in_fp32_and_a_chat_templates_bos_once(toy, tmp_path):
    """A reward model saved in bf16 ran in bf16 with bf16 off; a tokenizer that adds BOS put a second one
    before the chat template's own."""
    import shutil

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    out, rows, _ = toy
    copy = tmp_path / "rm"
    shutil.copytree(out, copy)
    AutoModelForSequenceClassification.from_pretrained(copy).to(torch.bfloat16).save_pretrained(copy)
    tokenizer = AutoTokenizer.from_pretrained(copy)
    tokenizer.add_bos_token = True
    tokenizer.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(copy)
    rm = make_reward("rm_score", model=str(copy), bf16=False, device="cpu")
    assert {p.dtype for p in rm.model.parameters()} == {torch.float32}
    sample = Sample(rows[0]["prompt"], rows[0]["chosen"], (), (), "stop", {})
    ids = tokenizer(rm.format(sample), add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1 and tokenizer(rm.format(sample))["input_ids"][:2] == [1, 1]
    with torch.no_grad():
        expected = float(rm.model(input_ids=torch.tensor([ids])).logits[0, 0])
    assert rm([sample])[0] == pytest.approx(expected, abs=1e-5)


def test_train_rm_trains_without_dropout(tmp_path):
    """Dropout (a LoRA's here, a model config's elsewhere) was on: chosen and rejected each had a mask of
    their own, so the margin, the gradient's one signal, carried its noise."""
    rows, margins = marker_pairs(16, seed=2), []
    for dropout in (0.0, 0.5):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            report = train_reward_model(
                rows, tmp_path / f"rm{dropout}", model="tiny-random-llama", epochs=1, eval_fraction=0.25,
                lora=f"{{r = 4, lora_alpha = 8, lora_dropout = {dropout}}}", learning_rate=3e-3,
            )  # fmt: skip
        margins.append(report.after.mean_margin)
        # a dropout that is given and does nothing is said to do nothing
        said = [
            w
            for w in seen
            if "lora_dropout = 0.5 has no effect: textgym trains with dropout off" in str(w.message)
        ]
        assert len(said) == (dropout > 0)
    assert margins[0] == margins[1]


def test_lora_is_merged_into_a_plain_directory_that_rm_score_loads(tmp_path):
    rows = marker_pairs(32, seed=1)
    report = train_reward_model(
        rows, tmp_path / "rm", model="tiny-random-llama", lora="{r = 4, lora_alpha = 8}", epochs=2,
        learning_rate=3e-3, eval_fraction=0.25,
    )  # fmt: skip
    assert report.settings["lora"] == {"r": 4, "lora_alpha": 8}
    assert report.after.loss < report.before.loss
    assert not (tmp_path / "rm" / "adapter_config.json").exists()
    held_out = [rows[line - 1] for line in report.eval_lines]
    margins = rm_score_margins(tmp_path / "rm", held_out)  # merged weights and the trained head
    assert sum(margins) / len(margins) == pytest.approx(report.after.mean_margin, abs=1e-4)


def char_count(samples):
    return [float(len(s.completion)) for s in samples]


def test_label_pairs_ranks_by_the_gold_stack_and_flips_the_asked_share(register, tmp_path, capsys):
    register(reward_plugin("chars", char_count), "chars-plugin")
    gold = tmp_path / "gold.toml"
    gold.write_text('rewards = [{ name = "chars", weight = 0.5 }]\n')
    prompts = ["Say hello.", "Name a colour.", "Count to three."]
    (tmp_path / "prompts.txt").write_text("\n".join(prompts) + "\n")
    out = tmp_path / "pairs.jsonl"
    argv = ["label-pairs", "--prompts", str(tmp_path / "prompts.txt"), "--policy", "tiny-random-llama",
            "--rewards", str(gold), "--output", str(out), "--num-prompts", "20", "--batch-size", "8",
            "--max-new-tokens", "6", "--label-noise", "0.25", "--seed", "3"]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    summary = capsys.readouterr().out
    ties = int(re.search(r"(\d+) ties skipped", summary).group(1))
    assert len(rows) + ties == 20 and len(rows) >= 15  # 20 prompts in batches of 8, 8, 4
    assert f"wrote {len(rows)} pairs" in summary
    cycled = iter(prompts[i % 3] for i in range(20))  # the source starts over; ties leave gaps
    assert all(any(r["prompt"] == p for p in cycled) for r in rows)
    flipped = [r for r in rows if r["flipped"]]
    assert len(flipped) == math.floor(0.25 * len(rows) + 0.5) > 0
    for r in rows:
        assert r["chosen"] != r["rejected"]
        assert r["chosen_score"] == 0.5 * len(r["chosen"]) and r["rejected_score"] == 0.5 * len(r["rejected"])
        assert (
            r["gold_margin"] == r["chosen_score"] - r["rejected_score"] and "margin" not in r
        )  # TRL's loss reads it
        assert (r["gold_margin"] < 0) == r["flipped"]  # noise swaps the labels, never the scores
    assert main(argv) == 0  # seeded: the same file again
    assert [json.loads(line) for line in out.read_text().splitlines()] == rows


def test_label_pairs_counts_totals_equal_up_to_rounding_as_ties(register, tmp_path):
    """0.1 + 0.2 against 0.3 + 0.0: the same total in exact arithmetic, a preference by rounding."""
    register(reward_plugin("a", lambda ss: [0.1 if len(s.completion) % 2 else 0.3 for s in ss]), "a-plugin")
    register(reward_plugin("b", lambda ss: [0.2 if len(s.completion) % 2 else 0.0 for s in ss]), "b-plugin")
    stats = label_pairs("chat", "tiny-random-llama", ["a", "b"], tmp_path / "pairs.jsonl", num_prompts=16,
                        max_new_tokens=5, seed=0, progress=False)  # fmt: skip
    assert stats.pairs == 0 and stats.ties == 16


def test_label_pairs_says_its_file_is_incomplete_when_a_gold_reward_fails(register, tmp_path, capsys):
    """The rows of the batches before the error stayed, valid-looking, with nothing said (a Ctrl-C said)."""
    calls = []

    def fails_second(samples):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("gold service down")
        return char_count(samples)

    register(reward_plugin("flaky", fails_second), "flaky-plugin")
    out = tmp_path / "pairs.jsonl"
    argv = ["label-pairs", "--prompts", "chat", "--policy", "tiny-random-llama", "--rewards", "flaky",
            "--output", str(out), "--num-prompts", "16", "--batch-size", "8", "--max-new-tokens", "6"]  # fmt: skip
    assert main(argv) == 2
    kept = len(out.read_text().splitlines())
    err = capsys.readouterr().err
    assert kept > 0 and f"the {kept} pairs written before its error are in {out}, an incomplete file" in err
    assert err.index("incomplete file") < err.index("gold service down")
    # an error before the file is opened leaves an earlier file whole, and says nothing of it
    argv[argv.index("flaky")] = "no_such_reward"
    assert main(argv) == 2
    assert len(out.read_text().splitlines()) == kept and "incomplete" not in capsys.readouterr().err


def test_label_pairs_skips_a_prompt_whose_completions_the_gold_stack_did_not_both_score(register, tmp_path):
    """A reward that does not apply (None) adds 0 to its completion's total: compared with a scored one, it
    made a preference no gold signal expressed (chosen_score 40, rejected_score 0)."""
    register(reward_plugin("even", lambda ss: [len(s.completion) if len(s.completion) % 2 == 0 else None for s in ss]),
             "even-plugin")  # fmt: skip
    register(reward_plugin("chars", char_count), "chars-plugin")  # weight 0: a metric, not in the total
    stats = label_pairs(
        "chat", "tiny-random-llama", ["even", "chars weight=0"], tmp_path / "pairs.jsonl", num_prompts=24,
        max_new_tokens=6, batch_size=12,
    )  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert stats.unscored > 0 and stats.pairs + stats.ties + stats.unscored == 24 and len(rows) == stats.pairs
    assert all(len(r["chosen"]) % 2 == 0 and len(r["rejected"]) % 2 == 0 for r in rows)
    assert f"{stats.unscored} not comparable" in stats.summary()
    # a gold stack that scored nothing is no tie: it was counted as 24 ties of two 0 totals
    register(reward_plugin("never", lambda ss: [None] * len(ss)), "never-plugin")
    stats = label_pairs("chat", "tiny-random-llama", ["never"], tmp_path / "none.jsonl", num_prompts=24,
                        max_new_tokens=6, batch_size=12)  # fmt: skip
    assert (stats.pairs, stats.ties, stats.unscored) == (0, 0, 24)


def test_label_pairs_output_trains_through_the_cli(register, tmp_path, capsys):
    register(reward_plugin("chars", char_count), "chars-plugin")
    out = tmp_path / "pairs.jsonl"
    stats = label_pairs(
        "chat", "tiny-random-llama", ["chars"], out, num_prompts=24, max_new_tokens=6, batch_size=12
    )
    assert stats.pairs + stats.ties == 24 and stats.flipped == 0
    # without a terminal (a log, CI) the bar is not drawn: a line at each tenth said nothing went quiet
    lines = re.findall(
        r"label-pairs: (\d+)/24 prompts \(\d+%\), \d+ pairs, \d+ ties, 0 flipped, \d+ s",
        capsys.readouterr().err,
    )
    assert len(lines) > 1 and lines[-1] == "24"
    assert len(read_pairs(out)) == stats.pairs  # label-pairs' extra keys are ignored
    argv = ["train-rm", str(out), "--output", str(tmp_path / "rm"), "--model", "tiny-random-llama",
            "--eval-fraction", "0.25", "--learning-rate", "1e-3"]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "accuracy" in printed and f"rm_score model='{tmp_path / 'rm'}'" in printed
    assert (tmp_path / "rm" / REPORT).is_file()
    # in a fresh process, where DeepSpeed is imported for the first time when the model is saved: its
    # "[WARNING] ... Setting accelerator to CPU" line was printed on stdout, amid the report
    textgym_cli = Path(sys.executable).with_name("textgym")
    result = subprocess.run([str(textgym_cli), *argv[:3], str(tmp_path / "rm2"), *argv[4:]], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert result.returncode == 0 and result.stdout.startswith("held-out pairs:"), result.stdout
    assert re.search(
        r"train-rm: (\d+)/\1 steps \(100%\), batch loss \d\.\d{3}, batch accuracy", result.stderr
    )
    # an accuracy on a few pairs says how many: "0.500 -> 1.000" on 2 pairs read as more than it is
    assert re.search(r"accuracy +\d\.\d{3} -> \d\.\d{3} \(\d -> \d of 6 pairs\)", printed)


@pytest.mark.slow
def test_smollm2_reward_model_learns_the_marker_and_loads_in_rm_score(tmp_path):
    """The embedded model end to end (its pad token, chat template, saved config): 6 steps, ~30 s here (3x
    the default learning rate, so that so few steps show it learning)."""
    rows = marker_pairs(32, seed=2)
    report = train_reward_model(rows, tmp_path / "rm", epochs=2, eval_fraction=0.25, learning_rate=3e-5)
    assert report.model == "smollm2-135m-instruct" and report.eval_pairs == 8
    assert report.after.loss < report.before.loss - 0.1  # measured: 0.705 -> 0.488
    assert report.after.mean_margin > report.before.mean_margin + 0.3  # measured: -0.012 -> +0.608
    held_out = [rows[line - 1] for line in report.eval_lines]
    margins = rm_score_margins(tmp_path / "rm", held_out)
    assert sum(margins) / len(margins) == pytest.approx(report.after.mean_margin, abs=1e-3)


# -- bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"prompt": "p", "chosen": "a", "rejected": "b"}', '{"prompt": "p", "chosen": "a"}'],
         r"line 2: the row has no 'rejected' \(it has 'prompt', 'chosen'\)"),
        (['{"prompt": "p", "chosen": "a", "rejected": "b"}', "", '{"prompt": "p", "chosen": "x", "rejected": "x"}'],
         r"line 3: chosen and rejected are the same text \('x'\)"),
        (['{"prompt": "p", "chosen": "a", "rejected": 3}'], r"line 1: 'rejected' must be a string, not 3"),
        (['{"prompt": "p", "chosen": "a", "rejected": "b"', ], r"line 1: not valid JSON"),
        (["[1, 2]"], r"line 1: expected an object with prompt, chosen and rejected"),
        ([""], r"has no pairs"),
        # a JSON array (an export), pretty-printed or on one line: the file is JSONL, and a one-line array
        # was printed whole in the message
        (["[", '  {"prompt": "p", "chosen": "a", "rejected": "b"}', "]"],
         r"line 1: not valid JSON \(.*\)\. The file reads as JSONL: one object per line, not a JSON array"),
        ([json.dumps([{"prompt": "p" * 500, "chosen": "a", "rejected": "b"}] * 50)],
         r"line 1: expected an object .*…( \(the file reads as JSONL: one object per line, not a JSON array\))\.$"),
        # TRL's conversational format
        (['{"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"}'],
         r"line 1: 'chosen' must be a string, not \[\{'role'.* \(a list of chat messages: give the texts"),
        # valid JSON, no text: it crashed in the tokenizer with no line named
        (['{"prompt": "p", "chosen": "a", "rejected": "b"}', '{"prompt": "p", "chosen": "nice \\ud83d", "rejected": "b"}'],
         r"line 2: 'chosen' holds a lone surrogate"),
    ],
)  # fmt: skip
def test_bad_pairs_files_name_the_line(tmp_path, lines, message):
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PairsError, match=message):
        train_reward_model(path, tmp_path / "rm", model="tiny-random-llama")


def test_a_pairs_file_not_in_utf8_names_its_line_and_a_bom_is_read(tmp_path):
    path = tmp_path / "pairs.jsonl"
    rows = [json.dumps(row) for row in marker_pairs(3)]
    path.write_bytes("\n".join(rows).encode() + b'\n{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}\n')
    with pytest.raises(
        PairsError, match=r"line 4: not UTF-8 \(byte 0xe9 at column 16\); save the file as UTF-8"
    ):
        read_pairs(path)
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(rows).encode("utf-8"))  # as some editors save UTF-8
    assert len(read_pairs(path)) == 3


def test_a_missing_pairs_file_is_one_line_on_the_cli(tmp_path, capsys):
    assert main(["train-rm", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "rm")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "textgym: error: pairs file" in err and "nope.jsonl" in err and "does not exist" in err
    assert main(["train-rm", str(tmp_path), "--output", str(tmp_path / "rm")]) == 2
    assert f"pairs file {str(tmp_path)!r} is a directory" in capsys.readouterr().err


def test_too_few_pairs_for_the_held_out_split(tmp_path):
    with pytest.raises(
        PairsError, match=r"4 pair\(s\) at eval_fraction 0.1 leave 0 held-out .* at least 5 pairs"
    ):
        train_reward_model(marker_pairs(4), tmp_path / "rm", model="tiny-random-llama")
    with pytest.raises(PairsError, match="leave 2 held-out and 0 training"):
        train_reward_model(marker_pairs(2), tmp_path / "rm", eval_fraction=0.9)


def test_copies_of_a_pair_are_never_on_both_sides_of_the_split():
    """The split was by position: a pairs file holding each pair twice measured held-out accuracy partly on
    training pairs (6 of 10 in one such file)."""
    from textgym.pairs import Pair, split_pairs

    distinct = [Pair(f"p{i}", f"good {i}", f"bad {i}", i) for i in range(20)]
    import numpy as np

    _, unique_held_out = split_pairs(distinct, 0.25, seed=0)
    assert len(unique_held_out) == 5  # without copies: the split as it was, by the same permutation
    assert [p.line for p in unique_held_out] == sorted(np.random.default_rng(0).permutation(20)[:5])
    twice = [*distinct, *(Pair(p.prompt, p.chosen, p.rejected, p.line + 20) for p in distinct)]
    train, held_out = split_pairs(twice, 0.25, seed=0)
    key = lambda p: (p.prompt, p.chosen, p.rejected)  # noqa: E731
    assert held_out and not {key(p) for p in train} & {key(p) for p in held_out}
    assert len(held_out) == 10 and len(train) + len(held_out) == 40
    with pytest.raises(PairsError, match="the 6 pairs are copies of 1 distinct pair"):
        split_pairs([distinct[0]] * 6, 0.25, seed=0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"epochs": 0}, r"epochs \(--epochs\) must be an integer >= 1, not 0"),
        ({"learning_rate": 0.0}, r"learning_rate \(--learning-rate\) must be a finite number > 0, not 0.0"),
        ({"learning_rate": -1e-5}, r"must be a finite number > 0, not -1e-05"),
        ({"learning_rate": float("inf")}, r"must be a finite number > 0, not inf"),  # trained to all-nan
        ({"learning_rate": True}, r"must be a finite number > 0, not True"),
        (
            {"head_learning_rate": 0},
            r"head_learning_rate \(--head-learning-rate\) must be a finite number > 0, not 0, e.g. 0.001",
        ),
        ({"batch_size": 0}, r"batch_size \(--batch-size\) must be an integer >= 1"),
        ({"eval_fraction": 1.0}, r"eval_fraction \(--eval-fraction\) must be between 0 and 1"),
        ({"lora": "{r = }"}, r"--lora '\{r = \}' is not a TOML inline table"),
        ({"lora": "8"}, r"must be a TOML inline table"),
        ({"seed": -1}, r"seed \(--seed\) must be an integer in \[0, 2\*\*32\), not -1"),  # numpy's traceback
    ],
)
def test_bad_training_settings(tmp_path, settings, message):
    with pytest.raises(ConfigError, match=message):
        train_reward_model(marker_pairs(20), tmp_path / "rm", model="tiny-random-llama", **settings)


def test_unknown_or_unusable_models(tmp_path):
    pairs = marker_pairs(20)
    with pytest.raises(
        UnknownNameError, match=r"unknown model 'tiny-random-lama'. Did you mean 'tiny-random-llama'"
    ):
        train_reward_model(pairs, tmp_path / "rm", model="tiny-random-lama")
    with pytest.raises(ModelError, match=r"model directory '\./no/such/dir' does not exist"):
        train_reward_model(pairs, tmp_path / "rm", model="./no/such/dir")
    with pytest.raises(ModelError, match="'tiny-char-llama' has no Hugging Face model and tokenizer to save"):
        train_reward_model(pairs, tmp_path / "rm", model="tiny-char-llama")
    with pytest.raises(ConfigError, match=r"--lora \{rank = 8\}: .*'rank'"):  # as TOML, not peft's repr
        train_reward_model(pairs, tmp_path / "rm", model="tiny-random-llama", lora={"rank": 8})
    # peft's "got multiple values for keyword argument 'task_type'" said nothing of who set it
    with pytest.raises(ConfigError, match=r"--lora \{task_type = \"CAUSAL_LM\"\}: task_type is textgym's to set "
                                          r"\('SEQ_CLS' here\)"):  # fmt: skip
        train_reward_model(pairs, tmp_path / "rm", model="tiny-random-llama", lora={"task_type": "CAUSAL_LM"})


def test_a_max_length_beyond_a_models_learned_positions_is_named_or_cut_to_them(tmp_path, tokenizer):
    """GPT-2 (learned positions) with n_positions=32: train-rm died with an IndexError in its embedding, and
    rm_score too; rotary models (tiny-random-llama) have no such table, and no limit is taken from them."""
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    from textgym.scoring import position_limit

    config = GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=16, n_layer=1, n_head=2,
                        pad_token_id=tokenizer.pad_token_id, num_labels=1)  # fmt: skip
    for cls, name in ((GPT2LMHeadModel, "lm"), (GPT2ForSequenceClassification, "rm")):
        cls(config).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    with pytest.raises(
        ConfigError, match=r"max_length=512 is more than the 32 positions of .*--max-length 32"
    ):
        train_reward_model(marker_pairs(20), tmp_path / "out", model=str(tmp_path / "lm"))
    with pytest.raises(PluginArgumentError, match=r"max_length=64 is more than the model's 32 positions"):
        make_reward("rm_score", model=str(tmp_path / "rm"), max_length=64)
    rm = make_reward(
        "rm_score", model=str(tmp_path / "rm"), chat_template=False
    )  # its default, 512: cut to 32
    long = " ".join(["word"] * 100)
    assert rm.max_length == 32 and all(math.isfinite(v) for v in rm([Sample("p", long, (), (), "stop", {})]))
    assert position_limit(textgym_model("tiny-random-llama")) is None


def textgym_model(name):
    import textgym

    return textgym.load_model(name)[0]


def test_a_model_directory_without_a_tokenizer_or_with_a_two_label_head_is_named(tmp_path):
    """Both were tracebacks from inside transformers."""
    from transformers import AutoModelForSequenceClassification

    from textgym.models import load_model

    model, tokenizer = load_model("tiny-random-llama")
    model.save_pretrained(tmp_path / "weights-only")
    with pytest.raises(
        ModelError, match=r"weights-only has no Hugging Face tokenizer that loads .*save_pretrained"
    ):
        train_reward_model(marker_pairs(20), tmp_path / "rm", model=tmp_path / "weights-only")
    model.save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    two = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lm", num_labels=2)
    two.save_pretrained(tmp_path / "two-labels")
    tokenizer.save_pretrained(tmp_path / "two-labels")
    with pytest.raises(ModelError, match=r"two-labels is a classifier whose head does not have one output"):
        train_reward_model(marker_pairs(20), tmp_path / "rm", model=tmp_path / "two-labels")
    # a tokenizer with ids the model does not embed: "IndexError: index out of range in self", a traceback
    model.resize_token_embeddings(64)
    model.save_pretrained(tmp_path / "other-tokenizer")
    tokenizer.save_pretrained(tmp_path / "other-tokenizer")
    with pytest.raises(ModelError, match=rf"its tokenizer has {len(tokenizer)} tokens, its model embeds 64"):
        train_reward_model(marker_pairs(20), tmp_path / "rm", model=tmp_path / "other-tokenizer")


def test_pairs_that_format_to_the_same_tokens_or_to_none_are_refused_with_their_cause(tmp_path):
    """A chat template that trims made "Hello!" and "Hello! " one text, and the message said to raise
    --max-length, which cannot help; an empty text with no chat template and no BOS was scored at a pad."""
    import copy

    from textgym.models import load_model

    model, shared = load_model("tiny-random-llama")
    tokenizer = copy.deepcopy(shared)  # the zoo's tokenizer is cached and shared: changed here, not there
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] | trim }}\n{% endfor %}"
    model.save_pretrained(tmp_path / "trims")
    tokenizer.save_pretrained(tmp_path / "trims")
    rows = marker_pairs(20)
    rows[5] = {"prompt": "Say hi.", "chosen": "Hello!", "rejected": "Hello! "}
    with pytest.raises(
        PairsError, match=r"1 pair\(s\) \(line 6\) have the same chosen and rejected tokens once formatted"
    ):
        train_reward_model(rows, tmp_path / "rm", model=tmp_path / "trims")
    tokenizer.chat_template = None
    tokenizer.add_bos_token = False
    model.save_pretrained(tmp_path / "bare")
    tokenizer.save_pretrained(tmp_path / "bare")
    rows[5] = {"prompt": "", "chosen": "", "rejected": "x"}
    with pytest.raises(PairsError, match=r"1 pair\(s\) \(line 6\) format to no tokens"):
        train_reward_model(rows, tmp_path / "rm", model=tmp_path / "bare")


# chat_template=False on purpose
@pytest.mark.filterwarnings("ignore:rm_score.*formatted otherwise:UserWarning")
def test_rm_score_names_a_text_that_formats_to_no_tokens(toy, tmp_path):
    """A batch of such texts crashed in the forward ("cannot reshape tensor of 0 elements"); mixed with
    others, the score was read at a pad token."""
    import shutil

    from transformers import AutoTokenizer

    out, _, _ = toy
    shutil.copytree(out, tmp_path / "rm")
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template, tokenizer.add_bos_token = None, False
    (tmp_path / "rm" / "chat_template.jinja").unlink()  # saving a tokenizer without one leaves the file
    tokenizer.save_pretrained(tmp_path / "rm")
    rm = make_reward("rm_score", model=str(tmp_path / "rm"))
    for batch in (
        [Sample("", "", (), (), "stop", {})],
        [Sample("p", "x", (), (), "stop", {}), Sample("", "", (), (), "stop", {})],
    ):
        with pytest.raises(RewardError, match=r"formats to no tokens.*template ="):
            rm(batch)
    assert (
        len(
            make_reward("rm_score", model=str(tmp_path / "rm"), template="Q: {prompt} A: {completion}")(batch)
        )
        == 2
    )


def test_on_a_gpu_the_held_out_figures_are_measured_in_rm_scores_bf16(toy):
    """rm_score scores in bf16 by default on a GPU; the report's figures were fp32 there (a SmolLM2 margin
    0.83 reported, 0.72 scored). The trainer's bf16 evaluation equals rm_score's with bf16 on, and leaves the
    model's fp32 weights in place."""
    import torch

    from textgym.pairs import Pair
    from textgym.rm_scoring import PairScorer, load_for_training

    out, rows, report = toy
    assert report.settings["bf16"] is False  # this CPU: fp32, as rm_score scores here by default
    model, tokenizer = load_for_training(out, seed=0)
    scorer = PairScorer(model, tokenizer, 512, "cpu")
    held_out = [rows[line - 1] for line in report.eval_lines]
    pairs = [Pair(r["prompt"], r["chosen"], r["rejected"], i) for i, r in enumerate(held_out, start=1)]
    metrics, _ = scorer.evaluate(pairs, 8, bf16=True)
    rm = make_reward("rm_score", model=str(out), bf16=True, batch_size=4)
    chosen = rm([Sample(p.prompt, p.chosen, (), (), "stop", {}) for p in pairs])
    rejected = rm([Sample(p.prompt, p.rejected, (), (), "stop", {}) for p in pairs])
    margins = [c - r for c, r in zip(chosen, rejected)]
    assert metrics.mean_margin == pytest.approx(sum(margins) / len(margins), abs=1e-3)
    assert metrics.mean_margin != pytest.approx(report.after.mean_margin, abs=1e-6)  # not the fp32 figure
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert scorer.evaluate(pairs, 8)[0].mean_margin == pytest.approx(report.after.mean_margin, abs=1e-5)


def test_train_rm_never_replaces_a_directory_it_did_not_write(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="exists and is not a train-rm output"):
        train_reward_model(marker_pairs(20), tmp_path / "mine", model="tiny-random-llama")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"label_noise": 0.5}, r"label_noise must be in \[0, 0.5\), not 0.5"),
        ({"label_noise": -0.1}, r"label_noise must be in \[0, 0.5\), not -0.1"),
        ({"temperature": 0.0}, r"temperature must be a finite number > 0, not 0.0: greedy decoding"),
        ({"temperature": math.inf}, r"temperature must be a finite number > 0, not inf"),  # it sampled
        ({"temperature": "1"}, r"temperature must be a finite number > 0, not '1'"),  # a TypeError
        ({"label_noise": "0.1"}, r"label_noise must be in \[0, 0.5\), not '0.1'"),
        ({"num_prompts": 0}, r"num_prompts must be a positive integer"),
        ({"num_prompts": True}, r"num_prompts must be a positive integer"),
        ({"top_k": 1}, r"top_k must be 0 \(off\) or an integer >= 2, not 1: top_k = 1 is greedy"),
        ({"top_k": -1}, r"top_k must be 0 \(off\) or an integer >= 2, not -1"),
        ({"top_k": 10**7}, r"top_k 10000000 is larger than the vocabulary \(\d+ tokens\)"),  # a traceback
        ({"rewards": []}, r"give the gold reward stack"),
        ({"seed": -1}, r"seed must be an integer in \[0, 2\*\*32\), not -1"),  # numpy's error, after loading
        ({"seed": 2**64}, r"seed must be an integer in \[0, 2\*\*32\)"),  # an overflow inside torch
        ({"seed": 1.5}, r"seed must be an integer"),
        ({"policy": "chars"}, r"policy 'chars' is a tokenizer without weights"),  # an AttributeError
    ],
)
def test_bad_label_pairs_settings(tmp_path, settings, message):
    kwargs = {"rewards": ["length_penalty target=4"], "policy": "tiny-random-llama", **settings}
    rewards, policy = kwargs.pop("rewards"), kwargs.pop("policy")
    with pytest.raises(ConfigError, match=message):
        label_pairs(
            "echo" if policy == "chars" else "chat", policy, rewards, tmp_path / "pairs.jsonl", **kwargs
        )
    assert not (tmp_path / "pairs.jsonl").exists()


def test_label_pairs_expands_a_home_directory_as_its_readers_do(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    label_pairs("chat", "tiny-random-llama", ["length_penalty target=4"], "~/pairs.jsonl", num_prompts=2,
                max_new_tokens=4, progress=False)  # fmt: skip
    assert (tmp_path / "home" / "pairs.jsonl").exists() and not (tmp_path / "~").exists()


def test_label_pairs_refuses_a_directory_as_its_output(tmp_path):
    with pytest.raises(ConfigError, match=f"output '{tmp_path}' is a directory: give the JSONL file"):
        label_pairs("chat", "tiny-random-llama", ["length_penalty target=4"], tmp_path)


def test_a_loss_that_becomes_nan_stops_train_rm_and_saves_nothing(tmp_path):
    """A learning rate far too high trained an all-nan model, saved it and said "wrote" (rm_score: nan)."""
    with pytest.raises(TrainingError, match=r"the loss became nan at step \d+ of 6, so nothing was saved"):
        train_reward_model(marker_pairs(20), tmp_path / "rm", model="tiny-random-llama", epochs=2,
                           learning_rate=1e30, head_learning_rate=1e30)  # fmt: skip
    assert not (tmp_path / "rm").exists()


def test_the_epoch_loss_is_the_mean_over_its_pairs_not_over_its_batches(tmp_path, monkeypatch):
    """9 training pairs in batches of 8: the last batch of 1 weighed as much as the 8 before it."""
    import textgym.reward_model as rm

    per_pair = []

    def fit(scorer, train, *args):  # the model barely moves (learning rates 1e-30): its loss before = after
        losses = real_fit(scorer, train, *args)
        per_pair.append(scorer.evaluate(train, 100)[0].loss)
        return losses

    real_fit = rm._fit
    monkeypatch.setattr(rm, "_fit", fit)
    report = train_reward_model(marker_pairs(12), tmp_path / "rm", model="tiny-random-llama", batch_size=8,
                                eval_fraction=0.25, learning_rate=1e-30, head_learning_rate=1e-30)  # fmt: skip
    assert report.train_pairs == 9
    assert report.train_loss[0] == pytest.approx(per_pair[0], abs=1e-4)


def test_pairs_that_are_one_text_once_cut_to_max_length_are_refused(tmp_path):
    """Their margin is 0 whatever the model: trained on without signal and counted as wrong answers."""
    rows = marker_pairs(20)
    tail = " and".join([" the end"] * 30)
    rows[3] = {"prompt": "p", "chosen": "good" + tail, "rejected": "bad" + tail}
    with pytest.raises(PairsError, match=r"1 pair\(s\) \(line 4\) have the same chosen and rejected text once "
                       r"cut to max_length=16 tokens \(from the left\).*raise --max-length"):  # fmt: skip
        train_reward_model(rows, tmp_path / "rm", model="tiny-random-llama", max_length=16)


def test_pairs_files_split_lines_at_newlines_only_and_pairs_keep_their_lines(tmp_path):
    """JSON strings may hold U+2028 and U+0085 raw; splitlines() cut the row there ("not valid JSON")."""
    rows = [
        {"prompt": "p\u2028q", "chosen": "a\x85b", "rejected": "c"},
        {"prompt": "p", "chosen": "x", "rejected": "y"},
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    pairs = read_pairs(path)
    assert [p.prompt for p in pairs] == ["p\u2028q", "p"] and [p.line for p in pairs] == [1, 2]
    assert [p.line for p in read_pairs(pairs[1:])] == [2]  # not renumbered from 1 (RMReport.eval_lines)


def test_the_advice_for_too_few_pairs_is_enough():
    from textgym.pairs import split_pairs

    pairs = read_pairs([{"prompt": "p", "chosen": f"a{i}", "rejected": "b"} for i in range(3)])
    with pytest.raises(PairsError, match="leave 2 held-out and 0 training .* Give at least 3 pairs"):
        split_pairs(pairs[:2], 0.75, 0)  # it said 2, which fails the same way
    train, held_out = split_pairs(pairs, 0.75, 0)
    assert len(train) == 1 and len(held_out) == 2
    # at every fraction the advice is the fewest pairs that split: a formula said 10 at 0.95, where 10 pairs
    # leave 10 held-out (0.95 * 10 + 0.5 rounds down to 9.999...) and 11 is the least
    many = read_pairs([{"prompt": "p", "chosen": f"a{i}", "rejected": "b"} for i in range(1200)])
    for fraction in (0.95, 0.975, 0.98, 0.99, 0.995, 0.999, 0.001, 0.5, 0.1):
        with pytest.raises(PairsError, match=r"Give at least (\d+) pairs") as refused:
            split_pairs(many[:1], fraction, 0)
        need = int(re.search(r"at least (\d+)", str(refused.value)).group(1))
        split_pairs(many[:need], fraction, 0)  # enough
        with pytest.raises(PairsError):
            split_pairs(many[: need - 1], fraction, 0)  # and the fewest
    for bad in (0, 1, 1.5, math.nan):
        with pytest.raises(
            PairsError, match=f"eval_fraction must be between 0 and 1 \\(exclusive\\), not {bad}"
        ):
            split_pairs(many, bad, 0)


def test_a_rewards_file_without_a_rewards_list(tmp_path):
    (tmp_path / "gold.toml").write_text('rewards = [{ name = "sentiment" }]\n[env]\nrewards = []\n')
    with pytest.raises(ConfigError, match=r"unknown top-level key\(s\) 'env'; it takes rewards = \[...\]"):
        label_pairs("chat", "tiny-random-llama", [str(tmp_path / "gold.toml")], tmp_path / "p.jsonl")
    (tmp_path / "gold.toml").write_text("gates = []\n")
    with pytest.raises(ConfigError, match="needs a top-level list"):
        label_pairs("chat", "tiny-random-llama", [str(tmp_path / "gold.toml")], tmp_path / "p.jsonl")


def test_a_rewards_files_gates_and_aggregate_label_the_pairs_and_its_fn_files_are_its_own(
    tmp_path, monkeypatch
):
    """Its gates and aggregate were dropped unsaid (pairs labelled by another stack than the file's), and a
    relative fn file resolved against the working directory instead of the file's."""
    (tmp_path / "gold").mkdir()
    (tmp_path / "gold" / "chars.py").write_text(
        "def chars(samples):\n    return [float(len(s.completion)) for s in samples]\n"
    )
    (tmp_path / "gold" / "gold.toml").write_text(
        'rewards = [{ fn = "chars.py:chars" }]\ngates = [{ component = "chars", min = 40, action = "zero" }]\n'
    )
    monkeypatch.chdir(tmp_path)  # not the file's directory
    label_pairs("chat", "tiny-random-llama", ["gold/gold.toml"], "p.jsonl", num_prompts=24, max_new_tokens=6,
                batch_size=12)  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "p.jsonl").read_text().splitlines()]
    scores = [r[k] for r in rows for k in ("chosen_score", "rejected_score")]
    assert rows and all(x == 0 or x >= 40 for x in scores) and 0 in scores  # the gate zeroed the short ones
    with pytest.raises(
        ConfigError, match="has gates or an aggregate: it is the whole gold stack; give it alone"
    ):
        label_pairs("chat", "tiny-random-llama", ["gold/gold.toml", "length_penalty target=3"], "q.jsonl")


# -- the docs --------------------------------------------------------------------------------------------

DOC = Path(__file__).parents[1] / "docs" / "reward-models.md"


def test_every_command_in_the_docs_parses(monkeypatch):
    """Each ``textgym ...`` line of docs/reward-models.md is accepted by the CLI as written (the doc tests do
    not run them: on SmolLM2 they take minutes)."""
    import shlex

    import textgym.cli

    ran = []
    monkeypatch.setattr(textgym.cli, "_train_rm", lambda args: ran.append(args) or 0)
    monkeypatch.setattr(textgym.cli, "_label_pairs", lambda args: ran.append(args) or 0)
    monkeypatch.setattr(textgym.cli, "_sample", lambda args: ran.append(args) or 0)
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    commands = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    commands = [c for c in commands if c.startswith("textgym ")]
    assert len(commands) >= 3
    for command in commands:
        assert main(shlex.split(command, comments=True)[1:]) == 0, command
    assert len(ran) == len(commands)


def test_the_python_snippet_in_the_docs_runs(tmp_path, monkeypatch, capsys):
    (block,) = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    monkeypatch.chdir(tmp_path)
    exec(compile(block, str(DOC), "exec"), {})
    printed = capsys.readouterr().out
    assert "pairs to runs/tiny/pairs.jsonl" in printed and "accuracy" in printed
    assert re.search(r"^\[-?\d+\.\d+\]$", printed, flags=re.M)  # the proxy's score of one sample
