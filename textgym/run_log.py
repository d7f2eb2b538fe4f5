"""A bench run's output, kept in its log file as the terminal would have shown it in the end."""

from __future__ import annotations

import contextlib
import io
import re
from collections.abc import Iterator
from pathlib import Path

__all__ = ["log_file", "logged_to", "readable"]


@contextlib.contextmanager
def logged_to(path: Path) -> Iterator[None]:
    """What a run prints (training progress, model loading) goes to its log, not to the bench's output. A
    start that failed leaves no run directory (``textgym train`` removes it): its log goes next to it, and
    into the run's own log once a later start made the directory."""
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            yield
    finally:
        where = log_file(path)
        # (its folder may not exist yet: an agent's, when that agent's first run failed to start)
        where.parent.mkdir(parents=True, exist_ok=True)
        beside = path.parent.with_name(path.parent.name + ".log")
        earlier = beside.read_text(encoding="utf-8") if where == path and beside.is_file() else None
        with where.open("a", encoding="utf-8") as f:
            if earlier is not None:  # the run has a directory now: the log of its failed start goes in it
                f.write(f"(from {beside.name}, an earlier start that failed)\n{earlier}\n")
            f.write(readable(log.getvalue()))
        if earlier is not None:
            beside.unlink()


def log_file(path: Path) -> Path:
    """Where :func:`logged_to` keeps the log ``path`` of a run: ``path`` in the run directory, or beside
    that directory (``runs/<run>.log``) when there is no run there (a start that failed removed it)."""
    from textgym.rundir import RunDir

    run_dir = path.parent
    return path if RunDir(run_dir).is_run() else run_dir.with_name(run_dir.name + ".log")


TERMINAL = re.compile(r"(\x1b\[[0-9;?]*[A-Za-z]|\r|\n)")  # what moves the cursor (and colours)


def readable(text: str) -> str:
    """Terminal output as the terminal showed it in the end, for a log file: nested progress bars redraw
    their lines in place, moving the cursor up (``\\x1b[A``) and back (``\\r``), which a file holds as one
    line per redraw and raw codes. A line written from its start replaces what was there."""
    lines, row, start = [""], 0, True
    for token in TERMINAL.split(text):
        if token == "\n":
            row, start = row + 1, True
            lines += [""] * (row + 1 - len(lines))
        elif token == "\r":
            start = True
        elif token == "\x1b[A":
            row = max(row - 1, 0)
        elif token and not token.startswith("\x1b"):
            lines[row] = token if start else lines[row] + token
            start = False
    return "\n".join(line.rstrip() for line in lines)
