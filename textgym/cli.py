"""The ``textgym`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, NoReturn

from textgym.cli_parser import DEMO_REWARDS, build_parser
from textgym.config import MAX_SEED
from textgym.errors import TextgymError


def command() -> NoReturn:
    """The textgym command (its console script, and ``python -m textgym``): exits with :func:`main`'s status.
    One of several processes (torchrun, ``accelerate launch``, ``run.processes = N``) skips the interpreter's
    teardown (see :func:`textgym.launch.exit_process`)."""
    from textgym.launch import exit_process, world_size

    if world_size() <= 1:
        raise SystemExit(main())
    try:
        code = main()
    except SystemExit as exc:  # what Python's exit does with it
        if isinstance(exc.code, int) or exc.code is None:
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # a bug, or a collective broken by another process: its traceback, and code 1
        import traceback

        traceback.print_exc()
        code = 1
    exit_process(code)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.plugin = [*args.plugin, *args.plugin_after_command]
    from textgym.stopping import dropped_interrupts_raised_again, terminate_as_interrupt

    with dropped_interrupts_raised_again(), terminate_as_interrupt():
        return _command(args)


def _command(args: argparse.Namespace) -> int:
    try:
        code = _run_command(args)
        sys.stdout.flush()  # a reader that left fails here, in the handler below, not at the interpreter's exit
        return code
    except TextgymError as exc:
        import os

        from textgym.errors import AnotherProcessFailed, WriteError
        from textgym.launch import FOLLOWED_EXIT, LAUNCHED_VAR, WRITE_FAILED_EXIT

        if os.environ.get("TEXTGYM_TRACEBACK"):  # the whole chain: a failing plugin's frames, and textgym's
            import traceback

            traceback.print_exception(exc)
        print(f"textgym: error: {exc}", file=sys.stderr)
        _print_notes(exc)
        # under run.processes = N, the launcher blames the process that failed for itself, and tells a full
        # disk (which stops a bench) from a run's own failure
        if os.environ.get(LAUNCHED_VAR) and isinstance(exc, (AnotherProcessFailed, WriteError)):
            return FOLLOWED_EXIT if isinstance(exc, AnotherProcessFailed) else WRITE_FAILED_EXIT
        return 2
    except BrokenPipeError:  # `textgym plugins --json | head`: the reader is gone; no traceback for that
        import os

        # no second error when the interpreter flushes stdout at exit (Python's own recipe, and its code 1)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        if args.command != "plugins":  # a command cut short says so (a listing is simply done)
            print(
                f"textgym: stopped: {args.command}'s output was closed (a pipe's reader exited)",
                file=sys.stderr,
            )
        return 1
    except KeyboardInterrupt as exc:  # a second Ctrl-C, or one before training started
        from textgym.launch import speaks_for_the_run

        if speaks_for_the_run():  # said once
            kept = {
                "train": " (the last checkpoint, if any, is kept)",
                "bench": " (each run's last checkpoint, if any, is kept)",
            }
            print(f"\ntextgym: aborted{kept.get(args.command, '')}", file=sys.stderr)
            _print_notes(exc)
        return 130


def _print_notes(exc: BaseException) -> None:
    """What textgym added to an error on its way up (``add_note``): where a failed run left its directory."""
    for note in getattr(exc, "__notes__", ()):
        print(f"textgym: {note}", file=sys.stderr)


def _run_command(args: argparse.Namespace) -> int:
    _quiet_libraries()
    from textgym import plugin_manager

    for path in args.plugin:
        plugin_manager.load_plugin_file(path)
    if args.command == "plugins":
        return _plugins(args)
    if args.command == "train":
        return _train(args)
    if args.command == "train-rm":
        return _train_rm(args)
    if args.command == "label-pairs":
        return _label_pairs(args)
    if args.command == "bench":
        from textgym.bench import RunsFailed, Stopped
        from textgym.bench import run as bench

        try:
            out = bench(args.designs, args.set, plugins=args.plugin)
        except Stopped as exc:
            print(f"\ntextgym: {exc}", file=sys.stderr)
            return 130
        except RunsFailed as exc:  # 1, not 2: the bench ran, and its report names the runs that failed
            print(f"textgym: error: {exc}", file=sys.stderr)
            return 1
        print(f"textgym: report in {out / 'report.md'}")
        return 0
    return _sample(args)


def _quiet_libraries() -> None:
    """textgym draws its own progress bars; transformers' per-file bars (loading and saving shards at every
    checkpoint) would drown them."""
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # DeepSpeed, which accelerate imports wherever it is installed (saving any model), says on stdout, in the
    # middle of textgym's output, that a machine without GPUs runs on the CPU
    logging.getLogger("DeepSpeed").addFilter(
        lambda record: "Setting accelerator to CPU" not in record.getMessage()
    )
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def _train(args: argparse.Namespace) -> int:
    from textgym.config import load_config
    from textgym.errors import ConfigError
    from textgym.launch import speaks_for_the_run, under_launcher
    from textgym.rundir import RunDir
    from textgym.train import run

    if (args.config is None) == (args.resume is None):
        raise ConfigError(
            "give a config file to start a run, or --resume RUN_DIR to continue one (not both)."
        )
    try:
        path = run(args.config, args.set, resume=args.resume, agent_name=args.agent, plugins=args.plugin)
    except BaseException as exc:
        kept = getattr(exc, "kept_run_dir", None)
        # a run that failed after training: its directory named (runs/<config>-<time> is new), once, by the
        # process that speaks for the run (a bench says its own route: run the bench again)
        if kept is not None and speaks_for_the_run():
            exc.add_note(
                f"the run directory {kept} is kept, with its last checkpoint if any: textgym train --resume "
                f"{shlex.quote(str(kept))} continues it"
            )
        if isinstance(exc, ConfigError) and args.set and "--set" not in str(exc):  # a later check's refusal
            exc.add_note(f"the values given with --set: {' '.join(shlex.quote(o) for o in args.set)}")
        raise
    # torchrun's and accelerate's processes exit 0: a launcher reports a nonzero exit as a failure
    if under_launcher():
        return 0
    # stopped by a signal, the checkpoint saved: 130, as a Ctrl-C'd command exits, so a script does not go on
    total = load_config(path / "config.toml")["run"]["total_timesteps"]
    return 0 if RunDir(path).finished(total) else 130


def _train_rm(args: argparse.Namespace) -> int:
    from textgym.reward_model import train_reward_model

    report = train_reward_model(
        args.pairs, args.output, model=args.model, lora=args.lora, epochs=args.epochs,
        learning_rate=args.learning_rate, head_learning_rate=args.head_learning_rate,
        batch_size=args.batch_size, eval_fraction=args.eval_fraction, seed=args.seed, max_length=args.max_length,
    )  # fmt: skip
    print(report.summary())
    return 0


def _label_pairs(args: argparse.Namespace) -> int:
    from textgym.pairs import label_pairs

    try:
        stats = label_pairs(
            args.prompts, args.policy, args.rewards, args.output, num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens,
            temperature=args.temperature, top_k=args.top_k, label_noise=args.label_noise, seed=args.seed,
            batch_size=args.batch_size, chat_template=args.chat_template,
        )  # fmt: skip
    except (KeyboardInterrupt, Exception) as exc:
        kept = getattr(exc, "pairs_written", None)  # None: stopped before it opened (and emptied) the file
        if isinstance(exc, KeyboardInterrupt):
            said = f"the {kept} pairs written so far are in" if kept is not None else "nothing was written to"
            print(f"textgym: interrupted; {said} {args.output}", file=sys.stderr)
            return 130
        if kept is not None:  # its error follows: the file is not what a finished run writes
            print(
                f"textgym: label-pairs stopped; the {kept} pairs written before its error are in {args.output}, "
                f"an incomplete file",
                file=sys.stderr,
            )
        raise
    print(stats.summary())
    return 0


def _plugins(args: argparse.Namespace) -> int:
    from textgym import plugin_info, plugin_manager

    if args.name is not None:
        described = plugin_info.describe(args.name)
        if args.json:
            print(json.dumps(described, indent=2, default=repr))
            return 0
        for row in described:
            print(f"{row['kind']} {row['name']}  (plugin {row['plugin']}: {row['source']})")
            if row["signature"] is not None:
                print(f"    arguments: {row['signature']}")
            if row["kind"] == "reward":  # what a spec takes besides the arguments
                from textgym.rewards import takes_its_own_timeout

                own = takes_its_own_timeout({"name": row["name"]}, None, "")
                timeout = "the argument above" if own else "seconds each call may take; default none"
                print(f"    spec keys: weight (default 1.0), timeout ({timeout})")
            if row["defaults"] and row["kind"] == "agent":  # an LM agent's config fields, one a line
                print("    hyperparameters (defaults):")
                for key, value in row["defaults"].items():
                    print(f"        {key} = {value!r}")
            elif row["defaults"]:
                print(f"    registered with: {', '.join(f'{k}={v!r}' for k, v in row['defaults'].items())}")
            print(textwrap.indent(row["doc"] or "(no documentation)", "    "))
        return 0
    report = plugin_info.plugins_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    # A file's @textgym.reward and @textgym.responder functions are plugins of their own, with the source
    # "DECORATOR in FILE"; the file's own row (named FILE) says what they registered.
    # An installed package's say it on its entry point's row (named by the entry point).
    decorated: dict[str, dict[str, list[str]]] = {}  # file or entry point -> decorator -> names
    for row in report:
        decorator, within, file = row["source"].partition(" in ")
        if decorator.startswith("@") and within:
            owner = plugin_manager.entry_point_of(row["name"]) or file
            names = decorated.setdefault(owner, {}).setdefault(decorator, [])
            names.extend(name for kind_names in row["registers"].values() for name in kind_names)
    for row in report:
        print(f"{row['name']}  ({row['source']})")
        for kind, names in row["registers"].items():
            print(f"    {kind}s: {', '.join(names)}")
        if not row["registers"]:
            found = "; ".join(
                f"{d}: {', '.join(names)}" for d, names in decorated.get(row["name"], {}).items()
            )
            print(f"    ({found or 'registers nothing'})")
    for name, source in plugin_manager.skipped.items():
        print(f"{name}  ({source})\n    (skipped: {plugin_manager.BLOCK_VAR})")
    return 0


def _sample(args: argparse.Namespace) -> int:
    import contextlib

    from textgym.envs import TextGenVectorEnv
    from textgym.errors import ConfigError

    if args.num < 1 or args.batch_size < 1:
        raise ConfigError(f"--num and --batch-size must be positive, not {args.num} and {args.batch_size}.")
    if not args.temperature >= 0:
        raise ConfigError(f"--temperature must be >= 0 (0 = greedy), not {args.temperature}.")
    if not 0 <= args.seed < MAX_SEED:
        raise ConfigError(f"--seed must be in [0, 2**32), not {args.seed}.")
    if args.top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0 = off), not {args.top_k}.")
    batch = min(args.batch_size, args.num)
    env = TextGenVectorEnv(
        num_envs=batch,
        model=args.model,
        prompts=args.prompts,
        rewards=args.reward or DEMO_REWARDS,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        chat_template=args.chat_template,
        stop=args.stop,
        prompt_order="sequential",
        autoreset_mode="Disabled",
        responder=args.responder,
        max_turns=args.max_turns,
    )
    with contextlib.closing(env):  # its responder's close(), whatever fails below
        return _sample_on(env, args, batch)


def _sample_on(env: Any, args: argparse.Namespace, batch: int) -> int:
    from textgym.errors import ConfigError
    from textgym.models import load_model
    from textgym.sampling import sample_episodes

    if args.top_k > env.single_action_space.n:
        raise ConfigError(
            f"--top-k {args.top_k} is larger than the vocabulary ({env.single_action_space.n} tokens)."
        )
    model, _ = load_model(args.model)
    if model is None:
        raise ConfigError(
            f"--model {args.model!r} is a tokenizer without weights; sample with a model, e.g. a zoo LM."
        )
    rows: list[dict[str, Any]] = []
    from tqdm.auto import tqdm

    # Rows are written as each batch finishes, so an interrupted run keeps what it sampled.
    output = None
    if args.output:
        try:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            output = args.output.open("w", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(
                f"--output {str(args.output)!r} cannot be written ({exc.strerror or exc}): give a file path."
            ) from None
    try:
        with tqdm(total=args.num, desc="sampling", unit="episode", disable=None) as bar:
            for round_ in range(math.ceil(args.num / batch)):
                seed = args.seed + round_
                episodes = sample_episodes(
                    model, env, temperature=args.temperature, top_k=args.top_k, seed=seed
                )
                episodes = episodes[: args.num - len(rows)]
                rows.extend(episodes)
                if output:
                    output.writelines(json.dumps(row) + "\n" for row in episodes)
                    output.flush()
                bar.update(len(episodes))
    finally:
        if output:
            output.close()
    from textgym.envs.conversation import format_transcript
    from textgym.formatting import format_table

    for row in rows:  # multi-turn episodes: the whole conversation, turn by turn, before the table
        if "turns" in row:
            print(format_transcript(row) + "\n")
    print(format_table(rows))
    if args.output:
        print(f"wrote {len(rows)} rows to {args.output}")
    return 0


if __name__ == "__main__":
    command()
