"""The GPU sections of docs/performance.md: the GPU check's rollout and agents (benchmarks/gpu_check.py), and
the larger policies on one GPU."""

from __future__ import annotations

# benchmarks/gpu_check.py's agents (its AGENTS), which its results do not record
GPU_CHECK_AGENTS = (
    "LMPPO one epoch of one minibatch (its default: 4 epochs), one completion per prompt; GRPO 8 completions "
    "per prompt and beta = 0.04 (grpo-beta0: beta = 0, GRPO's default); RLOO 8 completions per prompt (its "
    "default: 2), beta 0.05"
)


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
        growth = [
            big["generate_s"] / small["generate_s"]
            for r in runs
            for small in r["rollout"]
            for big in r["rollout"]
            if "error" not in small
            and "error" not in big
            and (small["batch"], big["batch"], small["bf16"]) == (lo, hi, big["bf16"])
        ]
        lines += [
            f"A decoding step costs {min(step_ms):.0f}-{max(step_ms):.0f} ms in `generate`, over "
            f"{len(runs)} run{'s' if len(runs) > 1 else ''} of this check, at {lo} rows and at {hi}. "
            + (
                f"A cost that grows far less than the batch ({min(growth):.2f}-{max(growth):.2f}x for {hi // lo}x "
                "the rows, within a run and a precision) "
                if growth
                else "A cost that barely moves with the batch "
            )
            + "is mostly the host launching the step's kernels, not the GPU's arithmetic: at this model size the "
            "GPU waits for the CPU. So:",
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
            # the same cells in the other runs of this check: how far one run's ratios are from another's
            cells = {(row["batch"], row["bf16"]): row["ratio"] for row in rollout}
            again = [
                (row["batch"], row["bf16"], cells[row["batch"], row["bf16"]], row["ratio"])
                for r in (g, interleaved)  # `before` ran older rollout code
                if r and r is not shown
                for row in r["rollout"]
                if "error" not in row and (row["batch"], row["bf16"]) in cells
            ]
            spread = max(again, key=lambda a: abs(a[2] - a[3]), default=None)
            lines.append(
                "- The rollout against `generate`: "
                + "; ".join(f"{min(r):.2f}-{max(r):.2f}x for {size}" for size, r in spans.items())
                + (
                    f". These are one run's ratios: another run of this check measured {spread[3]:.2f} where this "
                    f"one measured {spread[2]:.2f} (SmolLM2, batch {spread[0]}, "
                    f"{'bf16' if spread[1] else 'fp32'}), so a difference between these ratios as large as that is "
                    "within the spread between runs, and no trend over the policy's size is claimed"
                    if spread
                    else ""
                )
                + ". The cause of the gap is not profiled. At most it was "
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
