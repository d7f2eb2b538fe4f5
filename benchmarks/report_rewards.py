"""The reward-plugin section of docs/performance.md (benchmarks/reward_throughput.py)."""

from __future__ import annotations

# the largest score change the report calls "the same scores": float32 summation order moves a mean log-prob by
# ~1e-5 (the tests compare the fast formula to the slow one within that)
SAME_SCORES = 1e-4

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
