"""What LM agents need to train data-parallel under ``torchrun`` / ``accelerate launch``: statistics over all
processes' episodes, sums for global normalisers, and errors that stop every process instead of leaving
the others waiting in a collective forever; and the launcher and device checks made before training
(bf16 only where the CPU computes it natively).

With one process every function is the identity, so single-process code paths are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from textgym.errors import AnotherProcessFailed, TextgymError, TrainingError


class PeerFailed(TextgymError):
    """Raised on the processes of a lockstep rollout whose own work went well when another process's failed
    (its reward plugin raised): all stop on the same step; :meth:`Collective.agree` then names the failure."""


class _PeerError(TrainingError, AnotherProcessFailed):
    """What the processes that did not fail raise, naming the one that did."""


class Collective:
    """The process group of an ``accelerate.Accelerator``, from the agents' side."""

    def __init__(self, accelerator: Any):
        self.accelerator = accelerator
        self.world = accelerator.num_processes
        self.rank = accelerator.process_index
        self.is_main = accelerator.is_main_process

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every process's ``x`` (same shape everywhere), concatenated along dim 0 in process order."""
        if self.world == 1:
            return x
        device = self.accelerator.device
        return self.accelerator.gather(x.to(device).contiguous()).to(x.device)

    def sum(self, x: torch.Tensor | float) -> torch.Tensor:
        """The sum over processes (a tensor, on ``x``'s device)."""
        x = torch.as_tensor(x, dtype=torch.float64)
        if self.world == 1:
            return x
        return self.accelerator.reduce(x.to(self.accelerator.device), reduction="sum").to(x.device)

    def any(self, flag: bool) -> bool:
        """True on every process if it is true on any."""
        return bool(self.sum(float(flag)) > 0)

    def lockstep(self, active: bool, failed: bool = False) -> bool:
        """One step of a lockstep rollout (:func:`~textgym.sampling.rollout`): whether any process still has
        an active episode. When a process failed, False on it and :class:`PeerFailed` on the others, so that
        all leave the rollout on the same step instead of waiting in each other's collectives."""
        if self.world == 1:
            return active and not failed
        counts = self.sum(torch.tensor([float(active), float(failed)]))
        if counts[1] > 0:
            if failed:
                return False
            raise PeerFailed("another process failed during the rollout; stopping with it.")
        return bool(counts[0] > 0)

    def gather_objects(self, items: list[Any]) -> list[Any]:
        if self.world == 1:
            return items
        from accelerate.utils import gather_object

        return gather_object(items)

    def agree(self, error: BaseException | None) -> None:
        """A collective check after work a process may have failed in (a reward plugin raising on one
        process only): every process raises, the failing one its own error, the others one that names it."""
        if self.world == 1:
            if error is not None:
                raise error
            return
        if isinstance(error, PeerFailed):  # not this process's failure: the one that failed is named below
            error = None
        messages = self.gather_objects([None if error is None else f"{type(error).__name__}: {error}"])
        failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
        if not failed:
            return
        if error is not None:
            raise error
        rank, message = failed[0]
        raise _PeerError(f"process {rank} failed, so every process stops: {message}")

    def on_main(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the main process only (writing files, reading a model); all processes then raise if
        it failed, whatever it raised: the others would otherwise wait in their next collective."""
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except Exception as exc:
                error = exc
        self.agree(error)
        return result


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, dist: Collective, shift_mean: bool = True
) -> torch.Tensor:
    """``ppo_core.masked_whiten`` with the mean and the (Bessel-corrected) variance taken over every
    process's entries, so a batch split across processes is whitened as one batch."""
    mask = mask.to(x.dtype)
    n = dist.sum(mask.sum())
    mean = (dist.sum((x * mask).sum()) / n.clamp(min=1)).to(x.dtype)
    var = dist.sum((((x - mean) ** 2) * mask).sum()) / n.clamp(min=1)
    if n > 1:
        var = var * n / (n - 1)
    whitened = (x - mean) * torch.rsqrt(var.to(x.dtype) + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (x86 avx512_bf16 / amx_bf16; assumed elsewhere)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True
    if "flags" not in flags:  # not x86 (e.g. ARM: bf16 support differs per core; torch decides)
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags
