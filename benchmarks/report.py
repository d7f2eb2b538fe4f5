"""Write docs/performance.md from benchmarks/results/*.json."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

from benchmarks.common import ROOT, results_dir

# benchmarks/gpu_check.py's agents (its AGENTS), which its results do not record
GPU_CHECK_AGENTS = (
    "LMPPO one epoch of one minibatch (its default: 4 epochs), one completion per prompt; GRPO 8 completions "
    "per prompt and beta = 0.04 (grpo-beta0: beta = 0, GRPO's default); RLOO 8 completions per prompt (its "
    "default: 2), beta 0.05"
)

# the largest score change the report calls "the same scores": float32 summation order moves a mean log-prob by
# ~1e-5 (the tests compare the fast formula to the slow one within that)
SAME_SCORES = 1e-4

PROFILE_NOTES = """\
## Profile and fix

`time/*` in every LMPPO iteration is the first profile. It splits an iteration into rollout (generation
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
   PPO iteration 17.7 -> 16.5 s (TRL, same run conditions: 28.5 and 27.5 s).
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


REWARD_NOTES = """\
How. The former `fluency` ran the trunk and the LM head (576 x 49,152, a fifth of SmolLM2's weights) over
every position of padded batches of 16 and built a (B, W, 49,152) log-softmax. Now rows are sorted by length
(by prompt first when prompts repeat) into batches of 32, the prefix that a batch's prompts share (the chat
template's system prompt) runs once, so does each prompt that comes more than once (a group method's
completions; in the cycled batch each prompt comes two or three times, so it is grouped too), the head runs
only on the positions that predict a completion token, and log p = logit - logsumexp, taken 32 rows at a
time so that each pass over the logits reads them from the cache. A prompt runs once by padding the shorter
prompts of a batch before their completions; a model whose outputs that padding would change (a sliding
window, ALiBi by slot distance) shares the batch's common prefix only, and one whose cache cannot be
repeated across rows (a convolution or recurrent state) runs each row whole. `rm_score` shares the same way
(for a prompt that comes more than once, the tokens that its texts start with run once; its batches are
sorted by prompt text then) and applies its score head, already tiny, where the model reads, at the last
token that is not padding; `similarity` (MiniLM, bidirectional, so no prefix to share) sorts and embeds each
distinct text once. In fp32 the trunk's matmuls over the tokens that remain are the floor, so the speed-up
stays near the ratio of the work above, and that ratio depends on how much the prompts share (nothing
shared: the *no shared prefix* column). Past that, bf16 is the lever: this CPU has AMX, matrix instructions
for bf16. With `bf16 = true` the three plugins store their linear layers' weights in bf16 once, at load,
instead of letting autocast cast them at every call (the scores are bit for bit those of autocast over fp32
weights; a test checks it). bf16 is on by default on GPUs only, because it moves the scores.
"""


def fluency_work(row: dict, matmul_gflops: float | None) -> list[str]:
    w = row.get("work")
    if not w:
        return []
    ratio = w["gflop_before"] / w["gflop"]
    lines = [
        f"Work in one call: the trunk runs over {w['trunk_tokens']} row-tokens (before: "
        f"{w['trunk_tokens_before']}) and the LM head over {w['head_positions']} positions (before: "
        f"{w['head_positions_before']}), {w['gflop']:.0f} GFLOP of matmuls against {w['gflop_before']:.0f}: "
        f"{ratio:.2f}x less. "
        + (
            f"The measured fp32 speed-up ({row['speedup']:.2f}x) is larger: the log-softmax and the "
            "(B, W, V) logits that are no longer written cost memory traffic on top of their FLOPs."
            if row["speedup"] > ratio
            else f"The measured fp32 speed-up is {row['speedup']:.2f}x."
        ),
        "",
    ]
    if "gflop_floor" in w and row["speedup"] < 10:
        before_s, rate = row["ms_per_batch_before"] / 1e3, w["gflop"] / (row["ms_per_batch"] / 1e3)
        peak = matmul_gflops or rate
        lines += [
            "Why 10x is out of reach in fp32 here: an exact formula computes, at the least, each distinct "
            f"context once: {w['trunk_tokens_floor']} positions through the trunk (every distinct prefix of a "
            f"prompt and its completion) and {w['head_positions_floor']} through the head (those that predict "
            f"a completion token), {w['gflop_floor']:.0f} GFLOP. At "
            + (
                f"the rate of one 2048 x 2048 fp32 matmul on the same threads ({peak:.0f} GFLOP/s; the former "
                f"code's matmuls over its whole call time come to {w['gflop_before'] / before_s:.0f}, the "
                f"current one's to {rate:.0f})"
                if matmul_gflops
                else f"the current code's rate ({rate:.0f} GFLOP/s)"
            )
            + f", that takes {w['gflop_floor'] / peak:.2f} s against the former code's {before_s:.2f} s per "
            f"call: at most {before_s * peak / w['gflop_floor']:.1f}x.",
            "",
        ]
    return lines


def group_work(row: dict) -> list[str]:
    w = row["work"]
    return [
        f"`fluency`, {row['case']} (GRPO's default group): each batch runs each of its prompts once, then "
        f"the completions after their prompt's cache. The trunk runs over {w['trunk_tokens']} row-tokens "
        f"(before: {w['trunk_tokens_before']}), {w['gflop']:.0f} GFLOP against {w['gflop_before']:.0f}; "
        f"measured {row['speedup']:.2f}x in fp32 and {row['speedup_bf16']:.2f}x with bf16. The shipped prompts "
        "are short against the completions: the longer the prompts, the more this saves.",
        "",
    ]


def label(row: dict) -> str:
    return f"{row['reward']}, {row['case']}" if "case" in row else row["reward"]


def reward_section(w: dict) -> list[str]:
    a = w["args"]
    load = w.get("workload")
    prompts, tokens = (
        (f"{load['prompts']} ", " of {}-{} tokens".format(*load["completion_tokens"])) if load else ("", "")
    )
    lines = [
        "## Reward plugins",
        "",
        "`python benchmarks/run.py --only rewards` (which runs `python -m benchmarks.reward_throughput "
        "--rm-model .bench/rm-smollm2 --baseline`). "
        f"Batch {a['batch']}: the {prompts}shipped chat prompts, cycled, each with a different completion"
        f"{tokens} (the completions of one prompt start differently, as sampled replies do); the rows marked "
        "*8 completions per prompt* take 8 prompts with 8 such completions each, a GRPO batch. Median of "
        f"{a['repeats']} calls after a warm-up. `fluency` (SmolLM2-135M-Instruct) and "
        "`rm_score` (a sequence-classification head on the same SmolLM2) run a 135M model, `similarity` runs "
        "MiniLM, all on the CPU in fp32 unless the column says bf16, with "
        f"{w['machine']['torch_threads']} torch thread{'s' if w['machine']['torch_threads'] != 1 else ''}"
        + (
            f" (5-minute load average {w['load_average_5min']['before']:.1f} when the run began and "
            f"{w['load_average_5min']['after']:.1f} when it ended, on {w['machine']['cpu_count']} cores)."
            if "load_average_5min" in w
            else "."
        ),
        "",
        "| reward | samples/s | ms per batch |",
        "|---|---|---|",
    ]
    for row in w["rows"]:
        lines.append(f"| {label(row)} | {row['samples_per_s']:.0f} | {row['ms_per_batch']:.3g} |")
    model_rows = [row for row in w["rows"] if "samples_per_s_bf16" in row]
    if not model_rows:
        return [*lines, ""]
    lines += [
        "",
        "The model-based rewards, each variant timed in the same run, alternating within every repetition. "
        "*before*: the former code on the same loaded model (padded batches in arrival order, of 16 for `fluency`, no shared "
        "prefix, and for `fluency` logits and a log-softmax over the 49,152-token vocabulary at every "
        "position). *no shared prefix*: the current code with `share_prefix = false`. *bf16*: the current "
        "code with `bf16 = true` (autocast; the default on GPUs, opt-in on the CPU). The last columns give "
        "the largest change of any score against the default.",
        "",
        "| reward | before (samples/s) | no shared prefix | default (fp32) | bf16 | speed-up fp32 | speed-up bf16 "
        "| score change: before, bf16 |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def cell(row: dict, key: str, fmt: str = ".1f") -> str:
        return format(row[key], fmt) if key in row else "-"

    for row in model_rows:
        speedup = f"**{row['speedup']:.2f}x**" if "speedup" in row else "-"
        speedup_bf16 = f"{row['speedup_bf16']:.2f}x" if "speedup_bf16" in row else "-"
        lines.append(
            f"| {label(row)} | {cell(row, 'samples_per_s_before')} | {cell(row, 'samples_per_s_no_prefix')} "
            f"| {row['samples_per_s']:.1f} | {row['samples_per_s_bf16']:.1f} | {speedup} | {speedup_bf16} "
            f"| {cell(row, 'max_score_difference_before', '.1e')}, {row['max_score_difference_bf16']:.1e} |"
        )
    fluency = next(
        (r for r in model_rows if r["reward"] == "fluency" and "speedup" in r and "case" not in r), None
    )
    groups = next(
        (r for r in model_rows if r["reward"] == "fluency" and "speedup" in r and "case" in r), None
    )
    if fluency:
        best = max(fluency["speedup"], fluency["speedup_bf16"])
        moved = fluency["max_score_difference_before"]
        same = moved <= SAME_SCORES
        scores = (
            f"with the same scores (fp32, largest difference {moved:.1e})"
            if same
            else f"but with other scores (fp32, largest difference {moved:.1e}, above {SAME_SCORES:g})"
        )
        met = fluency["speedup"] >= 10 and same
        lines += [
            "",
            f"`fluency`: {fluency['speedup']:.1f}x the former throughput {scores}, {fluency['speedup_bf16']:.1f}x with bf16 "
            f"autocast (scores move by up to {fluency['max_score_difference_bf16']:.2f} in a mean log-prob). "
            f"Target: at least 10x at batch 64 with the same scores: {'met' if met else 'missed'} "
            f"in fp32{'' if best < 10 or met else ', met only with bf16, which changes the scores a little'}.",
            "",
            *fluency_work(fluency, w.get("matmul_gflops")),
            *(group_work(groups) if groups else []),
            REWARD_NOTES.rstrip(),
        ]
    return [*lines, ""]


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
            f" (without the weight cast, autocast alone, the bf16 rollout took {b['rollout_autocast_only_bf16']:.2f} s)"
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


def gpu_section(
    g: dict | None,
    before: dict | None = None,
    micro: dict | None = None,
    train_rows: list | None = None,
    interleaved: dict | None = None,
    big: list[dict] | None = None,
    lora: list[dict] | None = None,
) -> list[str]:
    """From gpu_check.json and, where present, gpu_check_before.json (the same check on the code before the
    rollout and the updates stopped reading back per step and per micro-batch), gpu_check_micro256.json,
    gpu_train_copy.csv (a short `textgym train` on the same GPU), gpu_check_interleaved.json (the rollout
    alone, bf16 and fp32 interleaved), and the larger policies' runs: ``big`` (rollout, full and LoRA
    agents) and ``lora`` (LoRA agents, each after the one before was freed, with the rollout folded and
    not)."""
    lines = ["## On a GPU", ""]
    if not g or g["args"].get("device", "cpu") == "cpu":
        return [
            *lines,
            "Not measured: no GPU was available to this project's benchmarks. `python -m benchmarks.gpu_check` "
            "measures the rollout against `generate` and one iteration of each LM agent at batches 64 and 256 "
            "with SmolLM2 in bf16 on a GPU, and writes `benchmarks/results/gpu_check.json`; this section shows "
            "its figures once that file holds a GPU run.",
            "",
        ]
    m, tokens = g["machine"], int(g["args"]["new_tokens"])
    runs = [r for r in (before, g, interleaved) if r]
    larger = [r for r in big or [] if r]
    shown = interleaved or g  # the table's SmolLM2 rows: both precisions, interleaved, where measured
    rollout = [row for row in shown["rollout"] if "error" not in row]
    sized = [(policy_size(shown), row) for row in rollout] + [
        (policy_size(r), row) for r in larger for row in r["rollout"] if "error" not in row
    ]
    agents = [row for row in g["agents"] if "error" not in row]
    micro_rows = [row for row in (micro or {}).get("agents", []) if "error" not in row]
    failed = [row for row in g["rollout"] + g["agents"] if "error" in row]
    full_length = all(
        row["stats"].get("completions/clipped_ratio") == 1.0 for row in agents if "stats" in row
    )

    step_ms = [row["generate_s"] / tokens * 1000 for r in runs for row in r["rollout"] if "error" not in row]
    batches = sorted({row["batch"] for row in rollout})
    lines += [
        f"Measured on one {m.get('cuda')} (torch {m['torch']}, transformers {m.get('transformers')}, Python "
        f"{m['python']}, {m['cpu_count']} CPU cores), with `benchmarks/gpu_check.py`; its files are "
        "`benchmarks/results/gpu_check*.json`."
        + (
            " The model's package could not be installed on that machine, so the model is the architecture and "
            "tokenizer of `--model` with freshly initialised weights (`--random-weights`): a forward costs what "
            "it costs with trained weights."
            if g.get("weights", "").startswith("random")
            else ""
        )
        + (
            f" Every completion ran to the {tokens}-token limit (no episode ended early)."
            if full_length and agents
            else ""
        ),
        "",
        "<!-- not run: needs a GPU and a model directory (DIR) -->",
        "```bash",
        "python -m benchmarks.gpu_check --model DIR --random-weights --also-fp32-rollout   # DIR: a model directory",
        "python -m benchmarks.gpu_check --model DIR --random-weights --skip-rollout --agents lmppo grpo \\",
        "    --batches 256 --micro-batch 256 --out benchmarks/results/gpu_check_micro256.json",
        "python -m benchmarks.gpu_check --model DIR --random-weights --also-fp32-rollout --agents \\",
        "    --out benchmarks/results/gpu_check_interleaved.json",
        "# larger policies: SmolLM2-1.7B's shape, then a 6.5B Llama's (DIR: SmolLM2-135M's config and tokenizer)",
        "for SIZE in 1b7 7b; do",
        '  [ $SIZE = 1b7 ] && SHAPE=\'{"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 8192, "rope_theta": 130000}\'',
        '  [ $SIZE = 7b ] && SHAPE=\'{"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192, "rope_theta": 500000}\'',
        '  python -m benchmarks.gpu_check --model DIR --random-weights --override "$SHAPE" --batches 64 \\',
        "      --also-fp32-rollout --agents lmppo-lora grpo-lora lmppo --out benchmarks/results/gpu_check_$SIZE.json",
        '  python -m benchmarks.gpu_check --model DIR --random-weights --override "$SHAPE" --batches 64 \\',
        "      --skip-rollout --agents grpo-lora lmppo-lora --out benchmarks/results/gpu_check_lora_$SIZE.json",
        "done",
        "```",
        "",
    ]
    if failed:
        lines += [
            f"Failed in this run: {', '.join(str(row.get('agent', row.get('batch'))) for row in failed)}.",
            "",
        ]
    lines += [
        f"**Rollout against `generate`**, {tokens} new tokens, greedy, medians of {g['args']['repeats']}. *syncs*: "
        "the host-device syncs in one call, counted by `torch.cuda.set_sync_debug_mode`.",
        "",
        "| policy | batch | precision | `generate` (s) | rollout (s) | rollout / `generate` | syncs, `generate` / rollout |",
        "|---|---|---|---|---|---|---|",
    ]
    for size, row in sized:
        syncs = row.get("syncs") or {}
        lines.append(
            f"| {size} | {row['batch']} | {'bf16 autocast' if row['bf16'] else 'fp32'} | {row['generate_s']:.2f} | "
            f"{row['rollout_s']:.2f} | {row['ratio']:.2f} | {syncs.get('generate')} / {syncs.get('rollout')} |"
        )
    lines.append("")
    if batches:
        lo, hi = batches[0], batches[-1]
        lines += [
            f"A decoding step costs {min(step_ms):.0f}-{max(step_ms):.0f} ms in `generate`, over "
            f"{len(runs)} run{'s' if len(runs) > 1 else ''} of this check, whether it decodes {lo} rows or {hi}. "
            "A cost that does not grow with the batch is the host launching the step's kernels, not the GPU's "
            "arithmetic: at this model size the GPU waits for the CPU. So:",
        ]
        old = next(
            (row for row in (before or {}).get("rollout", []) if "syncs" in row and "error" not in row), None
        )
        lines.append(
            "- The rollout keeps to `generate`'s syncs. Per step it copies the chosen tokens to the host. It "
            "copies the rows' state (which rows are active, where their next token goes) to the device only "
            "after a step on which an episode or a turn ended"
            + (
                ", which no step here did: with a trained model, each such step adds one copy."
                if full_length
                else "."
            )
            + (
                f" Before, a step made about {old['syncs']['rollout'] / tokens:.0f} transfers "
                f"({old['syncs']['rollout']} syncs per rollout against `generate`'s {old['syncs']['generate']})."
                if old
                else ""
            )
        )
        precisions: dict[tuple[str, int], dict[bool, dict]] = {}
        for size, row in sized:
            if row.get("interleaved"):
                precisions.setdefault((size, row["batch"]), {})[row["bf16"]] = row
        both = [(key, rows[True], rows[False]) for key, rows in precisions.items() if len(rows) == 2]
        if both:
            gains = [(key, f["generate_s"] / b["generate_s"]) for key, b, f in both]
            faster = [(key, gain) for key, gain in gains if gain >= 1.1]
            lines.append(
                "- bf16 autocast against fp32, the two interleaved in every repetition (`generate`'s time): "
                + "; ".join(
                    f"{size} at batch {batch}, {b['generate_s']:.2f} s against {f['generate_s']:.2f} s"
                    for (size, batch), b, f in both
                )
                + ". "
                + (
                    "bf16 paid only where matrix products, not kernel launches, set the pace: "
                    + ", ".join(f"{gain:.2f}x for {size} at batch {batch}" for (size, batch), gain in faster)
                    + ". bf16 stays the GPU default, for that and for its memory."
                    if faster
                    else "bf16 did not pay at these sizes, where kernel launches set the pace; it stays the GPU "
                    "default for its memory."
                )
            )
            spans: dict[str, list[float]] = {}
            for size, row in sized:
                spans.setdefault(size, []).append(row["ratio"])
            lines.append(
                "- The rollout against `generate`: "
                + "; ".join(f"{min(r):.2f}-{max(r):.2f}x for {size}" for size, r in spans.items())
                + ". The gap shrinks as the policy grows, as a fixed cost per step that a small policy's forward "
                "does not hide would. Its cause is not profiled. At most it was "
                f"{max((row['rollout_s'] - row['generate_s']) / tokens * 1000 for _, row in sized):.1f} ms a "
                'step, where the env\'s own step takes tens of microseconds for 64 rows ("The env alone" above). Candidates '
                "are the rollout's own kernels per step, which `generate` does not run: the chosen tokens' "
                "log-probs, and the hidden states kept for the value head."
            )
        lines.append("")
    names = AGENT_NAMES
    lines += [
        f"**One iteration of each agent** (after a warm-up one; {'bf16' if g['args']['bf16'] == 'True' else 'fp32'}; "
        f"micro-batch {g['args']['micro_batch']} unless stated; {GPU_CHECK_AGENTS}; *syncs*: in one more, untimed, "
        "iteration):",
        "",
        "| agent | batch | iteration (s) | rollout (s) | reference (s) | update (s) | peak GPU memory (GiB) | syncs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = [(row, "") for row in agents] + [
        (row, f", micro-batch {micro['args']['micro_batch']}") for row in micro_rows
    ]
    order = list(AGENT_NAMES)
    rows.sort(key=lambda item: (order.index(item[0]["agent"]) if item[0]["agent"] in order else len(order),
                                item[0]["agent"], item[0]["batch"], item[1]))  # fmt: skip
    for row, label in rows:
        t = row["breakdown"]
        lines.append(
            f"| {names.get(row['agent'], row['agent'])}{label} | {row['batch']} | {row['iteration_s']:.2f} | "
            f"{t['time/rollout']:.2f} | {t['time/reference']:.2f} | {t['time/update']:.2f} | "
            f"{row['peak_memory_mb'] / 1024:.1f} | {row['syncs_per_iteration']} |"
        )
    lines += [
        "",
        "(Peak memory: the most GPU memory allocated from building each row's agent through its warm-up and "
        "measured iterations (the iterations set it: activations, gradients and AdamW state), counting whatever the rows "
        "before it had not freed: this run predates the check's garbage collection before each agent, so a row "
        "can carry an earlier agent's memory. *rollout* includes the behaviour log-prob forwards.)",
    ]
    pairs = [(a, b) for a in (before or {}).get("agents", []) for b in agents
             if (a["agent"], a["batch"]) == (b["agent"], b["batch"]) and "error" not in a]  # fmt: skip
    if pairs:
        old_syncs = [a["syncs_per_iteration"] for a, _ in pairs]
        slower = [
            (b["iteration_s"] / a["iteration_s"], a) for a, b in pairs if b["iteration_s"] > a["iteration_s"]
        ]
        faster = max((a["iteration_s"] / b["iteration_s"] for a, b in pairs), default=1.0)
        gen = [max(a["generate_s"], b["generate_s"]) / min(a["generate_s"], b["generate_s"])
               for a in before["rollout"] for b in rollout
               if (a.get("batch"), a.get("bf16")) == (b["batch"], b["bf16"]) and "error" not in a]  # fmt: skip
        worst, worst_row = max(slower, key=lambda x: x[0]) if slower else (1.0, None)
        lines += [
            f"- The same check before the sync changes counted {min(old_syncs)}-{max(old_syncs)} syncs per "
            "iteration. There were three causes:",
            "  - `weights_are_finite` read each weight tensor on its own.",
            "  - The updates read their statistics per micro-batch.",
            "  - The rollout made several transfers a step.",
            "- Now a weight check reads back once, and an update reads its statistics once, when it ends. "
            "`tests/test_host_syncs.py` holds both to that on the CPU. An update still copies each "
            "micro-batch's rows from the host to the device, and transformers' attention-mask checks read "
            "back once per forward; so the syncs still grow with the number of micro-batches.",
            f"- The iteration times did not fall. In the run after the change, {len(slower)} of {len(pairs)} "
            f"iterations were slower than before"
            + (
                f" (by up to {worst:.2f}x: {names.get(worst_row['agent'], worst_row['agent'])} at batch "
                f"{worst_row['batch']})"
                if worst_row
                else ""
            )
            + f", and none was faster by more than {faster:.2f}x. `generate`, whose code did not change, moved "
            f"by up to {max(gen, default=1.0):.2f}x between the same two runs. With one run of each version, "
            "these differences are of the size by which unchanged code moved; telling them apart needs runs "
            "that alternate the two versions. While the GPU waits for the host's launches anyway, a sync costs "
            "little.",
        ]
    ppo = {(row["batch"], bool(label)): row for row, label in rows if row["agent"] == "lmppo"}
    big = max(batches) if batches else None
    if (big, True) in ppo and (big, False) in ppo:
        small, large = ppo[(big, False)], ppo[(big, True)]
        lines.append(
            f"- What does move them is fewer, larger forwards. At batch {big}, one micro-batch of "
            f"{micro['args']['micro_batch']} instead of several of {g['args']['micro_batch']} takes LMPPO's "
            f"update from {small['breakdown']['time/update']:.2f} to {large['breakdown']['time/update']:.2f} s, "
            f"and its iteration from {small['iteration_s']:.2f} to {large['iteration_s']:.2f} s. It costs "
            f"{large['peak_memory_mb'] / 1024:.0f} GiB of memory at the peak."
        )
    lines += [
        f"- At this size the rollout is most of the iteration: {tokens} launch-bound decoding steps. CUDA graphs "
        "over a static KV cache are what would shorten it. textgym does not build them yet.",
        "",
    ]
    lines += larger_policies(larger, [r for r in lora or [] if r])
    if train_rows:
        lines += [
            "`benchmarks/results/gpu_train_copy.csv` is the metrics file of `textgym train examples/copy.toml "
            "--set agent.device=cuda --set run.total_timesteps=1200` on the same machine: the tiny "
            f"character-level Llama, {len(train_rows)} LMPPO iterations, {train_rows[-1]['timesteps']} tokens. "
            "The run completed and wrote its run directory, checkpoint included. The machine had one GPU, so "
            "training over several GPUs (data-parallel, FSDP2 or ZeRO-3) has not run: the two-process CPU "
            "tests check its logic, in fp32 and bf16, over gloo, but not NCCL's device-side collectives, "
            "DeepSpeed's CUDA accelerator or its memory on GPUs.",
            "",
        ]
    return lines


AGENT_NAMES = {"lmppo": "LMPPO", "grpo": "GRPO", "grpo-beta0": "GRPO, beta = 0", "rloo": "RLOO",
               "lmppo-lora": "LMPPO, LoRA", "grpo-lora": "GRPO, LoRA"}  # fmt: skip


def base_parameters(run: dict) -> int | None:
    """The parameters of a gpu_check run's policy, without adapters or value head (the fewest any of its
    agents recorded), or None where none recorded a count."""
    counts = [
        row["parameters"] - (row["trainable_parameters"] if "lora" in row["agent"] else 0)
        for row in run.get("agents", [])
        if "parameters" in row
    ]
    return min(counts, default=None)


def policy_size(run: dict) -> str:
    """A gpu_check run's policy, in words: its parameter count where its agents recorded one, else the
    model as named."""
    count = base_parameters(run)
    if count is None:
        return "SmolLM2-135M"
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.0f}M"


def larger_policies(big: list[dict], lora: list[dict]) -> list[str]:
    """The LoRA agents (``lora``: each measured after the one before was freed) and full LMPPO (``big``)
    on policies of 1-8B parameters."""
    if not lora and not big:
        return []
    names = AGENT_NAMES
    shapes = {
        2048: "SmolLM2-1.7B's shape",
        4096: "Llama-3-8B's depth, width and MLP with SmolLM2's 64-wide attention heads (Llama-3-8B's are "
        "128 wide) and its 49,152-token vocabulary",
    }
    lines = [
        "### Larger policies on one GPU",
        "",
        "The same check on two larger architectures with fresh weights (`--override`, the config fields "
        "in each file's `args`): "
        + "; ".join(
            f"{policy_size(r)} parameters, "
            + shapes.get(json_override(r).get("hidden_size"), "a changed SmolLM2 config")
            for r in lora or big
        )
        + ". Batch 64, 32 tokens, bf16, micro-batch 32; LoRA r = 16 on the attention projections "
        "(`q_proj`, `k_proj`, `v_proj`, `o_proj`), its reference the same model with the adapter off. The "
        "LoRA rows come from runs that free each agent before measuring the next "
        "(`gpu_check_lora_*.json`); the full LMPPO rows from an earlier run that did not (`gpu_check_1b7.json`, "
        "`gpu_check_7b.json`), so their peak memory is not theirs alone and is left out.",
        "",
        "| policy | agent | trainable parameters | iteration (s) | rollout (s) | reference (s) | update (s) | peak GPU memory (GiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run, agents in [(r, ("grpo-lora", "lmppo-lora")) for r in lora] + [(r, ("lmppo",)) for r in big]:
        size = policy_size(run)
        for row in run["agents"]:
            if row["agent"] not in agents:
                continue
            if "error" in row:
                lines.append(f"| {size} | {names[row['agent']]} | all | out of memory | | | | |")
                continue
            t = row["breakdown"]
            memory = f"{row['peak_memory_mb'] / 1024:.1f}" if "lora" in row["agent"] else "-"
            trainable = f"{row['trainable_parameters'] / 1e6:.1f}M" if "lora" in row["agent"] else "all"
            lines.append(
                f"| {size} | {names[row['agent']]} | {trainable} | "
                f"{row['iteration_s']:.2f} | {t['time/rollout']:.2f} | {t['time/reference']:.2f} | "
                f"{t['time/update']:.2f} | {memory} |"
            )
    lines.append("")
    failed = [r for r in big if any(row["agent"] == "lmppo" and "error" in row for row in r["agents"])]
    for run in failed:
        base = base_parameters(run)
        lines.append(
            f"- Full LMPPO on the {policy_size(run)} policy ran out of the GPU's memory, in a run where the "
            "LoRA agents measured before it had not been freed, so this does not show that it cannot fit "
            "alone. It would be tight at best: 16 bytes per parameter for the fp32 weights, their gradients "
            f"and AdamW's two moments, and 4 more for the reference copy, make {base * 20 / 2**30:.0f} GiB of "
            "the GPU's 140 before any activation. With LoRA the same policy trained in the memory shown above."
        )
    folds = [(policy_size(r), row) for r in lora for row in r["agents"] if "rollout_folded_s" in row]
    if folds:
        lines.append(
            "- A LoRA policy samples with its adapters folded into the rollout's bf16 weight copy "
            "(agents/precision.py). Against the same rollout through the adapters, the two alternating in one "
            "run: "
            + "; ".join(
                f"{names[row['agent']]} at {size}, {row['rollout_folded_s']:.2f} s against "
                f"{row['rollout_adapters_s']:.2f} s ({row['rollout_adapters_s'] / row['rollout_folded_s']:.2f}x)"
                for size, row in folds
            )
            + ". Through the adapters, every adapted projection adds two small matmuls, a scaling and an add "
            "to each decoding step, which waits on kernel launches."
        )
    lines.append("")
    return lines


def json_override(run: dict) -> dict:
    """The ``--override`` a gpu_check run was given (its args are stored as strings)."""
    import ast

    return ast.literal_eval(run["args"].get("override", "{}"))


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
            "Reproduce everything with `make bench` (the first run also installs TRL into "
            "`.bench/trl-venv`). Each section names the command for its own figures; the raw numbers are in "
            "`benchmarks/results/*.json`.",
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
            "warm-up per point; sampled responses can end early, so the cost is also given per generated token.",
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
            "agent (never EOS, so episodes run their 32 tokens and restart), a `length_penalty` reward, no model.",
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
