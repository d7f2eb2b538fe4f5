"""Several processes for one ``textgym train`` run: under torchrun (or ``accelerate launch``), or started by
textgym itself for ``run.processes = N``.

The main process (rank 0) prepares the run directory while the others wait (:func:`on_main`); every process
checks the same settings (:func:`check_processes`) so a bad split fails everywhere with the same message.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from textgym.agent_config import is_lm_agent
from textgym.errors import AnotherProcessFailed, ConfigError, TrainingError, WriteError
from textgym.rundir import RunDir

__all__ = ["LAUNCHED_VAR", "SHARDING_VARS", "check_processes", "end_process_group", "exit_process", "follow_the_launcher",
           "init_process_group", "launch", "on_main", "rank", "speaks_for_the_run", "under_launcher",
           "world_size"]  # fmt: skip

LAUNCHED_VAR = "TEXTGYM_LAUNCHED"
LAUNCHER_PID_VAR = "TEXTGYM_LAUNCHER_PID"  # the process that started this one (run.processes = N)
# the exit code of a process that run.processes = N started and that stopped because another one failed
FOLLOWED_EXIT = 3
# ... and of one that could not write a run file (a full disk): the launcher raises a WriteError for it
WRITE_FAILED_EXIT = 74  # (sysexits' EX_IOERR)


def world_size() -> int:
    """Processes training this run (torchrun's and accelerate's WORLD_SIZE; 1 without them)."""
    return int(os.environ.get("WORLD_SIZE", 1))


def rank() -> int:
    return int(os.environ.get("RANK", 0))


def speaks_for_the_run() -> bool:
    """Whether this process says what every process would: the main one (rank 0), and not one of the
    processes ``run.processes = N`` started (the one that started them speaks)."""
    return rank() == 0 and not os.environ.get(LAUNCHED_VAR)


def under_launcher() -> bool:
    """Whether a launcher (torchrun, accelerate's multi-process launch) started this process, even as the only
    one: then the launcher, not ``run.processes``, decides how many processes train."""
    return "WORLD_SIZE" in os.environ


def follow_the_launcher() -> None:
    """A process that ``run.processes = N`` started stops after its iteration, with a checkpoint, when the
    process that started it dies without a word (``kill -9``, the OOM killer): else it trained on with nobody
    reading its output. Linux sends it :data:`DEATH_SIGNAL` then (``PR_SET_PDEATHSIG``); elsewhere, nothing."""
    launcher = os.environ.get(LAUNCHER_PID_VAR)
    if not launcher or not sys.platform.startswith("linux") or DEATH_SIGNAL is None:
        return
    import ctypes

    pr_set_pdeathsig = 1
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(DEATH_SIGNAL), 0, 0, 0) != 0:
        return
    if os.getppid() != int(launcher):  # it died before this process asked
        os.kill(os.getpid(), DEATH_SIGNAL)


def init_process_group(device: str = "auto") -> None:
    """Start the process group before the agent exists (the run directory is prepared on the main process
    while the others wait); the agent's Accelerator then joins it, and keeps its device: so the group is
    started on the agent's ``device`` (``"cpu"`` on a GPU machine: gloo and the CPU, not NCCL and a GPU)."""
    import torch
    from accelerate import PartialState

    PartialState(cpu=device == "cpu" or not torch.cuda.is_available())


def end_process_group() -> None:
    """Leave the process group before the interpreter exits: a gloo group torn down by the interpreter's
    shutdown can abort the process ("terminate called without an active exception"). So can a DDP model
    freed after the group ends: the training's callbacks and closures form reference cycles that keep the
    agent's Accelerator (and the DDP-wrapped modules it holds) alive until a garbage collection, so one
    runs first, while the group still exists. FSDP2's device meshes outlive the group too (DTensor's caches
    hold them), each with its process groups: those are let go here, so the groups are freed now."""
    import gc

    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gc.collect()
        torch.distributed.destroy_process_group()
        _release_device_meshes()
        gc.collect()


def _release_device_meshes() -> None:
    """Empty the process-group registry of every device mesh still alive (their groups have ended)."""
    import gc

    mesh_class = getattr(sys.modules.get("torch.distributed.device_mesh"), "DeviceMesh", None)
    if not isinstance(mesh_class, type):
        return
    for obj in gc.get_objects():  # by the class's MRO: DeviceMesh's isinstance hook touches every object
        if mesh_class in type(obj).__mro__ and isinstance(
            registry := getattr(obj, "_pg_registry", None), dict
        ):
            registry.clear()


# How long a process other than the main one waits before it exits on a failure, under torchrun or
# accelerate launch: they stop every process once one has failed, and the main process's report (which
# names the process that failed, and its error) comes after the same clean-up as this one's
FAILURE_GRACE_S = 5.0


def exit_process(code: int) -> NoReturn:
    """End a process that took part in a process group, as :mod:`multiprocessing` ends its workers: threads
    joined, ``atexit`` handlers run, output flushed, then ``os._exit``, skipping the interpreter's teardown.
    What a library keeps alive past the group's end (DeepSpeed's engine, held by its hooks) still holds
    gloo's worker threads, and one of those taking the GIL while the interpreter is torn down aborts the
    process (SIGABRT, "terminate called without an active exception") after a run that finished whole.
    A process other than the main one that failed (not one stopped by a Ctrl-C, 130) then gives the main
    process :data:`FAILURE_GRACE_S` to report the failure, under a launcher that stops every process once
    one has exited (not under ``run.processes = N``, whose launcher waits for all)."""
    import atexit
    import threading
    import time

    try:
        try:
            if hasattr(threading, "_shutdown"):
                threading._shutdown()
        except BaseException as exc:  # as Python's own exit: said, and atexit runs still
            if isinstance(exc, KeyboardInterrupt):  # a Ctrl-C while a thread is joined
                code = code or 130
            else:
                import traceback

                traceback.print_exc()
        atexit._run_exitfuncs()
        _flush_output()
        if code not in (0, 130) and rank() != 0 and not os.environ.get(LAUNCHED_VAR):
            time.sleep(FAILURE_GRACE_S)  # everything is written: a signal now changes only the exit code
    finally:
        try:
            _flush_output()
        finally:  # (a second signal in the flush)
            os._exit(code)


def _flush_output() -> None:
    """Python's standard streams, then C's (a library's own printf), as the interpreter's exit would."""
    import ctypes

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)


