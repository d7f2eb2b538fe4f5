"""How a process of a several-process run ends: its process group freed while the interpreter still runs, and
no interpreter teardown for gloo's worker threads to abort (SIGABRT after a run that finished whole)."""

import os
import signal
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


# A plugin file with an atexit handler, and an object whose __del__ runs only at the interpreter's teardown.
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
import atexit, sys, time
from textgym.launch import exit_process

atexit.register(lambda: print("atexit handler ran"))
print("written before the exit")  # buffered: stdout is a pipe
sys.stderr.write(f"{time.time()}\\n")
sys.stderr.flush()
exit_process(int(sys.argv[1]))
"""


@pytest.mark.parametrize(
    ("rank", "code", "launched", "waits"),
    [("1", 2, False, True), ("1", 130, False, False), ("0", 2, False, False), ("1", 2, True, False)],
)
def test_a_failed_process_other_than_the_main_one_waits_for_the_main_ones_report(rank, code, launched, waits):
    """Under torchrun, the first process to exit with a failure gets the others stopped: a failing process
    1 that exited at once cut off process 0's "process 1 failed, so every process stops" (seen in CI).
    textgym's own launcher (run.processes = N) waits for every process: no wait there."""
    from textgym.launch import FAILURE_GRACE_S, LAUNCHED_VAR

    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "RANK": rank,
        "PYTHONUNBUFFERED": "",
        LAUNCHED_VAR: "1" if launched else "",
    }
    process = subprocess.Popen([sys.executable, "-c", GIVES_GRACE, str(code)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    started = float(process.stderr.readline())
    assert process.wait(timeout=60) == code
    waited = time.time() - started
    if waits:
        assert waited >= FAILURE_GRACE_S
    else:
        assert waited < FAILURE_GRACE_S  # (no wait: this is seconds under)
    assert process.stdout.read() == "written before the exit\natexit handler ran\n"


def test_a_launchers_sigterm_during_the_wait_loses_no_output():
    """torchrun stops the waiting process with a SIGTERM once the main one has exited: everything was
    written before the wait (the wait had come first, and the signal killed the process with it unwritten)."""
    from textgym.launch import LAUNCHED_VAR

    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "1", "PYTHONUNBUFFERED": "", LAUNCHED_VAR: ""}
    process = subprocess.Popen([sys.executable, "-c", GIVES_GRACE, "2"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    process.stderr.readline()
    # everything written, then the 5 s wait: the signal comes in it (a fixed sleep here could come before
    # the flush on a busy machine)
    written = process.stdout.readline() + process.stdout.readline()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == -signal.SIGTERM  # stopped in the wait
    assert written + process.stdout.read() == "written before the exit\natexit handler ran\n"


def test_an_error_escaping_main_in_one_of_several_processes_is_shown_and_skips_the_teardown(tmp_path):
    """An error that is not a textgym one (a bug; gloo's "Connection closed by peer" when another process
    died) escaped main(), and the process went through the teardown that can abort it."""
    script = WITNESS + (
        "import textgym.cli\n"
        "def broken():\n"
        "    raise RuntimeError('Connection closed by peer')\n"
        "textgym.cli.main = broken\n"
        "textgym.cli.command()\n"
    )
    witness = tmp_path / "w"
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0"}
    result = subprocess.run(
        [sys.executable, "-c", script, str(witness)], capture_output=True, text=True, env=env
    )
    assert result.returncode == 1
    assert "RuntimeError: Connection closed by peer" in result.stderr and "Traceback" in result.stderr
    assert result.stdout == "atexit handler ran\n"
    assert (tmp_path / "w.teardown").read_text() == ""  # no teardown


def test_an_error_while_threads_are_joined_is_shown_and_atexit_runs_still():
    script = (
        "import atexit, threading\n"
        "from textgym.launch import exit_process\n"
        "atexit.register(lambda: print('atexit handler ran'))\n"
        "threading._register_atexit(lambda: 1 / 0)  # (as concurrent.futures registers its shutdown)\n"
        "exit_process(0)\n"
    )
    env = {**os.environ, "WORLD_SIZE": "2", "RANK": "0"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0
    assert "ZeroDivisionError" in result.stderr and result.stdout == "atexit handler ran\n"


def test_the_launcher_records_the_order_its_processes_exit_in(tmp_path):
    """run.processes = N's launcher judges a failed run by the process that failed first: a process that died
    (here process 1, killed as the kernel's OOM killer does) makes the others fail moments later, in the
    collective it left. It had named the failed process of lowest rank, the one that only followed."""
    from textgym.launch import _wait

    died = tmp_path / "died"
    follows = f"import pathlib, time\nwhile not pathlib.Path({str(died)!r}).exists(): time.sleep(0.01)\n"
    follows += "time.sleep(0.2)\nraise SystemExit(1)"  # as gloo's "connection closed by peer" does
    dies = f"import os, pathlib, signal\npathlib.Path({str(died)!r}).touch()\nos.kill(os.getpid(), signal.SIGKILL)"
    processes = [subprocess.Popen([sys.executable, "-c", code]) for code in (follows, dies)]
    codes, order, signals, stopped = _wait(processes)
    assert codes == [1, 128 + signal.SIGKILL] and order == [1, 0] and not signals and not stopped


@pytest.mark.parametrize(
    ("codes", "order", "signals", "raised", "says"),
    [
        ([1, 2], [1, 0], set(), "TrainingError", "process 1 exited with code 2"),
        ([1, 130], [0, 1], set(), "TrainingError", "process 0 exited with code 1"),
        ([0, 1], [0, 1], set(), "TrainingError", "process 1 exited with code 1"),
        # process 0 stopped because process 1 failed (its code says so), and exited first
        ([3, 2], [0, 1], set(), "TrainingError", "process 1 exited with code 2"),
        ([3, 3], [1, 0], set(), "TrainingError", "process 1 exited with code 3"),  # (no other to blame)
        # two Ctrl-Cs: process 0 aborted, and process 1 failed in the collective it was waiting in
        ([130, 1], [0, 1], {signal.SIGINT}, "KeyboardInterrupt", ""),
        ([0, 130], [0, 1], {signal.SIGINT}, "KeyboardInterrupt", ""),
        ([143, 143], [1, 0], {signal.SIGTERM}, "KeyboardInterrupt", ""),  # killed during start-up
        # a Ctrl-C came, but a process had failed first: that failure is the news
        ([1, 130], [0, 1], {signal.SIGINT}, "TrainingError", "process 0 exited with code 1"),
    ],
)
def test_a_failed_launch_is_judged_by_its_first_process_to_fail(codes, order, signals, raised, says):
    from textgym.launch import _raise_for

    with pytest.raises(BaseException) as info:
        _raise_for(codes, order, signals, "the 2-process run of runs/x")
    assert type(info.value).__name__ == raised
    assert says in str(info.value)
    if says:
        assert str(info.value) == f"the 2-process run of runs/x failed ({says}); see above."


def test_a_captured_launch_names_the_failed_processs_own_error_and_a_full_disk_stays_a_write_error():
    """Under textgym bench the processes' output goes to the run's log, not above: the error said "see
    above", and that was all the bench's report and message said of why the run failed."""
    from textgym.errors import TrainingError, WriteError
    from textgym.launch import WRITE_FAILED_EXIT, _error_of, _raise_for

    output = (
        "textgym: error: process 1 failed, so every process stops: RewardError: it broke\n"
        "iteration 3\ntextgym: error: reward function 'flaky' raised ValueError: it broke.\n"
    )
    assert _error_of(output) == "reward function 'flaky' raised ValueError: it broke."
    assert _error_of(output.split("iteration")[0]).startswith("process 1 failed")  # the only one said
    assert _error_of("no error here\n") == ""
    # each process's own output: the one blamed is named by its own error, not one printed beside it
    outputs = ["textgym: error: process 1 failed, so every process stops: RewardError: it broke\n",
               "iteration 3\ntextgym: error: reward function 'flaky' raised ValueError: it broke.\n"]  # fmt: skip
    with pytest.raises(TrainingError) as info:
        _raise_for([3, 2], [1, 0], set(), "the run", " Resume it.", outputs=outputs)
    assert str(info.value) == (
        "the run failed (process 1 exited with code 2): reward function 'flaky' raised ValueError: it broke. "
        "Resume it."
    )
    with pytest.raises(TrainingError, match=r"code 2\): its own\.$"):
        _raise_for(
            [2, 0], [0, 1], set(), "the run", outputs=["textgym: error: its own\n", "textgym: error: x\n"]
        )
    # a bug or an out-of-memory error prints a traceback, not textgym's line: its last line is the error
    crashed = (
        'iteration 1\nTraceback (most recent call last):\n  File "x.py", line 1\n    f()\nMemoryError: out\n'
    )
    assert _error_of(crashed) == "MemoryError: out"
    followed = "textgym: error: the main process could not start the run: no\n"
    assert _error_of(followed + "textgym: error: its own\n") == "its own"
    # captured, but nothing said why (a crash by a signal): the output is in the run's log, not above
    with pytest.raises(TrainingError, match=r"\(process 0 was killed by SIGSEGV\); see the run's log\.$"):
        _raise_for([139, 3], [0, 1], set(), "the run", outputs=["", ""])
    with pytest.raises(TrainingError, match=r"the other processes' errors in the run's log follow from it"):
        _raise_for([137, 3], [0, 1], set(), "the run", outputs=["", ""])
    # a process that could not write a run file: a bench stops at it, as at its own full disk
    with pytest.raises(WriteError, match="could not write metrics.csv"):
        _raise_for([WRITE_FAILED_EXIT, 3], [0, 1], set(), "the run",
                   outputs=["textgym: error: could not write metrics.csv\n", ""])  # fmt: skip


def test_a_process_killed_by_a_signal_is_named_by_it_and_the_message_says_where_a_resume_continues():
    from textgym.errors import TrainingError
    from textgym.launch import _raise_for

    with pytest.raises(TrainingError) as info:
        _raise_for([1, 137], [1, 0], set(), "the 2-process run of runs/x", " Resume it.")
    assert str(info.value) == (
        "the 2-process run of runs/x failed: process 1 was killed by SIGKILL (kill -9, or the system's "
        "out-of-memory killer); the other processes' errors above follow from it. Resume it."
    )
    # a crash printed its own error: "see above" stays
    with pytest.raises(
        TrainingError, match=r"^the run failed \(process 0 was killed by SIGSEGV\); see above\.$"
    ):
        _raise_for([139, 1], [0, 1], set(), "the run")
    with pytest.raises(TrainingError, match=r"process 0 exited with code 255\); see above\.$"):
        _raise_for([255, 0], [0, 1], set(), "the run")
    # killed by the launcher itself, GRACE_S after another process failed: not a kill -9 from outside
    with pytest.raises(
        TrainingError, match=r"\(process 1 did not exit within 60 s of a failure and was stopped\)"
    ):
        _raise_for([3, 137], [0, 1], set(), "the run", stopped=frozenset({1}))
