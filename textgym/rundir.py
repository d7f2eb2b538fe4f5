"""A run directory that survives what users and machines do to it.

- It is textgym's own: a marker file says so, and a directory holding anything else is never used.
- One process at a time: a lock file (``fcntl.flock``, released by the OS when the process dies).
- Every file is written atomically (a temporary sibling, then a rename), the checkpoint as a directory by
  :func:`textgym.atomic.atomic_build_dir`. A kill between the two renames of a checkpoint swap leaves the
  new and the previous checkpoint as complete temporaries: :meth:`RunDir.recover_checkpoint` restores the
  newest complete one and removes stale temporaries.
- On resume, ``samples.jsonl`` is cut back to the checkpoint's iteration (``metrics.csv`` is rewritten from
  the checkpoint's history), so no iteration appears twice.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import json
import os
import shlex
import shutil
import signal
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from textgym.errors import ConfigError, WriteError

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # the errnos of a write that found no room
MARKER = ".textgym-run"
WRITTEN_CONFIG = ".config-written.toml"  # config.toml as textgym last wrote it: a resume finds edits by hand
LOCK = ".lock"
CHECKPOINT = "checkpoint"
SAMPLES_AFTER = "samples_after.jsonl"  # written when a run finishes, not when it stops
CRASH_VAR = "TEXTGYM_CRASH_AT"  # crash-consistency tests kill the process at a named point
INTERRUPT_VAR = "TEXTGYM_INTERRUPT_AT"  # the Ctrl-C tests send the process SIGINT at a named point


_crash_counts: dict[str, int] = {}


def crash_point(name: str) -> None:
    """Kill this process with SIGKILL when ``$TEXTGYM_CRASH_AT`` is ``name`` or ``name:N`` (the N-th time
    this point is reached): the crash-consistency tests use it to cut a run at exact moments. Send it
    SIGINT (a Ctrl-C) when ``$TEXTGYM_INTERRUPT_AT`` is ``name`` (SIGTERM when it is ``name:SIGTERM``; several
    points: ``a,b``)."""
    for wanted_point in os.environ.get(INTERRUPT_VAR, "").split(","):
        point, _, sent = wanted_point.partition(":")
        if point == name:
            signal.raise_signal(signal.SIGTERM if sent == "SIGTERM" else signal.SIGINT)
    wanted = os.environ.get(CRASH_VAR)
    if not wanted or wanted.partition(":")[0] != name:
        return
    _crash_counts[name] = _crash_counts.get(name, 0) + 1
    if _crash_counts[name] == int(wanted.partition(":")[2] or 1):
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def _signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held within the block and delivered after it (on the main thread; elsewhere Python
    delivers none)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum)) for s in held}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # (None: set outside Python)
        for s in dict.fromkeys(received):
            signal.raise_signal(s)


def write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary sibling and a rename. A write that fails (a full disk)
    removes its temporary: a partial copy would hold the space a user frees to resume."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def hold_lock(path: Path, in_use: Callable[[str], str], unwritable: str) -> int:
    """Take the exclusive ``flock`` of ``path`` (created if missing) and write this process's id into it;
    returns the open file descriptor (closing it releases the lock, as the OS does when the process dies).
    Raises :class:`ConfigError` with ``in_use(holder pid)`` when another process holds it."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(
            f"{unwritable}: {exc.strerror or exc}; textgym writes into it, so it must be writable."
        ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder_pid(fd)
        os.close(fd)
        raise ConfigError(in_use(holder)) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    return fd


def _holder_pid(fd: int) -> str:
    """The process id that the holder of the lock file ``fd`` wrote into it."""
    return os.read(fd, 32).decode(errors="replace").strip() or "another process"


def metrics_csv(history: Sequence[dict[str, Any]]) -> str:
    columns = list(dict.fromkeys(key for row in history for key in row))
    lines: list[str] = []

    class Sink:
        def write(self, text: str) -> None:
            lines.append(text)

    writer = csv.DictWriter(Sink(), fieldnames=columns)
    writer.writeheader()
    writer.writerows(history)
    return "".join(lines)


