"""SB3's user contract for textgym's LM agents: ``learn`` (the loop of ``collect_rollouts`` and ``train``,
with callbacks, logger and progress bar), ``predict``, atomic ``save`` and ``load``.

:class:`SB3Contract` is a mixin of :class:`~textgym.agents.base.LMAgent`, which owns everything it reads
(``config``, ``dist``, ``optimizer``, ``env``, ``rollout_model``, ...). :data:`COMMON_STATS` is the one
metrics schema every agent logs (TRL's names), so ``textgym train`` and ``textgym bench`` never need to
know which agent wrote a file.
"""

from __future__ import annotations

import math
import numbers
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from textgym.errors import ConfigError, TrainingError
from textgym.formatting import headline_scores, number
from textgym.sampling import mask_logits

if TYPE_CHECKING:
    from textgym.agents.base import LMAgent
    from textgym.envs import TextGenVectorEnv

__all__ = ["COMMON_STATS", "SB3Contract", "require_tensorboard"]

# Logged by every agent, every iteration (NaN where an agent has no such quantity, e.g. `kl` without a
# reference model). Agents add their own keys (LMPPO: TRL's PPO names, `objective/*`, `policy/*`, ...).
COMMON_STATS = (
    "iteration",
    "timesteps",
    "reward",  # mean return: reward-stack total (before the agent's score shaping) plus any turn rewards
    "reward_std",
    "frac_reward_zero_std",  # share of prompt groups (the whole batch for non-group agents) with equal totals
    "kl",  # KL(policy || reference) per completion: sum over its tokens of log pi - log pi_ref, batch mean
    "entropy",  # mean per-token entropy of the policy in the update
    "completions/mean_length",  # generated tokens per completion (EOS included)
    "completions/clipped_ratio",  # share of completions cut at max_new_tokens (no EOS)
    "lr",
    "train/skipped_steps",  # optimizer steps skipped for non-finite losses or gradients, so far
    "time/rollout",
    "time/reward",
    "time/reference",
    "time/update",
    "time/iteration",
    "time/tokens_per_s",
)


def require_tensorboard(what: str) -> None:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{what} writes TensorBoard logs, and TensorBoard is not installed: pip install 'textgym[tensorboard]'."
        ) from None


def stdout_format() -> Any:
    """SB3's stdout table with room for long keys: by default it cuts them to 36 characters and refuses two
    that become one (a reward of 30 characters logs rewards/<name>/mean and /std: the first dump raised)."""
    from stable_baselines3.common.logger import HumanOutputFormat

    return HumanOutputFormat(sys.stdout, max_length=120)


def folderless_logger(verbose: int) -> Any:
    """SB3's ``Logger`` writing to stdout when ``verbose``, and to no folder: SB3's own default,
    ``configure(None, ...)``, makes an empty ``SB3-<time>`` folder in the temp dir for every logger."""
    from stable_baselines3.common.logger import Logger

    return Logger(folder=None, output_formats=[stdout_format()] if verbose else [])