def on_main(fn: Any) -> Any:
    """``fn()`` on the main process; its result (or its error, as a one-line error) on every process. An error
    other than a ConfigError or an OSError (a bug, a damaged file, a Ctrl-C) is raised as itself, with its traceback, on
    the main process; the others, which would wait for the result, stop with its one-line summary."""
    from accelerate.utils import broadcast_object_list

    payload: list[Any] = [None]
    error: BaseException | None = None
    if rank() == 0:
        try:
            payload = [("ok", fn())]
        except (ConfigError, OSError) as exc:
            payload = [("error", f"{exc}")]
        except BaseException as exc:  # a Ctrl-C too: the others wait for this broadcast
            payload, error = [("error", f"{type(exc).__name__}: {exc}".removesuffix(": "))], exc
    broadcast_object_list(payload)
    status, value = payload[0]
    if error is not None:
        raise error
    if status == "error":
        if rank() == 0:
            raise ConfigError(value)
        raise _MainProcessFailed(f"the main process could not start the run: {value}")
    return value


class _MainProcessFailed(ConfigError, AnotherProcessFailed):
    """What the other processes raise when the main one could not start the run."""


# what asks a launch for sharding (accelerate launch sets them from its config file), read by textgym's own
# sharding too (agents/sharding.py)
SHARDING_VARS = ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED")