class RunDir:
    """The files of one training run (see the module docstring)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock_fd: int | None = None
        # create() reused an existing empty directory: emptied again if the start fails
        self._was_empty = False

    @property
    def checkpoint(self) -> Path:
        return self.path / CHECKPOINT

    def is_run(self) -> bool:
        return (self.path / MARKER).is_file()

    # -- creating and locking ------------------------------------------------------------------------
    def create(self) -> bool:
        """Make a new run directory. Refuses a directory that holds a run or anything textgym did not
        write. Returns whether the directory itself was created (an existing empty one is reused)."""
        if self.path.exists() and not self.path.is_dir():
            raise ConfigError(f"run.output_dir {str(self.path)!r} is a file, not a directory.")
        existing = sorted(p.name for p in self.path.iterdir()) if self.path.is_dir() else []
        if existing:
            holder = self._holder() if self.is_run() else None
            if holder is not None:  # a run in progress: "--resume it" would be refused until it ends
                raise ConfigError(
                    f"run.output_dir {self.path} holds a run that textgym process {holder} is training now: "
                    f"choose another run.output_dir (two runs on one directory would overwrite each other)."
                )
            if self.is_run():
                raise ConfigError(
                    f"{self.path} already holds a run; continue it with `textgym train --resume {shlex.quote(str(self.path))}`, "
                    f"or choose another run.output_dir."
                )
            shown = ", ".join(existing[:5]) + (", ..." if len(existing) > 5 else "")
            raise ConfigError(
                f"run.output_dir {str(self.path)!r} holds files textgym did not write ({shown}); choose another "
                f"run.output_dir (textgym never writes into a directory it does not own)."
            )
        created = not self.path.exists()
        self._was_empty = not created  # an existing empty directory: emptied again if the start fails
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / MARKER).write_text("a textgym run directory\n")
        except OSError as exc:
            raise ConfigError(
                f"cannot create the run directory {self.path}: {exc.strerror or exc}; choose a run.output_dir "
                f"in a writable directory."
            ) from None
        return created

    def _holder(self) -> str | None:
        """The id of the process that holds this run directory's lock (one training it now), or None. Asks
        with a shared lock, which fails while another process holds the exclusive one, and writes nothing.
        (A start asking at the very moment a resume takes the lock can make that resume wait for nothing: it
        is refused as in use, and the same command then works.)"""
        try:
            import fcntl
        except ImportError:  # (no flock: Windows)
            return None

        try:
            fd = os.open(self.path / LOCK, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _holder_pid(fd)
        finally:
            os.close(fd)  # (releases the shared lock, where it was taken)
        return None

    def lock(self) -> None:
        self._lock_fd = hold_lock(
            self.path / LOCK,
            in_use=lambda holder: (
                f"run directory {self.path} is in use by textgym process {holder}: two runs on one directory "
                f"would overwrite each other. Wait for it to finish, or stop it."
            ),
            unwritable=f"cannot lock the run directory {self.path}",
        )

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    def discard_failed_start(self, created: bool) -> None:
        """Remove the directory a start ``created`` when it failed before its first iteration was logged, or
        empty again the empty one it started in: a start that fails leaves nothing behind.

        A Ctrl-C or SIGTERM that comes meanwhile (a second one: the first aborted the start) is held until
        the removal is done, then delivered: cut in the middle, the removal left the run's marker without
        its lock, and the same command then refused the directory as a run. The marker goes last, so even
        a ``kill -9`` leaves a directory that ``--resume`` takes."""
        if (self.path / "metrics.csv").exists() or not (created or self._was_empty):
            return
        with _signals_held():
            self.unlock()
            crash_point("discard-start")
            for child in sorted(self.path.iterdir(), key=lambda p: p.name == MARKER):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
            if created:
                with contextlib.suppress(OSError):
                    self.path.rmdir()

    # -- checkpoints -----------------------------------------------------------------------------------
    def recover_checkpoint(self) -> Path | None:
        """The last complete checkpoint, restored from a temporary if a swap was cut by a kill; stale
        temporaries are removed. None when there is no complete checkpoint."""
        from textgym.atomic import is_complete

        temporaries = [p for p in self.path.glob(f".{CHECKPOINT}.*") if p.is_dir()]
        if not is_complete(self.checkpoint):
            newest = self._last_complete()
            if newest is not None:
                if self.checkpoint.exists():
                    shutil.rmtree(self.checkpoint)
                os.rename(newest, self.checkpoint)
                temporaries.remove(newest)
                print(
                    f"textgym: restored the checkpoint from {newest.name} (a checkpoint swap was interrupted)"
                )
        for p in temporaries:
            shutil.rmtree(p, ignore_errors=True)
        return self.checkpoint if is_complete(self.checkpoint) else None

    def write_checkpoint(self, save: Any) -> None:
        """``save(path)`` into the checkpoint, with disk errors reported as one line naming the last good one."""
        try:
            save(self.checkpoint)
        except OSError as exc:
            raise self.disk_error("the checkpoint", exc) from None
        except Exception as exc:
            failed = _failed_write(exc)
            if failed is None:
                raise
            raise self.disk_error("the checkpoint", failed) from None

    def disk_error(self, what: str, exc: OSError) -> WriteError:
        reason = exc.strerror or str(exc)
        if exc.errno in DISK_FULL:
            reason += " (the disk is full)"
        elif exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            reason += " (the directory is not writable)"
        k = self.last_checkpoint()
        last = "there is no checkpoint yet" if k is None else f"the last good checkpoint is at iteration {k}"
        # a start that fails is removed (discard_failed_start): it is started again, not resumed
        then = "--resume" if k is not None or (self.path / "metrics.csv").exists() else "start the run again"
        return WriteError(
            f"could not write {what} in {self.path}: {reason}; {last}. Free space or fix permissions, then {then}."
        )

    def _last_complete(self) -> Path | None:
        """The complete checkpoint a resume continues from: the checkpoint, or the newest complete temporary
        that a swap cut by a kill left (:meth:`recover_checkpoint` restores it); None when there is none."""
        from textgym.atomic import is_complete

        if is_complete(self.checkpoint):
            return self.checkpoint
        complete = [p for p in self.path.glob(f".{CHECKPOINT}.*") if p.is_dir() and is_complete(p)]
        return max(complete, key=_progress) if complete else None

    def last_checkpoint(self) -> int | str | None:
        """The iteration ``--resume`` would continue from (:meth:`_last_complete`'s), "?" where its state
        cannot be read (a swap renaming it right now), None when there is no checkpoint yet."""
        path = self._last_complete()
        if path is None:
            return None
        try:
            return json.loads((path / "state.json").read_text()).get("iteration", "?")
        except (OSError, ValueError, AttributeError):
            return "?"

    # -- metrics and samples ---------------------------------------------------------------------------
    def write_config(self, config: dict[str, Any]) -> None:
        """The resolved config as ``config.toml``, atomically (keys set to None are left out: TOML has no null),
        and the copy a resume compares it with (written first: an interruption between the two leaves a copy
        that differs from config.toml at most in what the resume being written may change). A run directory
        without the copy (from before textgym kept one) is not given one by a resume: its config.toml may hold
        edits the copy would then vouch for."""
        import tomli_w

        text = tomli_w.dumps(_drop_none(config))
        if (self.path / WRITTEN_CONFIG).exists() or not (self.path / "config.toml").exists():
            self.write_file(WRITTEN_CONFIG, text, what="config.toml")
        self.write_file("config.toml", text)

    def write_file(self, name: str, text: str, what: str | None = None) -> None:
        """``text`` into the run's file ``name``, atomically; a failed write (a full disk) is one line that
        names ``what`` (default: the file) and the last good checkpoint (:meth:`disk_error`)."""
        try:
            write_atomic(self.path / name, text)
        except OSError as exc:
            raise self.disk_error(what or name, exc) from None

    def write_metrics(self, history: Sequence[dict[str, Any]]) -> None:
        self.write_file("metrics.csv", metrics_csv(history))

    def append_samples(self, rows: Iterable[dict[str, Any]]) -> None:
        try:
            with (self.path / "samples.jsonl").open("a", encoding="utf-8") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
        except OSError as exc:
            raise self.disk_error("samples.jsonl", exc) from None

    def write_jsonl(self, name: str, rows: Iterable[dict[str, Any]]) -> None:
        self.write_file(name, "".join(json.dumps(row) + "\n" for row in rows))

    def truncate_samples(self, iteration: int) -> int:
        """Drop sample rows written after ``iteration`` (by a run killed after its last checkpoint), and a
        last line the kill cut. Returns how many were dropped. A line before the last that is not JSON is
        damage no kill makes: refused, naming it, rather than deleted with the rows past the checkpoint."""
        path = self.path / "samples.jsonl"
        if not path.is_file():
            return 0
        kept, dropped = [], 0
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        for number, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                if number < len(lines):
                    raise ConfigError(
                        f"{str(path)!r} line {number} is not JSON ({exc}): the file was damaged (a kill cuts "
                        f"only its last line). Repair or delete that line, then resume."
                    ) from None
                dropped += 1  # the line the kill cut
                continue
            if row.get("iteration", 0) <= iteration:
                kept.append(line)
            else:
                dropped += 1
        if dropped:
            self.write_file(path.name, "".join(kept))
        return dropped

    def finished(self, total_timesteps: int) -> bool:
        """Whether the run trained its ``total_timesteps`` to the end. A Ctrl-C or SIGTERM stops it with a
        checkpoint short of them or, in its last iteration or final evaluation, without the after-training
        samples."""
        return self.tokens_trained() >= total_timesteps and (self.path / SAMPLES_AFTER).is_file()

    def tokens_trained(self) -> int:
        """The tokens of the run's last checkpoint (-1 without one)."""
        return _tokens_in(self.checkpoint)

    def iterations_logged(self) -> int:
        """The rows of ``metrics.csv`` (0 without one)."""
        path = self.path / "metrics.csv"
        return max(0, len(path.read_text(encoding="utf-8").splitlines()) - 1) if path.is_file() else 0

    def clear_progress(self) -> None:
        """Forget a run that never reached its first checkpoint (it restarts from the beginning)."""
        for name in (
            "metrics.csv",
            "samples.jsonl",
            "samples_before.jsonl",
            SAMPLES_AFTER,
            "reward_kl.png",
        ):
            (self.path / name).unlink(missing_ok=True)


def _failed_write(exc: Exception) -> OSError | None:
    """The OSError behind a tensor library's own error for a write that failed, else None: safetensors
    raises SafetensorError ("I/O error: No space left on device (os error 28)"), torch.save a RuntimeError
    from its zip writer ("[enforce fail at inline_container.cc:...] . unexpected pos ...") that names no
    cause."""
    text = str(exc)
    if type(exc).__name__ == "SafetensorError" and "I/O error" in text:
        code = errno.ENOSPC if "os error 28" in text else errno.EIO
        return OSError(code, os.strerror(code))
    if isinstance(exc, RuntimeError) and "inline_container" in text:
        return OSError(errno.EIO, f"torch.save could not write its file (is the disk full?): {text}")
    return None


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    return value


def _tokens_in(checkpoint: Path) -> int:
    """The tokens a checkpoint was saved at (-1 where it has no readable state)."""
    try:
        return int(json.loads((checkpoint / "state.json").read_text()).get("num_timesteps", 0))
    except (OSError, ValueError, TypeError, AttributeError):  # (a state.json of another shape)
        return -1


def _progress(checkpoint: Path) -> tuple[int, float]:
    return _tokens_in(checkpoint), checkpoint.stat().st_mtime
