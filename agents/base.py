"""``LMAgent``: what every language-model agent shares, in the spirit of SB3's ``OnPolicyAlgorithm``.

``learn`` is a loop of ``collect_rollouts()`` (one batch of episodes through the vector env, as a typed
:class:`RolloutBatch`) and ``train(batch)`` (the agent's update, returning its statistics). A subclass
implements those two and, if it has them, extra modules (a value head) and extra state. The base owns the
rest: loading the policy (zoo name, directory or model object), LoRA, the reference model (a frozen copy, the
adapter-disabled model, or none when the agent does not need one), ``accelerate``, the optimizer, seeding,
the rollout and score shaping. Three mixins add the rest: :class:`~textgym.agents.forwards.Forwards`, the
forwards over prompt + response (the policy's and the reference's log-probs, the KL);
:class:`~textgym.agents.update_guards.UpdateGuards`, the guards against non-finite losses, gradients and
weights; :class:`~textgym.agents.sb3_contract.SB3Contract`, SB3's user contract (``learn`` with callbacks,
logger and progress bar, ``predict``, atomic ``save``, ``load``) and the one metrics schema every agent
logs (:data:`COMMON_STATS`).
"""

from __future__ import annotations

import collections
import copy
import functools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from textgym.agents import checkpoint, lora, precision, sharding, zero3
from textgym.agents.batch_checks import batch_statistics, check_totals, recombine_totals
from textgym.agents.distributed import Collective, cpu_has_native_bf16
from textgym.agents.forwards import Forwards
from textgym.agents.lm_config import LMAgentConfig, make_config
from textgym.agents.rollout_batch import RolloutBatch, RunningMoments
from textgym.agents.sb3_contract import COMMON_STATS, SB3Contract, require_tensorboard
from textgym.agents.tokenizer_check import check_tokenizer
from textgym.agents.update_guards import UpdateGuards
from textgym.config import MAX_SEED, iteration_seed
from textgym.envs import TextGenVectorEnv
from textgym.errors import ConfigError, TextgymError, TrainingError
from textgym.reward_functions import add_to_sums
from textgym.sampling import Rollout, allowed_actions, rollout
from textgym.scoring import cuda_has_native_bf16

__all__ = [
    "COMMON_STATS",
    "LMAgent",
    "LMAgentConfig",
    "RolloutBatch",
    "RunningMoments",
    "require_tensorboard",
]


