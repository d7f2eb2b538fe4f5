"""The forwards of an LM agent over prompt + response: the policy's log-probs (with gradients) and entropy,
whole-sequence log-probs under any model (no gradients, micro-batched), the reference's, and the KL to the
reference per completion. A mixin of :class:`~textgym.agents.base.LMAgent`, whose attributes it uses."""

from __future__ import annotations

import functools
from typing import Any

import torch

from textgym.agents import lora, sharding, zero3
from textgym.agents.ppo_core import entropy_from_logits, logprobs_from_logits
from textgym.agents.rollout_batch import RolloutBatch
from textgym.errors import ConfigError
from textgym.sampling import logits_to_keep, mask_logits


class Forwards:
    """``forward``, ``policy_logprobs``, ``sequence_logprobs``, ``reference_logprobs`` and ``sequence_kl``."""

    # set by LMAgent.__init__; autocast, rollout_model, uses_reference and _load_policy are LMAgent's too
    config: Any
    device: Any
    env: Any
    allowed: Any  # the tokens the env lets the agent choose (LMAgent.set_env), or None for all
    action_n: int | None  # the env's vocabulary size
    policy: Any
    ref_policy: Any
    policy_source: Any
    bf16: bool
    name: str
    dist: Any
    fsdp: Any
    zero3: Any

    def forward(
        self, model: Any, batch: RolloutBatch, hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over prompt + response: the logits that chose each response token (N, T, V), and
        the last hidden states they came from (N, T, H) if asked."""
        # Prompts are left-padded to max_prompt_tokens; columns that are padding in every row are dropped
        # (the batch lives on the host: reading its mask waits for no device work).
        start = int(batch.query_mask.any(0).long().argmax())
        query_ids, query_mask = batch.query_ids[:, start:], batch.query_mask[:, start:]
        ids = torch.cat([query_ids, batch.response_ids], dim=1).to(self.device)  # (N, P'+T)
        mask = torch.cat([query_mask, batch.response_mask], dim=1).to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        T = batch.response_ids.shape[1]
        # the LM head runs over the response positions only (the engine's forward is the policy's)
        keep = logits_to_keep(self.rollout_model if model is self.policy else model, T + 1)
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=hidden, **keep
        )
        P = query_ids.shape[1]
        last_hidden = out.hidden_states[-1][:, P - 1 : -1] if hidden else None
        logits = out.logits[:, -(T + 1) : -1]  # (N, T, V): positions P-1 .. P+T-2 chose the response tokens
        if self.action_n is not None:  # a model's vocabulary padded past its tokenizer's: the rollout samples
            logits = logits[..., : self.action_n]  # from the env's tokens (a loaded agent: the saved env's)
        # and from those the env allows (never pad): the log-probs and entropy of the same distribution
        return mask_logits(logits, self.allowed), last_hidden

    def policy_logprobs(
        self, batch: RolloutBatch, hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Log-probs (N, T) of the response tokens under the policy (with gradients), per-token entropy
        (N, T; without a graph) and, if asked, the hidden states."""
        with self.autocast():
            logits, last_hidden = self.forward(self.policy, batch, hidden=hidden)
        logprobs = logprobs_from_logits(logits, batch.response_ids.to(self.device), self.config.temperature)
        with torch.no_grad():
            entropy = entropy_from_logits(logits, self.config.temperature)
        return logprobs, entropy, last_hidden

    def sequence_logprobs(
        self, model: Any, batch: RolloutBatch, hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (N, T) of the response tokens under ``model`` at the sampling temperature (0 on
        environment tokens), and its last hidden states (N, T, H) if asked: whole-sequence forwards without
        gradients in the agent's precision, one micro-batch at a time."""
        chunks, states = [], []
        step = self.config.micro_batch_size or len(batch)
        for start in range(0, len(batch), step):
            mb = batch.select(torch.arange(start, min(start + step, len(batch))))
            with torch.no_grad():
                with self.autocast():
                    logits, last_hidden = self.forward(model, mb, hidden=hidden)
                tokens = mb.response_ids.to(self.device)
                chunks.append(logprobs_from_logits(logits, tokens, self.config.temperature).cpu())
            states.append(last_hidden)
        return torch.cat(chunks) * batch.action_mask, torch.cat(states) if hidden else None

    def reference_logprobs(self, batch: RolloutBatch) -> torch.Tensor:
        """Log-probs (N, T) of the response tokens under the reference, at the sampling temperature."""
        if self.ref_policy is None:  # LoRA: the same weights, as they started (agents/lora.py)
            with lora.reference_weights(self.rollout_model):
                return self.sequence_logprobs(self.rollout_model, batch)[0]
        return self.sequence_logprobs(self.ref_policy, batch)[0]

    def _initial_policy(self) -> Any:
        """The policy as loaded from its source, frozen, on the device; sharded as the policy is (read by the
        main process only), so that a policy too large for one device is not loaded whole on each."""
        if not self.sharded:
            return self._load_policy(self.policy_source).requires_grad_(False).to(self.device)
        load = functools.partial(self._load_policy, self.policy_source)
        model, skeleton = sharding.load_on_main(load, self.dist)
        model.requires_grad_(False)
        weights = sharding.main_weights(model, self.dist) if skeleton is not None else None
        if self.zero3 is not None:
            return zero3.reference(model, self.zero3, self.device, weights)
        return sharding.shard(model, self.fsdp, self.device, weights)

    def sequence_kl(self, batch: RolloutBatch) -> torch.Tensor:
        """KL(policy || reference) per completion (N,): the sum over its tokens of log pi - log pi_ref for the
        sampled tokens. Agents without a reference (e.g. GRPO with beta = 0) load the initial policy for this,
        once, outside training (evaluation only)."""
        if self.uses_reference or self.config.lora is not None:  # LoRA: the adapter-disabled model
            ref = self.reference_logprobs(batch)
        else:
            if getattr(self, "_kl_reference", None) is None:
                if self.policy_source is None:
                    raise ConfigError(f"this {self.name} has no reference model to measure a KL against.")
                self._kl_reference = self._initial_policy()
            ref = self.sequence_logprobs(self._kl_reference, batch)[0]
        # bf16: the policy's side from the same kind of forward as the reference's (agents/precision.py); and
        # without an env (a loaded agent, one scoring another's batch): the rollout's log-probs are over the
        # tokens its env allowed, which this agent may not know, and the reference's over those it knows
        same_forward = self.bf16 or self.env is None
        policy = self.sequence_logprobs(self.rollout_model, batch)[0] if same_forward else batch.logprobs
        return ((policy - ref) * batch.action_mask).sum(1)
