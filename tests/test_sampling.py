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
    # without a seed, each call samples anew, from torch's global stream (torch.manual_seed repeats it)
    completions = [[e["completion"] for e in sample_episodes(model, env, temperature=1.0)] for _ in range(2)]
    assert completions[0] != completions[1]
    again = []
    for _ in range(2):
        torch.manual_seed(7)
        again.append([e["completion"] for e in sample_episodes(model, env, temperature=1.0)])
    assert again[0] == again[1]


@pytest.mark.parametrize("allowed", [None, "ab"])
def test_rollouts_choose_only_the_tokens_the_env_allows(allowed):
    """The rollout sampled from every token of the vocabulary: the pad token (which the env says is never an
    action, and which vanishes from the completion's text) in about 9% of the tiny model's actions, and
    anything outside allowed_tokens."""
    from lm_helpers import char_llama, make_env

    from textgym.sampling import rollout

    env = make_env(64, max_new_tokens=8, allowed_tokens=allowed)
    r = rollout(char_llama(), env, temperature=1.0, seed=0)
    actions = r.response_ids[r.action_mask.bool()]
    assert torch.from_numpy(env.action_masks()[0])[actions].all()
    assert (actions != env.pad_token_id).all()


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
    assert main(["sample", "--model", "tiny-random-llama", "--seed", "-1"]) == 2  # was gymnasium's traceback
    assert "--seed must be in [0, 2**32), not -1." in capsys.readouterr().err
    assert main(["sample", "--model", "tiny-random-llama", "--seed", str(2**32)]) == 2  # numpy's traceback
    assert f"--seed must be in [0, 2**32), not {2**32}." in capsys.readouterr().err


