"""How a process of a several-process run ends: its process group freed while the interpreter still runs, and
no interpreter teardown for gloo's worker threads to abort (SIGABRT after a run that finished whole)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent

FSDP2_SCRIPT = """
import sys, weakref
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from textgym.launch import end_process_group

dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
groups = [weakref.ref(group) for group in dist.distributed_c10d._world.pg_map]
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
for layer in model:
    fully_shard(layer)
fully_shard(model)
model(torch.randn(3, 4)).sum().backward()  # DTensor's caches now hold the device mesh
del model, layer
end_process_group()
print("groups alive:", sum(group() is not None for group in groups), "of", len(groups))
"""


def test_ending_the_group_frees_its_process_groups_though_fsdp2_device_meshes_outlive_it(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", FSDP2_SCRIPT, str(tmp_path / "store")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "groups alive: 0 of 1" in result.stdout, result.stdout + result.stderr[-2000:]


# A plugin file with an atexit handler, and an object whose __del__ runs only when the interpreter is torn down.
WITNESS = """
import atexit, sys
import textgym

class Witness:
    def __init__(self, path):
        self.file = open(path, "w")

    def __del__(self):
        self.file.write("torn down")
        self.file.close()

textgym.teardown_witness = Witness(sys.argv[-1] + ".teardown")  # textgym's namespace is cleared at teardown
atexit.register(lambda: print("atexit handler ran"))
"""


@pytest.mark.parametrize("how", ["python -m textgym", "textgym"])
def test_one_of_several_processes_skips_the_teardown_keeping_output_exit_status_and_atexit(tmp_path, how):
    (tmp_path / "witness.py").write_text(WITNESS)
    command = [sys.executable, "-m", "textgym"] if how != "textgym" else [str(BIN / "textgym")]
    runs = {}
    for world in ("1", "2"):
        for status, name in ((0, None), (2, "no-such-name")):
            argv = [*command, "--plugin", "witness.py", "plugins", *([name] if name else ["--json"])]
            env = {**os.environ, "WORLD_SIZE": world, "RANK": "0", "PYTHONUNBUFFERED": ""}  # output buffered
            result = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
            assert result.returncode == status, result.stderr[-2000:]
            assert result.stdout.endswith("atexit handler ran\n")
            torn_down = (tmp_path / f"{argv[-1]}.teardown").read_text()
            runs[world, status] = result.stdout, result.stderr, torn_down
    for status in (0, 2):
        alone, several = runs["1", status], runs["2", status]
        assert alone[2] == "torn down" and several[2] == ""  # one of several: no teardown
        assert several[:2] == alone[:2]  # the same output, flushed
    assert '"lmppo"' in runs["2", 0][0]  # (less than a buffer's worth: written at exit, by the flush)


GIVES_GRACE = """
import sys, time
from textgym.launch import exit_process

print(time.time(), flush=True)
exit_process(int(sys.argv[1]))
"""


@pytest.mark.parametrize(("rank", "code", "waits"), [("1", 2, True), ("1", 130, False), ("0", 2, False)])
def test_a_failed_process_other_than_the_main_one_waits_for_the_main_ones_report(rank, code, waits):
    """Under torchrun, the first process to exit with a failure gets the others stopped: a failing process
    1 that exited at once cut off process 0's "process 1 failed, so every process stops" (seen in CI)."""
    from textgym.launch import FAILURE_GRACE_S

    env = {**os.environ, "WORLD_SIZE": "2", "RANK": rank}
    process = subprocess.Popen(
        [sys.executable, "-c", GIVES_GRACE, str(code)], stdout=subprocess.PIPE, env=env
    )
    started = float(process.stdout.readline())
    assert process.wait(timeout=60) == code
    waited = time.time() - started
    if waits:
        assert waited >= FAILURE_GRACE_S
    else:
        assert waited < FAILURE_GRACE_S  # (no wait: this is seconds under)