class LMAgent(Forwards, SB3Contract, UpdateGuards):
    """Base class of textgym's LM agents. See the module docstring for the template.

    Args:
        policy: a zoo name or model directory (then also the reference, reloadable from the name), or a
            causal-LM model object.
        env: a ``TextGenVectorEnv`` with ``autoreset_mode="Disabled"`` whose tokenizer matches the policy.
            Optional for inference (``predict``).
        **hyperparameters: fields of the agent's config dataclass (``config_class``).
    """

    config_class: ClassVar[type] = LMAgentConfig
    name: ClassVar[str] = "lm-agent"  # the registered name, in messages and checkpoints

    @classmethod
    def check_placement(cls, **hyperparameters: Any) -> None:
        """Refuse a device or precision this machine or environment cannot give, as the constructor would:
        ``run.processes = N`` checks it once before it starts the processes, which would each say it."""
        cls._placement(make_config(cls.config_class, cls.name, hyperparameters))

    @staticmethod
    def _placement(c: Any) -> tuple[bool, bool, Any, Any]:
        """(on a GPU, bf16, the ZeRO-3 and FSDP settings asked for) from the config and the environment."""
        if c.device == "cuda" and not torch.cuda.is_available():  # accelerate would fall back to the CPU
            raise ConfigError('device = "cuda", but torch sees no CUDA GPU: use device = "auto" or "cpu".')
        on_gpu = torch.cuda.is_available() if c.device == "auto" else c.device.startswith("cuda")
        bf16 = (on_gpu and cuda_has_native_bf16()) if c.bf16 is None else c.bf16
        if bf16 and not on_gpu and not cpu_has_native_bf16():
            raise ConfigError(
                "bf16 = true on a CPU without native bf16 instructions (no avx512_bf16 or amx_bf16): torch would "
                "emulate bf16, slower than fp32. Set bf16 = false (the CPU default)."
            )
        # bf16 autocast is textgym's own (see autocast()): the Accelerator's mixed-precision setting is a
        # process-wide singleton, which would forbid two agents of different precision in one process.
        # textgym shards itself: see agents/sharding.py (FSDP2) and agents/zero3.py (DeepSpeed ZeRO-3)
        zero, fsdp = zero3.zero3_requested(on_gpu), sharding.fsdp_requested()
        if zero is not None and fsdp is not None:
            raise ConfigError(
                "the environment asks for both FSDP (ACCELERATE_USE_FSDP) and DeepSpeed "
                "(ACCELERATE_USE_DEEPSPEED): set one."
            )
        mixed = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
        if mixed not in ("no", ""):  # the Accelerator would wrap the training forward in its autocast
            raise ConfigError(
                f"accelerate's mixed_precision is {mixed!r} (ACCELERATE_MIXED_PRECISION, which `accelerate "
                f"launch` sets from its config or --mixed_precision): textgym's LM agents set their precision "
                f"themselves. Use the agent's bf16 = true, and mixed_precision: no."
            )
        return on_gpu, bool(bf16), zero, fsdp

    def __init__(self, policy: Any, env: TextGenVectorEnv | None = None, **hyperparameters: Any):
        from accelerate import Accelerator

        self.config = c = make_config(self.config_class, self.name, hyperparameters)
        on_gpu, bf16, zero, fsdp = self._placement(c)
        with sharding.accelerate_without_sharding():
            self.accelerator = Accelerator(cpu=not on_gpu)
        if self.accelerator.device.type != ("cuda" if on_gpu else "cpu"):  # accelerate's first state in a
            raise ConfigError(  # process fixes its device: an earlier agent's, or a process group's
                f"device = {c.device!r}, but accelerate already runs this process on {self.accelerator.device} "
                f"(the first Accelerator or process group of a process fixes its device): give every agent of "
                f"a process the same device, and start a process group on it (textgym.launch.init_process_group)."
            )
        self.bf16 = bool(bf16)
        sharding.refuse_accelerate_sharding(self.accelerator)
        self.device = self.accelerator.device
        self.dist = Collective(self.accelerator)
        launched = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.fsdp = fsdp if launched else None  # without a process group there is nothing to shard over
        self.zero3 = zero if launched else None
        if self.dist.world > 1:  # each process its share of the machine's cores
            local = int(os.environ.get("LOCAL_WORLD_SIZE", self.dist.world))
            torch.set_num_threads(
                int(os.environ.get("TEXTGYM_NUM_THREADS", 0)) or max(1, (os.cpu_count() or 1) // local)
            )
        self.seed_process()
        self.policy_source = str(policy) if isinstance(policy, (str, os.PathLike)) else None
        self.source_fingerprint = checkpoint.source_fingerprint(self.policy_source)  # a load checks it
        skeleton = None  # sharded, from a name: only the main process reads it (sharding.load_on_main)
        if self.sharded and self.policy_source is not None:
            load = functools.partial(self._load_policy, policy)
            model, skeleton = sharding.load_on_main(load, self.dist, self._with_lora)
        else:
            model = self._with_lora(self._load_policy(policy))
        self.ref_policy = None  # with LoRA, the reference is the same weights (lora.reference_weights)
        model.eval()  # dropout off, LoRA's included: rollout and training log-probs must agree
        if c.lora is None and self.uses_reference:
            self.ref_policy = (skeleton() if skeleton else copy.deepcopy(model)).requires_grad_(False)
            self.ref_policy = self.ref_policy if self.sharded else self.ref_policy.to(self.device)
        modules = self.build_modules(model)  # e.g. {"value_head": ValueHead(...)}
        precision.check_trainable(model)
        if self.zero3 is not None:  # one engine trains the policy and the modules (agents/zero3.py)
            zero3.check_one_dtype({"the policy": model, **modules})
            if self.ref_policy is not None:  # a skeleton takes the main process's policy
                weights = sharding.main_weights(model, self.dist) if skeleton is not None else None
                self.ref_policy = zero3.reference(self.ref_policy, self.zero3, self.device, weights)
                del weights  # the main process's whole copy, which the policy's partition frees
            self.engine, self.optimizer, params = zero3.initialize(
                model, modules, self.zero3, self._adamw, c.max_grad_norm, self.device, bf16
            )
            self.policy = self.engine  # training forwards go through the engine; rollouts: rollout_model
            self.modules = dict(self.engine.module.extra.items())
        else:
            self.policy, self.optimizer, self.modules, params = self._prepare(
                model, modules, skeleton is not None
            )
        self.params = params
        self.score_moments = RunningMoments()
        self.num_timesteps = 0
        self.iteration = 0  # never reset: it seeds the rollouts, so a resumed run continues the same stream
        self.skipped_steps = 0
        self._total_timesteps = 0
        self._logger = self._folder_logger = None
        self._custom_logger = False
        self.env: TextGenVectorEnv | None = None
        self.allowed: torch.Tensor | None = None  # set with the env: the tokens it lets the agent choose
        # the env's tokens (a policy's vocabulary may be larger); a checkpoint keeps it for predict()
        self.action_n: int | None = None
        if env is not None:
            self.set_env(env)
        self.last_episodes: list[dict[str, Any]] = []
        # SB3's: Monitor's record ({"r": return, "l": length, "t": seconds}) of the last 100 episodes
        self.ep_info_buffer: collections.deque[dict[str, float]] = collections.deque(maxlen=100)
        self.ep_success_buffer: collections.deque[bool] = collections.deque(maxlen=100)  # (no success flag)
        self._learn_started: float | None = None
        self.history: list[dict[str, float]] = []

    def _prepare(
        self, model: nn.Module, modules: dict[str, nn.Module], from_main: bool = False
    ) -> tuple[Any, Any, dict[str, nn.Module], list[nn.Parameter]]:
        """Shard with FSDP2 when asked, make the AdamW, and let accelerate wrap them (DDP under torchrun).
        ``from_main``: the policy and the reference hold weights on the main process only (the others have
        meta-device skeletons), which sharding hands out. Returns the policy, the optimizer, the modules and
        the trainable parameters."""
        if self.fsdp is not None:  # every model and module: one kind of parameter (see agents/sharding.py)
            weights = sharding.main_weights(model, self.dist) if from_main else None
            model = sharding.shard(model, self.fsdp, self.device, weights)  # to the device one unit at a time
            if self.ref_policy is not None:
                self.ref_policy = sharding.shard(self.ref_policy, self.fsdp, self.device, weights)
            del weights  # the main process's whole copy
            modules = {k: sharding.shard_module(m, self.fsdp, self.device) for k, m in modules.items()}
        params = [p for m in (model, *modules.values()) for p in m.parameters() if p.requires_grad]
        optimizer = self._adamw(params)
        if self.fsdp is not None:
            prepared = [model, *modules.values(), self.accelerator.prepare(optimizer)]
        else:
            prepared = self.accelerator.prepare(model, *modules.values(), optimizer)
            if self.ref_policy is not None and self.dist.world > 1:
                # DDP hands the main process's weights to the policy only: a policy object whose weights
                # differ per process (from_config under per-process seeds) kept a reference of its own
                sharding.broadcast_from_main(self.ref_policy, self.device)
        # the policy is DDP-wrapped under torchrun
        return prepared[0], prepared[-1], dict(zip(modules, prepared[1:-1])), params

    def _with_lora(self, model: Any, on_meta: bool = False) -> Any:
        """The model with the config's LoRA adapter (the model itself without ``lora``, or if it has one),
        and, where the adapter does not start as a no-op (PiSSA, OLoRA, ...), a frozen copy of it as the
        reference (agents/lora.py). ``on_meta``: a meta-device skeleton, whose adapter weights come from the
        main process, so no initialisation may read the base weights."""
        return lora.adapted(model, self.config.lora, self.config.seed, on_meta)

    def _adamw(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """The agent's AdamW, sharded or not (DeepSpeed steps its shards through this one too)."""
        settings = {"lr": self.config.learning_rate, "weight_decay": self.config.weight_decay}
        try:  # the fused kernel is ~3x faster per step on the CPU (and on GPUs) than the default
            return torch.optim.AdamW(params, **settings, fused=True)
        except (RuntimeError, TypeError):
            return torch.optim.AdamW(params, **settings)

    # -- what subclasses implement -------------------------------------------------------------------
    @property
    def uses_reference(self) -> bool:
        """Whether the agent needs reference log-probs (False: no reference model is loaded at all)."""
        return True

    @property
    def group_size(self) -> int:
        """Completions per prompt in a batch (1: every sub-env draws its own prompt)."""
        return 1

    minibatch_knob = ""  # the hyperparameter that splits a batch into optimizer steps (none: one step)

    @property
    def minibatches(self) -> tuple[str, int]:
        """The hyperparameter that splits a batch into optimizer steps, and its value."""
        knob = self.minibatch_knob
        return knob, int(getattr(self.config, knob)) if knob else 1

    def build_modules(self, model: Any) -> dict[str, nn.Module]:
        """Trainable modules besides the policy (saved and loaded with it), e.g. a value head."""
        return {}

    def collect_rollouts(self) -> RolloutBatch:
        """One batch of episodes with everything ``train`` needs."""
        return self.generate()[0]

    def train(self, batch: RolloutBatch) -> dict[str, float]:
        """Update the policy on ``batch``; return the update's statistics."""
        raise NotImplementedError

    def extra_state(self) -> dict[str, Any]:
        """JSON-serialisable state a subclass saves with checkpoints (e.g. its KL controller)."""
        return {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`extra_state` returned."""

    # -- policy and env ------------------------------------------------------------------------------
    @staticmethod
    def _load_policy(policy: Any) -> Any:
        if isinstance(policy, (str, os.PathLike)):
            from textgym.models import load_model

            model = load_model(policy)[0]
            if model is None:
                raise ConfigError(
                    f"{str(policy)!r} is a tokenizer without weights; give a model as the policy."
                )
            return model
        if not hasattr(policy, "config") or not callable(policy):
            raise ConfigError(f"policy must be a zoo name, a model directory or a causal LM, not {policy!r}.")
        return policy

    def seed_process(self) -> None:
        """Seed torch, numpy and Python from the config's seed, each process (under a launcher) with its own,
        hence its own rollouts: ``seed`` is this process's."""
        from accelerate.utils import set_seed

        self.seed = self.config.seed + 10_007 * self.dist.rank
        set_seed(self.seed)

    def set_env(self, env: TextGenVectorEnv, force_reset: bool = True) -> None:
        """Train on ``env`` from the next ``learn``. ``force_reset`` is SB3's argument: every iteration of
        an LM agent starts new episodes anyway."""
        if not isinstance(env, TextGenVectorEnv):
            raise ConfigError(
                f"{self.name} needs a textgym TextGenVectorEnv, not {type(env).__name__}; e.g. "
                f'gymnasium.make_vec("textgym/TextGen-v0", num_envs=16, autoreset_mode="Disabled").'
            )
        if env.autoreset_mode.value != "Disabled":
            raise ConfigError(
                f"{self.name} generates whole batches: make the env with autoreset_mode='Disabled'."
            )
        if env.num_envs % self.group_size:
            raise ConfigError(
                f"the env's batch (num_envs={env.num_envs}) must be a multiple of num_generations="
                f"{self.group_size}: each prompt gets {self.group_size} completions."
            )
        knob, steps = self.minibatches
        if steps > env.num_envs:
            world = self.dist.world
            batch = (
                f"each process's share of a batch ({env.num_envs} of num_envs={env.num_envs * world}, over "
                f"{world} processes)"
                if world > 1
                else f"a batch of {env.num_envs} episodes (num_envs)"
            )
            raise ConfigError(
                f"{knob}={steps} splits {batch} into more minibatches than it has episodes: give {knob} <= "
                f"{env.num_envs}, or more num_envs."
            )
        check_tokenizer(self.rollout_model.config, self.policy_source, env)
        if self.dist.world > 1:  # sequential prompt order: each process its own prompts, not all the same
            env.shard_prompts(self.dist.rank, self.dist.world)
        self.env, self.action_n = env, int(env.single_action_space.n)
        # the tokens it may choose, masked in the rollout, in training and in predict
        self.allowed = allowed_actions(env, self.device)

    def autocast(self) -> Any:
        """bf16 autocast on the agent's device when ``bf16`` is on (the policy's forwards run in it). Sharded,
        without autocast's cache of cast weights, which would keep a bf16 copy of every gathered unit."""
        return torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=self.bf16, cache_enabled=not self.sharded
        )

    @property
    def rollout_model(self) -> Any:
        """The policy without its data-parallel wrapper: rollouts, reference passes and predictions run on
        each process independently (a DDP forward would wait for the other processes)."""
        if self.zero3 is not None:
            return self.engine.module.policy
        return self.unwrap(self.policy)

    @staticmethod
    def unwrap(module: nn.Module) -> nn.Module:
        """A module without its DDP wrapper (accelerate's ``unwrap_model`` would import deepspeed, when it is
        installed, in every run)."""
        return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module

    def accumulating(self, last: bool) -> Any:
        """Context for one micro-batch's backward: gradients are all-reduced across processes only on the
        ``last`` micro-batch of an optimizer step (DDP's ``no_sync`` for the others)."""
        import contextlib

        stack = contextlib.ExitStack()
        if self.zero3 is not None:  # the engine reduce-scatters every backward; it steps at the boundary
            self.engine.set_gradient_accumulation_boundary(last)
            return stack
        for module in (self.policy, *self.modules.values()):
            if self.fsdp is not None:  # FSDP2: gradients reduce-scatter after the last micro-batch only
                module.set_requires_gradient_sync(last)
                stack.callback(module.set_requires_gradient_sync, True)
            elif self.dist.world > 1 and not last:
                stack.enter_context(self.accelerator.no_sync(module))
        return stack

    @property
    def sharded(self) -> bool:
        """Whether the policy is sharded, with FSDP2 or DeepSpeed ZeRO-3 (asked for, and more than one
        process)."""
        return self.fsdp is not None or self.zero3 is not None

    @property
    def sharding_engine(self) -> str | None:
        """What shards the policy, in words ("FSDP2", "DeepSpeed ZeRO-3"); None when it is not sharded."""
        return "FSDP2" if self.fsdp is not None else "DeepSpeed ZeRO-3" if self.zero3 is not None else None

    @property
    def lockstep(self) -> Callable[..., bool] | None:
        """For :func:`~textgym.sampling.rollout` under sharding: whether any process still has an active
        episode (every forward of a sharded model needs every process), and a failure on one process stops
        all (:meth:`~textgym.agents.distributed.Collective.lockstep`). None otherwise: no collective."""
        return self.dist.lockstep if self.sharded else None

    def rollout(self, env: TextGenVectorEnv, shares: bool = False, **kwargs: Any) -> Rollout:
        """:func:`~textgym.sampling.rollout` of the policy on ``env`` in the agent's precision (see
        agents/precision.py), in lockstep when sharded (a process that fails stops all, each naming it).
        ``kwargs`` go to the rollout. A ``normalize_then_sum`` stack's totals are recombined over the whole
        rollout (the env standardised each episode with those that ended on the same step only); with
        ``shares`` (each process's rollout is its share of one batch, as in training) over every process's."""
        model = self.rollout_model
        error = None
        with precision.bf16_linear_weights(model, self.bf16 and not self.sharded):
            try:
                r = rollout(model, env, lockstep=self.lockstep, precision=self.autocast, **kwargs)
            except TextgymError as exc:
                error = exc
        # sharded, every process left the rollout on the same step; with shares, the totals below gather:
        # either way all processes now stop together, naming the failure
        if self.sharded or shares:
            self.dist.agree(error)
        elif error is not None:
            raise error
        if getattr(env.reward_stack, "aggregate", "sum") != "sum":
            recombine_totals(env.reward_stack, r, self.dist if shares else None)
        return r

    # -- one batch of episodes -----------------------------------------------------------------------
    def shape_scores(self, raw: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
        """missing-EOS penalty -> scale -> running normalisation -> clip, in that order."""
        c = self.config
        scores = raw.clone()
        if c.missing_eos_penalty is not None:
            scores[truncated] -= c.missing_eos_penalty
        scores = scores * c.score_scale
        if c.score_norm:  # the running moments of every process's scores, identical on all
            self.score_moments.update(self.dist.gather(scores))
            scores = (scores - self.score_moments.mean) / self.score_moments.std
        if c.score_clip is not None:
            scores = scores.clamp(-c.score_clip, c.score_clip)
        return scores

    def generate(self, keep_hidden: bool = False) -> tuple[RolloutBatch, Any]:
        """Roll out one episode per sub-env (``group_size`` consecutive sub-envs per prompt), take the
        reference log-probs and the scores, and the statistics every agent logs. Returns the batch and the
        hidden states (N, T, H) when ``keep_hidden``."""
        env = self.env
        if env is None:
            raise ConfigError(f"this {self.name} has no env: pass one to the agent or to load(path, env).")
        stack = env.reward_stack
        if hasattr(stack, "set_progress") and self._total_timesteps:
            stack.set_progress(min(1.0, self.num_timesteps / self._total_timesteps))
        # The global streams (random, numpy's, torch's) a reward plugin or responder may draw from start each
        # rollout from (seed, iteration), as the rollout's own generator does: a resumed run draws what the
        # uninterrupted one drew, and whatever ran between iterations ([eval], samples) changes nothing.
        from accelerate.utils import set_seed

        set_seed(iteration_seed(self.seed, self.iteration) % MAX_SEED)
        start, reward_before = time.perf_counter(), env.reward_seconds
        env.take_reward_metrics()  # (what was logged outside training, e.g. by an evaluation on this env)
        options = {"group_size": self.group_size} if self.group_size > 1 else None
        # shares: a reward plugin that fails on one process stops every process there, naming it
        r = self.rollout(
            env,
            shares=True,
            temperature=self.config.temperature,
            seed=iteration_seed(self.seed, self.iteration),
            options=options,
            keep_hidden=keep_hidden and not self.bf16,  # bf16: from the forward below
        )
        t_rollout = time.perf_counter() - start
        t_reward = env.reward_seconds - reward_before
        batch, hidden = RolloutBatch.from_rollout(r), r.hidden
        if self.bf16:  # the behaviour log-probs from whole-sequence forwards, as training's (precision.py)
            batch.logprobs, hidden = self.sequence_logprobs(self.rollout_model, batch, hidden=keep_hidden)
            t_rollout = time.perf_counter() - start  # this forward counts as rollout time
        error = None
        try:
            check_totals(batch.raw_scores, r.infos, self.config.max_abs_score)
        except TrainingError as exc:
            error = exc
        self.dist.agree(error)
        batch.scores = self.shape_scores(batch.raw_scores, batch.truncated)
        start = time.perf_counter()
        if self.uses_reference:
            batch.ref_logprobs = self.reference_logprobs(batch)
        t_reference = time.perf_counter() - start
        batch.stats = self.rollout_stats(batch)
        batch.stats.update(logged_reward_metrics(self.dist.gather_objects([env.take_reward_metrics()])))
        # the run's throughput: every process's tokens over the slowest process's rollout
        tokens = float(self.dist.sum(batch.action_mask.sum()))
        slowest = float(self.dist.gather(torch.tensor([t_rollout])).max())
        batch.stats.update(
            {
                "time/rollout": t_rollout - t_reward,
                "time/reward": t_reward,
                "time/reference": t_reference,
                "time/tokens_per_s": tokens / max(slowest, 1e-9),
            }
        )
        self.last_episodes = self.dist.gather_objects(r.infos)  # every process's (the main one writes)
        return batch, hidden

    def rollout_stats(self, batch: RolloutBatch) -> dict[str, float]:
        """The common statistics of a batch (see :data:`COMMON_STATS`), over every process's episodes."""
        return batch_statistics(batch, self.dist, self.group_size)


def logged_reward_metrics(records: Sequence[Mapping[str, tuple[float, int]]]) -> dict[str, float]:
    """The mean of each metric TRL-style reward functions logged (``log_metric``), over every process's
    record (sum and count per name)."""
    sums: dict[str, tuple[float, int]] = {}
    for record in records:
        for name, (total, count) in record.items():
            add_to_sums(sums, name, total, count)
    return {name: total / count for name, (total, count) in sorted(sums.items())}
