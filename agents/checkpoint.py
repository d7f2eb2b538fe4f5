"""Checkpoints of LM agents: one directory, written atomically, loaded without running pickled code.

Layout: ``policy/`` (Hugging Face format; the adapter alone with LoRA, the base reloaded by name, and in
``policy/reference/`` the frozen initial adapter of a LoRA policy that did not start at its base model, see
:mod:`textgym.agents.lora`), ``reference/`` (only when the policy was given as an object), ``<module>.pt``
per trainable module (e.g. the value head), ``optimizer.pt`` and ``state.json`` (agent name, config,
counters, history, extra state).
Tensors are loaded with ``weights_only=True``.

Under sharding (FSDP2, :mod:`textgym.agents.sharding`; DeepSpeed ZeRO-3, :mod:`textgym.agents.zero3`) the
full weights and optimizer state are gathered by every process (:func:`gather_checkpoint`) and written by the
main one, in the same layout: a checkpoint of a sharded run is a normal Hugging Face directory that one
process loads, and resumes sharded or not.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from textgym.agents import lora, sharding, zero3
from textgym.agents.lm_config import lora_as_saved
from textgym.agents.rollout_batch import RunningMoments
from textgym.agents.tokenizer_check import check_tokenizer
from textgym.errors import ConfigError, TrainingError

if TYPE_CHECKING:
    from textgym.agents.base import LMAgent


def checkpoint_path(path: str | Path) -> Path:
    """A checkpoint is a directory: SB3's ``CheckpointCallback`` passes ``name_<steps>_steps.zip``, which
    becomes ``name_<steps>_steps``."""
    path = Path(path)
    return path.with_suffix("") if path.suffix == ".zip" else path


def gather_checkpoint(agent: LMAgent) -> dict[str, Any] | None:
    """Under sharding, on every process: check the policy's health and gather what :func:`save_checkpoint`
    writes (the full policy, reference and optimizer state, on the CPU); the main process keeps it for its
    next save. None (nothing to do) without sharding."""
    if not agent.sharded:
        return None
    try:
        agent.check_health()  # collective: its forward needs every process
    except TrainingError as exc:
        raise TrainingError(f"{exc} No checkpoint was written; the last good one is kept.") from None
    keep = agent.dist.is_main

    def gather(module: Any) -> Any:  # FSDP2's gather keeps the result on the main process only
        return (
            zero3.full_state_dict(module, keep)
            if agent.zero3 is not None
            else sharding.full_state_dict(module)
        )

    full = {
        "policy": gather(agent.rollout_model),
        "reference": gather(agent.ref_policy)
        if agent.policy_source is None and agent.ref_policy is not None
        else None,
        "optimizer": zero3.full_optimizer_state(agent.optimizer, agent.params, keep)
        if agent.zero3 is not None
        else sharding.full_optimizer_state(agent.optimizer, keep),
        "modules": {name: gather(module) for name, module in agent.modules.items()},
    }
    agent._gathered = full if agent.dist.is_main else None
    return full


FINGERPRINT_BYTES = 1 << 20  # read from each end of each file: a changed model changes its first or last MB


def source_fingerprint(source: str | None) -> str | None:
    """A digest of a policy directory (each file's name, size, first and last MB), or None for a zoo name
    (built the same by this textgym). A checkpoint keeps it: a load reads the reference (and a LoRA policy's
    base) from the source again, and refuses a directory that changed since."""
    path = Path(source).expanduser() if source is not None else None
    if path is None or not path.is_dir():
        return None
    digest = hashlib.sha256()
    # not hidden files and directories (.git, .cache/huggingface): they change without the model changing
    files = (
        f
        for f in path.rglob("*")
        if f.is_file() and not any(part.startswith(".") for part in f.relative_to(path).parts)
    )
    for file in sorted(files):
        size = file.stat().st_size
        digest.update(f"{file.relative_to(path).as_posix()}:{size}\n".encode())
        with file.open("rb") as f:
            digest.update(f.read(FINGERPRINT_BYTES))
            if size > 2 * FINGERPRINT_BYTES:
                f.seek(-FINGERPRINT_BYTES, 2)
                digest.update(f.read(FINGERPRINT_BYTES))
    return digest.hexdigest()[:16]


def masked_actions(allowed: torch.Tensor | None) -> list[int] | None:
    """The token ids an env's mask leaves out (pad, those outside ``allowed_tokens``), for the checkpoint."""
    return None if allowed is None else (~allowed).nonzero().squeeze(1).tolist()


def _check_source_unchanged(
    source: str | None, saved: str | None, reads: str = "the KL reference or the LoRA base weights"
) -> None:
    """Before a load reads ``source`` again. A directory that is gone fails in the loader, naming it."""
    if source is None or not Path(source).expanduser().is_dir():
        return
    if saved is not None and source_fingerprint(source) != saved:
        raise ConfigError(
            f"the policy directory {source!r} changed since this checkpoint was trained from it, and this load "
            f"reads {reads} from it: put the original files back, or train a new run from this checkpoint's "
            f"policy/ (its weights, with a new reference)."
        )


def _saves_itself(tokenizer: Any) -> bool:
    """A Hugging Face tokenizer, or textgym's character tokenizer (it writes its alphabet)."""
    from transformers import PreTrainedTokenizerBase

    from textgym.models import CharTokenizer

    return isinstance(tokenizer, (PreTrainedTokenizerBase, CharTokenizer))


def save_checkpoint(agent: LMAgent, path: Path) -> None:
    from textgym.atomic import atomic_build_dir

    full, agent._gathered = getattr(agent, "_gathered", None), None
    error = _refused_save_target(path)
    if agent.sharded and full is None:  # every process is in this save: all stop, none waits in the gather
        agent.dist.agree(error)
    elif error is not None:
        raise error
    if agent.sharded:
        if full is None:  # not gathered beforehand: every process is in this save
            full = gather_checkpoint(agent)
        if not agent.dist.is_main:
            return
    else:
        if not agent.dist.is_main:  # data parallel: every process holds the same weights; one writes them
            return
        full = {"policy": None, "reference": None, "optimizer": None, "modules": {}}
        try:
            agent.check_health(collective=False)  # saving runs on the main process only
        except TrainingError as exc:
            raise TrainingError(
                f"{exc} No checkpoint was written to {str(path)!r}; the last good one is kept."
            ) from None
    policy = agent.rollout_model
    if agent.policy_source is None and agent.config.lora is not None:
        raise ConfigError(
            "saving a LoRA policy needs the base model given by name or path, not as an object."
        )

    def build(out: Path) -> None:
        policy.save_pretrained(out / "policy", state_dict=full["policy"])
        tokenizer = getattr(agent.env, "tokenizer", None)
        if agent.config.lora is None and _saves_itself(tokenizer):  # policy/: a model directory of its own
            tokenizer.save_pretrained(out / "policy")  # (`textgym sample --model RUN/checkpoint/policy`)
        if agent.policy_source is None and agent.ref_policy is not None:
            agent.ref_policy.save_pretrained(out / "reference", state_dict=full["reference"])
        for name, module in agent.modules.items():
            weights = full["modules"].get(name) or agent.unwrap(module).state_dict()
            torch.save(weights, out / f"{name}.pt")
        torch.save(full["optimizer"] or agent.optimizer.state_dict(), out / "optimizer.pt")
        state = {
            "agent": agent.name,
            "config": asdict(agent.config),
            "policy_source": agent.policy_source,
            "source_fingerprint": agent.source_fingerprint,  # the directory as the agent was built from it
            "num_timesteps": agent.num_timesteps,
            "iteration": agent.iteration,
            "skipped_steps": agent.skipped_steps,
            "score_moments": asdict(agent.score_moments),
            "extra": agent.extra_state(),
            # where a sequential prompt order is: a resume goes on from there, not from the first prompt
            "prompt_cursor": getattr(agent.env, "prompt_cursor", None),
            "action_n": agent.action_n,  # predict() without an env samples only the env's tokens
            "masked_actions": masked_actions(agent.allowed),  # and only those it allows, as log-probs count
            "history": agent.history,
            "sharding": agent.sharding_engine,  # how the run was trained (a resume may differ: it is said)
        }
        (out / "state.json").write_text(json.dumps(state, indent=2))

    atomic_build_dir(path, build, replace=True)


def _refused_save_target(path: Path) -> ConfigError | None:
    """The error of a save to ``path``, if it must not write there. A save replaces a checkpoint, or fills an
    empty or new directory; anything else in ``path`` is the user's: a save refuses it rather than delete it."""
    from textgym.atomic import is_complete

    empty = path.is_dir() and not any(path.iterdir())
    if path.exists() and not empty and not (is_complete(path) and (path / "state.json").is_file()):
        return ConfigError(
            f"{str(path)!r} exists and is not a textgym checkpoint: save to a new or empty directory (a "
            f"checkpoint there is replaced, nothing else is)."
        )
    return None


def _sharded_over_processes() -> bool:
    """Whether an agent made now will shard, with FSDP2 or ZeRO-3 (asked for, and more than one process)."""
    import os

    asked = sharding.fsdp_requested() is not None or zero3.zero3_asked()
    return asked and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _load_trained_policy(agent: LMAgent, policy_dir: Path) -> None:
    """The checkpoint's policy weights into the shards of an agent built from the source policy: the main
    process reads them, every process gets its shards. A failed read stops every process."""
    from transformers import AutoModelForCausalLM

    if not agent.sharded:  # not sharded after all: every process reads them
        agent.rollout_model.load_state_dict(AutoModelForCausalLM.from_pretrained(policy_dir).state_dict())
        return
    trained = agent.dist.on_main(lambda: AutoModelForCausalLM.from_pretrained(policy_dir))
    weights = sharding.main_weights(trained, agent.dist)
    if agent.zero3 is not None:
        zero3.load_from_main(agent.rollout_model, weights[0], str(policy_dir))
    else:
        sharding.load_from_main(agent.rollout_model, weights, agent.device)


def checked_checkpoint(path: str | Path, agent_class: str) -> Path:
    """``path`` as a checkpoint directory (:func:`checkpoint_path`), refused unless a save completed it."""
    from textgym.atomic import is_complete

    path = checkpoint_path(path)
    if not path.exists():
        raise ConfigError(f"{str(path)!r} does not exist: give the directory {agent_class}.save wrote.")
    if not is_complete(path):
        raise ConfigError(
            f"{str(path)!r} is not a complete {agent_class} checkpoint (no state.json written by save)."
        )
    return path


def keep_configured_optimizer_settings(agent: LMAgent, learning_rate: bool = False) -> None:
    """A loaded optimizer state holds the settings it was saved with: the agent's config's instead (its weight
    decay; its learning rate where ``learning_rate`` is set or the schedule is constant: a linear schedule
    sets the rate at every iteration)."""
    for group in agent.optimizer.param_groups:
        group["weight_decay"] = agent.config.weight_decay
        if learning_rate or agent.config.lr_schedule == "constant":
            group["lr"] = agent.config.learning_rate


def load_checkpoint(cls: type[LMAgent], path: Path, env: Any, overrides: dict[str, Any]) -> LMAgent:
    from transformers import AutoModelForCausalLM

    path = checked_checkpoint(path, cls.__name__)
    try:
        state = json.loads((path / "state.json").read_text())
        saved_by = state.get("agent", "lmppo")
        if saved_by != cls.name:
            raise ConfigError(
                f"{str(path)!r} is a checkpoint of agent {saved_by!r}, not {cls.name!r}: load it with that agent."
            )
        config = {**state["config"], **overrides}
        # what a load changes: a resume passes every [agent] setting, most as they were saved
        saved = state["config"]
        changed = {k for k, v in overrides.items() if json.loads(json.dumps(v, default=str)) != saved.get(k)}
        # the saved weights are an adapter, or whole: other settings cannot read them (the same ones in another
        # spelling can: target_modules as a set, or in another order)
        if "lora" in changed and _lora_settings(overrides["lora"]) != _lora_settings(saved.get("lora")):
            raise ConfigError(
                f"{str(path)!r} was trained with lora = {saved.get('lora')!r}; it cannot be loaded with lora = "
                f"{overrides['lora']!r}. Load it with its own (leave lora out), or start a new run."
            )
        source, fingerprint = state["policy_source"], state.get("source_fingerprint")
        from_main = source is not None and config.get("lora") is None and _sharded_over_processes()
        if from_main:  # sharded: only the main process reads the models (sharding.load_on_main)
            # the reference is the source, sharded from the main process's copy
            _check_source_unchanged(source, fingerprint)
            agent = cls(source, env, **config)
            _load_trained_policy(agent, path / "policy")
        elif config.get("lora") is not None:
            from peft import PeftModel

            _check_source_unchanged(source, fingerprint)
            base = cls._load_policy(source)
            with lora.seeded_init(state["config"]["seed"]):  # the adapters remade as made (base._with_lora)
                policy = PeftModel.from_pretrained(base, path / "policy", is_trainable=True)
            lora.load_reference_adapter(policy, path / "policy")
            with lora.restoring():
                agent = cls(policy, env, **config)
        else:
            if env is not None:  # no weights come from the source, but a resumed run's env has its tokenizer
                _check_source_unchanged(source, fingerprint, "the tokenizer of the env")
            agent = cls(AutoModelForCausalLM.from_pretrained(path / "policy"), env, **config)
        agent.policy_source, agent.source_fingerprint = source, fingerprint
        if env is not None and source is not None and not from_main:  # from an object: set_env compared sizes
            check_tokenizer(agent.rollout_model.config, source, env)
        if agent.ref_policy is not None and not from_main:
            if not source and not (path / "reference").is_dir():  # GRPO/RLOO at beta = 0 keep none
                beta = getattr(agent.config, "beta", None)
                raise ConfigError(
                    f"{str(path)!r} holds no KL reference: its agent was made from a policy object and trained "
                    f"without one (beta = 0), so it cannot be loaded with beta = {beta!r}. Load it with beta = 0, "
                    f"or start a new run from the policy."
                )
            _check_source_unchanged(source, fingerprint)
            reference = (
                cls._load_policy(source)
                if source
                else AutoModelForCausalLM.from_pretrained(path / "reference")
            )
            reference = reference.requires_grad_(False).eval()
            if agent.zero3 is not None:  # into the agent's engine: a second one would never be freed
                where = source or str(path / "reference")
                zero3.load_from_main(agent.ref_policy, dict(reference.named_parameters()), where)
            elif agent.fsdp is not None:
                agent.ref_policy = sharding.shard(reference, agent.fsdp, agent.device)
            else:
                agent.ref_policy = reference.to(agent.device)
        for name, module in agent.modules.items():
            # (saved on a GPU: its tensors are read onto the CPU, and loading them moves them to the agent's)
            weights = torch.load(path / f"{name}.pt", weights_only=True, map_location="cpu")
            if agent.zero3 is not None:
                zero3.load_from_main(module, weights, str(path / f"{name}.pt"))
            elif agent.fsdp is not None:
                sharding.load_full_state_dict(module, weights)
            else:
                agent.unwrap(module).load_state_dict(weights)
        optimizer_state = torch.load(path / "optimizer.pt", weights_only=True, map_location="cpu")
        if agent.zero3 is not None:  # a full state dict: each process takes its shard
            zero3.load_full_optimizer_state(agent.optimizer, agent.params, optimizer_state)
        elif agent.fsdp is not None:
            sharding.load_full_optimizer_state(agent.optimizer, optimizer_state)
        else:
            agent.optimizer.load_state_dict(optimizer_state)
        # (an override's rate too; a constant schedule's, where a linear one had annealed it)
        keep_configured_optimizer_settings(agent, learning_rate="learning_rate" in changed)
        agent.num_timesteps, agent.iteration = state["num_timesteps"], state["iteration"]
        agent.skipped_steps = state.get("skipped_steps", 0)
        agent.score_moments = RunningMoments(**state["score_moments"])
        agent.history = state["history"]
        agent.trained_sharding = state.get("sharding", agent.sharding_engine)  # older checkpoints: unknown
        # what the agent keeps between iterations (LMPPO's adaptive KL coefficient), but not what load overrides
        agent.load_extra_state({k: v for k, v in state.get("extra", {}).items() if k not in changed})
        if env is None:
            agent.action_n = state.get("action_n")
            if state.get("masked_actions"):  # older checkpoints: none saved
                agent.allowed = torch.ones(agent.action_n, dtype=torch.bool, device=agent.device)
                agent.allowed[state["masked_actions"]] = False
        if state.get("prompt_cursor") is not None and hasattr(env, "prompt_cursor"):
            env.prompt_cursor = state["prompt_cursor"]
    except (ConfigError, TrainingError):
        raise
    except Exception as exc:  # whatever a damaged file makes the loaders raise
        raise ConfigError(
            f"checkpoint {str(path)!r} is corrupt or incomplete: {type(exc).__name__}: {exc}"
        ) from exc
    return agent


def _lora_settings(lora: Any) -> Any:
    """LoRA settings as peft reads them, to compare: ``target_modules`` in any order or as a set."""
    if not isinstance(lora, dict):
        return lora
    same = lora_as_saved(lora)
    if isinstance(same.get("target_modules"), (list, tuple)):
        same["target_modules"] = sorted(same["target_modules"])
    return json.loads(json.dumps(same, default=str))
