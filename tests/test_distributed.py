"""Data-parallel and sharded (FSDP2, DeepSpeed ZeRO-3) training on two CPU processes (gloo), as `torchrun
--nproc_per_node 2 -m textgym train` runs it (with ACCELERATE_USE_FSDP=true or ACCELERATE_USE_DEEPSPEED=true
for sharding, as `accelerate launch` with the shipped configs sets them)."""

import contextlib
import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lm_helpers import char_llama, copy_run_config, csv_rows, make_env
from transformers import AutoModelForCausalLM

from textgym.agents.distributed import cpu_has_native_bf16
from textgym.agents.ppo import LMPPO
from textgym.agents.sharding import ENGINE_ENVIRONMENT
from textgym.cli import main
from textgym.config import load_config
from textgym.rundir import RunDir

HERE = Path(__file__).parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
# sequential prompt order: the processes must still draw different prompts (the env's shard)
COPY = copy_run_config(total_timesteps=96).replace(
    "num_envs = 8", 'num_envs = 8\nprompt_order = "sequential"'
)
# Summation order differs between one process and an all-reduce over two. AdamW's first step moves each
# weight by lr * g / (|g| + eps), so where a gradient entry is near eps its float32 rounding changes that
# weight's step noticeably (seen: 1.1e-5 on one weight of 2048). The bound is 1% of one step (lr = 1e-2);
# every other weight agrees to ~1e-7.
TOLERANCE = 1e-4


# what `accelerate launch --config_file examples/accelerate/{fsdp,zero3}.yaml` sets
SHARDING = {None: {}, **ENGINE_ENVIRONMENT}  # the environment that asks for each engine
SHARDING["zero3"] = {**SHARDING["zero3"], "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true"}  # as zero3.yaml sets
ENGINE = {None: None, "fsdp": "FSDP2", "zero3": "DeepSpeed ZeRO-3"}


def failure(result):
    """A failed launch's message: each process's own last error lines, then the launcher's report (which
    alone filled the 3000 characters shown before, hiding the error of the process that failed first)."""
    own = {}
    for line in result.stderr.splitlines():
        if match := re.match(r"\[rank(\d+)\]:", line):
            own.setdefault(match[1], []).append(line)
    return (
        "\n".join(line for _, lines in sorted(own.items()) for line in lines[-30:])
        + "\n...\n"
        + result.stderr[-1500:]
    )


def run_cmd(cmd, shard=None, timeout=600, **kwargs):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    for variable in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"):
        env.pop(variable, None)
    env.update(SHARDING[shard])
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, **kwargs)


@pytest.fixture(scope="module")
def batch_file(tmp_path_factory):
    """One fixed batch of 16 episodes for the update scripts."""
    batch, _ = LMPPO(char_llama(), make_env(16), seed=3, verbose=0).generate()
    fields = ("query_ids", "query_mask", "response_ids", "response_mask", "logprobs", "scores", "truncated")
    path = tmp_path_factory.mktemp("batch") / "batch.pt"
    torch.save({k: getattr(batch, k) for k in fields}, path)
    return path


def update(batch_file, out, agents, processes, shard=None, *options):
    """Run tests/distributed_update.py: each agent's update, in turn, in the same processes."""
    script = [str(HERE / "distributed_update.py"), str(batch_file), str(out), *agents, *map(str, options)]
    result = run_cmd([*TORCHRUN, *script] if processes == 2 else [sys.executable, *script], shard=shard)
    assert result.returncode == 0, failure(result)
    for agent in agents:  # how it really ran
        assert f"{agent} sharded={ENGINE[shard] if processes == 2 else None}" in result.stdout
    (out / "stdout.txt").write_text(result.stdout)
    return out


BF16 = ["lmppo-bf16"] if cpu_has_native_bf16() else []
# what each launch updates: one process on the whole batch, and two processes per engine (None: DDP)
LAUNCHES = {
    "one": ["lmppo", "grpo", "lmppo-lora", "lmppo-zoo", "lmppo-pissa-zoo"],
    None: ["lmppo", "grpo", *BF16],
    "fsdp": ["lmppo", "grpo", "lmppo-lora", *BF16, "lmppo-zoo", "lmppo-pissa-zoo"],
    "zero3": ["lmppo", "grpo", "lmppo-lora", *BF16, "lmppo-zoo", "lmppo-pissa-zoo"],
}


class Updates:
    """The updates of tests/distributed_update.py, one launch per entry of LAUNCHES (the checkpoints of LMPPO
    and LMPPO by name saved), and the second updates resumed from the one-process checkpoints, each made the
    first time a test asks for it: a launch starts two or three Python processes, which costs more than the
    updates in it."""

    def __init__(self, batch_file, tmp_path_factory):
        self.batch_file, self.tmp_path_factory, self.dirs = batch_file, tmp_path_factory, {}

    def dir(self, launch):
        if launch not in self.dirs:
            out = self.tmp_path_factory.mktemp(f"update-{launch}")
            processes, shard = (1, None) if launch == "one" else (2, launch)
            self.dirs[launch] = update(
                self.batch_file, out, LAUNCHES[launch], processes, shard, "--save", "lmppo", "lmppo-zoo"
            )
        return self.dirs[launch]

    def resumed(self, launch):
        """The second update, of the agents the resume tests compare, from the one-process checkpoints."""
        if ("resumed", launch) not in self.dirs:
            out = self.tmp_path_factory.mktemp(f"resumed-{launch}")
            processes, shard = (1, None) if launch == "one" else (2, launch)
            agents = ["lmppo-zoo"] if launch == "fsdp" else ["lmppo", "lmppo-zoo"]
            self.dirs["resumed", launch] = update(
                self.batch_file, out, agents, processes, shard, "--load", self.dir("one")
            )
        return self.dirs["resumed", launch]

    def params(self, launch, agent):
        return torch.load(self.dir(launch) / f"{agent}.pt")

    def output(self, launch):
        return (self.dir(launch) / "stdout.txt").read_text()


@pytest.fixture(scope="module")
def updates(batch_file, tmp_path_factory):
    return Updates(batch_file, tmp_path_factory)


