import json

import pytest
import torch

from textgym import TextGenVectorEnv
from textgym.cli import main
from textgym.sampling import sample_episodes

PROMPTS = ["Hi", "Tell me a long story about a dragon and a knight.", "Why?"]


def test_kv_cached_greedy_sampling_matches_generate_with_left_padded_prompts(tiny):
    model, tok = tiny
    env = TextGenVectorEnv(
        num_envs=3, model="tiny-random-llama", prompts=PROMPTS, rewards=[{"name": "length_penalty", "target": 4}],
        max_new_tokens=6, prompt_order="sequential", autoreset_mode="Disabled",
    )  # fmt: skip
    episodes = sample_episodes(model, env, temperature=0)
    assert [e["prompt"] for e in episodes] == PROMPTS
    for episode in episodes:
        ids = env.episodes.encode_prompt(PROMPTS.index(episode["prompt"]))
        out = model.generate(
            torch.from_numpy(ids[None]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        )  # fmt: skip
        new = out[0, len(ids) :].tolist()
        if tok.eos_token_id in new:
            new = new[: new.index(tok.eos_token_id)]
        assert episode["completion"] == tok.decode(new, skip_special_tokens=True)
        assert set(episode["reward_components"]) == {"length_penalty"}


def test_sampling_is_reproducible_with_a_seed(tiny):
    model, _ = tiny
    env = TextGenVectorEnv(
        num_envs=2,
        model="tiny-random-llama",
        prompts=PROMPTS,
        rewards=[{"name": "sentiment"}],
        max_new_tokens=5,
        autoreset_mode="Disabled",
    )
    first = sample_episodes(model, env, temperature=1.0, seed=3)
    assert sample_episodes(model, env, temperature=1.0, seed=3) == first


def test_sample_command_prints_a_table_and_writes_jsonl(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    args = [
        "sample",
        "--model",
        "tiny-random-llama",
        "--num",
        "3",
        "--batch-size",
        "2",
        "--max-new-tokens",
        "4",
    ]
    args += ["--reward", "sentiment", "--reward", "length_penalty weight=0.5 target=2", "--output", str(out)]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "prompt" in table and "sentiment" in table and "length_penalty" in table and "total" in table
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3 and [r["prompt"] for r in rows] == [
        "Write one sentence about the sea.",
        "Describe your ideal weekend in one sentence.",
        "Give me a tip for learning to cook.",
    ]
    for row in rows:
        expected = row["reward_components"]["sentiment"] + 0.5 * row["reward_components"]["length_penalty"]
        assert row["reward"] == pytest.approx(expected)


def test_sample_command_bad_reward_is_a_clear_error(capsys):
    assert main(["sample", "--model", "tiny-random-llama", "--reward", "lenght_penalty"]) == 2
    assert "unknown reward 'lenght_penalty'. Did you mean 'length_penalty'?" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_on_the_embedded_model(tmp_path, capsys):
    out = tmp_path / "demo.jsonl"
    assert main(["sample", "--num", "4", "--max-new-tokens", "16", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    assert set(rows[0]["reward_components"]) == {"sentiment", "fluency", "safety", "length_penalty"}
    assert all(len(r["completion"].split()) >= 2 for r in rows)  # a real model writes words
