"""The environments textgym ships, registered through the same hook as any plugin's."""

from __future__ import annotations

from collections.abc import Callable

from textgym.hookspecs import hookimpl

TEXTGEN = "textgym.envs:TextGenEnv"
TEXTGEN_VECTOR = "textgym.envs:TextGenVectorEnv"


@hookimpl
def register_envs(register: Callable[..., None]) -> None:
    # Prompted completion with the embedded model's tokenizer, plain or chat template.
    register("textgym/TextGen-v0", TEXTGEN, vector_entry_point=TEXTGEN_VECTOR)
    # Small-vocabulary task (31 characters + pad + EOS): copy a 3-letter prompt, then stop. The reward is
    # the string similarity to the prompt, so a plain MLP policy can learn it in a minute or two.
    register(
        "textgym/Copy-v0",
        TEXTGEN,
        vector_entry_point=TEXTGEN_VECTOR,
        model="chars",
        prompts="copy",
        rewards=[{"name": "match", "partial": True}],
        max_new_tokens=4,
        max_prompt_tokens=3,
        chat_template=False,
    )