def check_processes(
    config: dict[str, Any],
    world: int,
    resuming: bool,
    agent_class: Any,
    hp: dict[str, Any],
    table: str = "agent",
) -> None:
    """Refuse a run whose batch does not split over its processes, into its groups and into its minibatches.
    ``table`` is where a message names the agent's settings: ``agent`` for a run; a bench, whose message names
    the agent's entry itself, passes ``""``."""
    run, env = config["run"], config["env"]
    if world > 1 or under_launcher():
        if resuming and run["processes"] != world:
            n, resume = run["processes"], f"textgym train --resume {shlex.quote(str(run['output_dir']))}"
            # a sharded launch: the advice keeps the sharding (a plain resume would drop it)
            shard = next((v for v in SHARDING_VARS if os.environ.get(v, "").lower() in ("1", "true")), None)
            # (set by accelerate launch, not by torchrun)
            accelerate = "ACCELERATE_DYNAMO_BACKEND" in os.environ
            if shard and accelerate:  # sharding from its config file
                how = f"accelerate launch --config_file CONFIG --num_processes {n}, with the same sharding config"
                how += f", or {shard}=true {resume}, which starts them itself" if n > 1 else ""
            elif shard:
                how = f"{shard}=true torchrun --nproc_per_node {n}"
                how += f", or {shard}=true {resume}, which starts them itself" if n > 1 else ""
            elif n == 1:
                how = f"{resume}, without a launcher"
            elif accelerate:
                how = f"accelerate launch --num_processes {n}, or {resume}, which starts them itself"
            else:
                how = f"torchrun --nproc_per_node {n}, or {resume}, which starts them itself"
            raise ConfigError(
                f"{run['output_dir']} was trained by {run['processes']} process(es); resume it with the same number "
                f"({how}), not {world}: the seeds and the batch split depend on it."
            )
        run["processes"] = world
    if run["processes"] > 1 and not is_lm_agent(agent_class):
        raise ConfigError(
            "Stable-Baselines3 agents train in one process: set run.processes = 1, and run them without "
            "torchrun or accelerate launch."
        )
    if env["num_envs"] % run["processes"]:
        raise ConfigError(
            f"env.num_envs={env['num_envs']} does not split evenly over {run['processes']} processes: make it a "
            f"multiple of {run['processes']}."
        )
    knob = getattr(agent_class, "minibatch_knob", "")
    steps = hp.get(knob, getattr(getattr(agent_class, "config_class", None), knob, 1)) if knob else 1
    share = env["num_envs"] // run["processes"]
    if run["processes"] > 1 and isinstance(steps, int) and steps > share:
        raise ConfigError(
            f"{table + '.' if table else ''}{knob}={steps} splits each of the {run['processes']} processes' share of the batch ({share} of "
            f"env.num_envs={env['num_envs']}) into more minibatches than it has episodes: give {knob} <= {share}, or "
            f"more env.num_envs."
        )
    group = hp.get("num_generations") or getattr(
        getattr(agent_class, "config_class", None), "num_generations", 1
    )
    if is_lm_agent(agent_class) and group and (env["num_envs"] // run["processes"]) % group:
        share = (
            f"env.num_envs={env['num_envs']} is"
            if run["processes"] == 1
            else f"each of the {run['processes']} processes gets {env['num_envs'] // run['processes']} episodes,"
        )
        raise ConfigError(
            f"{share} not a multiple of num_generations={group}: make env.num_envs a multiple of "
            f"{run['processes'] * group}."
        )


def launch(config: dict[str, Any], run_dir: Path, resuming: bool, overrides: Sequence[str] = ()) -> Path:
    """``run.processes = N`` without a launcher: prepare the run directory here, then train it with N
    processes on this machine (gloo on CPUs, NCCL on GPUs), started here with the environment torchrun would
    give them. The processes resume the run directory; a resume's ``overrides`` (``--set``) are passed on.

    textgym starts them itself, rather than through torchrun, for Ctrl-C: the terminal sends SIGINT to every
    process of the group, and the processes finish their iteration and save (a second one aborts them). This
    process only waits. torchrun would send them a second SIGINT of its own (an abort), and print a traceback.
    """
    import subprocess
    import tempfile

    from torch.distributed import TCPStore

    n = config["run"]["processes"]
    # The processes meet at a store this process holds, as torchrun's agent does: its port is bound here and
    # now, so no other program can take it between choosing a free port and the main process binding it.
    # (Before the run directory is made: a store that cannot start leaves none.)
    store = TCPStore("127.0.0.1", 0, world_size=n, is_master=True, wait_for_workers=False)
    rd = RunDir(run_dir)
    created = False
    if not resuming:
        created = rd.create()
        rd.write_config(config)
    cmd = [sys.executable, "-m", "textgym", "train", "--resume", str(run_dir)]
    if resuming:  # a new run's overrides are in the config.toml written above
        cmd += [arg for override in overrides for arg in ("--set", override)]
    print(f"textgym: training {run_dir} with {n} processes on this machine", flush=True)
    env = {**os.environ, LAUNCHED_VAR: "1", LAUNCHER_PID_VAR: str(os.getpid()), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True", "WORLD_SIZE": str(n),
           "LOCAL_WORLD_SIZE": str(n), "GROUP_RANK": "0"}  # fmt: skip
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    # Where this process's output is redirected (textgym bench writes each run's to its train.log), the
    # processes' output goes there too, not to the console.
    # Each process's to a file of its own: the log holds one process's lines together, and a failure is
    # named by the error of the process that failed, not by another's printed beside it.
    captured = sys.stdout is not sys.__stdout__
    outputs: list[str] | None = None
    with contextlib.ExitStack() as files:
        logs = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in range(n if captured else 0)]
        processes: list[subprocess.Popen] = []
        try:
            for i in range(n):
                output = {"stdout": logs[i], "stderr": subprocess.STDOUT} if captured else {}
                processes.append(
                    subprocess.Popen(cmd, env={**env, "RANK": str(i), "LOCAL_RANK": str(i)}, **output)
                )
            codes, order, signals, stopped = _wait(processes)
        except BaseException:
            for process in processes:
                process.kill()
            rd.discard_failed_start(created)
            raise
        finally:
            if captured:
                outputs = [_read_all(log) for log in logs]
                for i, text in enumerate(outputs):
                    sys.stdout.write(f"textgym: the output of process {i}:\n{text}" if i and text else text)
    if not any(codes):  # trained, or stopped and saved after a Ctrl-C, as the processes said
        return run_dir
    rd.discard_failed_start(created)  # a start the processes refused, or aborted, say
    after = ""
    if (run_dir / "metrics.csv").exists():  # it trained: say where a resume continues
        k, resume = rd.last_checkpoint(), f"textgym train --resume {shlex.quote(str(run_dir))}"
        after = (
            f" There is no checkpoint yet: {resume} starts it again."
            if k is None
            else f" Its last checkpoint is at iteration {k}: {resume} continues from there."
        )
    try:
        _raise_for(codes, order, signals, f"the {n}-process run of {run_dir}", after, stopped, outputs)
    except KeyboardInterrupt as exc:
        # aborted by a second Ctrl-C: what it trained is kept, for the caller to name (as train.run does)
        if (run_dir / "metrics.csv").exists():
            exc.kept_run_dir = run_dir  # type: ignore[attr-defined]
        raise


