"""The ``textgym`` command line's arguments: every command, its options and their help."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

from textgym import __version__

CHAT_TEMPLATE = "wrap each prompt as a user message (default: when the tokenizer has a chat template)"
DEMO_REWARDS = [
    "sentiment weight=1.0",
    "fluency weight=0.2",
    "safety weight=1.0",
    "length_penalty weight=0.5 target=24",
]


def build_parser() -> argparse.ArgumentParser:
    """The parser of every ``textgym`` command (:func:`textgym.cli.main` runs what it parses)."""
    # --plugin before the command or after it: two destinations, because a subcommand's default would
    # overwrite what the main parser read before it (argparse gives a subparser's defaults the last word)
    parser = argparse.ArgumentParser(
        prog="textgym",
        description="Text generation as a Gymnasium environment: train agents, benchmark reward designs, sample "
        "and score completions, train reward models.",
    )
    parser.add_argument("--version", action="version", version=f"textgym {__version__}")
    plugin_args = argparse.ArgumentParser(add_help=False)
    for options, dest in ((parser, "plugin"), (plugin_args, "plugin_after_command")):
        options.add_argument(
            "--plugin",
            action="append",
            default=[],
            dest=dest,
            metavar="FILE.py",
            help="load a plugin file (repeatable)",
        )
    commands = parser.add_subparsers(dest="command", required=True)
    add_parser = functools.partial(commands.add_parser, formatter_class=_DefaultsHelp)

    p = add_parser("plugins", parents=[plugin_args], help="list plugins and what each registered")
    p.add_argument(
        "name",
        nargs="?",
        help="a registered name (a reward, env, agent, ...): its arguments and documentation",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")

    p = add_parser(
        "sample", parents=[plugin_args], help="sample completions through the vector env and score them"
    )
    p.add_argument("--model", default="smollm2-135m-instruct", help="zoo name or model directory")
    p.add_argument("--prompts", default="chat", help="prompt-source name or prompt file")
    p.add_argument(
        "--num",
        type=int,
        default=8,
        help="number of prompts (taken in order, from the first again past the last)",
    )
    p.add_argument("--batch-size", type=int, default=8, help="episodes generated together")
    p.add_argument("--max-new-tokens", type=int, default=32, help="the most tokens a completion has")
    p.add_argument("--max-prompt-tokens", type=int, default=96, help="longer prompts are cut to their end")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0: all)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="the sampling seed (batch i uses seed + i, so the completions also depend on --batch-size, and on "
        "--num where it is smaller)",
    )
    p.add_argument(
        "--reward",
        action="append",
        metavar="'NAME [weight=W] [key=value ...]'",
        help=f"a reward spec (repeatable); default: {'; '.join(DEMO_REWARDS)}",
    )
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None, help=CHAT_TEMPLATE)
    p.add_argument("--stop", action="append", help="a stop string that ends the model's turn (repeatable)")
    p.add_argument("--responder", metavar="'NAME [key=value ...]'", help="multi-turn: the environment's side")
    p.add_argument("--max-turns", type=int, help="multi-turn: the most turns of the model per episode")
    p.add_argument("--output", type=Path, help="also write the rows as JSONL here")

    p = add_parser(
        "train",
        parents=[plugin_args],
        help="train an agent as a TOML config says",
        epilog="exit codes: 0 the run trained to its end; 130 stopped by Ctrl-C or SIGTERM (the checkpoint "
        "saved; --resume continues), or aborted by a second one; 2 an error textgym names (a config value, a "
        "plugin that raised); 1 one it did not foresee, or a closed output pipe",
    )
    p.add_argument(
        "config",
        nargs="?",
        type=Path,
        help="the run's TOML config (see docs/training.md and examples/*.toml)",
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override a config value; the value is TOML (agent.lora={r=8}, env.prompts=['Hi']); repeatable",
    )  # fmt: skip
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.add_argument(
        "--agent",
        help="overrides agent.name: a registered agent (lmppo, grpo, rloo, `textgym plugins` lists them) or a "
        "Stable-Baselines3 / sb3-contrib algorithm for discrete actions by name (a2c, dqn, recurrentppo, ...)",
    )

    p = add_parser(
        "bench",
        parents=[plugin_args],
        help="benchmark reward designs side by side",
        epilog="exit codes: 0 every run finished; 1 some runs failed (the report names them; a rerun resumes "
        "them); 130 stopped by Ctrl-C or SIGTERM; 2 an error that stopped the bench",
    )
    p.add_argument("designs", type=Path, help="the designs file (TOML; see docs/bench.md)")
    p.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override a value of the designs file; the value is TOML; repeatable",
    )  # fmt: skip

    p = add_parser(
        "train-rm", parents=[plugin_args], help="train a reward model on preference pairs (for rm_score)"
    )
    p.add_argument(
        "pairs", type=Path, help="JSONL rows with prompt, chosen and rejected (see docs/reward-models.md)"
    )
    p.add_argument("--output", type=Path, required=True, metavar="DIR", help="the model directory to write")
    p.add_argument(
        "--model", default="smollm2-135m-instruct", help="the LM to start from: zoo name or directory"
    )
    p.add_argument(
        "--lora", metavar="'{r = 8}'", help="train a LoRA adapter (peft LoraConfig arguments as TOML)"
    )
    p.add_argument("--epochs", type=int, default=1, help="passes over the training pairs")
    p.add_argument("--learning-rate", type=float, help="the LM's: default 1e-5, or 1e-4 with --lora")
    p.add_argument("--head-learning-rate", type=float, help="the new score head's: default 1e-3")
    p.add_argument("--batch-size", type=int, default=8, help="pairs per step")
    p.add_argument("--eval-fraction", type=float, default=0.1, help="share of pairs held out")
    p.add_argument(
        "--seed", type=int, default=0, help="the split, the order of the pairs and the head's init"
    )
    p.add_argument(
        "--max-length",
        type=int,
        default=512,
        help="tokens per text, cut from the left (default 512; rm_score scores with the same)",
    )

    p = add_parser(
        "label-pairs",
        parents=[plugin_args],
        help="make preference pairs: two samples per prompt, ranked by a gold stack",
    )
    p.add_argument("--prompts", required=True, help="prompt-source name or prompt file")
    p.add_argument(
        "--policy", default="smollm2-135m-instruct", help="the model that samples: zoo name or directory"
    )
    p.add_argument(
        "--rewards", nargs="+", required=True, metavar="SPEC",
        help="the gold stack: reward specs as `sample --reward` takes them, or .toml files with a `rewards` list",
    )  # fmt: skip
    p.add_argument(
        "--output", type=Path, required=True, metavar="PAIRS.jsonl", help="the pairs file to write"
    )
    p.add_argument("--num-prompts", type=int, help="prompts to sample (default: all; more cycles the source)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="the most tokens a completion has")
    p.add_argument("--max-prompt-tokens", type=int, default=96, help="longer prompts are cut to their end")
    p.add_argument("--temperature", type=float, default=1.0, help="the policy's own distribution at 1")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0: all)")
    p.add_argument("--label-noise", type=float, default=0.0, help="share of labels flipped, in [0, 0.5)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed and the label noise's")
    p.add_argument("--batch-size", type=int, default=8, help="prompts sampled together (two episodes each)")
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None, help=CHAT_TEMPLATE)
    return parser


class _DefaultsHelp(argparse.HelpFormatter):
    """Each option's help ends with its default, where it has one that its help does not already give."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        none = (
            default is None or default is False or default == [] or default is argparse.SUPPRESS
        )  # 0 is one
        if not action.option_strings or none or "default" in text:
            return text
        return f"{text} (default: %(default)s)"