def test_sample_command_bad_model_directory_or_output_path_is_a_clear_error(tmp_path, capsys):
    """Both were tracebacks: transformers' "Couldn't instantiate the backend tokenizer", an IsADirectoryError."""
    (tmp_path / "weights").mkdir()
    (tmp_path / "weights" / "config.json").write_text("{}")
    assert main(["sample", "--model", str(tmp_path / "weights")]) == 2
    assert f"{tmp_path / 'weights'} has no tokenizer files" in capsys.readouterr().err
    (tmp_path / "weights" / "adapter_config.json").write_text("{}")
    assert main(["sample", "--model", str(tmp_path / "weights")]) == 2
    assert "it is a LoRA adapter, not a whole model" in capsys.readouterr().err
    assert main(["sample", "--model", "tiny-random-llama", "--num", "1", "--output", str(tmp_path)]) == 2
    assert f"--output {str(tmp_path)!r} cannot be written" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_on_the_embedded_model(tmp_path, capsys):
    out = tmp_path / "demo.jsonl"
    assert main(["sample", "--num", "4", "--max-new-tokens", "16", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 4
    assert set(rows[0]["reward_components"]) == {"sentiment", "fluency", "safety", "length_penalty"}
    assert all(len(r["completion"].split()) >= 2 for r in rows)  # a real model writes words


def test_rollout_logprobs_equal_one_full_forward_at_the_same_temperature(tiny):
    """Before any update the PPO ratio must be 1: the KV-cached rollout (left padding, positions, masking
    after EOS, temperature) and a single forward over prompt + response give the same log-probs."""
    from textgym.agents.ppo_core import logprobs_from_logits
    from textgym.sampling import allowed_actions, mask_logits, rollout

    model, tok = tiny
    env = TextGenVectorEnv(
        num_envs=3, model="tiny-random-llama", prompts=PROMPTS, rewards=[{"name": "sentiment"}],
        max_new_tokens=8, prompt_order="sequential", autoreset_mode="Disabled", chat_template=False,
    )  # fmt: skip
    result = rollout(model, env, temperature=0.7, seed=0, keep_hidden=True)
    for row, info in enumerate(result.infos):  # mask: ones up to and including the last token, then zeros
        n = int(result.response_mask[row].sum())
        assert result.response_mask[row, :n].all() and not result.response_mask[row, n:].any()
        last = int(result.response_ids[row, n - 1])
        assert (last == tok.eos_token_id) == (info["finish_reason"] == "stop") and (
            n == 8 or last == tok.eos_token_id
        )
    ids = torch.cat([result.query_ids, result.response_ids], dim=1)  # (N, P+T)
    mask = torch.cat([result.query_mask, result.response_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
    P = result.query_ids.shape[1]
    logits = out.logits[:, P - 1 : -1]  # (N, T, V): the logits that chose each response token
    logits = mask_logits(logits, allowed_actions(env, "cpu"))  # over the tokens the env allows (no pad)
    full = logprobs_from_logits(logits, result.response_ids, temperature=0.7) * result.response_mask
    torch.testing.assert_close(full, result.logprobs, atol=1e-5, rtol=0)
    m = result.response_mask.bool()
    torch.testing.assert_close(out.hidden_states[-1][:, P - 1 : -1][m], result.hidden[m], atol=1e-4, rtol=0)
    assert (result.response_ids[~m] == tok.pad_token_id).all() and (result.logprobs[~m] == 0).all()
    assert result.scores.tolist() == [i["reward"] for i in result.infos]


def test_a_diverged_model_fails_the_rollout_with_its_cause():
    import textgym
    from textgym.errors import TrainingError

    model, _ = textgym.load_model("tiny-random-llama")
    with torch.no_grad():
        model.lm_head.weight.fill_(float("nan"))
    env = TextGenVectorEnv(
        num_envs=2, model="tiny-random-llama", prompts=PROMPTS, rewards=[{"name": "length_penalty", "target": 4}],
        max_new_tokens=3, autoreset_mode="Disabled",
    )  # fmt: skip
    for temperature in (1.0, 0.0):  # greedy too: argmax of a NaN row picked a token and went on
        with pytest.raises(TrainingError, match="next-token distribution is not finite"):
            sample_episodes(model, env, temperature=temperature, seed=0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=float("nan")), "temperature must be a finite number >= 0 .0: greedy., not nan"),
        (dict(temperature=float("inf")), "temperature must be a finite number >= 0"),
        (dict(temperature=-1), "temperature must be a finite number >= 0"),
        (dict(top_k=-2), r"top_k must be an integer in \[0, \d+\] .0: off; \d+ tokens in the env., not -2"),
        (dict(top_k=10**6), r"top_k must be an integer in \[0, \d+\]"),
        (dict(top_k=2.5), r"top_k must be an integer"),
    ],
)
def test_bad_rollout_arguments_are_clear_errors(tiny, kwargs, message):
    from textgym.sampling import rollout

    env = TextGenVectorEnv(num_envs=2, model="tiny-random-llama", prompts=PROMPTS, max_new_tokens=3,
                           autoreset_mode="Disabled")  # fmt: skip
    with pytest.raises(ValueError, match=message):
        rollout(tiny[0], env, **kwargs)


def test_a_rollout_with_no_sub_env_reset_returns_no_episodes(tiny):
    import numpy as np

    from textgym.sampling import rollout

    env = TextGenVectorEnv(num_envs=2, model="tiny-random-llama", prompts=PROMPTS, max_new_tokens=3,
                           autoreset_mode="Disabled")  # fmt: skip
    r = rollout(tiny[0], env, seed=0, options={"reset_mask": np.zeros(2, dtype=bool)})
    assert r.infos == [{}, {}]


def test_rollout_log_probs_are_of_the_sampled_tokens_and_hidden_states_come_back_when_asked(tiny):
    """(On a GPU the log-probs come back on the host and the hidden states stay on the model's device;
    tests/test_host_syncs.py counts the copies on every machine.)"""
    from textgym.sampling import rollout

    model, _ = tiny
    env = TextGenVectorEnv(
        num_envs=2, model="tiny-random-llama", prompts=PROMPTS, rewards=[{"name": "length_penalty", "target": 4}],
        max_new_tokens=3, autoreset_mode="Disabled",
    )  # fmt: skip
    r = rollout(model, env, temperature=1.0, seed=0, keep_hidden=True)
    device = next(model.parameters()).device
    assert r.logprobs.device.type == "cpu" and r.hidden.device == device
    assert torch.isfinite(r.logprobs).all() and (r.logprobs[r.response_mask.bool()] < 0).all()
    assert r.hidden.shape[:2] == r.logprobs.shape and r.hidden.shape[2] == model.config.hidden_size


def test_a_tiny_char_llama_checkpoints_policy_samples_from_the_command_line(tmp_path, capsys):
    """Its character tokenizer wrote no files, so `textgym sample --model RUN/checkpoint/policy` (as the
    docs say) failed with "has no tokenizer files" for every Copy run."""
    from textgym.agents.ppo import LMPPO
    from textgym.models import CharTokenizer, load_model

    env = TextGenVectorEnv(num_envs=2, model="tiny-char-llama", prompts="copy", autoreset_mode="Disabled")
    LMPPO("tiny-char-llama", env, verbose=0).save(tmp_path / "ckpt")
    _, tokenizer = load_model(tmp_path / "ckpt" / "policy")
    assert isinstance(tokenizer, CharTokenizer) and tokenizer.alphabet == CharTokenizer().alphabet
    policy = str(tmp_path / "ckpt" / "policy")
    assert (
        main(["sample", "--model", policy, "--prompts", "copy", "--num", "2", "--max-new-tokens", "3"]) == 0
    )
    assert "completion" in capsys.readouterr().out


def test_sampled_normalize_then_sum_totals_are_standardised_over_all_the_episodes():
    """The env standardises a normalize_then_sum stack over the episodes that end on the same step: `textgym
    sample` and label-pairs reported (and ranked by) those totals, where training recombines over the batch."""
    import numpy as np
    from lm_helpers import CHARS, char_llama

    def length(samples):
        return [float(len(s.completion_ids)) for s in samples]

    env = TextGenVectorEnv(
        num_envs=8, model=CHARS, prompts="copy", max_new_tokens=6, max_prompt_tokens=3, autoreset_mode="Disabled",
        rewards={"aggregate": "normalize_then_sum", "components": [length]}, allowed_tokens=[CHARS.encode("a")[0], CHARS.eos_token_id],
    )  # fmt: skip
    episodes = sample_episodes(char_llama(), env, seed=0)
    lengths = np.array([e["reward_components"]["length"] for e in episodes])
    assert len(set(lengths)) > 2  # episodes ended on several steps
    np.testing.assert_allclose([e["reward"] for e in episodes], env.reward_stack.combine({"length": lengths}))


def test_a_partial_reset_rolls_out_only_the_reset_rows_and_recombines_their_totals():
    """Rows left idle kept the previous episode's tokens and masks, and a normalize_then_sum stack failed on
    their empty infos (a KeyError)."""
    import numpy as np
    from lm_helpers import char_llama, make_env, share_of_a

    from textgym import FunctionReward, RewardStack
    from textgym.sampling import rollout

    def count_b(samples):
        return [s.completion.count("b") for s in samples]

    stack = RewardStack([(FunctionReward("a", share_of_a), 1.0), (FunctionReward("b", count_b), 1.0)],
                        aggregate="normalize_then_sum")  # fmt: skip
    env, model = make_env(4, rewards=stack), char_llama()
    sample_episodes(model, env, seed=0)  # every row holds an episode now
    episodes = sample_episodes(model, env, seed=1, options={"reset_mask": np.array([1, 1, 0, 0], bool)})
    assert [bool(e) for e in episodes] == [True, True, False, False]
    # standardised over the two episodes that ran: each component's values sum to 0 across them
    assert episodes[0]["reward"] + episodes[1]["reward"] == pytest.approx(0.0)
    r = rollout(model, env, seed=2, options={"reset_mask": np.array([0, 1, 0, 1], bool)})
    assert r.response_mask[[0, 2]].sum() == 0 and r.action_mask[[0, 2]].sum() == 0
    assert (r.response_ids[[0, 2]] == env.pad_token_id).all() and r.response_mask[[1, 3]].sum() > 0
    assert r.scores[[0, 2]].tolist() == [0.0, 0.0]


def test_top_k_samples_among_the_k_likeliest_tokens(tiny):
    """top_k = 1 keeps the likeliest token alone: sampling at temperature 1 is then greedy decoding, and
    each chosen token has probability 1 under the truncated distribution the log-probs are taken from."""
    from textgym.sampling import rollout

    model, _ = tiny
    env = TextGenVectorEnv(num_envs=3, model="tiny-random-llama", prompts=PROMPTS,
                           rewards=[{"name": "length_penalty", "target": 4}], max_new_tokens=6,
                           prompt_order="sequential", autoreset_mode="Disabled")  # fmt: skip
    greedy = [e["completion"] for e in sample_episodes(model, env, temperature=0)]
    for seed in (0, 1):
        assert [e["completion"] for e in sample_episodes(model, env, top_k=1, seed=seed)] == greedy
    sampled = {tuple(e["completion"] for e in sample_episodes(model, env, seed=s)) for s in range(3)}
    assert tuple(greedy) not in sampled  # without top_k the random model's samples are not greedy
    r = rollout(model, env, top_k=1, seed=0)
    assert (r.logprobs[r.action_mask.bool()] == 0).all()
