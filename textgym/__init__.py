"""textgym: text generation as a Gymnasium environment, with rewards as pluggy plugins.

One token is one action, one completion (or one conversation, with a responder) is one episode, and
the reward is a weighted stack of reward plugins. Importing textgym loads the plugins and registers their
environments with Gymnasium.
"""

import sys as _sys

__version__ = "0.1.0"


def _is_cli() -> bool:
    """Whether this process is the textgym command: ``textgym ...`` (``sys.argv[0]`` is the script), or
    ``python [OPTIONS] -m textgym ...``, as torchrun starts it (with -u). The interpreter's own arguments end
    with ``-m textgym``, just before the program's (``sys.argv[1:]``): so also while textgym is imported, when
    ``sys.argv[0]`` is still ``-m``."""
    module = len(_sys.orig_argv) - len(_sys.argv)
    ran = module >= 1 and _sys.orig_argv[module - 1 : module + 1] == ["-m", "textgym"]
    return ran or _sys.argv[0].replace("\\", "/").endswith(("/textgym", "textgym.exe"))


try:
    from textgym.hookspecs import hookimpl  # noqa: I001  (this order: no import cycles)
    from textgym.responders import Conversation, Reply, Responder, make_responder, responder
    from textgym.rewards import (
        FunctionReward,
        Reward,
        RewardStack,
        Sample,
        Turn,
        build_reward_stack,
        make_reward,
        reward,
    )

    from textgym import errors, plugin_manager
    from textgym.envs import TextGenEnv, TextGenVectorEnv
    from textgym.models import load_model, load_tokenizer
    from textgym.prompts import Prompt, load_prompts

    try:
        plugin_manager.load_plugins()
    except errors.TextgymError as _exc:
        # a broken plugin: every lookup raises the error, which the CLI prints as one line. In Python it is
        # said now too: gymnasium.make("textgym/...") never asks textgym, and would say only that the
        # namespace is not found.
        if not _is_cli():
            import warnings as _warnings

            _warnings.warn(
                f"textgym's plugins did not load, so its envs, rewards and agents are not registered: {_exc}",
                RuntimeWarning,
                stacklevel=2,
            )
except KeyboardInterrupt:  # Ctrl-C while the command imports torch and transformers: one line, no traceback
    if not _is_cli():
        raise
    print("\ntextgym: aborted", file=_sys.stderr)
    raise SystemExit(130) from None

__all__ = [
    "Conversation",
    "FunctionReward",
    "Prompt",
    "Reply",
    "Responder",
    "Reward",
    "RewardStack",
    "Sample",
    "TextGenEnv",
    "TextGenVectorEnv",
    "Turn",
    "build_reward_stack",
    "hookimpl",
    "load_model",
    "load_prompts",
    "load_tokenizer",
    "make_responder",
    "make_reward",
    "responder",
    "reward",
]
