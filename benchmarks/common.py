"""Shared helpers for the benchmarks: timing, memory, machine facts, JSON results."""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".bench"  # ignored by git: the TRL venv, the reward model


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def time_sides(
    sides: dict[str, Callable[[], Any]],
    repeats: int,
    timer: Callable[[Callable[[], Any]], tuple[float, Any]] = timed,
) -> dict[str, float]:
    """Median seconds of each side, the sides alternating within every repetition, after one warm-up.
    ``timer``: how one call is timed (``timed``, or one that waits for a device's queued work)."""
    for fn in sides.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            times[name].append(timer(fn)[0])
    return {name: median(t) for name, t in times.items()}


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine() -> dict[str, Any]:
    import torch

    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def results_dir() -> Path:
    """benchmarks/results, or $TEXTGYM_BENCH_RESULTS (``run.py --quick`` uses a scratch directory)."""
    return Path(os.environ.get("TEXTGYM_BENCH_RESULTS") or ROOT / "benchmarks" / "results")


def write_result(name: str, data: dict[str, Any]) -> Path:
    results = results_dir()
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{name}.json"
    path.write_text(json.dumps({"machine": machine(), **data}, indent=2))
    return path


def ppo_arguments(parser: Any) -> Any:
    """The settings both sides of the PPO comparison take (ppo_textgym.py and ppo_trl.py)."""
    parser.add_argument("--prompts", required=True, help="JSON file: prompt texts (chat template applied)")
    parser.add_argument("--rm-model", required=True)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--response-length", type=int, default=24)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--minibatches", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=3)
    return parser


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """The shipped chat prompts with the chat template, tokenized, cycled to ``n``."""
    from textgym.prompts import load_prompts

    texts = [p.text for p in load_prompts("chat")]
    out = []
    for i in range(n):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": texts[i % len(texts)]}], tokenize=False, add_generation_prompt=True
        )
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


def left_padded_prompts(env: Any, pad_id: int) -> tuple[Any, Any]:
    """The env's encoded prompts as ``generate`` takes them: (input_ids, attention_mask), left-padded."""
    import torch

    ids = [env.encode_prompt(i) for i in range(env.num_envs)]
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id)
    mask = torch.zeros(len(ids), width, dtype=torch.long)
    for row, x in enumerate(ids):
        input_ids[row, width - len(x) :] = torch.as_tensor(x)
        mask[row, width - len(x) :] = 1
    return input_ids, mask
