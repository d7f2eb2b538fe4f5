"""Write docs/performance.md from benchmarks/results/*.json."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

from benchmarks.common import ROOT, results_dir
from benchmarks.report_gpu import GPU_CHECK_AGENTS, gpu_section
from benchmarks.report_rewards import reward_section

PROFILE_NOTES = """\
## Profile and fix

Historical: the before and after figures of this section were measured once each, on the code before and
after each fix (2026-11), and are not stored in `benchmarks/results`; the current costs are the tables
above. `time/*` in every LMPPO iteration is the first profile. It splits an iteration into rollout (generation
through the env), reward (the stack), reference (the reference forward) and update (the PPO epochs). The
fixes below do not change the computation, only its cost. The tests (PPO ratio 1 before the first update,
bit-for-bit resume) pass unchanged. Over the first three iterations of `examples/demo.toml` the scores
are identical before and after, and the KLs agree within 0.001: the fused optimizer and a different
summation order change the last bits. The same three iterations took 24.4, 20.4 and 19.4 s before fixes 2
and 3, and 16.8, 16.1 and 15.3 s after.

1. **Padding.** On `examples/demo.toml` (16 episodes x 24 tokens) the update took about 27 s of a 38 s
   iteration. Every prompt is left-padded to `max_prompt_tokens` (96), but the chat-templated prompts
   are about 50 tokens, so every forward ran over 120 positions where about 75 carry tokens. The rollout's
   prefill and every training and reference forward now drop the prompt columns that are padding in every
   row of the (micro-)batch. The positions come from the attention mask, so the logits do not change.
   First two demo iterations, before -> after: 37.6 -> 26.6 s and 31.3 -> 22.0 s.
2. **The LM head over positions nobody reads.** The first `make bench` measured rollout / `generate`
   ratios of 1.03, 1.05, 1.11 and 1.13 at batch 1, 8, 32 and 64, missing the 1.10 target at 32 and 64.
   Cause: the rollout's prefill computed logits for every prompt position (64 x ~50 x 49,152 floats), where
   `generate` keeps only the last position. Likewise, training and reference forwards computed logits over
   the prompt. Now they pass `logits_to_keep` (1 in the prefill, response length + 1 in training), and
   per-step log-probs are `logit - logsumexp` instead of a full log-softmax. Without an entropy bonus,
   the logged entropy is computed outside the autograd graph. After: ratios 1.00, 1.00, 1.01 and 1.02.
   PPO iteration 17.7 -> 16.5 s (TRL in the same runs: 28.5 and 27.5 s, configured then with the 2
   optimizer steps per iteration described below, not 4).
3. **The optimizer step.** AdamW over 135M parameters took 0.19 s per step with torch's default CPU
   implementation and 0.056 s with `fused=True` (measured side by side). Four steps per iteration.
   LMPPO now uses the fused kernel where torch has it. PPO iteration 16.5 -> 15.4 s.

