"""The guards around an LM agent's update: ``backward`` and ``optimizer_step`` skip (and count) a step
whose loss or gradient norm is not finite, on every process at once, and ``check_health`` stops a run whose
weights or logits have diverged before it writes a checkpoint or samples from NaN. A mixin of
:class:`~textgym.agents.base.LMAgent`, whose attributes it uses; data-parallel, FSDP2 and DeepSpeed ZeRO-3
alike."""

from __future__ import annotations

import math
from typing import Any

import torch

from textgym.agents import sharding
from textgym.agents.rollout_batch import RolloutBatch
from textgym.errors import TrainingError


class UpdateGuards:
    """``backward``, ``optimizer_step``, ``weights_are_finite`` and ``check_health`` (see the module doc)."""

    # set by LMAgent.__init__; forward, rollout_model and sharded are LMAgent's too
    config: Any
    accelerator: Any
    dist: Any
    engine: Any
    optimizer: Any
    params: list[torch.nn.Parameter]
    zero3: Any
    iteration: int
    skipped_steps: int

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backward through ``loss``; :meth:`optimizer_step` then skips the step if this loss was not finite.
        Nothing is read back to the host here (no device sync per micro-batch): returns whether the loss was
        finite as a 0-dim tensor on its device."""
        finite = torch.isfinite(loss.detach()).all()
        if self.zero3 is not None:  # x NaN: the engine skips a step whose gradient norm is not finite
            self.engine.backward(
                loss * torch.where(finite, 1.0, math.nan).to(loss.dtype), scale_wrt_gas=False
            )
        else:  # the step's losses, read with its gradient norm
            previous = getattr(self, "_losses_finite", None)
            self._losses_finite = finite if previous is None else previous & finite
            self.accelerator.backward(loss)
        return finite

    def optimizer_step(self) -> bool:
        """Clip and apply the accumulated gradients, unless a loss or the gradient norm was not finite:
        then the step is skipped and counted (``train/skipped_steps``). Returns whether it stepped. Reading
        that back is the step's one device sync."""
        if self.zero3 is not None:  # the engine clips to max_grad_norm and skips a non-finite norm itself
            self.engine.step()
            if self.optimizer.overflow:
                self.skipped_steps += 1
                return False
            return True
        if self.sharded:  # DTensor gradients: the norm over every process's shards
            norm = sharding.clip_grad_norm(self.params, self.config.max_grad_norm)
        else:
            norm = self.accelerator.clip_grad_norm_(self.params, self.config.max_grad_norm)
        ok = torch.isfinite(torch.as_tensor(norm)).all()
        losses, self._losses_finite = getattr(self, "_losses_finite", None), None
        if losses is not None:
            ok = ok & losses.to(ok.device)
        if self.dist.any(not ok):  # every process skips, or none: the weights stay identical
            self.optimizer.zero_grad()
            self.skipped_steps += 1
            return False
        self.optimizer.step()
        return True

    def weights_are_finite(self) -> bool:
        """This process's weights (its shards under sharding: combine over processes, as check_health does)."""
        return bool(
            torch.stack([torch.isfinite(sharding.local(p)).all() for p in self.params]).all()
        )  # one sync

    def check_health(self, batch: RolloutBatch | None = None, collective: bool = True) -> None:
        """Raise :class:`TrainingError` unless the weights are finite and the policy's logits on (two rows
        of) ``batch`` are too: a diverged update (e.g. learning_rate=1e6) stops training here, with its
        cause, before a checkpoint is written or a rollout samples from NaN. ``collective=False`` checks
        this process alone (for code that runs on the main process only, such as saving); a sharded agent's
        check is always collective (each process holds shards; the forward needs all of them)."""
        batch = batch if batch is not None else getattr(self, "_last_batch", None)
        finite = self.weights_are_finite()
        if self.sharded:  # the forward below runs on every process or on none
            finite = not self.dist.any(not finite)
        if finite and batch is not None:
            with torch.no_grad():
                logits, _ = self.forward(self.rollout_model, batch.select(torch.arange(min(2, len(batch)))))
            finite = bool(torch.isfinite(logits).all())
        if collective:
            finite = not self.dist.any(not finite)
        if not finite:
            raise TrainingError(
                f"the policy's weights or outputs are no longer finite after iteration {self.iteration}: the "
                f"update diverged (learning_rate={self.config.learning_rate:g}"
                + (
                    f", {self.skipped_steps} optimizer steps skipped for non-finite losses or gradients"
                    if self.skipped_steps
                    else ""
                )
                + "). The last checkpoint holds the weights from before it (a --resume would diverge the same "
                "way): start a new run with a lower learning_rate (or max_grad_norm), from scratch or from "
                "those weights (agent.policy = '<run>/checkpoint/policy')."
            )
