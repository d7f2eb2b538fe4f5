"""Seconds per PPO iteration and peak memory of TRL 1.12's PPOTrainer. Runs in its own virtual environment
(made by run.py), so TRL never touches textgym's dependencies; it does not import textgym."""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    TrainerCallback,
)
from trl.experimental.ppo import PPOConfig, PPOTrainer

from benchmarks.common import ppo_arguments  # run.py puts the repository on PYTHONPATH


class Timer(TrainerCallback):
    def __init__(self) -> None:
        self.stamps = [time.perf_counter()]

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append(time.perf_counter())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="the converted SmolLM2 directory")
    args = ppo_arguments(parser).parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    texts = json.loads(Path(args.prompts).read_text())
    ids = [tokenizer.encode(t) for t in texts]
    n = args.batch * (args.iterations + 1)
    dataset = Dataset.from_dict({"input_ids": [ids[i % len(ids)] for i in range(n)]})
    policy = AutoModelForCausalLM.from_pretrained(args.model)
    ref = AutoModelForCausalLM.from_pretrained(args.model)
    value = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1)
    reward = AutoModelForSequenceClassification.from_pretrained(args.rm_model)
    config = PPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.batch // args.micro_batch, num_mini_batches=args.minibatches,
        num_ppo_epochs=args.epochs, response_length=args.response_length, total_episodes=n,
        local_rollout_forward_batch_size=args.batch, num_sample_generations=0, report_to="none", use_cpu=True,
        temperature=1.0, learning_rate=3e-5, save_strategy="no", logging_steps=10_000, stop_token="eos",
        seed=0, bf16=False, fp16=False, dataloader_num_workers=0, kl_coef=0.05,
    )  # fmt: skip
    timer = Timer()
    trainer = PPOTrainer(
        args=config, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
        train_dataset=dataset, value_model=value, callbacks=[timer],
    )  # fmt: skip
    timer.stamps = [time.perf_counter()]
    trainer.train()
    times = [b - a for a, b in zip(timer.stamps, timer.stamps[1:])]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"iteration_s": times[1:], "peak_rss_mb": peak}))


if __name__ == "__main__":
    main()