**What is left against TRL.** An LMPPO iteration runs four forward + backward passes over 8 sequences of
~74 tokens, one per optimizer step, and they are most of it (*update* in the breakdown above): compute in
the model itself. TRL takes the same four optimizer steps (counted by the benchmark), each through the policy
and a second, separate value model, and generation, reference and reward cost about the same on both sides,
so at equal settings the ratio has little room below 0.5 (the measured one is in the table above). Earlier runs of this
benchmark configured TRL with `gradient_accumulation_steps = 2` over micro-batches of 8, which in TRL's
`PPOTrainer` accumulates across minibatches: it took 2 optimizer steps in most iterations instead of 4, so
their ratios (0.50 to 0.62 over three runs) understated TRL's cost; the benchmark now gives TRL the whole
minibatch per device and no accumulation. bf16 autocast (`bf16 = true`) would cut textgym's
update further, but it is not used here because the comparison holds the settings equal.
"""


def agents_section(a: dict | None) -> list[str]:
    if not a:
        return []
    lines = [
        "## The LM agents on this CPU",
        "",
        "`python benchmarks/run.py --only agents` (which runs `python -m benchmarks.gpu_check --device cpu "
        "--skip-rollout --agents NAME " + " ".join(a["settings"]) + "` once per agent, each in its own "
        "process). One iteration of each agent after a warm-up one, with the check's settings: "
        + GPU_CHECK_AGENTS
        + "; memory is the process's peak resident set (the model, its copies, the optimizer state and the "
        "batch).",
        "",
        "| agent | batch | seconds per iteration | peak memory (MB) | rollout (s) | update (s) |",
        "|---|---|---|---|---|---|",
    ]
    for row in a["rows"]:
        if "error" in row:  # gpu_check records a failed agent with its error
            lines.append(f"| {row['agent']} | {row['batch']} | failed: {row['error'][:80]} | | | |")
            continue
        b = row["breakdown"]
        lines.append(
            f"| {row['agent']} | {row['batch']} | {row['iteration_s']:.1f} | {row['peak_memory_mb']:.0f} | "
            f"{b.get('time/rollout', float('nan')):.1f} | {b.get('time/update', float('nan')):.1f} |"
        )
    lines += [
        "",
        "`grpo-beta0` is GRPO with `beta = 0`: no reference model is loaded or run, which saves a copy of the "
        "weights and the reference forward. LMPPO's value head shares the policy's trunk, so its extra memory "
        "is the head and the reference copy.",
        "",
    ]
    return lines


def distributed_section(d: dict | None) -> list[str]:
    if not d:
        return []
    s, one, two = d["settings"], d["one_process"], d["two_processes"]
    return [
        "## Two processes against one",
        "",
        "`python -m benchmarks.distributed_speedup`. `textgym train` with LMPPO on "
        f"{s['model']}, a total batch of {s['total_batch']} episodes of {s['response_length']} tokens, "
        f"{s['ppo_epochs']} epochs x {s['minibatches']} minibatches (micro-batch {s['micro_batch']}): once in "
        "one process with both cores, then under `torchrun --standalone --nproc_per_node 2` (gloo), each process with one "
        "core and half the batch: data-parallel, and sharded with FSDP2 (`ACCELERATE_USE_FSDP=true`) and with "
        "DeepSpeed ZeRO-3 (`ACCELERATE_USE_DEEPSPEED=true`, ZeRO stage 3). Median seconds per iteration, the "
        "first (warm-up) iteration left out. Each run in turn, with nothing else running.",
        "",
        "| processes | seconds per iteration | iterations measured |",
        "|---|---|---|",
        f"| 1 | {one['iteration_s']:.1f} | {len(one['times'])} |",
        f"| 2, data-parallel | {two['iteration_s']:.1f} | {len(two['times'])} |",
        *[
            f"| 2, sharded with {name} | {d[key]['iteration_s']:.1f} | {len(d[key]['times'])} |"
            for key, name in (("two_processes_fsdp2", "FSDP2"), ("two_processes_zero3", "DeepSpeed ZeRO-3"))
            if key in d
        ],
        "",
        f"Speed-up: **{d['speedup']:.2f}x**. On two cores this is well below 2x: one process already uses "
        "both cores through torch's threads, so a second process adds no compute; it only splits the work "
        "differently and adds the gradient all-reduce (135M parameters over gloo, every optimizer step) and the "
        "gathers of statistics. Data parallelism pays where each process has its own device or its own "
        "cores: see docs/distributed.md. Sharding trades more communication for memory: every forward and "
        "backward gathers each layer's weights from the other process (and every rollout step is a forward), "
        "so on one machine's CPUs it is slower than data parallelism; it is for policies whose weights, "
        "gradients and AdamW state do not fit one device.",
        "",
    ]


def bf16_section(b: dict | None) -> list[str]:
    if not b:
        return []
    return [
        "## bf16 against fp32 on this CPU",
        "",
        f"`python -m benchmarks.bf16_cpu`. {b['model']}, batch {b['batch']}, {b['new_tokens']} new tokens, "
        "greedy; bf16 is `torch.autocast` over the fp32 weights, and textgym's rollout, as an agent runs it, "
        "also casts the linear layers' weights to bf16 once per rollout (agents/precision.py). An LMPPO "
        "iteration is 16 episodes x 24 tokens, 2 epochs x 2 minibatches, micro-batch 8. `generate` and the "
        "rollout: medians of alternated runs; the LMPPO iteration: one iteration in each precision, fp32 "
        "first, so its ratio is one pair of measurements.",
        "",
        "| | fp32 (s) | bf16 (s) | fp32 / bf16 |",
        "|---|---|---|---|",
        f"| `model.generate` | {b['generate_fp32']:.2f} | {b['generate_bf16']:.2f} | "
        f"**{b['generate_fp32'] / b['generate_bf16']:.2f}x** |",
        f"| textgym rollout | {b['rollout_fp32']:.2f} | {b['rollout_bf16']:.2f} | "
        f"**{b['rollout_fp32'] / b['rollout_bf16']:.2f}x** |",
        f"| LMPPO iteration | {b['iteration_fp32']:.2f} | {b['iteration_bf16']:.2f} | "
        f"**{b['iteration_fp32'] / b['iteration_bf16']:.2f}x** |",
        "",
        f"Rollout against `generate` in the same precision: {b['rollout_fp32'] / b['generate_fp32']:.2f} in "
        f"fp32, {b['rollout_bf16'] / b['generate_bf16']:.2f} in bf16"
        + (
            f" (without the weight cast, autocast alone, the bf16 rollout took {b['rollout_autocast_only_bf16']:.2f} s, "
            f"{b['rollout_autocast_only_bf16'] / b['generate_bf16']:.2f} of `generate`'s: the rollout's gain in bf16 is "
            "the once-per-rollout cast of the linear weights, which `generate` under autocast does not make)"
            if "rollout_autocast_only_bf16" in b
            else ""
        )
        + ". The PPO ratio before the first update (the training forward's log-probs over the whole batch "
        "against the behaviour log-probs of the same tokens) is 1 within "
        f"{b['ratio_max_abs_dev_fp32']:.1e} in fp32 (largest deviation over the tokens), where the behaviour "
        f"log-probs are the rollout's own, and within {b['ratio_max_abs_dev_bf16']:.2f} in bf16"
        + (
            f" (mean {b['ratio_mean_abs_dev_bf16']:.3f}), where they come from whole-sequence forwards in "
            "micro-batches of 8. That is bf16's rounding, which differs with the rows a forward holds. The "
            "rollout's own bf16 log-probs differ from whole-sequence ones by as much (largest "
            f"{b['rollout_vs_whole_max_bf16']:.2f}, mean {b['rollout_vs_whole_mean_bf16']:.3f}): recomputing "
            "them does not remove that noise; it gives the behaviour, reference and training log-probs one "
            "kind of forward, so that an unchanged policy's KL to the reference is exactly 0"
            if "ratio_mean_abs_dev_bf16" in b
            else ""
        )
        + ". The default on CPUs stays fp32 (`bf16 = false`); see docs/training.md for when to turn it on.",
        "",
    ]


def load(name: str) -> dict | None:
    path = results_dir() / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _platforms() -> list[str]:
    """A line naming the kernel each CPU result was measured under, where they differ (the same 2-core
    machine type, started at different times)."""
    by_platform: dict[str, list[str]] = {}
    for path in sorted(results_dir().glob("*.json")):
        machine = json.loads(path.read_text()).get("machine") or {}
        if not machine.get("cuda") and machine.get("platform"):
            by_platform.setdefault(machine["platform"], []).append(path.stem)
    if len(by_platform) < 2:
        return []
    parts = [f"{platform} ({', '.join(names)})" for platform, names in by_platform.items()]
    return [
        f"The CPU results come from machines of this type under {len(parts)} kernels: {'; '.join(parts)}.",
        "",
    ]


def _other_run_note(scaling: dict, ppo: dict | None) -> str:
    """Where the scaling table has the PPO table's own setting: both times, measured in different runs."""
    if not ppo:
        return ""
    s = ppo["settings"]
    same = [
        r for r in scaling["rows"] if (r["batch"], r["response_length"]) == (s["batch"], s["response_length"])
    ]
    if not same:
        return ""
    ppo_s = statistics.median(ppo["textgym"]["iteration_s"])
    setting = f"the PPO table's setting (batch {s['batch']}, {s['response_length']} tokens)"
    if scaling["machine"].get("platform") == ppo["machine"].get("platform"):
        return (
            f" {setting[0].upper()}{setting[1:]} took {same[0]['iteration_s']:.1f} s here (one iteration) and "
            f"{ppo_s:.1f} s there (the median of {len(ppo['textgym']['iteration_s'])}): the spread of one "
            "iteration's time on this shared machine."
        )
    return (
        f" This table comes from another run than the PPO table's (its kernel: {scaling['machine'].get('platform')}"
        f"), and this machine's speed moves between runs: {setting} took {same[0]['iteration_s']:.1f} s here and "
        f"{ppo_s:.1f} s there. Compare the rows of one table, not figures across tables."
    )


