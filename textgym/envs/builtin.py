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

    # Multi-turn: the same env classes with a responder (docs/environments.md).
    # A chat with a scripted user who asks each prompt's follow-up questions.
    register(
        "textgym/MultiTurn-v0",
        TEXTGEN,
        vector_entry_point=TEXTGEN_VECTOR,
        prompts="followups",
        responder="user_simulator",
        max_turns=3,
        max_new_tokens=192,
    )
    # Tool use: arithmetic with a calculator the model calls as <calc>EXPRESSION</calc>; the final answer is
    # scored by `match` against the prompt's reference.
    register(
        "textgym/Calculator-v0",
        TEXTGEN,
        vector_entry_point=TEXTGEN_VECTOR,
        prompts="arithmetic",
        responder="calculator",
        rewards=[{"name": "match"}],
        stop=["</calc>"],
        max_turns=4,
        max_new_tokens=128,
        max_prompt_tokens=128,
    )
    # A game: guess the secret number with higher/lower feedback; solving in fewer turns pays more.
    register(
        "textgym/GuessNumber-v0",
        TEXTGEN,
        vector_entry_point=TEXTGEN_VECTOR,
        prompts="guess_number",
        responder="guess_number",
        rewards=[],
        max_turns=6,
        max_new_tokens=128,
        max_prompt_tokens=128,
    )
    # Small-vocabulary multi-turn task (chars): say back each letter (a-d) the env says, three turns. Turn
    # rewards only; SB3's PPO and a tiny char-level LM train on it quickly.
    register(
        "textgym/Echo-v0",
        TEXTGEN,
        vector_entry_point=TEXTGEN_VECTOR,
        model="chars",
        prompts="echo",
        responder={"name": "echo", "partial": True},
        rewards=[],
        max_turns=3,
        max_new_tokens=10,
        max_prompt_tokens=1,
        chat_template=False,
    )
