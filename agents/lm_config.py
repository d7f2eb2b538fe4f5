"""The hyperparameters every LM agent has, and how an agent's config is built from user input."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from dataclasses import dataclass
from typing import Any

from textgym.config import MAX_SEED, annotation_mismatch
from textgym.errors import ConfigError


@dataclass
class LMAgentConfig:
    """Hyperparameters every LM agent has. Subclasses add theirs (a dataclass per agent)."""

    learning_rate: float = 1e-5
    """AdamW learning rate."""
    lr_schedule: str = "constant"
    """"constant", or "linear" (anneal to 0 over the learn() call's total_timesteps)."""
    temperature: float = 1.0
    """Sampling temperature; it divides the logits wherever log-probs are computed."""
    max_grad_norm: float = 1.0
    """Gradient clipping."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay (torch's default; TRL's trainers use 0.0). It pulls the weights toward 0,
    not toward the reference policy."""
    micro_batch_size: int | None = None
    """Sequences per forward pass; gradients accumulate over the minibatch (None: the whole minibatch)."""
    missing_eos_penalty: float | None = None
    """Subtract this from the score of episodes that hit max_new_tokens without EOS."""
    score_scale: float = 1.0
    """Multiply the reward-stack total by this."""
    score_norm: bool = False
    """Normalise scores by their running mean and std."""
    score_clip: float | None = None
    """Clip (scaled, normalised) scores to [-score_clip, score_clip]."""
    max_abs_score: float = 1e6
    """An episode's return (the reward-stack total, plus a multi-turn episode's turn rewards) beyond ±this
    stops training with the plugin or responder that produced it named (a reward of 1e20 is finite but
    drives the losses to inf)."""
    lora: dict[str, Any] | None = None
    """peft LoraConfig arguments (e.g. {"r": 8}); the reference is then the adapter-disabled model."""
    device: str = "auto"
    """"auto" (the GPU when there is one), "cpu", "cuda", ..."""
    bf16: bool | None = None
    """bf16 autocast; None: on for GPUs, off on the CPU."""
    seed: int = 0
    """Seeds torch, numpy and the rollouts."""
    verbose: int = 1
    """0: silent; 1: log to stdout."""
    tensorboard_log: str | None = None
    """Folder for tensorboard (and CSV) logs."""

    def __post_init__(self) -> None:
        # Every field of a plain type is checked by its annotation, a plugin agent's too: a TOML `False` typed
        # as "False" (a string: --set takes what TOML cannot parse as text) is truthy, and "two" epochs
        # would fail only inside train(), after the model loaded
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is f.default:  # the agent's own default, whatever its annotation says: not user input
                continue
            if what := annotation_mismatch(f.type, value):
                raise ConfigError(f"{f.name} must be {what}, not {value!r}.")
        if not isinstance(self.temperature, (int, float)) or not 0 < self.temperature < math.inf:
            # log-probs divide by it; greedy rollouts have no importance ratio
            raise ConfigError(
                f"temperature must be a finite number > 0 for training, not {self.temperature!r}."
            )
        if not isinstance(self.learning_rate, (int, float)) or not 0 < self.learning_rate < math.inf:
            raise ConfigError(f"learning_rate must be a positive number, not {self.learning_rate!r}.")
        if self.lr_schedule not in ("constant", "linear"):
            raise ConfigError(f"lr_schedule must be 'constant' or 'linear', not {self.lr_schedule!r}.")
        if self.micro_batch_size is not None:
            check_positive_int("micro_batch_size", self.micro_batch_size)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < MAX_SEED:
            raise ConfigError(f"seed must be an integer in [0, 2**32), not {self.seed!r}.")
        check_number("max_abs_score", self.max_abs_score, above=0, inf_ok=True)  # inf: no limit
        # a negative max_grad_norm flips the gradients' sign (torch scales them by max_norm / norm), a
        # negative score_clip clamps every score to -score_clip: both were accepted, and trained backwards
        check_number("max_grad_norm", self.max_grad_norm, above=0)
        check_number("weight_decay", self.weight_decay, at_least=0)
        check_number("score_scale", self.score_scale, above=0)
        check_number("score_clip", self.score_clip, above=0, none_ok=True)
        check_number("missing_eos_penalty", self.missing_eos_penalty, none_ok=True)
        if self.lora is not None and not isinstance(self.lora, dict):
            raise ConfigError(
                f"lora must be a table of peft LoraConfig arguments (e.g. {{r = 8}}), not {self.lora!r}."
            )
        if self.lora is not None:  # sets as lists: peft takes both, and a checkpoint's state.json records it
            self.lora = lora_as_saved(self.lora)
            for key, value in self.lora.items():
                try:
                    json.dumps(value)
                except (TypeError, ValueError):
                    raise ConfigError(
                        f"lora.{key} = {value!r} cannot be saved with a checkpoint: give a list, string or number."
                    ) from None
        if self.lora is not None:
            check_lora(self.lora)
        if self.device not in DEVICES:
            raise ConfigError(f"device must be one of {', '.join(map(repr, DEVICES))}, not {self.device!r}.")


DEVICES = ("auto", "cpu", "cuda")


def check_number(
    name: str, value: Any, *, above: float | None = None, at_least: float | None = None,
    at_most: float | None = None, none_ok: bool = False, inf_ok: bool = False,
) -> None:  # fmt: skip
    """A finite number in the given range (``None`` too, where ``none_ok``; +-inf too, where ``inf_ok``),
    else a ConfigError naming it. NaN is never accepted."""
    if value is None and none_ok:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    number = number and (inf_ok or math.isfinite(value))
    if (
        number
        and (above is None or value > above)
        and (at_least is None or value >= at_least)
        and (at_most is None or value <= at_most)
    ):
        return
    bounds = [f"> {above}" if above is not None else "", f">= {at_least}" if at_least is not None else "",
              f"<= {at_most}" if at_most is not None else ""]  # fmt: skip
    what = " and ".join(b for b in bounds if b) or "finite"
    raise ConfigError(f"{name} must be a number {what}{' (or none)' if none_ok else ''}, not {value!r}.")


def lora_as_saved(lora: dict[str, Any]) -> dict[str, Any]:
    """LoRA settings with sets as sorted lists: peft takes both, and a checkpoint's state.json records them."""
    return {k: sorted(v) if isinstance(v, (set, frozenset)) else v for k, v in lora.items()}


def check_lora(lora: dict[str, Any]) -> None:
    """The LoRA settings whose KL reference (the policy as it started) textgym can keep, else a ConfigError.

    ``bias = "all"`` or ``"lora_only"`` trains the base model's own biases, which the reference shares:
    the reference would move with the policy and the KL would be understated. ``lora_alpha = 0`` scales
    every adapter to nothing, so training changes nothing. CorDA and LoftQ need a preparation (peft's
    ``preprocess_corda``; a ``loftq_config`` and bitsandbytes) that a config cannot give."""
    if "r" in lora:
        check_positive_int("lora.r", lora["r"])
    if "lora_alpha" in lora:
        check_number("lora.lora_alpha", lora["lora_alpha"], above=0)
    if lora.get("bias", "none") != "none":
        raise ConfigError(
            f"lora.bias = {lora['bias']!r} trains the base model's biases, which the KL reference (the policy "
            f"with its adapter off) shares, so the reference would move with the policy: leave bias = 'none', "
            f"or give the adapter its own bias with lora_bias = true."
        )
    if lora.get("inference_mode"):
        raise ConfigError(
            "lora.inference_mode = true freezes the adapter, so training would change nothing: leave it out."
        )
    init = lora.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower() in ("corda", "loftq"):
        raise ConfigError(
            f"lora.init_lora_weights = {init!r} needs a preparation a config cannot give (CorDA: peft's "
            f"preprocess_corda on the model; LoftQ: a loftq_config and bitsandbytes); use 'pissa' or 'olora' "
            f"for an adapter that starts from the weights' principal part, or leave it unset."
        )


def check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, not {value!r}.")


def make_config(config_class: type, agent_name: str, hyperparameters: dict[str, Any]) -> Any:
    """``config_class(**hyperparameters)``, with an unknown name reported with the closest valid ones."""
    valid = [f.name for f in dataclasses.fields(config_class)]
    for name in hyperparameters:
        if name not in valid:
            close = difflib.get_close_matches(name, valid, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"{agent_name} has no hyperparameter {name!r}.{hint} Valid: {', '.join(sorted(valid))}."
            )
    return config_class(**hyperparameters)
