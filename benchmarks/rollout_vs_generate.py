"""LMPPO's rollout through TextGenVectorEnv against model.generate, same prompts and settings.

Greedy decoding on both sides, so both produce the same tokens and run the same number of steps; the env
side includes the env's bookkeeping and a trivial reward (length_penalty), and keeps the hidden states for
the value head as LMPPO does.
"""

from __future__ import annotations

import argparse

import torch

import textgym
from benchmarks.common import chat_prompts, left_padded_prompts, median, timed, write_result
from textgym import TextGenVectorEnv
from textgym.sampling import rollout


def written(ids: torch.Tensor, tokenizer) -> list[int]:
    """The tokens ``generate`` wrote for one row: up to and including its first EOS (padding after)."""
    ids = ids.tolist()
    return ids[: ids.index(tokenizer.eos_token_id) + 1] if tokenizer.eos_token_id in ids else ids


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    args = parser.parse_args()
    model, tokenizer = textgym.load_model(args.model)
    rows = []
    for batch in args.batches:
        prompts = [tokenizer.decode(ids) for ids in chat_prompts(tokenizer, batch)]
        env = TextGenVectorEnv(
            num_envs=batch, model=args.model, prompts=[p for p in prompts], chat_template=False,
            rewards=[{"name": "length_penalty", "target": 16}], max_new_tokens=args.new_tokens,
            prompt_order="sequential", autoreset_mode="Disabled",
        )  # fmt: skip
        input_ids, mask = left_padded_prompts(env, tokenizer.pad_token_id)

        def generate():
            with torch.inference_mode():
                return model.generate(
                    input_ids=input_ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                )  # fmt: skip

        def env_rollout():
            return rollout(model, env, temperature=0, keep_hidden=True)

        env_times, gen_times = [], []
        generate()  # warm-up
        env_rollout()
        for _ in range(args.repeats):
            t, out = timed(generate)
            gen_times.append(t)
            t, r = timed(env_rollout)
            env_times.append(t)
        same = [  # greedy on both sides: each row's tokens up to its EOS, compared
            r.response_ids[i][r.response_mask[i].bool()].tolist()
            == written(out[i, input_ids.shape[1] :], tokenizer)
            for i in range(batch)
        ]
        steps = int(r.response_mask.sum(1).max())
        tokens = int(r.response_mask.sum())
        gen_steps = out.shape[1] - input_ids.shape[1]
        rows.append(
            {
                "batch": batch,
                "new_tokens": args.new_tokens,
                "steps_env": steps,
                "steps_generate": gen_steps,
                "same_tokens": sum(same) / batch,
                "generated_tokens": tokens,
                "generate_s": median(gen_times),
                "env_rollout_s": median(env_times),
                "ratio": median(env_times) / median(gen_times),
                "env_tokens_per_s": tokens / median(env_times),
            }
        )
        print(rows[-1], flush=True)
    write_result("rollout_vs_generate", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