def _raise_for(
    codes: list[int],
    order: list[int],
    signals: set[int],
    what: str,
    after: str = "",
    stopped: frozenset[int] = frozenset(),
    outputs: Sequence[str] | None = None,
) -> NoReturn:
    """Raise for processes that did not all exit 0, judged by the first of them to fail (``order`` is the
    order they exited in): the others may have failed only because it left (a collective whose peer is gone
    fails), so they say nothing of what went wrong. ``after`` ends the message (where a resume continues);
    ``stopped``: the processes this launcher killed (:func:`_wait`), whose kill is not the news;
    ``outputs``: what each process printed, where it was captured (to a bench run's log: the message names
    the failed process's error from it), None where it went to the terminal, above this message."""
    where = "above" if outputs is None else "in the run's log"
    # (a process that said it stopped because another failed is not the first to blame)
    first = next((i for i in order if codes[i] not in (0, FOLLOWED_EXIT)), next(i for i in order if codes[i]))
    if signals & {signal.SIGINT, signal.SIGTERM} and codes[first] in _INTERRUPTED:
        raise KeyboardInterrupt  # a second Ctrl-C or SIGTERM (or one during start-up): the processes aborted
    killed = _signal_of(codes[first])
    error = None if outputs is None else _error_of(outputs[first])
    if first in stopped:
        said = f"process {first} did not exit within {GRACE_S:g} s of a failure and was stopped"
    elif killed == signal.SIGKILL:
        # it printed nothing: what the others printed (a lost peer) follows from it
        raise TrainingError(
            f"{what} failed: process {first} was killed by SIGKILL (kill -9, or the system's out-of-memory "
            f"killer); the other processes' errors {where} follow from it.{after}"
        )
    elif killed is not None and killed not in (signal.SIGINT, signal.SIGTERM):  # a crash: SIGSEGV, SIGABRT
        said = f"process {first} was killed by {killed.name}"
    else:
        said = f"process {first} exited with code {codes[first]}"
    error_class = WriteError if codes[first] == WRITE_FAILED_EXIT else TrainingError
    because = (
        f": {error.rstrip('.')}." if error else "; see above." if error is None else "; see the run's log."
    )
    raise error_class(f"{what} failed ({said}){because}{after}")


FOLLOWED = ("failed, so every process stops", "the main process could not start the run")