def assert_close(one, two):
    assert len(one) == len(two)
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize(
    "agent, shard",
    [("lmppo", None), ("grpo", None), ("lmppo", "fsdp"), ("grpo", "fsdp"), ("lmppo-lora", "fsdp"),
     ("lmppo", "zero3"), ("grpo", "zero3"), ("lmppo-lora", "zero3")],
    ids=["lmppo", "grpo", "lmppo-fsdp", "grpo-fsdp", "lmppo-lora-fsdp", "lmppo-zero3", "grpo-zero3",
         "lmppo-lora-zero3"],
)  # fmt: skip
def test_one_update_split_over_two_processes_equals_one_process_on_the_whole_batch(updates, agent, shard):
    one = updates.params("one", agent)
    initial = [p.detach() for p in char_llama().parameters()]
    if "lora" not in agent:
        assert any(not torch.equal(a, b) for a, b in zip(one, initial))  # the update changed the weights
    assert_close(one, updates.params(shard, agent))


@pytest.mark.parametrize("shard", ["fsdp", "zero3"])
def test_sharded_only_the_main_process_reads_the_policy_and_the_update_is_the_same(updates, shard):
    # the other process builds the policy and its reference on the meta device and gets its shards of the
    # main process's weights (tied embeddings included); the update is one process's on the whole batch
    for agent in ("lmppo-zoo", "lmppo-pissa-zoo"):  # PiSSA's adapter is made from the weights it adapts
        assert f"rank 0: {agent} read a policy 1 times" in updates.output(shard)
        assert f"rank 1: {agent} read a policy 0 times" in updates.output(shard)
        assert_close(updates.params("one", agent), updates.params(shard, agent))


@pytest.mark.parametrize("shard", ["fsdp", "zero3"])
def test_sharded_only_the_main_process_reads_a_checkpoint_and_it_resumes_to_the_same_update(updates, shard):
    # the main process reads the source policy (the reference) and the checkpoint's weights; the second
    # update from one process's checkpoint is the same resumed in one process or sharded over two
    again, sharded = updates.resumed("one"), updates.resumed(shard)
    output = (sharded / "stdout.txt").read_text()
    assert (
        "rank 0: lmppo-zoo read a policy 2 times" in output
        and "rank 1: lmppo-zoo read a policy 0 times" in output
    )
    again, sharded = (torch.load(d / "lmppo-zoo.pt") for d in (again, sharded))
    assert any(not torch.equal(a, b) for a, b in zip(again, updates.params("one", "lmppo-zoo")))  # it moved
    assert_close(again, sharded)


@pytest.mark.parametrize("shard", ["fsdp", "zero3"])
def test_sharded_a_policy_the_main_process_cannot_read_stops_every_process(tmp_path, shard):
    (tmp_path / "bad.py").write_text("from textgym.agents.ppo import LMPPO\nLMPPO('no-such-model', None)\n")
    result = run_cmd([*TORCHRUN, str(tmp_path / "bad.py")], shard=shard, timeout=120)
    assert result.returncode != 0
    assert "no-such-model" in result.stderr  # the main process's own error
    assert "process 0 failed, so every process stops: UnknownNameError" in result.stderr  # the other's


FALLBACK_PLUGIN = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import textgym
from textgym.models import CharTokenizer

CONFIG = dict(vocab_size=33, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, pad_token_id=0, eos_token_id=1, bos_token_id=None)


def cast():  # cast after it is built: its rotary table is bf16, which a meta copy's is not
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16).eval(), CharTokenizer()


def local():  # a class of its own, which does not pickle
    class Local(LlamaForCausalLM):
        pass

    torch.manual_seed(0)
    return Local(LlamaConfig(**CONFIG)).eval(), CharTokenizer()


@textgym.hookimpl
def register_models(register):
    register("cast-llama", cast)
    register("local-llama", local)
"""

FALLBACK = """
import sys
import torch
import torch.distributed
import textgym.models
from textgym.agents.ppo import LMPPO
from textgym.agents.sharding import full_tensor
from textgym.launch import end_process_group, exit_process
from textgym.plugin_manager import load_plugin_file

load_plugin_file(sys.argv[1])
reads = [0]
load = textgym.models.load_model


def counted(*args, **kwargs):
    reads[0] += 1
    return load(*args, **kwargs)


textgym.models.load_model = counted


def main():
    agent = LMPPO(sys.argv[2], None, seed=0, verbose=0)
    buffers = [b.float() for b in agent.rollout_model.buffers()]
    logits = agent.rollout_model(input_ids=torch.tensor([[2, 3, 4, 5]])).logits.float()
    weights = [full_tensor(p).float() for p in agent.params]
    mine = [*buffers, logits.detach(), *[w.detach() for w in weights]]
    theirs = agent.dist.gather_objects([mine])
    same = all(torch.equal(a, b) for a, b in zip(*theirs))
    print(f"rank {agent.dist.rank}: read {reads[0]} times, the same model on both: {same}", flush=True)


