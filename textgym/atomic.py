"""Directories that appear whole or not at all: a converted model, a checkpoint, a trained reward model.

:func:`atomic_build_dir` builds into a temporary sibling and renames it into place after a completion marker
is written and everything is on the disk, so an interrupted build (Ctrl-C, ``kill -9``, a power cut) leaves
the previous version or nothing, never half of one.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_build_dir", "is_complete", "synced"]

_COMPLETE = "textgym-complete"  # written last: a directory without it is never used


def atomic_build_dir(target: Path, build: Callable[[Path], None], replace: bool = False) -> Path:
    """Return ``target``, building it first with ``build(tmp_dir)`` if it is not complete (or always, with
    ``replace=True``, e.g. for checkpoints).

    ``build`` writes into a temporary sibling directory, which is renamed into place only after it
    returned and a completion marker was written; an interrupted or failed build leaves ``target`` as it
    was (absent, or the previous complete version).
    """
    target = Path(target)
    if not replace and is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # a unique sibling made with the umask's mode, as the target would be (mkdtemp's is 0700: a checkpoint or a
    # converted model would then be unreadable to the others that share its folder)
    tmp = target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}"
    tmp.mkdir()
    from textgym.rundir import crash_point

    try:
        build(tmp)
        crash_point("checkpoint-build")
        # on the disk before the marker says so: a power cut then leaves no complete-but-empty file
        synced(tmp)
        (tmp / _COMPLETE).write_text("ok\n")
        synced(tmp / _COMPLETE)
        while True:
            if not replace and is_complete(target):  # a concurrent build's result
                return target
            old = None
            if target.exists():  # an old version, or an incomplete leftover: moved away, then replaced
                old = tmp.with_name(tmp.name + ".old")
                try:
                    os.rename(target, old)
                except FileNotFoundError:  # a concurrent build moved the leftover away first: look again
                    continue
                crash_point("checkpoint-swap")  # the state RunDir.recover_checkpoint repairs
            try:
                os.rename(tmp, target)
            except OSError:  # another process's build was renamed into place since the check above
                if replace or not is_complete(target):
                    raise
            synced(target.parent, recursive=False)  # the renames too, before the old version goes
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def synced(path: Path, recursive: bool = True) -> None:
    """``fsync`` a file, or a directory with every file and directory under it (their entries included);
    with ``recursive=False`` the directory alone: its entries (renames into it), not what other processes
    build next to them."""
    path = Path(path)
    below = sorted(path.rglob("*"), reverse=True) if recursive and path.is_dir() else []
    for p in [*below, path]:  # files before the directories that hold them
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def is_complete(directory: Path) -> bool:
    """Whether ``directory`` was finished by :func:`atomic_build_dir`."""
    return (Path(directory) / _COMPLETE).is_file()
