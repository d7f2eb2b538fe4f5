"""bf16 autocast against fp32 on this CPU, side by side: ``model.generate``, textgym's rollout as an agent
runs it (against ``generate`` in the same precision; in bf16 also without the once-per-rollout cast of the
linear weights), an LMPPO iteration, and how far the PPO ratio is from 1 before the first update.

    python -m benchmarks.bf16_cpu [--quick]
"""

from __future__ import annotations

import argparse

import torch

import textgym
from benchmarks.common import chat_prompts, left_padded_prompts, median, timed, write_result
from textgym import TextGenVectorEnv
from textgym.agents.ppo import LMPPO
from textgym.agents.precision import bf16_linear_weights
from textgym.agents.rollout_batch import RolloutBatch
from textgym.sampling import rollout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="the tiny model, to check that it runs")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    name, batch, new_tokens = ("tiny-random-llama", 4, 4) if args.quick else ("smollm2-135m-instruct", 32, 32)
    model, tokenizer = textgym.load_model(name)
    prompts = [tokenizer.decode(ids) for ids in chat_prompts(tokenizer, batch)]
    env = TextGenVectorEnv(
        num_envs=batch, model=name, prompts=prompts, chat_template=False, max_new_tokens=new_tokens,
        rewards=[{"name": "length_penalty", "target": 16}], prompt_order="sequential", autoreset_mode="Disabled",
    )  # fmt: skip
    input_ids, mask = left_padded_prompts(env, tokenizer.pad_token_id)

    def generate(bf16: bool):
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  do_sample=False, pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id)  # fmt: skip

    def env_rollout(bf16: bool, cast: bool = True):  # as LMAgent.rollout runs it: autocast per forward
        def precision():
            return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)

        with bf16_linear_weights(model, bf16 and cast):
            return rollout(model, env, temperature=0, keep_hidden=True, precision=precision)

    times: dict[str, list[float]] = {}
    for bf16 in (False, True):
        generate(bf16), env_rollout(bf16)  # warm-up
    env_rollout(True, False)
    for _ in range(args.repeats):
        for bf16 in (False, True):
            tag = "bf16" if bf16 else "fp32"
            times.setdefault(f"generate_{tag}", []).append(timed(lambda: generate(bf16))[0])
            times.setdefault(f"rollout_{tag}", []).append(timed(lambda: env_rollout(bf16))[0])
        times.setdefault("rollout_autocast_only_bf16", []).append(timed(lambda: env_rollout(True, False))[0])
    result = {k: median(v) for k, v in times.items()}

    # An LMPPO iteration (16 x 24 tokens, 2 epochs, 2 minibatches, micro-batch 8) in each precision, and the
    # ratio of the training log-probs (the whole batch in one forward) to the behaviour log-probs (fp32: the
    # rollout's; bf16: whole-sequence forwards in micro-batches of 8) before any update.
    train_env = TextGenVectorEnv(
        num_envs=4 if args.quick else 16, model=name, prompts="chat", max_new_tokens=4 if args.quick else 24,
        rewards=[{"name": "length_penalty", "target": 16}], autoreset_mode="Disabled",
    )  # fmt: skip
    for bf16 in (False, True):
        tag = "bf16" if bf16 else "fp32"
        agent = LMPPO(name, train_env, bf16=bf16, n_epochs=2, n_minibatches=2, micro_batch_size=8, verbose=0)
        batch_ = agent.collect_rollouts()
        with torch.no_grad():
            logprobs, _, _ = agent.policy_logprobs(batch_)
        ratio = (logprobs - batch_.logprobs).exp()[batch_.response_mask.bool()]
        result[f"ratio_max_abs_dev_{tag}"] = float((ratio - 1).abs().max())
        result[f"ratio_mean_abs_dev_{tag}"] = float((ratio - 1).abs().mean())
        if bf16:  # the rollout's own log-probs (token by token) against whole-sequence forwards of its tokens
            own = RolloutBatch.from_rollout(agent.rollout(train_env, temperature=1.0, seed=1))
            whole, _ = agent.sequence_logprobs(agent.rollout_model, own)
            gap = (own.logprobs - whole)[own.action_mask.bool()].abs()
            result.update(
                rollout_vs_whole_max_bf16=float(gap.max()), rollout_vs_whole_mean_bf16=float(gap.mean())
            )
        iteration = []
        for _ in range(2):
            agent.learn(1, reset_num_timesteps=False)
            iteration.append(agent.history[-1]["time/iteration"])
        result[f"iteration_{tag}"] = iteration[-1]
    result.update(
        generate_speedup=result["generate_fp32"] / result["generate_bf16"],
        rollout_over_generate_bf16=result["rollout_bf16"] / result["generate_bf16"],
        rollout_over_generate_fp32=result["rollout_fp32"] / result["generate_fp32"],
        iteration_speedup=result["iteration_fp32"] / result["iteration_bf16"],
    )
    print(result, flush=True)
    write_result("bf16_cpu", {"model": name, "batch": batch, "new_tokens": new_tokens, **result})


if __name__ == "__main__":
    main()