main()
torch.distributed.barrier()
end_process_group()
exit_process(0)
"""


@pytest.mark.parametrize(
    "model, shard", [("cast-llama", "fsdp"), ("local-llama", "fsdp"), ("local-llama", "zero3")]
)
def test_sharded_a_policy_the_other_processes_cannot_build_on_the_meta_device_is_loaded_by_each(
    model, shard, tmp_path
):
    # a loader that casts its model after building it (the meta copy's buffers would differ), and a class
    # that does not pickle: each process loads the policy itself, and all hold the same model
    (tmp_path / "models.py").write_text(FALLBACK_PLUGIN)
    (tmp_path / "fallback.py").write_text(FALLBACK)
    script = [str(tmp_path / "fallback.py"), str(tmp_path / "models.py"), model]
    result = run_cmd([*TORCHRUN, *script], shard=shard, timeout=180)
    assert result.returncode == 0, failure(result)
    for rank in (0, 1):
        assert f"rank {rank}: read 1 times, the same model on both: True" in result.stdout


def test_zero3_names_a_policy_whose_dtype_differs_from_the_value_heads(tmp_path):
    # the engine flattens the trainable parameters into one buffer; FSDP2 takes the same policy (above)
    (tmp_path / "models.py").write_text(FALLBACK_PLUGIN)
    (tmp_path / "fallback.py").write_text(FALLBACK)
    script = [str(tmp_path / "fallback.py"), str(tmp_path / "models.py"), "cast-llama"]
    result = run_cmd([*TORCHRUN, *script], shard="zero3", timeout=180)
    assert result.returncode != 0
    message = "DeepSpeed ZeRO-3 trains parameters of one dtype, and these differ (the policy: bfloat16, value_head: float32)"
    assert message in result.stderr


def test_zero3_checkpoints_hold_what_one_process_saves_and_load_into_the_same_next_update(updates):
    # LMPPO under ZeRO-3 (its first update equals one process's: the test above): its gathered checkpoint
    # (weights, value head, AdamW moments and step) equals one process's checkpoint; then an unsharded
    # checkpoint loaded into ZeRO-3 shards gives the same second update as one process (the moments and step
    # count decide AdamW's).
    one, two = updates.dir("one") / "lmppo", updates.dir("zero3") / "lmppo"
    saved = [torch.load(d / "optimizer.pt", weights_only=True) for d in (one, two)]
    assert saved[1]["param_groups"] == saved[0]["param_groups"]
    assert saved[1]["state"].keys() == saved[0]["state"].keys()
    for index, entry in saved[0]["state"].items():
        assert float(entry["step"]) == float(saved[1]["state"][index]["step"]) == 1
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(saved[1]["state"][index][key], entry[key], atol=1e-6, rtol=0)
    heads = [torch.load(d / "value_head.pt", weights_only=True) for d in (one, two)]
    assert_close(list(heads[0].values()), list(heads[1].values()))
    again, sharded = (torch.load(updates.resumed(launch) / "lmppo.pt") for launch in ("one", "zero3"))
    assert any(not torch.equal(a, b) for a, b in zip(again, updates.params("one", "lmppo")))  # it moved
    assert_close(again, sharded)


@pytest.mark.skipif(not BF16, reason="bf16 = true needs a CPU with native bf16")
@pytest.mark.parametrize("shard", ["fsdp", "zero3"])
def test_a_sharded_bf16_update_equals_the_data_parallel_one(updates, shard):
    # bf16 rounds the whole batch and each half differently (~1e-2 here), so the reference is DDP's split
    for a, b in zip(updates.params(None, "lmppo-bf16"), updates.params(shard, "lmppo-bf16")):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("shard", [None, "fsdp", "zero3"], ids=["ddp", "fsdp", "zero3"])
def test_sharded_rollouts_run_in_lockstep_and_bad_values_on_one_process_stop_every_process(shard):
    # process 0's episodes end after 2 tokens, process 1's after up to 6; a process that stopped stepping
    # (or skipped a backward) would leave the other waiting in a collective forever: the timeout turns that
    # hang into a failure. See tests/distributed_sharding.py.
    script = [str(HERE / "distributed_sharding.py"), *(["--ddp"] if shard is None else [])]
    result = run_cmd([*TORCHRUN, *script], shard=shard, timeout=180)
    assert result.returncode == 0, failure(result)
    assert f"rank 0: sharded with {ENGINE[shard]}" in result.stdout
    assert ("rank 1: padding filled with NaN" in result.stdout) == (shard == "zero3")
    assert (
        "rank 0: saved before any step" in result.stdout and "rank 1: saved before any step" in result.stdout
    )
    assert "rank 0: 4 episodes of up to 2 tokens, as unsharded" in result.stdout
    for rank in (0, 1):
        assert f"rank {rank}: normalize_then_sum standardised over every process's episodes" in result.stdout
        assert f"rank {rank}: tokens per second over every process's tokens" in result.stdout
        assert (f"rank {rank}: the KL reference is sharded as the policy" in result.stdout) == (
            shard is not None
        )
    assert "rank 1: 4 episodes of up to 6 tokens, as unsharded" in result.stdout
    for rank in (0, 1):
        assert f"rank {rank}: step skipped" in result.stdout and f"rank {rank}: not healthy" in result.stdout
        assert f"rank {rank}: the reference holds the main process's policy" in result.stdout
        assert f"rank {rank}: a callback on one process stopped learn after 1 iteration" in result.stdout
        assert (f"rank {rank}: data parallel, saved by the main process only" in result.stdout) == (
            shard is None
        )


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "copy.toml"
    path.write_text(COPY)
    return path


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """A short Copy-v0 run trained by two processes, made once: (its directory, the launch's result). A test
    that changes the run works on a copy (``copy_run``)."""
    path = tmp_path_factory.mktemp("two-process-run")
    (path / "copy.toml").write_text(COPY)
    out = path / "run"
    result = run_cmd([*TORCHRUN, "-m", "textgym", "train", str(path / "copy.toml"), "--set", f"run.output_dir='{out}'",
                      "--set", "run.report_to=['tensorboard']"])  # fmt: skip
    assert result.returncode == 0, failure(result)
    return out, result


def copy_run(run, tmp_path):
    return Path(shutil.copytree(run, tmp_path / "run"))


@pytest.mark.parametrize("shard", ["fsdp", "zero3"])
def test_a_sharding_config_with_one_launched_process_shards_and_trains_as_one_unsharded_process(
    config, tmp_path, shard
):
    """As accelerate does with --num_processes 1 (and a user checking a sharding config on one GPU before
    scaling out expects): the sharded code runs, over a process group of one, and learns what one unsharded
    process learns. Without a launcher there is no group, and nothing is sharded (test_agent_base)."""
    one = [*TORCHRUN[:-1], "--nproc_per_node=1", "-m", "textgym", "train", str(config)]
    sharded = run_cmd([*one, "--set", f"run.output_dir='{tmp_path / 'sharded'}'"], shard=shard)
    assert sharded.returncode == 0, failure(sharded)
    assert f"textgym: the policy is sharded over 1 process ({ENGINE[shard]})" in sharded.stdout
    assert main(["train", str(config), "--set", f"run.output_dir='{tmp_path / 'plain'}'"]) == 0
    rows = {name: csv_rows(tmp_path / name / "metrics.csv") for name in ("sharded", "plain")}
    assert len(rows["sharded"]) == len(rows["plain"]) > 1
    for mine, theirs in zip(rows["sharded"], rows["plain"]):  # the same episodes, updates within rounding
        for key in ("reward", "kl", "loss/policy_avg", "loss/value_avg"):
            assert float(mine[key]) == pytest.approx(float(theirs[key]), abs=TOLERANCE), key


def test_a_two_process_run_writes_one_run_directory_with_statistics_over_all_episodes(
    two_process_run, tmp_path
):
    trained, result = two_process_run
    out = copy_run(trained, tmp_path)
    assert load_config(out / "config.toml")["run"]["processes"] == 2
    with open(out / "metrics.csv") as f:
        metrics = list(csv.DictReader(f))
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 * len(metrics)  # both processes' episodes: 4 each per iteration
    first = [s for s in samples if s["iteration"] == 1]
    assert float(metrics[0]["reward"]) == pytest.approx(sum(s["reward"] for s in first) / 8, abs=1e-6)
    assert len({s["prompt"] for s in first}) == 8  # not the same four prompts twice
    assert result.stdout.count("after training:") == 1  # only the main process reports
    assert len(list((out / "tensorboard" / "run_1").glob("events.out.tfevents.*"))) == 1  # the main one's
    resumed = run_cmd(
        [sys.executable, "-m", "textgym", "train", "--resume", str(out), "--set", "run.total_timesteps=200"]
    )
    assert resumed.returncode == 0, resumed.stderr  # run.processes = 2: relaunched with two processes
    assert int(csv_rows(out / "metrics.csv")[-1]["timesteps"]) >= 200  # with the resume's --set
    again = run_cmd([*TORCHRUN, "-m", "textgym", "train", "--resume", str(out), "--set", "run.processes=1"])
    assert again.returncode != 0


REQUESTED = """
import os
from textgym.agents.sharding import fsdp_requested
from textgym.agents.zero3 import zero3_requested
print(f"process {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: {fsdp_requested()} {zero3_requested()}")
"""


@pytest.mark.parametrize(
    "name, asks",
    [("fsdp", "FSDPSettings(reshard_after_forward=True"), ("zero3", "None {'stage': 3}")],
)
def test_accelerate_launch_with_a_shipped_config_starts_two_processes_asking_for_its_engine(
    name, asks, tmp_path
):
    (tmp_path / "requested.py").write_text(REQUESTED)
    config = HERE.parent / "examples" / "accelerate" / f"{name}.yaml"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    result = run_cmd([*launch, str(tmp_path / "requested.py")])
    assert result.returncode == 0, failure(result)
    for rank in (0, 1):  # on CPUs as on GPUs, and none of its options refused
        assert f"process {rank} of 2: {asks}" in result.stdout


def test_a_zero3_checkpoint_of_tied_weights_holds_what_one_process_writes(updates):
    from safetensors import safe_open

    # LMPPO by name, after its update: tiny-random-llama's LM head is its embeddings
    tensors = {}
    for launch in ("one", "zero3"):
        with safe_open(updates.dir(launch) / "lmppo-zoo" / "policy" / "model.safetensors", "pt") as f:
            tensors[launch] = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 (not iterable)
    assert tensors["zero3"].keys() == tensors["one"].keys()  # the tied LM head is written once, as unsharded
    assert_close(list(tensors["one"].values()), [tensors["zero3"][key] for key in tensors["one"]])


SHARED = """
import torch
import torch.distributed
from torch import nn

from textgym.agents import zero3
from textgym.agents.sharding import full_tensor, main_weights
from textgym.launch import end_process_group, exit_process

torch.distributed.init_process_group("gloo")
main = torch.distributed.get_rank() == 0


class Shared(nn.Module):  # a child under two parents, and a buffer registered in two modules
    def __init__(self):
        super().__init__()
        self.one, self.two, child = nn.Module(), nn.Module(), nn.Linear(3, 5)
        self.one.child, self.two.child, self.last = child, child, nn.Linear(5, 2)
        self.two.scale = nn.Parameter(torch.rand(2))  # two's Init reaches the child before the child's own
        table = torch.arange(4.0)
        self.one.register_buffer("table", table)
        self.last.register_buffer("table", table)


def partition():  # its models are freed before the group ends (else the interpreter's exit can abort)
    torch.manual_seed(0)
    whole = Shared()
    if main:
        print(f"expected: {[round(float(p.detach().sum()), 4) for p in whole.parameters()]}", flush=True)
    with torch.device("meta"):
        skeleton, other = Shared(), Shared()  # the reference on every process; the other process's policy
    model = whole if main else other
    config = zero3._engine_config({"stage": 3})
    zero3._partition(skeleton, config, torch.device("cpu"), main_weights(whole, type("D", (), {"is_main": main})))
    zero3._partition(model, config, torch.device("cpu"))
    for built in (skeleton, model):
        assert built.one.child is built.two.child and built.one.table is built.last.table
        assert torch.equal(built.one.table, torch.arange(4.0))
        values = [full_tensor(p) for p in built.parameters()]
        print(f"rank {torch.distributed.get_rank()}: {[round(float(v.sum()), 4) for v in values]}", flush=True)


partition()
torch.distributed.barrier()
end_process_group()
exit_process(0)
"""


def test_zero3_partitions_a_child_under_two_parents_and_a_buffer_in_two_modules_from_the_main_process(
    tmp_path,
):
    # the other process builds them on the meta device: each is allocated once, and takes the main's values
    (tmp_path / "shared.py").write_text(SHARED)
    result = run_cmd([*TORCHRUN, str(tmp_path / "shared.py")], shard="zero3", timeout=180)
    assert result.returncode == 0, failure(result)
    # each print is one write, but the two processes' writes may interleave: find them anywhere in the output
    expected = re.findall(r"expected: (\[[^]]*\])", result.stdout)
    sums = re.findall(r"rank \d: (\[[^]]*\])", result.stdout)
    assert len(expected) == 1 and len(sums) == 4, result.stdout  # both models, on both processes
    assert set(sums) == set(expected), result.stdout


EVAL = """
[eval]
every = 2
prompts = "copy-heldout"
episodes = 4
"""


@pytest.mark.parametrize("shard", ["fsdp", "zero3"])
def test_a_sharded_two_process_run_writes_a_checkpoint_one_process_loads_and_resumes(tmp_path, shard):
    (tmp_path / "copy.toml").write_text(COPY + EVAL)  # [eval]: held-out rollouts on every process too
    out = tmp_path / "run"
    cmd = [
        *TORCHRUN,
        "-m",
        "textgym",
        "train",
        str(tmp_path / "copy.toml"),
        "--set",
        f"run.output_dir='{out}'",
    ]
    result = run_cmd(cmd, shard=shard)
    assert result.returncode == 0, failure(result)
    assert result.stdout.count(f"the policy is sharded over 2 processes ({ENGINE[shard]})") == 1
    assert len(csv_rows(out / "metrics.csv")) == 3
    assert [r["iteration"] for r in csv_rows(out / "eval.csv")] == ["0", "2", "3"]  # every 2, and at the end
    assert (out / "samples_before.jsonl").is_file() and (out / "samples_after.jsonl").is_file()
    # the checkpoint is a plain Hugging Face model and optimizer state, loaded by one process
    policy = AutoModelForCausalLM.from_pretrained(out / "checkpoint" / "policy")
    assert policy.config.architectures == ["LlamaForCausalLM"]
    agent = LMPPO.load(out / "checkpoint")
    assert not agent.sharded and agent.iteration == 3
    for a, b in zip(agent.policy.parameters(), policy.parameters()):
        assert torch.equal(a, b)
    optimizer = torch.load(out / "checkpoint" / "optimizer.pt", weights_only=True)
    shapes = [p.shape for p in agent.params]
    assert [optimizer["state"][i]["exp_avg"].shape for i in range(len(shapes))] == shapes  # whole, not shards
    resumed = run_cmd([*TORCHRUN, "-m", "textgym", "train", "--resume", str(out), "--set", "run.total_timesteps=160"],
                      shard=shard)  # fmt: skip
    assert resumed.returncode == 0, failure(resumed)
    assert "resuming" in resumed.stdout and len(csv_rows(out / "metrics.csv")) > 3
    assert "this resume is" not in resumed.stdout  # sharded as it was trained: nothing to say
    assert LMPPO.load(out / "checkpoint").iteration > 3
    # without the sharding variables the checkpoint resumes data-parallel, and the run says so
    plain = run_cmd(
        [*TORCHRUN, "-m", "textgym", "train", "--resume", str(out), "--set", "run.total_timesteps=200"]
    )
    assert plain.returncode == 0, failure(plain)
    assert f"was last trained sharded with {ENGINE[shard]}; this resume is not sharded" in plain.stdout


def interrupted_two_process_run(config, out, signals, ready=None, options=(), sig=signal.SIGINT, group=True):
    """A ``run.processes = 2`` run sent ``signals`` SIGINTs (or ``sig``s; 50 ms apart) once its first iteration
    is logged (or once the file ``ready`` exists), to its whole process group, as a terminal's Ctrl-C is:
    textgym's own process and the two it started (``group=False``: to textgym's own process only, as a
    container's stop is). Returns the exit code and the output."""
    cmd = [sys.executable, "-m", "textgym", "train", str(config), "--set", f"run.output_dir='{out}'", "--set",
           "run.processes=2", "--set", "run.total_timesteps=100000", "--set", "run.checkpoint_every=1000",
           *options]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    ready = ready or out / "metrics.csv"
    deadline = time.time() + 300
    while not ready.is_file() and time.time() < deadline and proc.poll() is None:  # a failed start: at once
        time.sleep(0.2)
    for i in range(signals):
        time.sleep(0.05 * bool(i))
        os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
    output, _ = proc.communicate(timeout=180)
    return proc.returncode, output


def _proc_stat(pid):
    """(state, parent pid) of a process from /proc, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_processes_stop_with_a_checkpoint_when_their_launching_process_is_killed(config, tmp_path):
    """kill -9 of the process that run.processes = N started them from (or the OOM killer) left them training
    on, to the end of the run, with nobody reading their output."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "textgym", "train", str(config), "--set", f"run.output_dir='{out}'", "--set",
           "run.processes=2", "--set", "run.total_timesteps=100000", "--set", "run.checkpoint_every=1000"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    deadline = time.time() + 300
    while not (out / "metrics.csv").is_file() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    started = [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and (_proc_stat(p.name) or ("", 0))[1] == proc.pid
    ]
    assert len(started) == 2
    proc.kill()
    try:
        output, _ = proc.communicate(timeout=180)  # the output ends when both processes have closed it
    finally:
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert all((_proc_stat(pid) or ("Z",))[0] == "Z" for pid in started)  # (exited; reaped or not)
    assert "interrupted; checkpoint saved" in output and "Traceback" not in output, output
    # said as what happened: it was announced as a SIGTERM, which nobody had sent
    assert f"the launching process ({proc.pid}) ended: stopping after this iteration" in output, output
    assert "SIGTERM" not in output
    assert RunDir(out).recover_checkpoint() is not None
    assert not (out / "samples_after.jsonl").exists()  # stopped, not trained to its end


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_process_killed_by_a_signal_is_named_with_the_signal_and_where_a_resume_continues(config, tmp_path):
    """kill -9 of one process (or the OOM killer) read as "exited with code 137; see above", and above was only
    the other process's lost-connection traceback."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "textgym", "train", str(config), "--set", f"run.output_dir='{out}'", "--set",
           "run.processes=2", "--set", "run.total_timesteps=100000", "--set", "run.checkpoint_every=1"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        deadline = time.time() + 300
        while RunDir(out).last_checkpoint() is None and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        workers = [
            p.name
            for p in Path("/proc").iterdir()
            if p.name.isdigit() and (_proc_stat(p.name) or ("", 0))[1] == proc.pid
        ]
        rank1 = [pid for pid in workers if b"\0RANK=1\0" in Path(f"/proc/{pid}/environ").read_bytes()]
        assert len(workers) == 2 and len(rank1) == 1
        os.kill(int(rank1[0]), signal.SIGKILL)
        output, _ = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 2, output
    k = RunDir(out).last_checkpoint()
    assert isinstance(k, int) and k >= 1
    assert (
        f"process 1 was killed by SIGKILL (kill -9, or the system's out-of-memory killer); the other processes' "
        f"errors above follow from it. Its last checkpoint is at iteration {k}: textgym train --resume {out} "
        f"continues from there." in " ".join(output.split())
    ), output[-3000:]


def test_ctrl_c_of_a_run_processes_2_run_saves_once_in_one_line_and_it_resumes(config, tmp_path):
    out = tmp_path / "run"
    code, output = interrupted_two_process_run(config, out, signals=1)
    assert code == 130, output  # the processes exit 0 (else this one would take it for an abort)
    assert output.count("interrupted; checkpoint saved") == 1 and "Traceback" not in output, output
    assert output.count("Ctrl-C: stopping after this iteration") == 1  # the main process says it
    assert "error" not in output
    assert RunDir(out).recover_checkpoint() is not None
    done = len(csv_rows(out / "metrics.csv"))
    resumed = run_cmd([sys.executable, "-m", "textgym", "train", "--resume", str(out), "--set",
                       f"run.total_timesteps={(done + 1) * 32}"])  # fmt: skip
    assert resumed.returncode == 0, failure(resumed)
    assert "resuming" in resumed.stdout and len(csv_rows(out / "metrics.csv")) > done


@pytest.mark.parametrize(
    ("sig", "group"),
    [(signal.SIGTERM, True), (signal.SIGTERM, False), (signal.SIGINT, False)],
    ids=["sigterm-to-the-group", "sigterm-to-textgym", "sigint-to-textgym"],
)
def test_one_signal_stops_a_run_processes_2_run_and_two_abort_it(config, tmp_path, sig, group):
    """textgym passes a SIGTERM or SIGINT on to the processes it started; sent to the whole group (a service
    manager's stop, scancel), each process gets it twice, which must still be one, not an abort. A `kill -INT`
    of textgym's own process (as docs/training.md advises under a wrapper) was not passed on: the run went on."""
    out = tmp_path / "run"
    code, output = interrupted_two_process_run(config, out, signals=1, sig=sig, group=group)
    assert code == 130, output
    assert output.count("interrupted; checkpoint saved") == 1 and "Traceback" not in output, output
    said = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
    assert output.count(f"{said}: stopping after this iteration") == 1, output
    assert RunDir(out).recover_checkpoint() is not None
    code, output = interrupted_two_process_run(config, tmp_path / "again", signals=2, sig=sig, group=group)
    assert code == 130, output
    assert output.count("textgym: aborted") == 1 and "Traceback" not in output and "failed" not in output, (
        output
    )


def test_a_second_ctrl_c_aborts_a_run_processes_2_run_in_one_line(config, tmp_path):
    out = tmp_path / "run"
    code, output = interrupted_two_process_run(config, out, signals=2)
    assert code == 130, output
    assert output.count("textgym: aborted") == 1 and "Traceback" not in output and "failed" not in output, (
        output
    )
    assert (out / "metrics.csv").is_file()  # a run that logged an iteration is kept
    # and named once, as a one-process run names it (the launcher's abort carried no directory)
    assert output.count(f"textgym train --resume {out} continues it") == 1, output


SLOW_ON_RANK_0 = """
import os
import time
from pathlib import Path

import textgym

calls = []


@textgym.reward("slow_on_rank_0")
def slow_on_rank_0(samples):
    calls.append(len(samples))
    if os.environ["RANK"] == "0" and len(calls) == 3:  # in training: process 1 waits for it in a collective
        Path(__file__).with_name("sleeping").touch()
        time.sleep(5)
    return [0.0] * len(samples)
"""


def test_two_ctrl_cs_while_a_process_waits_in_a_collective_abort_in_one_line(config, tmp_path):
    """A process blocked in a collective runs its Python signal handler once for both Ctrl-Cs (Python calls a
    handler once for a signal that arrived any number of times meanwhile), so it only stops; the other one
    aborts and leaves, and the collective fails under the first. That is still the abort the user asked for."""
    (tmp_path / "slow.py").write_text(SLOW_ON_RANK_0)
    out = tmp_path / "run"
    options = [
        "--set",
        f"run.plugins=['{tmp_path / 'slow.py'}']",
        "--set",
        "env.rewards=[{name='slow_on_rank_0'}]",
    ]
    code, output = interrupted_two_process_run(
        config, out, signals=2, ready=tmp_path / "sleeping", options=options
    )
    assert code == 130, output
    assert output.count("textgym: aborted") == 1 and "Traceback" not in output and "failed" not in output, (
        output
    )


def test_resuming_with_another_number_of_processes_is_refused(two_process_run, tmp_path):
    out = copy_run(two_process_run[0], tmp_path)
    fsdp = HERE.parent / "examples" / "accelerate" / "fsdp.yaml"
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(fsdp)]
    itself = f"textgym train --resume {out}, which starts them itself"
    same_config = "accelerate launch --config_file CONFIG --num_processes 2, with the same sharding config"
    # torchrun with one process is a launcher too: it must not start a second one inside; a sharded launch
    # is told how to resume sharded (a plain resume would drop the sharding)
    fsdp_torchrun = "ACCELERATE_USE_FSDP=true torchrun --nproc_per_node 2"
    for launcher, hint, shard in [
        ([*TORCHRUN[:-1], "--nproc_per_node=3"], f"(torchrun --nproc_per_node 2, or {itself})", None),
        ([*accelerate, "--num_processes=3"], f"({same_config}, or ACCELERATE_USE_FSDP=true {itself})", None),
        ([*accelerate, "--num_processes=1"], f"({same_config}, or ACCELERATE_USE_FSDP=true {itself})", None),
        ([*TORCHRUN[:-1], "--nproc_per_node=1"], f"(torchrun --nproc_per_node 2, or {itself})", None),
        (
            [*TORCHRUN[:-1], "--nproc_per_node=1"],
            f"({fsdp_torchrun}, or ACCELERATE_USE_FSDP=true {itself})",
            "fsdp",
        ),
    ]:
        result = run_cmd([*launcher, "-m", "textgym", "train", "--resume", str(out)], shard=shard)
        assert result.returncode != 0, result.stdout[-2000:]
        assert f"resume it with the same number {hint}, not" in result.stderr
        assert "with 2 processes on this machine" not in result.stdout


def test_a_resume_that_sets_another_number_of_processes_is_refused(config, tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        main(["train", str(config), "--set", f"run.output_dir='{out}'", "--set", "run.total_timesteps=16"])
        == 0
    )
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--set", "run.processes=2"]) == 2
    assert f"{out} was trained by 1 process(es); a resume keeps that number" in capsys.readouterr().err
    assert load_config(out / "config.toml")["run"]["processes"] == 1


def test_a_two_process_resume_says_once_which_reward_code_changed(tmp_path):
    """The main process of run.processes = N is one the launcher started, which said nothing: the change
    went unsaid there, where one process said it."""
    (tmp_path / "rewards.py").write_text("def short(samples):\n    return [0.0 for s in samples]\n")
    config = tmp_path / "fn.toml"
    config.write_text(
        COPY.replace("num_envs = 8", 'num_envs = 8\nrewards = [{ fn = "rewards.py:short" }]', 1)
    )
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "textgym", "train"]
    first = run_cmd([*cmd, str(config), "--set", f"run.output_dir='{out}'", "--set", "run.processes=2",
                     "--set", "run.total_timesteps=32"])  # fmt: skip
    assert first.returncode == 0, failure(first)
    (tmp_path / "rewards.py").write_text("def short(samples):\n    return [1.0 for s in samples]\n")
    resumed = run_cmd([*cmd, "--resume", str(out), "--set", "run.total_timesteps=64"])
    assert resumed.returncode == 0, failure(resumed)
    said = f"warning: the code this run trains with changed since it last started or resumed ({tmp_path}"
    assert resumed.stdout.count(said) == 1, resumed.stdout