def continued_formats(folder: str, iteration: int, num_timesteps: int, csv_output: bool = True) -> list[Any]:
    """SB3's CSV (with ``csv_output``) and TensorBoard outputs for ``folder``, continuing what a run logged
    there up to ``iteration`` (at ``num_timesteps``). SB3's CSV output empties ``progress.csv``; this one keeps
    its rows up to ``iteration`` and drops the later ones (logged before an interruption, then done again).
    TensorBoard hides the events past ``num_timesteps`` in the earlier files (``purge_step``), for the same
    reason."""
    import csv

    from stable_baselines3.common.logger import CSVOutputFormat, TensorBoardOutputFormat
    from torch.utils.tensorboard import SummaryWriter

    # TensorBoard reads a folder's event files in name order, and a name starts with its second: the new file
    # must not share one with the files it continues (a run killed in its first second), or it may be read first
    stamps = [name.split(".")[3] for name in os.listdir(folder) if name.startswith("events.out.tfevents.")]
    newest = max((int(stamp) for stamp in stamps if stamp.isdigit()), default=0)
    while time.time() < newest + 1:
        time.sleep(0.05)
    tensorboard = TensorBoardOutputFormat.__new__(TensorBoardOutputFormat)
    tensorboard.writer = SummaryWriter(log_dir=folder, purge_step=num_timesteps + 1)
    tensorboard._is_closed = False
    if not csv_output:
        return [tensorboard]
    path = os.path.join(folder, "progress.csv")
    header: list[str] = []
    rows: list[list[str]] = []
    if os.path.exists(path):
        with open(path, newline="") as f:
            reader = csv.reader(f)
            header = next(reader, [])
            at = header.index("time/iterations") if "time/iterations" in header else None
            rows = [row for row in reader if at is None or (row[at:] and float(row[at]) <= iteration)]
    output = CSVOutputFormat(path)  # opens it emptied ("w+"): write back what is kept
    if header:
        csv.writer(output.file, lineterminator="\n").writerows([header, *rows])
        output.file.flush()
        output.keys = header
    return [output, tensorboard]


