"""The multi-turn rollout: replies prefilled through the KV cache as one chunk per turn, rows ending their
turns on different steps in the same batch, give what one forward over the whole conversations gives."""

import json

import numpy as np
import pytest
import torch
from lm_helpers import CHARS, char_llama

from textgym import Reply, TextGenVectorEnv
from textgym.agents.ppo_core import logprobs_from_logits
from textgym.sampling import allowed_actions, mask_logits, rollout


def varying_replies(conversations):
    """Replies of different lengths (1 to 5 letters), so that the chunks of one step differ in length."""
    return [Reply("abcdefgh"[: 1 + (len(c.last) + c.agent_turns) % 5]) for c in conversations]


varying_replies.name = "varying"


def full_forward_logprobs(model, r, temperature, env):
    """One forward over the whole conversations, over the tokens ``env`` lets the agent choose (no pad)."""
    ids = torch.cat([r.query_ids, r.response_ids], dim=1)  # (N, P+T): the whole conversations, no gaps
    mask = torch.cat([r.query_mask, r.response_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
    P = r.query_ids.shape[1]
    logits = mask_logits(out.logits[:, P - 1 : -1], allowed_actions(env, "cpu"))
    logprobs = logprobs_from_logits(logits, r.response_ids, temperature) * r.action_mask
    return logprobs, out.hidden_states[-1][:, P - 1 : -1]


def turn_end_steps(r, eos_id):
    """For each row, the agent steps (0-based action counts) on which its turns ended."""
    steps = []
    for row in range(len(r.response_ids)):
        actions = r.response_ids[row][r.action_mask[row].bool()].tolist()
        steps.append(tuple(k for k, token in enumerate(actions) if token == eos_id))
    return steps


def test_kv_cached_multi_turn_logprobs_equal_one_full_forward_with_turns_ending_on_different_steps():
    model = char_llama()
    env = TextGenVectorEnv(
        num_envs=6, model=CHARS, prompts=["abc", "de", "h", "gfed"], rewards=[], max_new_tokens=24,
        max_prompt_tokens=4, responder=varying_replies, max_turns=4, autoreset_mode="Disabled",
        prompt_order="sequential",
    )  # fmt: skip
    r = rollout(model, env, temperature=0.7, seed=1, keep_hidden=True)
    steps = turn_end_steps(r, CHARS.eos_token_id)
    assert (
        sum(len(s) for s in steps) >= 6 and len({s[0] for s in steps if s}) >= 3
    )  # turns end on different steps
    env_tokens = r.response_mask.bool() & ~r.action_mask.bool()
    assert env_tokens.sum() >= 10  # replies sit inside the response region
    full, hidden = full_forward_logprobs(model, r, 0.7, env)
    m = r.action_mask.bool()
    ratio = (full[m] - r.logprobs[m]).exp()
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)  # PPO ratio 1
    torch.testing.assert_close(full, r.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(hidden[m], r.hidden[m], atol=1e-4, rtol=0)
    assert (r.logprobs[~m] == 0).all()  # nothing is kept for environment tokens
    # the env's record of what it wrote is the rollout's complement of the agent's tokens
    P = env.max_prompt_tokens
    np.testing.assert_array_equal(env.env_token_mask[:, P:], env_tokens.numpy().astype(np.int8))


def test_kv_cached_multi_turn_rollout_with_the_chat_template_matches_one_forward(tiny):
    """SmolLM2's chat template: replies as `tool` messages, turns ended by a stop string (so the env writes
    the end of the agent's message), rows ending turns on different steps."""
    model, tok = tiny

    def tool(conversations):
        return [
            Reply(["ok", "the result is 42", "no"][c.agent_turns % 3] * (1 + len(c.last) % 3))
            for c in conversations
        ]

    tool.name, tool.role = "tool", "tool"
    env = TextGenVectorEnv(
        num_envs=4, model="tiny-random-llama", prompts=["Hi", "Tell me a long story about a dragon.", "Why?"],
        rewards=[], max_new_tokens=64, stop=["e"], responder=tool, max_turns=5, autoreset_mode="Disabled",
        prompt_order="sequential",
    )  # fmt: skip
    r = rollout(model, env, temperature=0.7, seed=0)
    text = tok.decode(r.response_ids[0][r.response_mask[0].bool()])
    assert "<|im_end|>\n<|im_start|>tool\n" in text and "<|im_start|>assistant\n" in text
    lengths = [[len(t["text"]) for t in e["turns"] if t["role"] == "assistant"] for e in r.infos]
    assert len({tuple(x[:2]) for x in lengths}) > 1  # rows end their turns after different numbers of tokens
    full, _ = full_forward_logprobs(model, r, 0.7, env)
    torch.testing.assert_close(full, r.logprobs, atol=1e-5, rtol=0)


def test_rollout_returns_add_turn_rewards_to_the_stack_total_and_count_agent_tokens():
    def paid(conversations):
        return [Reply("ab", reward=0.5, done=c.agent_turns >= 2) for c in conversations]

    paid.name = "paid"
    env = TextGenVectorEnv(
        num_envs=4, model=CHARS, prompts=["ab"], max_new_tokens=30, max_prompt_tokens=2, responder=paid,
        rewards=[{"name": "length_penalty", "target": 2}], autoreset_mode="Disabled",
    )  # fmt: skip
    r = rollout(char_llama(), env, temperature=1.0, seed=0)
    assert any(info["finish_reason"] == "stop" for info in r.infos)
    for row, info in enumerate(r.infos):
        total = info["reward_components"]["length_penalty"] if info["finish_reason"] != "length" else None
        assert info["num_tokens"] == int(r.action_mask[row].sum())
        if info["finish_reason"] == "stop":
            assert info["turn_rewards"] == [0.5, 0.5]
            assert info["reward"] == pytest.approx(1.0 + total) and r.scores[row] == pytest.approx(
                info["reward"]
            )


def test_sample_command_prints_multi_turn_episodes_turn_by_turn(tmp_path, capsys):
    from textgym.cli import main

    out = tmp_path / "rows.jsonl"
    args = ["sample", "--model", "tiny-random-llama", "--prompts", "guess_number", "--responder", "guess_number",
            "--max-turns", "3", "--num", "2", "--max-new-tokens", "40", "--max-prompt-tokens", "80", "--stop", " ",
            "--reward", "length_penalty weight=0 target=4", "--output", str(out)]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "prompt: I am thinking of a whole number" in printed
    assert "  > assistant: " in printed and "  <      user: Please answer with one whole number." in printed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [t["role"] for t in rows[0]["turns"]][:2] == ["assistant", "user"]