FAILS_ON_RANK_1 = """
import os

import textgym


@textgym.reward("flaky")
def flaky(samples):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("the judge is down")
    return [0.0] * len(samples)
"""


FAILS_TO_BUILD_ON_RANK_1 = """
import os

import textgym


class Judge:
    def __init__(self):
        if os.environ.get("RANK") == "1":
            raise RuntimeError("the judge is down")

    def __call__(self, samples):
        return [0.0] * len(samples)


@textgym.hookimpl
def register_rewards(register):
    register("flaky", Judge)
"""


@pytest.mark.parametrize(
    "shard, where",
    [(None, "env"), ("fsdp", "env"), (None, "eval"), (None, "eval-build")],
    ids=["ddp", "fsdp", "ddp-eval-metric", "ddp-eval-metric-built"],
)
def test_a_reward_failing_on_one_process_stops_every_process_with_its_name(config, tmp_path, shard, where):
    """Sharded, the rollouts run in lockstep (a collective per step): the failing process must stop the
    others in it, or they wait for its next forward forever (the timeout turns that hang into a failure).
    Unsharded, each process runs an [eval] alone, and the others went on to a raw "connection closed"."""
    (tmp_path / "flaky.py").write_text(FAILS_TO_BUILD_ON_RANK_1 if where == "eval-build" else FAILS_ON_RANK_1)
    out = tmp_path / "run"
    sets = (
        ["env.rewards=[{name='flaky'}]"]
        if where == "env"
        else ["eval.every=1", "eval.episodes=8", "eval.rewards=[{name='flaky'}]"]
    )
    result = run_cmd([*TORCHRUN, "-m", "textgym", "train", str(config), "--set", f"run.output_dir='{out}'",
                      "--set", "run.sample_prompts=1", "--set", f"run.plugins=['{tmp_path / 'flaky.py'}']",
                      *(arg for s in sets for arg in ("--set", s))], shard=shard, timeout=240)  # fmt: skip
    assert result.returncode != 0
    assert "reward function 'flaky'" in result.stderr or "reward plugin 'flaky'" in result.stderr
    assert (
        "the judge is down" in result.stderr and "process 1 failed, so every process stops" in result.stderr
    )


