"""What a resume of a run may change, checked before it starts: a resume continues the run as it was trained
(its optimizer, KL controller, seeds and env come from the checkpoint and ``config.toml``)."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

from textgym.errors import ConfigError
from textgym.launch import rank, speaks_for_the_run
from textgym.models import merge_lora
from textgym.rundir import RunDir

__all__ = [
    "CODE_FILE",
    "MACHINE_SETTINGS",
    "RESUME_SETTINGS",
    "check_checkpoint_config",
    "check_config_edits",
    "check_plugin_packages",
    "check_resume_changes",
    "check_reward_files",
    "check_sb3_checkpoint_config",
    "record_code",
]  # fmt: skip

# the code the run last started or resumed with: plugin and fn files, plugin packages, textgym's own
CODE_FILE = "code.json"


# hyperparameters that say where and how loudly a run trains, not what it learns: a resume may differ in them
MACHINE_SETTINGS = ("device", "verbose", "tensorboard_log")


def check_checkpoint_config(rd: RunDir, hyperparameters: dict[str, Any], agent_class: Any = None) -> None:
    """The checkpoint was trained with the agent and the hyperparameters the run's config.toml gives now. A
    resume loads the optimizer (its learning rate) and the counters from the checkpoint and the rest from
    config.toml: a value edited there would half apply (a new n_epochs, the old learning rate), and state.json
    would record one that was never used."""
    from textgym.evaluation import jsonable

    state_file = rd.checkpoint / "state.json"
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
        trained = state["config"]
    except (OSError, ValueError, KeyError):
        return  # an incomplete checkpoint: loading it says what is wrong
    trained_by = state.get("agent")
    if (
        agent_class is not None
        and trained_by is not None
        and trained_by != getattr(agent_class, "name", None)
    ):
        raise ConfigError(
            f"{rd.path / 'config.toml'} now names the agent {getattr(agent_class, 'name', agent_class)!r}, but "
            f"{rd.checkpoint} was trained by {trained_by!r}: a resume continues the run with its own agent. Put "
            f"agent.name = '{trained_by}' back, or start a new run for the other agent."
        )
    changed = [
        f"{'run' if key == 'seed' else 'agent'}.{key}: {trained[key]!r} -> {value!r}"  # the seed is run.seed
        for key, value in hyperparameters.items()
        if key in trained and key not in MACHINE_SETTINGS and jsonable(value) != jsonable(trained[key])
    ]
    # a LoRA checkpoint's policy/ holds the adapter alone, which is not a model to start from
    start = (
        f"merge its adapter into its base model, to start from its weights: {merge_lora(str(rd.checkpoint))}"
        if trained.get("lora") is not None
        else f"agent.policy = '{rd.checkpoint / 'policy'}' starts from its weights"
    )
    _refuse_changes(rd, changed, start)


def check_sb3_checkpoint_config(rd: RunDir, fresh: Any, hyperparameters: dict[str, Any]) -> None:
    """:func:`check_checkpoint_config` for a Stable-Baselines3 checkpoint: the values SB3 saved (as JSON, in
    its zip's ``data``) against the same attributes of ``fresh``, the agent built from config.toml now (both
    sides as SB3 stores them), for every hyperparameter the agent takes: one config.toml no longer gives falls
    back to its default, which is a change too."""
    import zipfile

    from textgym.evaluation import jsonable
    from textgym.sb3 import SB3_MODEL

    try:
        with zipfile.ZipFile(rd.checkpoint / SB3_MODEL) as archive:
            data = json.loads(archive.read("data"))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return  # loading it says what is wrong
    from textgym.agent_config import hyperparameter_names

    changed = []
    for key in dict.fromkeys([*hyperparameters, *(hyperparameter_names(type(fresh)) or [])]):
        if key not in data or key in MACHINE_SETTINGS or not hasattr(fresh, key):
            continue
        saved = data[key]
        if isinstance(saved, dict) and ":serialized:" in saved:
            continue  # pickled values (schedules, classes) are not compared
        now = jsonable(getattr(fresh, key))
        if now != jsonable(saved):
            changed.append(f"{'run' if key == 'seed' else 'agent'}.{key}: {saved!r} -> {now!r}")
    _refuse_changes(rd, changed)


def _refuse_changes(rd: RunDir, changed: list[str], start: str | None = None) -> None:
    if changed:
        raise ConfigError(
            f"{rd.path / 'config.toml'} no longer says what {rd.checkpoint} was trained with ({'; '.join(changed)}): "
            f"a resume continues the run as it was trained. Put those values back, or start a new run to change "
            f"them{f' ({start})' if start else ''}."
        )


# what a resume may change: how long the run goes on and what it writes; not what it trains, or how
RESUME_SETTINGS = ("run.total_timesteps", "run.checkpoint_every", "run.sample_prompts", "run.plugins",
                   "run.report_to")  # fmt: skip


def check_resume_changes(
    run_dir: Path, saved: dict[str, Any], config: dict[str, Any], agent_name: str | None
) -> None:
    if (
        agent_name
        and agent_name != saved["agent"]["name"]
        and not _same_agent(agent_name, saved["agent"]["name"])
    ):
        raise ConfigError(
            f"--agent {agent_name}: {run_dir} trains {saved['agent']['name']!r}, and a resume continues it; start "
            f"a new run for another agent, in a directory of its own (textgym train "
            f"{shlex.quote(str(run_dir / 'config.toml'))} --agent {agent_name} "
            f"--set {shlex.quote('run.output_dir=' + json.dumps(f'{run_dir}-{agent_name}'))})."
        )
    changed = [key for key in _differences(saved, config) if not _may_change(key)]
    if changed:
        raise ConfigError(
            f"--set {', '.join(changed)} on --resume: a resume continues {run_dir} as it was trained (its "
            f"optimizer, KL controller, seeds and env come from the checkpoint and config.toml), so only "
            f"{', '.join(RESUME_SETTINGS)} and the agent's {', '.join(MACHINE_SETTINGS)} may change. Start a new "
            f"run to change the others."
        )


def check_config_edits(run_dir: Path, saved: dict[str, Any]) -> bool:
    """``config.toml`` (``saved``, loaded) says what textgym last wrote there, but for what a resume may
    change. An edit by hand (``env.num_envs``, a reward's weight) would resume the checkpoint under settings it
    was not trained with, and the file would then describe a run that never happened. Returns whether a path
    was pointed at where its file moved (the copy is then written again)."""
    from textgym.config import load_config
    from textgym.rundir import WRITTEN_CONFIG

    if not (run_dir / WRITTEN_CONFIG).is_file():  # a run directory from before textgym kept the copy
        return False
    written = load_config(run_dir / WRITTEN_CONFIG)
    edited = [path for path in _changed_paths(written, saved) if not _may_change(_dotted(path))]
    moved = [path for path in edited if _moved(_get(written, path), _get(saved, path))]
    if speaks_for_the_run():  # said once
        for path in moved:
            print(
                f"textgym: {_dotted(path)}: {_get(written, path)} is gone; the run resumes with {_get(saved, path)}"
            )
    edited = [path for path in edited if path not in moved]
    if edited:
        shown = "; ".join(f"{_dotted(p)}: {_get(written, p)!r} -> {_get(saved, p)!r}" for p in edited)
        raise ConfigError(
            f"{run_dir / 'config.toml'} was edited since textgym wrote it ({shown}): a resume continues the run "
            f"as it was trained, so only {', '.join(RESUME_SETTINGS)} and the agent's "
            f"{', '.join(MACHINE_SETTINGS)} may change (or --set them), and a path whose file or directory has "
            f"moved. Put the rest back (textgym's copy: {run_dir / WRITTEN_CONFIG}), or start a new run to change "
            f"them."
        )
    return bool(moved)


def _moved(old: Any, new: Any) -> bool:
    """A path edited in config.toml because what it named moved (a project copied elsewhere: config.toml's
    paths are absolute): the old one is gone, the new one exists, under the same name. A reward's
    ``fn = "/path/file.py:function"`` counts by its file."""
    if not (isinstance(old, str) and isinstance(new, str)):
        return False
    old, new = _file_part(old), _file_part(new)
    return (
        os.path.isabs(old) and not os.path.exists(old) and os.path.exists(new)
        and os.path.basename(old) == os.path.basename(new) != ""
    )  # fmt: skip


def _file_part(value: str) -> str:
    """``/path/file.py`` of ``/path/file.py:function``."""
    head, sep, tail = value.rpartition(":")
    return head if sep and head.endswith(".py") and tail.isidentifier() else value


def _may_change(key: str) -> bool:
    if any(key == s or key.startswith(f"{s}.") for s in RESUME_SETTINGS):  # (run.plugins.0: a list's item)
        return True
    return key.startswith("agent.") and key.rsplit(".", 1)[-1] in MACHINE_SETTINGS


def _get(config: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        if isinstance(config, dict):
            config = config.get(part)
        elif isinstance(config, list) and isinstance(part, int) and part < len(config):
            config = config[part]
        else:
            return None
    return config


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(map(str, path))


def _changed_paths(a: Any, b: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Where two configs differ, as key paths; into tables, and into lists of the same length (a reward
    spec's ``fn`` in ``env.rewards``)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            p
            for name in dict.fromkeys([*a, *b])
            for p in _changed_paths(a.get(name), b.get(name), (*path, name))
        ]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in _changed_paths(x, y, (*path, i))]
    return [path] if a != b else []


def _same_agent(a: str, b: str) -> bool:
    """Two names of one agent (``a2c``, ``sb3-a2c``, ``A2C``)."""
    from textgym.agent_config import find_agent

    try:
        return find_agent(a) is find_agent(b)
    except Exception:  # an unknown name is another agent; resolving the config names it
        return False


def _differences(a: Any, b: Any) -> list[str]:
    """The dotted keys whose values differ between two configs."""
    return [_dotted(path) for path in _changed_paths(a, b)]


def check_reward_files(run_dir: Path, config: dict[str, Any]) -> None:
    """A reward ``fn`` file the run's config names (by its absolute path) and that is gone: a project that
    moved. Said with the fix, where loading it would say only that it does not exist."""
    from textgym.bench_identity import fn_files

    gone = [f for f in fn_files(config["env"].get("rewards")) if os.path.isabs(f) and not os.path.exists(f)]
    if gone:
        raise ConfigError(
            f"{run_dir} trains with the reward file {gone[0]}, which is gone. Where the project moved, edit that "
            f"path in {run_dir / 'config.toml'} to where the file is now (under the same name a resume accepts "
            f"the edit), or put the file back."
        )


def check_plugin_packages(run_dir: Path) -> None:
    """Say which plugin packages the run trained with are no longer installed, with their versions: a name
    one of them provided is then reported unknown, which alone would not say where it came from. (Said, not
    refused: another package, or a plugin file, may provide the name now.)"""
    import importlib.metadata

    packages = _recorded(run_dir).get("packages")
    if not isinstance(packages, dict) or not speaks_for_the_run():
        return
    missing = {}
    for name, version in packages.items():
        try:
            importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            missing[name] = str(version)
    if missing:
        pins = " ".join(f"'{name}=={(version.split() or ['?'])[0]}'" for name, version in missing.items())
        print(
            f"textgym: warning: {run_dir} trained with the plugin package(s) "
            f"{', '.join(f'{name} {version}' for name, version in missing.items())}, which this Python does not "
            f"have (pip install {pins})."
        )


def _recorded(run_dir: Path) -> dict[str, Any]:
    """``code.json`` of ``run_dir``; empty where it is missing (a run from before textgym kept it) or
    unreadable."""
    try:
        recorded = json.loads((run_dir / CODE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def record_code(run_dir: Path, config: dict[str, Any], resuming: bool) -> None:
    """Write the code the run trains with now to ``code.json``; on a resume, first say what changed since
    the run last started or resumed (a plugin package upgraded, a reward file edited, another textgym or
    torch): the run continues with the new code, and its earlier iterations were trained with the old."""
    from textgym.bench_identity import code_identity
    from textgym.evaluation import jsonable

    now = {"packages": {}, **jsonable(code_identity(config))}  # (each part named, when empty too)
    if "missing" in now["code"].values():  # a file that moved or went: the run fails to load it, and says so
        return
    before = _recorded(run_dir) if resuming else {}
    if before:
        before = {"code": {}, "packages": {}, **before}
        code = before.get("code")
        if isinstance(code, dict) and sorted(map(str, code.values())) == sorted(now["code"].values()):
            before["code"] = now["code"]  # the same files, where they are now (a moved project's paths)
        what = {"code": "", "packages": "package ", "software": ""}  # a file by its path, a package named so
        changes = [
            f"{what.get(str(path[0]), '')}{_dotted(path[1:]) or path[0]}: {_get(before, path) or '(none)'} -> "
            f"{_get(now, path) or '(none)'}"
            for path in _changed_paths(before, now)
        ]
        # (the main process: under run.processes = N the launcher never gets here)
        if changes and rank() == 0:
            print(
                f"textgym: warning: the code this run trains with changed since it last started or resumed "
                f"({'; '.join(changes)}). The run continues with the new code; the iterations before this "
                f"resume were trained with the old."
            )
    RunDir(run_dir).write_file(CODE_FILE, json.dumps(now, indent=1, sort_keys=True))
