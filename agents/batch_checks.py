"""What an LM agent works out from a batch of episodes before its update: the totals of a
``normalize_then_sum`` reward stack over the whole rollout, the check that no total is absurd, and the
common statistics over every process's episodes."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from textgym.agents.group_core import zero_std_share
from textgym.errors import TrainingError, user_stacklevel

if TYPE_CHECKING:
    from textgym.agents.distributed import Collective
    from textgym.agents.rollout_batch import RolloutBatch

__all__ = ["batch_statistics", "check_totals", "recombine_totals"]


def recombine_totals(stack: Any, rollout: Any, dist: Collective | None = None) -> None:
    """Recompute each episode's total over the whole rollout, in place. ``normalize_then_sum`` standardises
    each component over a batch: the env saw only the episodes that ended on the same step, so the totals
    are recombined over the whole rollout (the training signal). With ``dist`` (the processes' rollouts are
    shares of one batch) over every process's episodes, as one process would on the whole batch."""
    # the rows that ran an episode: a partial reset (options' reset_mask) leaves the others idle, info-less
    ran_rows = [i for i, e in enumerate(rollout.infos) if "reward_components" in e]
    ran = [rollout.infos[i] for i in ran_rows]
    components = np.array(  # (N, K); NaN: not applicable
        [[np.nan if (v := e["reward_components"][name]) is None else v for name in stack.names]
         for e in ran], dtype=np.float64,
    ).reshape(len(ran), len(stack.names))  # fmt: skip
    # a multi-turn episode's return also holds its turn rewards
    turn_rewards = np.array([sum(e.get("turn_rewards", ())) for e in ran], dtype=np.float64)
    rows = slice(None)
    if dist is not None and dist.world > 1:  # the same number of episodes on every process
        n = len(ran)
        components = dist.gather(torch.from_numpy(components)).numpy()
        rows = slice(dist.rank * n, (dist.rank + 1) * n)
    totals = stack.combine({name: components[:, k] for k, name in enumerate(stack.names)})[rows]
    totals = totals + turn_rewards
    rollout.scores = np.zeros(len(rollout.infos))
    rollout.scores[ran_rows] = totals
    for episode, total in zip(ran, totals):
        episode["reward"] = float(total)


def check_totals(raw: torch.Tensor, episodes: list[dict[str, Any]], limit: float) -> None:
    """Stop before an absurd score (not finite, or beyond ``limit`` = ``max_abs_score``) reaches the losses,
    naming the plugin that produced it."""
    bad = (~torch.isfinite(raw)) | (raw.abs() > limit)
    if not bad.any():
        return
    i = int(bad.nonzero()[0])
    episode = episodes[i]
    where = f"for completion {episode['completion'][:50]!r}"
    # the largest part of the episode's return: a reward plugin's score, or (multi-turn) the turn rewards
    parts = {
        f"reward plugin {k!r} returned {v:.3g} {where}": v
        for k, v in episode["reward_components"].items()
        if v is not None
    }
    if episode.get("turn_rewards"):
        parts[f"the responder's turn rewards sum to {sum(episode['turn_rewards']):.3g} {where}"] = sum(
            episode["turn_rewards"]
        )
    culprit = max(parts, key=lambda k: (not math.isfinite(parts[k]), abs(parts[k])), default=None)
    cause = f"{culprit}: " if culprit else ""
    raise TrainingError(
        f"{cause}the episode's return {float(raw[i]):.3g} is beyond max_abs_score={limit:g}. Fix or rescale "
        "that reward (its weight, score_scale), or raise max_abs_score if such values are meant. Training "
        "stopped before the update: the weights and checkpoints are untouched."
    )


def batch_statistics(batch: RolloutBatch, dist: Collective, group_size: int) -> dict[str, float]:
    """The common statistics of a batch (``COMMON_STATS``), over every process's episodes."""
    scores = dist.gather(batch.raw_scores.double())
    groups = scores.view(-1, group_size) if group_size > 1 else scores.view(1, -1)
    mask = batch.action_mask.float()  # the agent's tokens (a multi-turn episode's replies are not)
    stats = {
        "reward": float(scores.mean()),
        # group agents: the mean of the prompt groups' stds, as TRL's GRPO logs it (the spread advantages see);
        # one episode has no spread to speak of (as a component's std)
        "reward_std": float(groups.std(1).mean() if group_size > 1 else scores.std())
        if len(scores) > 1
        else math.nan,
        "frac_reward_zero_std": zero_std_share(scores, groups.shape[1]),
        "kl": math.nan,
        "completions/mean_length": float(dist.gather(mask.sum(1)).mean()),
        "completions/clipped_ratio": float(dist.gather(batch.truncated.double()).mean()),
    }
    if batch.ref_logprobs is not None:
        stats["kl"] = float(dist.gather(((batch.logprobs - batch.ref_logprobs) * mask).sum(1)).mean())
    names = list(batch.episodes[0]["reward_components"]) if batch.episodes else []
    if names:
        local = torch.tensor(
            [
                [math.nan if (v := e["reward_components"][n]) is None else v for n in names]
                for e in batch.episodes
            ],
            dtype=torch.float64,
        )  # (N, K); NaN = not applicable
        values = dist.gather(local).numpy()
        for k, name in enumerate(names):
            applicable = values[:, k][~np.isnan(values[:, k])]  # not applicable: left out of the statistics
            stats[f"rewards/{name}/mean"] = float(applicable.mean()) if len(applicable) else math.nan
            # (no spread to speak of under two values: not 0, which would say they agreed)
            stats[f"rewards/{name}/std"] = float(applicable.std(ddof=1)) if len(applicable) > 1 else math.nan
        if np.isnan(values).all() and dist.is_main:  # shown once: the warning's text does not change
            warnings.warn(
                f"no reward plugin applied to any episode of a batch (each of {', '.join(map(repr, names))} "
                f"returned None for every completion): each total is 0 (plus a multi-turn episode's turn "
                f"rewards), so the reward stack teaches nothing there. Check when the plugins return None (their "
                f"conditions, a gate), or that they score these completions.",
                stacklevel=user_stacklevel(),
            )
    return stats
