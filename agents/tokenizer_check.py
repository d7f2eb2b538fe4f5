"""The check an LM agent makes when it gets an env: the env must tokenize as the policy does."""

from __future__ import annotations

from typing import Any

import numpy as np

from textgym.envs import TextGenVectorEnv
from textgym.errors import ConfigError


def check_tokenizer(config: Any, policy_source: str | None, env: TextGenVectorEnv) -> None:
    """The env must tokenize with the policy's tokenizer (``config``: the policy's model config;
    ``policy_source``: its zoo name or directory, if given by name): same ids for the same text, same EOS."""
    vocab = getattr(config, "vocab_size", None)
    if vocab is None and hasattr(config, "get_text_config"):
        vocab = config.get_text_config().vocab_size
    mismatch = None
    if vocab is not None and env.single_action_space.n > vocab:
        mismatch = f"the env's vocabulary has {env.single_action_space.n} tokens, the policy's {vocab}"
    elif policy_source is not None:
        from textgym.models import load_tokenizer

        try:
            mine = load_tokenizer(policy_source)
        except Exception:  # a policy directory without a tokenizer: nothing to compare with
            mine = None
        if mine is not None and mine is not env.tokenizer:
            n = min(len(env.tokenizer), len(mine))  # a tokenizer may have gained a pad token
            probe = sorted(set(range(min(n, 64))) | set(np.linspace(0, n - 1, 64).astype(int).tolist()))
            same = mine.eos_token_id == env.eos_token_id
            same = same and all(mine.decode([i]) == env.tokenizer.decode([i]) for i in probe)
            if not same:
                mismatch = f"{policy_source!r} tokenizes differently from the env"
    if mismatch is None:
        eos = getattr(config, "eos_token_id", None)
        eos = eos if isinstance(eos, (list, tuple)) else [eos]
        if env.eos_token_id is not None and None not in eos and env.eos_token_id not in eos:
            mismatch = f"the env's EOS id is {env.eos_token_id}, the policy's {eos}"
    if mismatch is None:  # an end-of-turn id the policy generates that would not end the env's episodes
        from textgym.models import declared_eos_ids

        declared = {i for i in eos if isinstance(i, int)} | declared_eos_ids(policy_source)
        missing = sorted(
            i for i in declared - env.eos_token_ids - {env.pad_token_id} if i < len(env.tokenizer)
        )
        if missing:
            names = [env.tokenizer.convert_ids_to_tokens(i) for i in missing]
            mismatch = (
                f"the policy also ends replies on {names} (ids {missing}), which would not end an episode"
            )
    if mismatch:
        raise ConfigError(
            f"the env's tokenizer does not match the policy ({mismatch}): make the env with the policy's "
            f"tokenizer, e.g. model={policy_source or '<the policy name>'!r}."
        )