def _error_of(output: str) -> str:
    """The error a failed process printed in its captured ``output``: its ``textgym: error:`` line, or the
    last line of its traceback (a bug, an out-of-memory error); the first one, and not one that says it
    stopped because another process failed. "" when it printed none."""
    lines, errors = output.splitlines(), []
    for i, line in enumerate(lines):
        if line.startswith("textgym: error: "):
            errors.append(line.removeprefix("textgym: error: "))
        elif line.startswith("Traceback (most recent call last):"):  # its exception: the next unindented line
            errors.append(next((x for x in lines[i + 1 :] if x and not x[0].isspace()), ""))
    errors = [e for e in errors if e]
    own = [e for e in errors if not any(said in e for said in FOLLOWED)]
    return (own or errors or [""])[0]


def _read_all(file: Any) -> str:
    file.seek(0)
    return file.read()


def _signal_of(code: int) -> signal.Signals | None:
    """The signal that killed a process whose exit code is ``code`` (128 + the signal's number), or None."""
    if code <= 128:
        return None
    try:
        return signal.Signals(code - 128)
    except ValueError:
        return None


# after one process fails, the others have this long to stop by themselves (textgym stops every process when
# one fails) before they are killed: a process that died in a collective leaves the others waiting there
GRACE_S = 60.0
# what the launcher sends the processes as it passes on its first SIGTERM, and its second (see stopping.StopFlag)
STOP_SIGNAL = getattr(signal, "SIGUSR1", None)
ABORT_SIGNAL = getattr(signal, "SIGUSR2", None)
# and its first SIGINT (a `kill -INT` of textgym's own process): the same stop, said as a Ctrl-C
INTERRUPT_SIGNAL = signal.SIGRTMIN + 2 if hasattr(signal, "SIGRTMIN") else STOP_SIGNAL
# what Linux sends them when the launching process dies (PR_SET_PDEATHSIG): a signal of its own, since the
# process cannot tell from getppid() whether a STOP_SIGNAL came from that (a multi-threaded launcher's
# children are first handed to a sibling thread of the same process, which getppid() still names)
DEATH_SIGNAL = signal.SIGRTMIN + 1 if hasattr(signal, "SIGRTMIN") else None
# the exit codes of a process that a Ctrl-C or SIGTERM aborted: 130 (KeyboardInterrupt), or killed by one of
# the signals above before it could handle it (during start-up)
_INTERRUPTED = {
    128 + s
    for s in (signal.SIGINT, signal.SIGTERM, STOP_SIGNAL, INTERRUPT_SIGNAL, ABORT_SIGNAL, DEATH_SIGNAL)
    if s is not None
}


def _wait(processes: list[Any]) -> tuple[list[int], list[int], set[int], frozenset[int]]:
    """Wait for every process; returns their exit codes, their indices in the order they exited, the
    signals this process received meanwhile, and the processes it killed (GRACE_S after a failure). A SIGINT
    or SIGTERM is passed on to the processes, as a stop, then an abort: one sent to the whole process group
    (a terminal's Ctrl-C) reached them too, and one sent to this process alone (`kill -INT PID`) did not."""
    import threading
    import time

    received: list[int] = []
    stopped: set[int] = set()
    # a thread per process appends its index as the process exits: the order they exited in, to the millisecond
    exited: list[int] = []
    waiters = [
        threading.Thread(target=lambda i=i, p=p: (p.wait(), exited.append(i)), daemon=True)
        for i, p in enumerate(processes)
    ]

    def note(signum: int, frame: Any) -> None:
        received.append(signum)
        # A signal sent to the whole group reached the processes too, and two would abort them: this passes
        # on a stop, then an abort, that neither adds to nor doubles theirs
        stop = INTERRUPT_SIGNAL if signum == signal.SIGINT else STOP_SIGNAL
        passed_on = (stop if len(received) == 1 else ABORT_SIGNAL) or signal.SIGTERM  # (Windows: SIGTERM)
        for i, process in enumerate(processes):
            if i not in exited:
                process.send_signal(passed_on)  # (one that exited since: nothing is sent)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for waiter in waiters:
            waiter.start()
        failed_at = None
        while len(exited) < len(processes):
            if failed_at is None and any(processes[i].returncode for i in list(exited)):
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
                for i, process in enumerate(processes):
                    if process.poll() is None:
                        stopped.add(i)
                        process.kill()
            time.sleep(0.1)
        for waiter in waiters:
            waiter.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    codes = [p.returncode if p.returncode >= 0 else 128 - p.returncode for p in processes]
    return codes, exited, set(received), frozenset(stopped)