class SB3Contract:
    """``learn``, ``predict``, ``save``, ``load`` and the logger, as Stable-Baselines3 users expect them."""

    # set by LMAgent.__init__; collect_rollouts, train, check_health, rollout_model, autocast and seed_process are
    # LMAgent's too
    name: str
    config: Any
    env: TextGenVectorEnv | None
    allowed: torch.Tensor | None  # the tokens the env lets the agent choose (LMAgent.set_env)
    dist: Any
    device: torch.device
    optimizer: torch.optim.Optimizer
    num_timesteps: int
    iteration: int
    seed: int  # this process's: the config's, offset by the process's rank
    skipped_steps: int
    history: list[dict[str, float]]
    last_episodes: list[dict[str, Any]]  # the last iteration's episodes, every process's
    ep_info_buffer: Any  # SB3's: Monitor's record of the last 100 episodes
    ep_success_buffer: Any
    _learn_started: float | None  # when the episode record began (a learn() that reset the count)
    _folder_logger: Any  # the logger _setup_logger made (None before): closed when another replaces it
    _custom_logger: bool  # set_logger was called: learn() keeps that logger (tensorboard_log or not)

    def get_env(self) -> TextGenVectorEnv | None:
        return self.env

    # SB3's attributes of the env the agent trains on: a sub-env's spaces, and this process's sub-envs
    @property
    def observation_space(self) -> Any:
        return None if self.env is None else self.env.single_observation_space

    @property
    def action_space(self) -> Any:
        return None if self.env is None else self.env.single_action_space

    @property
    def n_envs(self) -> int | None:
        return None if self.env is None else self.env.num_envs

    def get_vec_normalize_env(self) -> None:
        return None

    # -- SB3's user contract -------------------------------------------------------------------------
    @property
    def logger(self) -> Any:
        if self._logger is None:
            self._logger = folderless_logger(self.config.verbose)
        return self._logger

    def set_logger(self, logger: Any) -> None:
        """Log to ``logger`` (an SB3 ``Logger``), as SB3's ``set_logger``: it takes the place of the one
        ``tensorboard_log`` and ``verbose`` would make, in every later ``learn()``."""
        self._logger, self._custom_logger = logger, True

    def _setup_logger(self, tb_log_name: str, reset_num_timesteps: bool) -> None:
        """Log to stdout, CSV and TensorBoard under ``tensorboard_log/<tb_log_name>_<n>``; a learn() call that
        continues (``reset_num_timesteps=False``) continues the latest run, as SB3 does. Under several
        processes, the main one only (the others log to stdout when verbose)."""
        if self._custom_logger or self.config.tensorboard_log is None or not self.dist.is_main:
            return  # (the main process only: statistics are gathered, and one writes them)
        from stable_baselines3.common.logger import Logger, make_output_format
        from stable_baselines3.common.utils import get_latest_run_id

        require_tensorboard("tensorboard_log")
        run_id = get_latest_run_id(self.config.tensorboard_log, tb_log_name)
        continued = not reset_num_timesteps and run_id > 0
        run_id += not continued
        folder = os.path.join(self.config.tensorboard_log, f"{tb_log_name}_{run_id}")
        os.makedirs(folder, exist_ok=True)
        if continued:  # a resume, or another learn() of this agent
            formats = continued_formats(folder, self.iteration, self.num_timesteps)
        else:
            formats = [make_output_format(f, folder) for f in ("csv", "tensorboard")]
        if self.config.verbose:
            formats.insert(0, stdout_format())
        if self._folder_logger is not None:  # an earlier learn()'s: its files are continued here
            self._folder_logger.close()
        self._logger = self._folder_logger = Logger(folder=folder, output_formats=formats)

    def learn(
        self,
        total_timesteps: int,
        callback: Any = None,
        log_interval: int = 1,
        tb_log_name: str | None = None,
        reset_num_timesteps: bool = True,
        progress_bar: bool = False,
    ) -> LMAgent:
        """Alternate ``collect_rollouts`` and ``train`` until ``total_timesteps`` tokens were generated.

        ``callback``: SB3 callback(s) or a function of ``(locals, globals)``; ``on_step`` is called once per
        iteration (one batch of episodes) and stops training when it returns False. Statistics are logged
        every ``log_interval`` iterations under TRL's names.
        """
        from tqdm.auto import tqdm

        if self.env is None:
            raise ConfigError(f"this {self.name} has no env: pass one to the agent or to load(path, env).")
        # a whole number of any numeric type (np.int64; 1e5, as SB3 users write it), not a bool
        numeric = isinstance(total_timesteps, numbers.Real) and not isinstance(total_timesteps, bool)
        if not (numeric and total_timesteps >= 0 and float(total_timesteps).is_integer()):
            raise ConfigError(
                f"learn(total_timesteps={total_timesteps!r}): give a whole number of tokens >= 0 (it is rounded up "
                f"to whole iterations)."
            )
        total_timesteps = int(total_timesteps)
        if reset_num_timesteps or self._learn_started is None:  # SB3's: a new count, a new episode record
            self.ep_info_buffer.clear()
            self.ep_success_buffer.clear()
            self._learn_started = time.perf_counter()  # Monitor's "t" counts from here
        if reset_num_timesteps:
            self.num_timesteps = 0
        else:
            total_timesteps += self.num_timesteps
        self._total_timesteps = total_timesteps
        self._setup_logger(tb_log_name or type(self).__name__, reset_num_timesteps)
        callback = self._init_callback(callback)
        callback.on_training_start(locals(), globals())
        bar = tqdm(
            total=total_timesteps,
            initial=self.num_timesteps,
            unit="tok",
            disable=not (progress_bar and self.dist.is_main),
        )
        while self.num_timesteps < total_timesteps:
            if self.config.lr_schedule == "linear":
                for group in self.optimizer.param_groups:
                    group["lr"] = self.config.learning_rate * max(
                        0.0, 1 - self.num_timesteps / total_timesteps
                    )
            callback.on_rollout_start()
            batch = self.collect_rollouts()
            # one env step = one agent token; every process's, so the count is the same everywhere
            tokens = int(self.dist.sum(batch.action_mask.sum()))
            self.num_timesteps += tokens
            elapsed = round(time.perf_counter() - self._learn_started, 6)
            self.ep_info_buffer.extend(
                {"r": e["reward"], "l": e["num_tokens"], "t": elapsed} for e in self.last_episodes
            )
            callback.update_locals(locals())
            callback.on_rollout_end()
            start = time.perf_counter()
            update_stats = self.train(batch)
            update_stats.setdefault("time/update", time.perf_counter() - start)
            self.iteration += 1
            self._last_batch = batch.select(torch.arange(min(2, len(batch))))
            self.check_health()
            stats = {
                **dict.fromkeys(COMMON_STATS, math.nan),  # every agent's rows have every common column
                "iteration": self.iteration,
                "timesteps": self.num_timesteps,
                **batch.stats,
                **update_stats,
                "lr": float(self.optimizer.param_groups[0]["lr"]),
                "train/skipped_steps": self.skipped_steps,
            }
            stats["time/iteration"] = sum(
                v
                for k, v in stats.items()
                if k.startswith("time/") and k not in ("time/tokens_per_s", "time/iteration")
            )
            self.history.append(stats)
            if log_interval and self.iteration % log_interval == 0:
                self.dump_logs()
            bar.total = max(bar.total, bar.n + tokens)  # the last iteration ends past the budget: a full bar
            bar.update(tokens)
            scores = headline_scores(stats, getattr(self.env.reward_stack, "aggregate", "sum"))
            bar.set_postfix({**{k: number(v) for k, v in scores.items()}, "kl": number(stats["kl"])})
            # one call per iteration, as SB3 makes one per env step, with what SB3's callbacks read: each
            # episode ended ("dones"), its info with Monitor's "episode" and its return ("rewards")
            infos = [{**e, "episode": {"r": e["reward"], "l": e["num_tokens"]}} for e in self.last_episodes]
            callback.update_locals({**locals(), "dones": np.ones(len(infos), dtype=bool), "infos": infos,
                                    "rewards": np.array([e["reward"] for e in infos], dtype=np.float32)})  # fmt: skip
            if self.dist.any(not callback.on_step()):  # one process stopping alone left the others waiting
                break
        bar.close()
        callback.on_training_end()
        return self

    def dump_logs(self, iteration: int = 0) -> None:
        """Write the last iteration's statistics to the logger now (``learn`` does every ``log_interval``
        iterations; SB3's ``LogEveryNTimesteps`` calls this). ``iteration`` is SB3's argument, unused."""
        if not self.history or not self.dist.is_main:
            return
        for key, value in self.history[-1].items():
            if key not in ("iteration", "timesteps"):
                self.logger.record(key, value)
        self.logger.record("time/iterations", self.iteration)
        self.logger.dump(step=self.num_timesteps)

    def _init_callback(self, callback: Any) -> Any:
        from stable_baselines3.common.callbacks import BaseCallback, CallbackList, ConvertCallback

        if isinstance(callback, list):
            callback = CallbackList(callback)
        if not isinstance(callback, BaseCallback):
            callback = ConvertCallback(callback)
        callback.init_callback(self)
        return callback

    def predict(
        self,
        observation: dict[str, np.ndarray],
        state: Any = None,
        episode_start: Any = None,
        deterministic: bool = False,
    ) -> tuple[np.ndarray, Any]:
        """The next token for each observation (a full forward; for generation, ``rollout`` is faster). A
        sharded agent's forward gathers the weights from every process: call it on all of them."""
        ids = np.asarray(observation["input_ids"])
        single = ids.ndim == 1
        ids = torch.as_tensor(ids.reshape(-1, ids.shape[-1]), dtype=torch.long, device=self.device)
        mask = torch.as_tensor(np.asarray(observation["attention_mask"]).reshape(ids.shape), dtype=torch.long)
        mask = mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        last = mask.shape[1] - 1 - mask.flip(-1).argmax(-1)  # (N,) index of each row's newest token
        with torch.no_grad(), self.autocast():  # the agent's precision, as in its rollouts
            logits = self.rollout_model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        logits = logits[torch.arange(len(ids)), last].float()  # (N, V)
        if self.action_n is not None:  # the env's actions only (loaded without an env: the saved one's)
            logits = logits[:, : self.action_n]
        logits = mask_logits(logits, self.allowed)  # those the env allows (None without an env: every one)
        if not bool(torch.isfinite(logits.logsumexp(-1)).all()):  # argmax would pick a token of a NaN row
            raise TrainingError(
                "the model's next-token distribution is not finite; its weights have diverged."
            )
        if deterministic:
            actions = logits.argmax(-1)
        else:
            actions = torch.multinomial((logits / self.config.temperature).softmax(-1), 1).squeeze(-1)
        actions = actions.cpu().numpy()
        return (actions[0] if single else actions), state

    def get_parameters(self) -> dict[str, dict[str, Any]]:
        """The agent's parameters by name, as SB3's: ``"policy"``, each trainable module (LMPPO's
        ``"value_head"``) and ``"optimizer"``, each a state dict of the agent's own tensors (not copies). Not
        a separate reference model. See :mod:`textgym.agents.parameters`."""
        from textgym.agents.parameters import get_parameters

        return get_parameters(self)

    def set_parameters(
        self,
        load_path_or_dict: str | os.PathLike | dict[str, Any],
        exact_match: bool = True,
        device: str | torch.device = "auto",
    ) -> None:
        """Set the parameters from a :meth:`get_parameters` dict or a checkpoint directory :meth:`save`
        wrote (its policy, this agent's modules, and its optimizer state when the same agent saved it), as
        SB3's: ``exact_match`` asks for every name and every key; ``exact_match=False`` sets what is given.
        The values are copied in; counters, config and a separate reference model stay the agent's. The
        weights go to the agent's device, whatever ``device`` says. Everything is checked before anything
        changes."""
        from textgym.agents.parameters import set_parameters

        set_parameters(self, load_path_or_dict, exact_match)

    def set_random_seed(self, seed: int | None = None) -> None:
        """Seed the agent's rollouts and torch, numpy and Python from ``seed`` (each process its own, as the
        agent's ``seed`` setting does), as SB3's; a checkpoint keeps it. None leaves them as they are."""
        if seed is None:
            return
        import dataclasses

        seed = int(seed) if isinstance(seed, numbers.Integral) and not isinstance(seed, bool) else seed
        self.config = dataclasses.replace(self.config, seed=seed)  # checked as the setting is
        self.seed_process()
        if self.env is not None:
            self.env.single_action_space.seed(self.seed)
            self.env.action_space.seed(self.seed)

    def save(self, path: str | os.PathLike) -> None:
        """Write a checkpoint directory atomically: the policy in Hugging Face format (the adapter with
        LoRA), the agent's modules, the optimizer, the counters, the config and the agent's extra state.
        Refuses a diverged policy, so a broken run never overwrites a good checkpoint. A sharded agent is
        saved by every process calling ``save``: the full weights are gathered, the main process writes."""
        from textgym.agents.checkpoint import checkpoint_path, save_checkpoint

        save_checkpoint(self, checkpoint_path(path))

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        env: TextGenVectorEnv | None = None,
        device: str | None = None,
        custom_objects: dict[str, Any] | None = None,
        print_system_info: bool = False,
        force_reset: bool = True,
        **overrides: Any,
    ) -> LMAgent:
        """An agent restored from :meth:`save`, with optimizer and counters; ``overrides`` replace config
        fields (e.g. ``learning_rate``), as SB3's ``custom_objects`` do, and ``device`` the saved one.
        ``print_system_info`` prints this machine's (a checkpoint keeps none); ``force_reset`` is SB3's
        argument: every iteration of an LM agent starts new episodes anyway."""
        from textgym.agents.checkpoint import checkpoint_path, load_checkpoint

        if print_system_info:
            from stable_baselines3.common.utils import get_system_info

            get_system_info(print_info=True)
        overrides = {**(custom_objects or {}), **overrides, **({} if device is None else {"device": device})}
        return load_checkpoint(cls, checkpoint_path(path), env, overrides)
