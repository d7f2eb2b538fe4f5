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


class StepCounter:
    """Counts the optimizer steps the trainer takes (accelerate skips them while it accumulates)."""

    def __init__(self, optimizer) -> None:
        self.count = 0
        optimizer.register_step_post_hook(self.hook)

    def hook(self, *args) -> None:
        self.count += 1


class Timer(TrainerCallback):
    def __init__(self) -> None:
        self.stamps = [time.perf_counter()]
        self.steps: StepCounter | None = None
        self.step_counts: list[int] = []  # optimizer steps so far, at the end of each iteration

    def on_step_end(self, args, state, control, **kwargs):
        self.stamps.append(time.perf_counter())
        self.step_counts.append(self.steps.count if self.steps else -1)


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
    # TRL's rollout batch is per_device_train_batch_size x gradient_accumulation_steps, and accelerate steps the
    # optimizer every gradient_accumulation_steps micro-batches, across minibatches: with micro-batches of 8
    # and 2 accumulation steps, one step per two minibatches. One step per minibatch, as LMPPO takes, needs
    # the micro-batch to be the minibatch: the whole batch per device, no accumulation.
    if args.micro_batch * args.minibatches != args.batch:
        raise SystemExit(
            "TRL's PPOTrainer steps once per minibatch only when micro-batch x minibatches = batch"
        )
    config = PPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1, num_mini_batches=args.minibatches,
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
    timer.steps = StepCounter(
        getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    )  # accelerate's wraps it
    timer.stamps = [time.perf_counter()]
    trainer.train()
    times = [b - a for a, b in zip(timer.stamps, timer.stamps[1:])]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    import transformers
    import trl

    versions = {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}
    per_iteration = [b - a for a, b in zip([0, *timer.step_counts], timer.step_counts)]
    print(json.dumps({"iteration_s": times[1:], "peak_rss_mb": peak, "optimizer_steps": per_iteration[1:],
                      "versions": versions}))  # fmt: skip


if __name__ == "__main__":
    main()
