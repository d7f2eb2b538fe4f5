"""The multi-turn rollout through TextGenVectorEnv against ``model.generate`` run turn by turn, on the same
conversations.

The env side is LMPPO's rollout on the user-simulator task (the shipped ``followups`` prompts: each answer is
followed by the prompt's next follow-up question; a turn ends at EOS or, by default, at its first sentence's
full stop), greedy, hidden states kept for a value head: agent tokens
one per step through the KV cache, each reply prefilled as one chunk. The ``generate`` side is what a
multi-turn loop built on ``generate`` does: for every turn, one batched ``generate`` call over the
conversation so far (prompt, earlier turns and replies, taken from the env's record so that both sides see
the same conversation), until EOS or the stop string. Both decode greedily, so both should write the same
agent tokens; ``same_tokens`` is the share of turns where they did.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import textgym
from benchmarks.common import median, timed, write_result
from textgym import TextGenVectorEnv
from textgym.sampling import rollout


def agent_turns(action_mask: np.ndarray) -> list[tuple[int, int]]:
    """The (start, end) response positions of each run of agent tokens in one row."""
    edges = np.diff(np.concatenate([[0], action_mask, [0]]))
    return list(zip(np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)))


def generate_side(model, tokenizer, r, stop: list[str]):
    """One batched ``generate`` per turn over the recorded conversations so far. Returns a closure that runs
    them all (the timed part) and returns, per (row, turn), the generated tokens."""
    from transformers import StoppingCriteriaList, StopStringCriteria

    # built once, outside the timed part: its vocabulary tables cost more than a short generate call
    criteria = StoppingCriteriaList([StopStringCriteria(tokenizer, stop)]) if stop else None
    n = len(r.response_ids)
    prompts = [r.query_ids[i][r.query_mask[i].bool()] for i in range(n)]
    turns = [agent_turns(r.action_mask[i].numpy()) for i in range(n)]
    calls = []
    for k in range(max(len(t) for t in turns)):
        rows = [i for i in range(n) if len(turns[i]) > k]
        contexts = [torch.cat([prompts[i], r.response_ids[i, : turns[i][k][0]]]) for i in rows]
        width = max(len(c) for c in contexts)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for j, c in enumerate(contexts):
            ids[j, width - len(c) :], mask[j, width - len(c) :] = c, 1
        longest = max(turns[i][k][1] - turns[i][k][0] for i in rows)
        calls.append((rows, k, ids, mask, longest, width))

    def run():
        out = {}
        with torch.inference_mode():
            for rows, k, ids, mask, longest, width in calls:
                generated = model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=longest, do_sample=False,
                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                    stopping_criteria=criteria,
                )  # fmt: skip
                for j, i in enumerate(rows):
                    out[i, k] = generated[j, width:]
        return out

    return run, turns


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128, help="the conversation's token budget")
    parser.add_argument("--stop", default=".", help="the stop string that ends a turn (besides EOS)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    model, tokenizer = textgym.load_model(args.model)
    stop = [args.stop] if args.stop else []
    rows = []
    for batch in args.batches:
        env = TextGenVectorEnv(
            num_envs=batch, model=args.model, prompts="followups", responder="user_simulator", rewards=[],
            max_turns=args.max_turns, max_new_tokens=args.new_tokens, stop=stop, prompt_order="sequential",
            autoreset_mode="Disabled",
        )  # fmt: skip

        options = {"prompts": [i % env.num_prompts for i in range(batch)]}  # the same conversations each time

        def env_rollout():
            return rollout(model, env, temperature=0, keep_hidden=True, options=options)

        r = env_rollout()  # warm-up, and the conversations the generate side replays
        generate, turns = generate_side(model, tokenizer, r, stop)
        generate()
        env_times, gen_times = [], []
        for _ in range(args.repeats):
            t, r2 = timed(env_rollout)
            env_times.append(t)
            t, generated = timed(generate)
            gen_times.append(t)
        assert torch.equal(r2.response_ids, r.response_ids)  # greedy: the same conversations every time
        # the same turn: the same tokens, and generate stopped where the env's turn ended (padding after),
        # unless the conversation's token budget (the response's width) cut the env's turn
        budget = r.response_ids.shape[1]
        same = [
            torch.equal(generated[i, k][: end - start], r.response_ids[i, start:end])
            and (end == budget or bool((generated[i, k][end - start :] == tokenizer.pad_token_id).all()))
            for i in range(batch)
            for k, (start, end) in enumerate(turns[i])
        ]
        agent_tokens, all_tokens = int(r.action_mask.sum()), int(r.response_mask.sum())
        rows.append(
            {
                "batch": batch,
                "turns": sum(len(t) for t in turns),
                "agent_tokens": agent_tokens,
                "env_tokens": all_tokens - agent_tokens,
                "steps_env": int(r.action_mask.sum(1).max()),
                "generate_calls": max(len(t) for t in turns),
                "same_tokens": float(np.mean(same)),
                "generate_s": median(gen_times),
                "env_rollout_s": median(env_times),
                "ratio": median(env_times) / median(gen_times),
                "env_agent_tokens_per_s": agent_tokens / median(env_times),
            }
        )
        print(rows[-1], flush=True)
    write_result("multiturn_rollout", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