def write_report(quick: bool = False) -> Path:
    lines = ["# Performance", ""]
    any_result = next(
        (load(n) for n in ("rollout_vs_generate", "ppo_vs_trl", "env_overhead") if load(n)), None
    )
    if any_result:
        m = any_result["machine"]
        lines += [
            f"Measured on: {m['platform']}, {m['cpu_count']} CPU cores, no GPU{'' if not m.get('cuda') else ' (' + m['cuda'] + ')'}; "
            f"Python {m['python']}, torch {m['torch']} ({m['torch_threads']} threads), transformers {m.get('transformers')}. "
            "The machine is shared and noisy (timings vary up to 2x between runs), so most figures are medians "
            "over repetitions (each section says over how many; a few are single measurements, and say so), and "
            "every ratio compares two sides measured in the same benchmark run.",
            "",
            *_platforms(),
            "`make bench` reproduces the CPU sections (the first run also installs TRL into `.bench/trl-venv`); "
            "`sharded_load_memory` has its own command (`python -m benchmarks.sharded_load_memory`, figures in "
            "docs/distributed.md), and so does each GPU section. Each section names the command for its own "
            "figures; the raw numbers are in `benchmarks/results/*.json`, except the profile's before and after "
            "figures at the end, measured on code that has changed since and kept as they were measured.",
            "",
        ]
    r = load("rollout_vs_generate")
    if r:
        lines += [
            "## Rollout through the env against `model.generate`",
            "",
            "`python -m benchmarks.rollout_vs_generate`. SmolLM2-135M-Instruct, fp32, the shipped chat prompts "
            f"with the chat template, {r['args']['new_tokens']} new tokens, greedy decoding on both sides, so "
            "both write the same tokens and take the same number of steps"
            + (
                " (checked: the same tokens in every row)"
                if all(row.get("same_tokens") == 1.0 for row in r["rows"])
                else " (not checked in this run)"
                if not any("same_tokens" in row for row in r["rows"])
                else " (yet not in every row: see `same_tokens` in the results)"
            )
            + ". The env side is LMPPO's rollout: "
            "`TextGenVectorEnv` stepping, a `length_penalty` reward, the KV cache, and the hidden states kept "
            f"for the value head. Median of {r['args']['repeats']} runs of each, alternated.",
            "",
            "| batch | decoding steps | `generate` (s) | env rollout (s) | ratio env / generate | env tokens/s |",
            "|---|---|---|---|---|---|",
        ]
        for row in r["rows"]:
            lines.append(
                f"| {row['batch']} | {row['steps_env']} | {row['generate_s']:.2f} | {row['env_rollout_s']:.2f} | "
                f"**{row['ratio']:.2f}** | {row['env_tokens_per_s']:.0f} |"
            )
        worst = max(row["ratio"] for row in r["rows"])
        lines += ["", f"Target: ratio at most 1.10 at every batch size. Worst measured: {worst:.2f} "
                  f"({'met' if worst <= 1.10 else f'missed by {worst - 1.10:.2f}'}).", ""]  # fmt: skip
    mt = load("multiturn_rollout")
    if mt:
        a = mt["args"]
        lines += [
            "## Multi-turn rollout against `model.generate` turn by turn",
            "",
            f"`python -m benchmarks.multiturn_rollout --batches {' '.join(map(str, a['batches']))} --repeats "
            f"{a['repeats']}`. The user-simulator task (shipped `followups` prompts: after "
            f"each answer the user asks the prompt's next follow-up), up to {a['max_turns']} turns of the model, "
            f"{a['new_tokens']} tokens for the whole conversation, turns ending on EOS or {a['stop']!r}, greedy. "
            "The env side is LMPPO's rollout: one agent token per step through the KV cache, each reply prefilled "
            "as one chunk in the same forward, hidden states kept. The `generate` side replays the same "
            "conversations as a multi-turn loop on `generate` would run them: one batched call per turn over the "
            "conversation so far (prompt, earlier turns and replies), until EOS or the stop string. "
            '"same tokens" is the share of turns where both wrote the same tokens. Median of '
            f"{a['repeats']} runs of each, alternated.",
            "",
            "| batch | turns | agent tokens | env tokens | `generate` calls | same tokens | `generate` (s) | env rollout (s) | ratio env / generate |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for row in mt["rows"]:
            lines.append(
                f"| {row['batch']} | {row['turns']} | {row['agent_tokens']} | {row['env_tokens']} | {row['generate_calls']} | "
                f"{row['same_tokens']:.2f} | {row['generate_s']:.2f} | {row['env_rollout_s']:.2f} | **{row['ratio']:.2f}** |"
            )
        lines += [
            "",
            "Turn by turn, `generate` prefills the whole conversation again at every turn and waits for the "
            "batch's slowest turn before any row starts its next one. The env rollout prefills only each new "
            "reply, and a row starts its next turn on the step after its reply, whatever the other rows do.",
            "",
        ]
    p = load("ppo_vs_trl")
    if p:
        s = p["settings"]
        t, trl = p["textgym"], p["trl"]
        lines += [
            f"## A PPO iteration: textgym's LMPPO against TRL {p['trl_version']}'s `PPOTrainer`",
            "",
            "`python benchmarks/run.py --only ppo`. Same model (SmolLM2-135M-Instruct, fp32, CPU), same 24 chat "
            f"prompts, batch {s['batch']}, response length {s['response_length']}, {s['ppo_epochs']} PPO "
            f"epochs, {s['minibatches']} minibatches, micro-batch {s['micro_batch']}, temperature 1, and the same "
            "reward: a sequence-classification head on the same SmolLM2 (textgym scores it through `rm_score`). "
            "TRL runs in its own virtual environment that the benchmark creates; each side runs in its own "
            "process, and memory is that process's peak resident set. TRL's PPO also trains a separate value "
            "model (a second copy of the LM); LMPPO's value head shares the policy's trunk.",
            "",
            "| | seconds per iteration (median) | peak memory (MB) |",
            "|---|---|---|",
            f"| textgym LMPPO | {statistics.median(t['iteration_s']):.1f} | {t['peak_rss_mb']:.0f} |",
            f"| TRL PPOTrainer | {statistics.median(trl['iteration_s']):.1f} | {trl['peak_rss_mb']:.0f} |",
            f"| ratio textgym / TRL | **{p['time_ratio']:.2f}** | **{p['memory_ratio']:.2f}** |",
            "",
            f"Iterations measured: textgym {[round(x, 1) for x in t['iteration_s']]}, TRL "
            f"{[round(x, 1) for x in trl['iteration_s']]} (after one warm-up iteration each). "
            "textgym's time breakdown of its last iteration: "
            + ", ".join(
                f"{k.split('/')[1]} {v:.1f}" for k, v in t["breakdown"].items() if k != "time/tokens_per_s"
            )
            + " s."
            + (
                f" Optimizer steps per measured iteration: textgym {s['ppo_epochs'] * s['minibatches']} (one per "
                f"minibatch), TRL {trl['optimizer_steps']}, counted by a hook on TRL's optimizer (TRL "
                f"{trl['versions']['trl']}, transformers {trl['versions']['transformers']}, torch "
                f"{trl['versions']['torch']})."
                if "optimizer_steps" in trl
                else ""
            ),
            "",
            f"Targets: textgym at most half of TRL's time per iteration: {'met' if p['time_ratio'] <= 0.5 else 'missed'} "
            f"({p['time_ratio']:.3f}); less peak memory: {'met' if p['memory_ratio'] < 1 else 'missed'} "
            f"({p['memory_ratio']:.2f}).",
            "",
        ]
    sc = load("scaling")
    if sc:
        lines += [
            "## Scaling",
            "",
            "`python benchmarks/run.py --only scaling`. LMPPO iterations as above (2 epochs, 2 minibatches, "
            "micro-batch 8), varying the batch size and the response length. One measured iteration after a "
            "warm-up per point; sampled responses can end early, so the cost is also given per generated token."
            + _other_run_note(sc, p),
            "",
            "| batch | response length | iteration (s) | generated tokens | ms per generated token | rollout | reference | update |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for row in sc["rows"]:
            b = row["breakdown"]
            lines.append(
                f"| {row['batch']} | {row['response_length']} | {row['iteration_s']:.1f} | {row['generated_tokens']:.0f} | "
                f"{row['ms_per_generated_token']:.0f} | {b['time/rollout']:.1f} | {b['time/reference']:.1f} | {b['time/update']:.1f} |"
            )
        lines += [
            "",
            "Time grows roughly linearly in the number of sequences, but the cost per generated token falls as "
            "batches and responses grow, for two reasons. Each iteration has fixed costs: four optimizer steps "
            "over 135M parameters, and Python per step. And every training and reference forward also runs over "
            "the prompt (about 50 tokens with SmolLM2's chat template and its system prompt), which is paid once "
            "per sequence whatever the response length. So halving the response length from 24 to 12 tokens "
            "saves only a fifth of the update, and the update (forward and backward over prompt + response) "
            "dominates at every point.",
            "",
        ]
    e = load("env_overhead")
    if e:
        lines += [
            "## The env alone",
            "",
            "`python -m benchmarks.env_overhead`. `TextGenVectorEnv` with the SmolLM2 tokenizer, a random "
            "agent (never EOS, so episodes run their 32 tokens and restart), a `length_penalty` reward, no model. "
            "Median of 3 runs of 320 vector steps; on this shared machine one env's figure moved between 26 and "
            "48 microseconds from one run to the next. The first `make bench` (kernel v509, before multi-turn "
            "episodes, stop strings and action checks joined the step) measured 14.9, 1.1 and 0.9 microseconds: "
            "those runs differ in both code and machine, so their ratio is not the code's cost alone.",
            "",
            "| envs | vector steps/s | env steps (tokens)/s | microseconds per env step |",
            "|---|---|---|---|",
        ]
        for row in e["rows"]:
            lines.append(
                f"| {row['num_envs']} | {row['vector_steps_per_s']:.0f} | {row['env_steps_per_s']:.0f} | {row['us_per_env_step']:.1f} |"
            )
        lines.append("")
    w = load("reward_throughput")
    if w:
        lines += reward_section(w)
    lines += agents_section(load("agents_cpu"))
    lines += distributed_section(load("distributed_speedup"))
    lines += bf16_section(load("bf16_cpu"))
    train = results_dir() / "gpu_train_copy.csv"
    train_rows = list(csv.DictReader(train.open())) if train.exists() else None
    lines += gpu_section(
        load("gpu_check"),
        load("gpu_check_before"),
        load("gpu_check_micro256"),
        train_rows,
        interleaved=load("gpu_check_interleaved"),
        big=[load("gpu_check_1b7"), load("gpu_check_7b")],
        lora=[load("gpu_check_lora_1b7"), load("gpu_check_lora_7b")],
    )
    lines.append(PROFILE_NOTES)
    # docs/performance.md is written from benchmarks/results only; other results get their report beside them
    in_docs = not quick and results_dir().resolve() == (ROOT / "benchmarks" / "results").resolve()
    path = ROOT / "docs" / "performance.md" if in_docs else results_dir() / "performance.md"
    path.write_text("\n".join(lines))
    return path