def test_a_run_processes_2_run_names_the_process_that_failed_not_one_that_stopped_with_it(
    config, tmp_path, capsys
):
    """Process 0, stopping because process 1's reward plugin failed, often exited first, and the launcher
    then named it as the failed one."""
    (tmp_path / "flaky.py").write_text(FAILS_ON_RANK_1)
    code = main(["train", str(config), "--set", "run.processes=2", "--set", f"run.output_dir='{tmp_path / 'run'}'",
                 "--set", f"run.plugins=['{tmp_path / 'flaky.py'}']", "--set", "env.rewards=[{name='flaky'}]"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 2 and "process 1 failed, so every process stops" in captured.out, captured.out[-3000:]
    assert "the 2-process run of" in captured.err and "failed (process 1 exited with code 2)" in captured.err


def test_a_batch_that_does_not_split_over_the_processes_is_refused(config, tmp_path, capsys):
    assert (
        main(
            ["train", str(config), "--set", "run.processes=3", "--set", f"run.output_dir='{tmp_path / 'x'}'"]
        )
        == 2
    )
    assert "env.num_envs=8 does not split evenly over 3 processes" in capsys.readouterr().err
    (tmp_path / "grpo.toml").write_text(COPY.replace("n_epochs = 1", "num_generations = 8"))
    assert main(["train", str(tmp_path / "grpo.toml"), "--agent", "grpo", "--set", "run.processes=2",
                 "--set", f"run.output_dir='{tmp_path / 'y'}'"]) == 2  # fmt: skip
    assert (
        "each of the 2 processes gets 4 episodes, not a multiple of num_generations=8"
        in capsys.readouterr().err
    )
    (tmp_path / "grpo3.toml").write_text(COPY.replace("n_epochs = 1", "num_generations = 3"))
    assert main(["train", str(tmp_path / "grpo3.toml"), "--agent", "grpo",
                 "--set", f"run.output_dir='{tmp_path / 'w'}'"]) == 2  # fmt: skip
    assert (
        "env.num_envs=8 is not a multiple of num_generations=3: make env.num_envs a multiple of 3"
        in capsys.readouterr().err
    )
    assert main(["train", str(config), "--agent", "sb3-ppo", "--set", "run.processes=2",
                 "--set", f"run.output_dir='{tmp_path / 'z'}'"]) == 2  # fmt: skip
    assert "Stable-Baselines3 agents train in one process: set run.processes = 1" in capsys.readouterr().err
    # more minibatches than a process's share has episodes: refused here, not in each started process
    assert main(["train", str(config), "--set", "run.processes=2", "--set", "agent.n_minibatches=8",
                 "--set", f"run.output_dir='{tmp_path / 'v'}'"]) == 2  # fmt: skip
    assert (
        "agent.n_minibatches=8 splits each of the 2 processes' share of the batch (4 of env.num_envs=8) into more "
        "minibatches than it has episodes: give n_minibatches <= 4" in capsys.readouterr().err
    )
    assert not any((tmp_path / d).exists() for d in "xyzv")


def test_a_start_the_processes_refuse_leaves_no_run_directory(config, tmp_path, capsys):
    """Under run.processes = N the run directory is made before the processes start; when they refuse to
    start (here a policy directory holding a tokenizer but no weights, which only the processes load), it is
    removed again, as a failed start in one process leaves none."""
    from textgym.models import load_tokenizer

    load_tokenizer("tiny-char-llama").save_pretrained(tmp_path / "no-weights")
    out = tmp_path / "run"
    code = main(["train", str(config), "--set", "run.processes=2", "--set", f"run.output_dir='{out}'",
                 "--set", f"agent.policy='{tmp_path / 'no-weights'}'"])  # fmt: skip
    captured = capsys.readouterr()
    assert code != 0 and "the 2-process run" in captured.err, captured.err[-2000:]
    assert not out.exists()


@pytest.mark.parametrize(
    ("setting", "environ", "says"),
    [
        ("agent.device='cuda'", {}, 'device = "cuda", but torch sees no CUDA GPU'),
        ("agent.policy='no-such-model'", {}, "unknown model 'no-such-model'"),
        ("agent.policy='{tmp_path}'", {}, "has no tokenizer files"),
        ("", {"ACCELERATE_USE_FSDP": "true", "FSDP_OFFLOAD_PARAMS": "true"}, "CPU offload is not supported"),
    ],
    ids=["device", "policy-name", "policy-directory", "fsdp-option"],
)
def test_what_every_process_would_refuse_is_refused_once_before_they_start(
    config, tmp_path, monkeypatch, capsys, setting, environ, says
):
    """Each started process printed the same error, and the launcher a third line blaming one of them."""
    for var, value in environ.items():
        monkeypatch.setenv(var, value)
    out = tmp_path / "run"
    extra = ["--set", setting.format(tmp_path=tmp_path)] if setting else []
    code = main(
        ["train", str(config), "--set", "run.processes=2", "--set", f"run.output_dir='{out}'", *extra]
    )
    captured = capsys.readouterr()
    output = captured.out + captured.err  # (started processes' output would be in captured.out)
    assert code == 2 and captured.err.count(says) == 1 and output.count(says) == 1, output
    assert "with 2 processes" not in output and "2-process run" not in output  # none started
    assert not out.exists()


def test_a_program_binding_the_port_before_the_processes_start_does_not_stop_a_run(
    config, tmp_path, monkeypatch
):
    """run.processes = N chose a free port, released it, and the main process bound it seconds later: another
    program (here, this test, just before the processes start) could take it meanwhile, and the run failed
    with "address already in use". The port is now held by the launching process's store throughout."""
    import socket

    taken, popen = [], subprocess.Popen

    def start(cmd, env, **kwargs):
        if not taken:  # the port the processes are told to meet at, bound by another program if it can
            other = socket.socket()
            try:
                other.bind((env["MASTER_ADDR"], int(env["MASTER_PORT"])))
                other.listen()
            except OSError:  # held: nobody else can take it
                other.close()
            taken.append(other)
        return popen(cmd, env=env, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", start)
    out = tmp_path / "run"
    try:
        assert (
            main(["train", str(config), "--set", "run.processes=2", "--set", f"run.output_dir='{out}'"]) == 0
        )
    finally:
        for other in taken:
            other.close()
    assert len(csv_rows(out / "metrics.csv")) == 3


def test_the_process_group_starts_on_the_agents_device(monkeypatch):
    """accelerate keeps the device of the first PartialState: a group started for a GPU would put an agent
    with device = "cpu" on the GPU (NCCL), so `textgym train` starts it on the agent's device."""
    import accelerate

    from textgym.launch import init_process_group

    started = []
    monkeypatch.setattr(accelerate, "PartialState", lambda cpu: started.append(cpu))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for device in ("cpu", "auto", "cuda"):
        init_process_group(device)
    assert started == [True, False, False]


def test_any_error_preparing_the_run_on_the_main_process_reaches_the_others(monkeypatch):
    """The main process prepares the run directory while the others wait for its result. An error that is not
    a ConfigError (a damaged file read as JSON, a bug) is raised as itself on the main process, and the others
    stop with its one-line summary, where they waited in the broadcast until the launcher killed them."""
    import accelerate.utils

    from textgym.errors import ConfigError
    from textgym.launch import on_main

    sent = []
    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", lambda payload: sent.append(list(payload)))
    monkeypatch.setenv("RANK", "0")

    def damaged():
        return json.loads("{")

    with pytest.raises(json.JSONDecodeError):
        on_main(damaged)
    assert sent == [[("error", "JSONDecodeError: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)")]]  # fmt: skip

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # a Ctrl-C on the main process reaches the others too
        on_main(interrupted)
    assert sent[-1] == [("error", "KeyboardInterrupt")]

    def received(payload):
        payload[0] = sent[0][0]

    monkeypatch.setattr(accelerate.utils, "broadcast_object_list", received)
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(
        ConfigError, match=r"^the main process could not start the run: JSONDecodeError: Expecting"
    ):
        on_main(damaged)
