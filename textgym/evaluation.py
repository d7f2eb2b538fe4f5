"""Held-out evaluation of a policy: what ``textgym train`` logs every ``[eval] every`` iterations and what
``textgym bench`` scores every finished run with.

An evaluation samples ``episodes`` completions on held-out prompts (the same prompts, in the same order and
with the same sampling seed every time, so two evaluations differ only by the policy; it samples ``[env]
num_envs`` completions at a time, so runs with another ``num_envs`` draw other samples) and reports:

- ``reward``: the training reward-stack total (composition applied, with scheduled weights as they end
  training, at every evaluation) on the held-out prompts. For a run trained on a proxy reward, this is the
  proxy.
- one value per metric reward (``rewards`` of ``[eval]``/``[metrics]``): "gold" rewards that the run may or
  may not train on, each named by its ``label``.
- the built-in metrics of :data:`~textgym.eval_settings.BUILTIN_METRICS`: ``kl``, ``length``, ``distinct_2``, ``eos_rate``.

Reward values that do not apply (``None``) are left out of their means. Each reward mean comes with its
standard error (``<name>_se``) and the number of episodes it is over (``<name>_n``), which the bench's flags
use to tell a real fall from noise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from textgym.eval_settings import REWARD, metric_reward_args
from textgym.rewards import RewardStack


class _BorrowedStack(RewardStack):
    """An evaluation's stack: the training rewards belong to the training stack and the metric rewards to
    the :class:`Evaluator`, which close them. Closing an eval env (its responder) leaves them open."""

    def close(self) -> None:
        pass


# -- one evaluation --------------------------------------------------------------------------------
@dataclass
class Evaluation:
    """What one evaluation measured.

    Attributes:
        metrics: ``reward``, each metric reward's label and each chosen built-in metric -> its mean
            (``reward``: NaN when no weighted training reward applied to any episode and nothing paid one).
        errors: standard error of the mean of ``reward`` and of each metric reward.
        counts: the episodes each of those means is over (those a metric applied to).
        components: per training component: ``weight``, ``mean``, ``std`` and ``share`` (its share of the
            summed variances of the weighted components: how much of the total's spread it makes).
        episodes: per held-out episode: prompt, completion, finish_reason, num_tokens, reward (the training
            total), components (training and metric rewards, None = not applicable) and kl.
    """

    metrics: dict[str, float]
    errors: dict[str, float] = field(default_factory=dict)
    components: dict[str, dict[str, float]] = field(default_factory=dict)
    episodes: list[dict[str, Any]] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)

    def row(self) -> dict[str, float]:
        """The metrics, their standard errors and episode counts as one flat row (``<name>_se``,
        ``<name>_n``)."""
        row = dict(self.metrics)
        row.update({f"{k}_se": v for k, v in self.errors.items()})
        row.update({f"{k}_n": v for k, v in self.counts.items()})
        return row


class Evaluator:
    """Evaluates policies of one run on held-out prompts, the same way every time.

    Args:
        config: the run's resolved config (``[env]`` and ``[agent]`` as ``textgym train`` takes them).
        spec: resolved ``[eval]`` settings (see :func:`check_eval_section`); only ``prompts``, ``episodes``,
            ``rewards``, ``builtin`` and ``seed`` are used.
        training_stack: the run's reward stack (a :class:`~textgym.rewards.RewardStack`, whose reward objects
            are shared, or its spec).
        lm_agent: whether the agent is an LM agent (native vector env, KL) or an SB3-style one.
    """

    def __init__(
        self, config: Mapping[str, Any], spec: Mapping[str, Any], training_stack: Any, lm_agent: bool
    ):
        from textgym.rewards import build_reward, build_reward_stack

        self.config, self.spec, self.lm_agent = config, spec, lm_agent
        train = build_reward_stack(training_stack)
        gold = []
        for metric in spec["rewards"]:
            reward, _ = build_reward(metric_reward_args(metric), where=f"metric {metric['label']!r}")
            gold.append((reward, 0.0))
        self._gold = [reward for reward, _ in gold]
        # One stack scores both: the training components keep their weights (the total is the training
        # total), the metrics join with weight 0 (logged, never in the total).
        self.stack = _BorrowedStack([*train.rewards, *gold], aggregate=train.aggregate, gates=train.gates)
        # Scheduled weights as they end training, at every evaluation: two evaluations then differ only by
        # the policy (a ramped penalty would otherwise move the held-out proxy by itself)
        self.stack.set_progress(1.0)
        self.train_names = self.stack.names[: len(train.rewards)]
        self.labels = dict(zip(self.stack.names[len(train.rewards) :], [m["label"] for m in spec["rewards"]]))
        self._env: Any = None

    def __call__(self, agent: Any) -> Evaluation:
        from textgym.models import seeded_sampling
        from textgym.sb3 import seeded_policy

        n, seed = self.spec["episodes"], self.spec["seed"]
        # Every evaluation draws the same random numbers: an SB3 policy's sampling (torch's global stream),
        # a metric or responder that draws from torch's, numpy's or Python's. Training's streams go on after
        # it as if it drew none. A DQN is evaluated without exploration: two evaluations differ only by the
        # policy, not by where its epsilon schedule stands.
        if self.lm_agent:
            with seeded_sampling(seed):
                episodes, tokens, kls = self._rollouts_lm(agent, n)
                return self._summarize(episodes, tokens, kls)
        with seeded_policy(agent, seed, explore=False):
            episodes, tokens, kls = self._rollouts_sb3(agent, n)
            return self._summarize(episodes, tokens, kls)

    def close(self) -> None:
        """Close the eval env (its responder) and the metric rewards. The training components belong to the
        training stack, which closes them."""
        if self._env is not None:
            self._env.close()
            self._env = None
        for reward in self._gold:
            close = getattr(reward, "close", None)
            if callable(close):
                close()

    # -- rollouts ----------------------------------------------------------------------------------
    def _env_kwargs(self) -> dict[str, Any]:
        kwargs = {k: v for k, v in self.config["env"].items() if k not in ("id", "num_envs", "rewards")}
        policy = self.config["agent"].get("policy")
        if self.lm_agent and "model" not in kwargs and isinstance(policy, str):
            kwargs["model"] = policy  # the policy's tokenizer, as in training
        if self.spec["prompts"] is not None:
            kwargs["prompts"] = self.spec["prompts"]
        return {**kwargs, "rewards": self.stack}

    def _rollouts_lm(
        self, agent: Any, n: int
    ) -> tuple[list[dict[str, Any]], list[list[list[int]]], list[float]]:
        import gymnasium
        import torch

        from textgym.agents.rollout_batch import RolloutBatch

        if self._env is None:
            self._env = gymnasium.make_vec(
                self.config["env"]["id"],
                num_envs=min(n, self.config["env"]["num_envs"]),
                vectorization_mode="vector_entry_point",
                autoreset_mode="Disabled",
                **self._env_kwargs(),
            )
        env = self._env
        episodes: list[dict[str, Any]] = []
        tokens: list[list[list[int]]] = []
        kls: list[float] = []
        for round_ in range(math.ceil(n / env.num_envs)):
            # Explicit prompt indices and seeds: every evaluation sees the same prompts and random stream.
            prompts = [(round_ * env.num_envs + i) % env.num_prompts for i in range(env.num_envs)]
            r = agent.rollout(  # sharded: every process evaluates, in step (same prompts, seeds)
                env,
                temperature=agent.config.temperature,
                seed=self.spec["seed"] + round_,
                options={"prompts": prompts},
            )
            batch = RolloutBatch.from_rollout(r)
            with torch.no_grad():
                kl = (
                    agent.sequence_kl(batch)
                    if "kl" in self.spec["builtin"]
                    else torch.full((len(batch),), math.nan)
                )
            mask = r.response_mask if r.action_mask is None else r.action_mask  # the policy's own tokens
            for row, info in enumerate(r.infos):
                tokens.append(_runs(r.response_ids[row].tolist(), mask[row].bool().tolist()))
                episodes.append(info)
            kls.extend(float(k) for k in kl)
        return episodes[:n], tokens[:n], kls[:n]

    def _rollouts_sb3(
        self, agent: Any, n: int
    ) -> tuple[list[dict[str, Any]], list[list[list[int]]], list[float]]:
        from textgym.sb3 import make_vec_env

        # One sub-env, prompts in order: the same prompts every time (the random streams: see __call__).
        kwargs = {**self._env_kwargs(), "prompt_order": "sequential"}
        env = make_vec_env(self.config["env"]["id"], n_envs=1, seed=self.spec["seed"], **kwargs)
        try:
            return self._episodes_sb3(agent, env, n)
        finally:
            env.close()  # its responder's close(); the stack's rewards stay open (see _BorrowedStack)

    def _episodes_sb3(
        self, agent: Any, env: Any, n: int
    ) -> tuple[list[dict[str, Any]], list[list[list[int]]], list[float]]:
        from textgym.sb3 import Predictor

        episodes: list[dict[str, Any]] = []
        tokens: list[list[list[int]]] = []
        chosen: list[int] = []  # the policy's tokens of the episode under way, EOS included, as the LM path's
        predict = Predictor(agent, 1)  # with MaskablePPO's masks and RecurrentPPO's state
        obs = env.reset()
        while len(episodes) < n:
            action = predict(obs, env, deterministic=False)
            chosen.append(int(np.asarray(action).reshape(-1)[0]))
            obs, _, dones, infos = env.step(action)
            predict.ended(dones)
            if dones[0]:
                info = infos[0]
                components = {
                    k: None if v is None or math.isnan(float(v)) else float(v)
                    for k, v in info["reward_components"].items()
                }
                episodes.append(
                    {
                        "prompt": str(info["prompt"]) if "prompt" in info else "",
                        "completion": str(info["completion"]),
                        "finish_reason": str(info["finish_reason"]),
                        "num_tokens": int(info["num_tokens"]),
                        "reward_components": components,
                        # multi-turn only, as the LM path's infos (sampling.rollout) have them
                        **(
                            {"turn_rewards": [float(r) for r in info["turn_rewards"]]}
                            if "turns" in info
                            else {}
                        ),
                    }
                )
                replies = [t["tokens"] for t in info.get("turns", []) if t["role"] == "assistant"]
                if sum(replies) == len(chosen) and replies:  # each agent turn apart, as the LM path's
                    ends = np.cumsum(replies)
                    tokens.append([chosen[end - size : end] for size, end in zip(replies, ends)])
                else:
                    tokens.append([chosen])
                chosen = []
        return episodes, tokens, [math.nan] * len(episodes)

    # -- the numbers -------------------------------------------------------------------------------
    def _summarize(
        self, episodes: list[dict[str, Any]], tokens: list[list[list[int]]], kls: list[float]
    ) -> Evaluation:
        from textgym.composition import standardize
        from textgym.rewards import ENDED_ON_A_TOKEN
        from textgym.scoring import corpus_distinct_n

        columns = {  # (N,) raw scores per component, NaN = not applicable
            name: np.array(
                [np.nan if (v := e["reward_components"][name]) is None else v for e in episodes], dtype=float
            )
            for name in self.stack.names
        }
        # The total over all held-out episodes at once, as agents recombine it (normalize_then_sum
        # standardises over the batch; the env only saw the episodes that ended on the same step).
        # plus the rewards a responder paid for each turn (multi-turn), as the training returns hold them
        turns = np.array([sum(e.get("turn_rewards") or ()) for e in episodes], dtype=float)
        totals = (self.stack.combine(columns) if self.stack.names else np.zeros(len(episodes))) + turns
        # A design whose weighted rewards applied to none of the episodes (and that nothing else paid: no gate,
        # no responder) was trained on totals of 0 that no reward gave: not measured, not a measured 0. Where
        # some applied, the mean is over every episode, as training paid them (a subset that the policy
        # chooses, by making its reward not apply, would not compare between agents).
        weighted = [name for name in self.train_names if self.stack.weights[name] != 0]
        multi_turn = any(e.get("turn_rewards") is not None for e in episodes)
        applied = multi_turn or any((~np.isnan(columns[name])).any() for name in weighted)
        scored = totals if applied or np.any(totals != 0) else np.full_like(totals, np.nan)
        metrics: dict[str, float] = {REWARD: _mean(scored)}
        errors: dict[str, float] = {REWARD: _se(scored)}
        counts = {REWARD: _count(scored)}
        if self.stack.aggregate == "normalize_then_sum":  # standardised over these very episodes: its mean is
            metrics[REWARD] = errors[REWARD] = math.nan  # 0 whatever the policy, and measures nothing
        for name, label in self.labels.items():
            metrics[label], errors[label] = _mean(columns[name]), _se(columns[name])
            counts[label] = _count(columns[name])
        builtin = self.spec["builtin"]
        if "kl" in builtin:
            metrics["kl"] = _mean(np.array(kls, dtype=float))
        if "length" in builtin:
            metrics["length"] = _mean(np.array([e["num_tokens"] for e in episodes], dtype=float))
        if "distinct_2" in builtin:
            metrics["distinct_2"] = corpus_distinct_n([turn for turns in tokens for turn in turns], 2)
        if "eos_rate" in builtin:
            # multi-turn: an episode stopped by its turn limit, or by a reply that did not fit, ended its
            # last turn on EOS too; only "length" was cut without one (training's clipped_ratio)
            metrics["eos_rate"] = _mean(
                np.array([e["finish_reason"] in ENDED_ON_A_TOKEN for e in episodes], dtype=float)
            )

        weights = self.stack.weights
        contributions = {}
        for name in self.train_names:
            scores = columns[name]
            if self.stack.aggregate == "normalize_then_sum":
                scores = standardize(scores)
            contributions[name] = np.nan_to_num(weights[name] * scores)  # not applicable adds nothing
        spread = sum(float(np.var(c)) for c in contributions.values())
        components = {
            name: {
                "weight": float(weights[name]),
                "mean": _mean(columns[name]),
                "std": _std(columns[name]),
                "share": float(np.var(contributions[name])) / spread if spread > 0 else math.nan,
            }
            for name in self.train_names
        }
        rows = []
        for e, total, kl in zip(episodes, totals, kls):
            named = {self._shown_name(k): v for k, v in e["reward_components"].items()}
            rows.append(
                {
                    "prompt": e["prompt"],
                    "completion": e["completion"],
                    "finish_reason": e["finish_reason"],
                    "num_tokens": int(e["num_tokens"]),
                    "reward": float(total),
                    "components": named,
                    "kl": None if math.isnan(kl) else float(kl),
                }
            )
        return Evaluation(metrics, errors, components, rows, counts)

    def _shown_name(self, name: str) -> str:
        """An episode's score's name: a training component's own, a metric's label; ``"<label> (metric)"``
        for a metric labelled as a training component is named (e.g. ``fluency`` with other arguments), so
        that neither hides the other."""
        label = self.labels.get(name)
        if label is None:
            return name
        return f"{label} (metric)" if label in self.train_names else label


def _mean(x: np.ndarray) -> float:
    x = x[~np.isnan(x)]
    return float(x.mean()) if len(x) else math.nan


def _std(x: np.ndarray) -> float:
    x = x[~np.isnan(x)]
    return float(x.std(ddof=1)) if len(x) > 1 else math.nan


def _count(x: np.ndarray) -> int:
    return int(np.count_nonzero(~np.isnan(x)))


def _se(x: np.ndarray) -> float:
    x = x[~np.isnan(x)]
    return float(x.std(ddof=1) / math.sqrt(len(x))) if len(x) > 1 else math.nan


def jsonable(value: Any) -> Any:
    """``value`` with numpy scalars and arrays as Python numbers and lists, NaN (not measured) as None, and
    an infinite value as the string ``"inf"`` or ``"-inf"`` (a KL that blew up is not "not measured";
    ``float()`` reads it back): strict JSON."""
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist())
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def _runs(ids: list[int], mask: list[bool]) -> list[list[int]]:
    """The runs of ``ids`` where ``mask`` is true: a multi-turn episode's replies, each apart (a bigram that
    spans the env's turn between two replies is not one the policy wrote)."""
    runs: list[list[int]] = []
    for token, mine, before in zip(ids, mask, [False, *mask]):
        if mine:
            if not before:
                runs.append([])
            runs[-1].append(token)
    return runs
