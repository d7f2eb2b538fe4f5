"""Run configuration for ``textgym train``: a TOML file, validated, with ``--set key=value`` overrides.

```toml
[run]
output_dir = "runs/demo"     # where the run directory goes
total_timesteps = 8000       # generated tokens (one token is one env step)
seed = 0
checkpoint_every = 5         # iterations between checkpoints (and one at the end)
sample_prompts = 4           # prompts shown before and after training
plugins = []                 # plugin files to load

[env]                        # TextGenVectorEnv arguments, plus the env id and num_envs
id = "textgym/TextGen-v0"
num_envs = 16
prompts = "chat"
max_new_tokens = 32
rewards = [{ name = "sentiment" }, { name = "length_penalty", weight = 0.5, target = 24 }]

[agent]                      # name (a registered agent), policy, then the agent's hyperparameters
name = "lmppo"
policy = "smollm2-135m-instruct"
learning_rate = 1e-5

[eval]                       # optional: held-out evaluations during training (see textgym.diagnostics)
every = 10
prompts = "reviews"
rewards = [{ name = "fluency" }]
```
"""

from __future__ import annotations

import copy
import difflib
import json
import math
import os
import re
import tomllib
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from textgym.errors import ConfigError, did_you_mean
from textgym.rundir import MARKER

DEFAULTS: dict[str, dict[str, Any]] = {
    "run": {
        "output_dir": None,
        "total_timesteps": 4096,
        "seed": 0,
        "checkpoint_every": 5,
        "sample_prompts": 4,
        "plugins": [],
        "allow_env_import": False,
        "report_to": [],
        "processes": 1,
    },
    "env": {"id": "textgym/TextGen-v0", "num_envs": 8},
    "agent": {"name": "lmppo", "policy": None},
    "eval": {},  # optional: held-out evaluations during training (textgym.diagnostics)
}
POSITIVE_INTS = ("total_timesteps", "checkpoint_every", "sample_prompts", "processes")
MAX_NUM_ENVS = 65_536

# An annotation's plain type: what a value must be, said, and checked (bool is an int to Python, not here)
_PLAIN_TYPES: dict[str, tuple[str, Any]] = {
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "list": ("a list", lambda v: isinstance(v, (list, tuple))),
}


def annotation_mismatch(annotation: Any, value: Any) -> str | None:
    """What ``value`` must be, as "a number (or none)", when its annotation is a plain type (``bool``,
    ``int``, ``float``, ``str``, ``list[...]``, each optionally ``| None`` or ``Optional[...]``; a string
    annotation too) and it is not one; None otherwise, and for any other annotation. A config's values come
    from TOML or ``--set``, where text that TOML cannot parse stays text: "two" epochs, ``words=maybe``."""
    # "float | None" whether the annotation is a string (postponed) or real: a class by its name, a union or
    # a generic (list[str]) as it prints
    text = annotation.__name__ if isinstance(annotation, type) else str(annotation).replace("typing.", "")
    if text.startswith("Optional[") and text.endswith("]"):  # Optional[float] as the typing module writes it
        text = text.removeprefix("Optional[").removesuffix("]") + " | None"
    elif text.startswith("Union[") and text.endswith("]"):
        text = " | ".join(_top_level(text.removeprefix("Union[").removesuffix("]"), ","))
    parts = _top_level(text, "|")
    optional = "None" in parts and len(parts) == 2
    base = next(part for part in parts if part != "None") if optional else text
    base = "list" if base.startswith(("list[", "List[")) else base
    if base not in _PLAIN_TYPES or (value is None and optional):
        return None
    what, ok = _PLAIN_TYPES[base]
    return None if ok(value) else what + (" (or none)" if optional else "")


def _top_level(text: str, separator: str) -> list[str]:
    """The parts of ``text`` between the ``separator`` characters outside brackets, stripped:
    ``"list[int | None] | None"`` splits on "|" into ``["list[int | None]", "None"]``."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += (char == "[") - (char == "]")
        if char == separator and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return [*parts, text[start:].strip()]


MAX_SEED = 2**32  # numpy's seeds (and so every library seeded from run.seed) stop below it


def iteration_seed(seed: int, iteration: int) -> int:
    """The seed of one iteration's draws (its rollout, its minibatch order) in a run seeded ``seed``: each
    iteration its own, so that a resumed run draws what the uninterrupted one drew. numpy's seeders take it
    modulo :data:`MAX_SEED`."""
    return seed * 1_000_003 + iteration


MAX_EPISODE_BYTES = 2**31  # observation arrays of all sub-envs (int64 ids + int8 mask): refuse beyond 2 GiB


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The config of ``path`` (or the defaults), with ``overrides`` (``"section.key=value"``, values
    parsed as TOML) applied, validated, and with defaults filled in."""
    config = read_toml(path, "config file") if path is not None else {}
    if path is not None:  # paths in a file mean the same from any working directory
        config = resolve_paths(config, Path(path).resolve().parent)
    for override in overrides:  # paths given on the command line are relative to the working directory
        apply_override(config, override, lambda given: resolve_paths(given, Path.cwd()))
    source = str(path) if path else "the config"
    if overrides:  # a bad value may come from either: both are named
        source += f" with --set {' '.join(overrides)}"
    return validate(config, source=source)


def resolve_paths(config: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """A copy of ``config`` with the relative paths it names made absolute against ``base_dir`` (the config
    file's directory): ``run.plugins``, and any string in ``[env]``, ``[agent]`` or a reward spec that is not a
    registered name and names an existing file or directory next to the config (prompt files, policy
    directories, reward-model directories, ``fn = "file.py:func"``). ``run.output_dir`` stays relative to the
    working directory, where runs are written."""
    from textgym.reward_functions import resolve_file_ref, resolve_fn_paths

    config = copy.deepcopy(config)
    run = config.get("run")
    if isinstance(run, dict) and isinstance(run.get("plugins"), list):
        run["plugins"] = [
            str((base_dir / Path(p).expanduser()).resolve()) if isinstance(p, str) else p
            for p in run["plugins"]
        ]
    for section in ("env", "agent", "eval"):
        if isinstance(config.get(section), dict):
            config[section] = resolve_value(config[section], base_dir)
    env = config.get("env")
    if isinstance(env, dict) and "rewards" in env:
        env["rewards"] = resolve_fn_paths(env["rewards"], base_dir)
    evaluation = config.get("eval")
    if isinstance(evaluation, dict) and isinstance(evaluation.get("rewards"), list):
        evaluation["rewards"] = resolve_fn_paths(evaluation["rewards"], base_dir)
    if isinstance(env, dict) and isinstance(env.get("responder"), dict):  # text_env / tool_env files
        env["responder"] = {
            k: resolve_file_ref(v, base_dir) if k in ("text_env", "tool_env") else v
            for k, v in env["responder"].items()
        }
    return config


# keys whose string is a file or directory when one of that name exists; elsewhere a string must also look
# like a path (a "/" or a file suffix), so a text that happens to name a directory ("." or "runs") stays text
PATH_KEYS = ("prompts", "model", "policy")
TEXT_KEYS = ("name", "id", "stop")  # names and texts, never paths


def resolve_value(value: Any, base_dir: Path, keep: Collection[str] = (), key: str | None = None) -> Any:
    """``value`` with every relative path in it made absolute: a string, in lists and tables, that is not a
    registered name, names an existing file or directory under ``base_dir``, and is under a
    :data:`PATH_KEYS` key (``key`` for ``value`` itself) or looks like a path. Strings under
    :data:`TEXT_KEYS` and those in ``keep`` stay as they are."""
    if isinstance(value, str) and value and value not in keep and not Path(value).expanduser().is_absolute():
        candidate = base_dir / value
        looks = key in PATH_KEYS or "/" in value or os.sep in value or bool(Path(value).suffix)
        if looks and candidate.exists() and not _is_registered_name(value):
            return str(candidate.resolve())
    if isinstance(value, list):
        return [resolve_value(v, base_dir, keep) for v in value]
    if isinstance(value, dict):
        return {k: (v if k in TEXT_KEYS else resolve_value(v, base_dir, keep, k)) for k, v in value.items()}
    return value


def _is_registered_name(value: str) -> bool:
    from textgym import plugin_manager

    return any(
        value in plugin_manager.registry(hook)
        for hook in ("register_models", "register_prompt_sources", "register_rewards", "register_agents")
    )


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """A TOML file as a dict; a missing or invalid file is a :class:`ConfigError` that names it."""
    path = Path(path)
    if path.is_dir():
        run = (
            f" It is a run directory: continue it with textgym train --resume {path}."
            if (path / MARKER).exists()
            else ""
        )
        raise ConfigError(f"{what} {str(path)!r} is a directory, not a TOML file.{run}")
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} does not exist.")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {str(path)!r} is not a TOML file: it is not UTF-8 text.") from None


def apply_override(
    config: dict[str, Any], override: str, resolve: Callable[[dict[str, Any]], dict[str, Any]] | None = None
) -> None:
    """Apply ``section.key=value`` (or ``section.table.key=value``, e.g. ``agent.grpo.beta=0.04``) to ``config``;
    the value is parsed as TOML, a bare word as a string. An inline table replaces the table it names
    (``agent.lora={r = 8}`` is that whole table), as the same line in the file would. ``resolve`` makes the
    paths the value names absolute first (against the working directory: see :func:`load_config`).

    Raises:
        ConfigError: a bare word that reads as another language's boolean, null or number (``False``,
            ``None``, ``.01``): taken as a string, it would mean something else (a non-empty string is true).
    """
    parts, parsed = parse_override(override)
    node = config
    for i, part in enumerate(parts[:-1]):  # env.rewards.1.target: a list's item is not a table's key
        node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, list):
            whole = dotted_key(parts[: i + 1])
            raise ConfigError(
                f"--set {override!r}: {whole} is a list, and a key cannot reach into one: give the whole list, "
                f"e.g. --set '{whole}=[...]' (as in the config file, one TOML line)."
            )
    if resolve is not None:
        parsed = resolve(parsed)
    merge_tables(config, parsed, depth=len(parts))


def dotted_key(parts: Sequence[str], keep_quoted: bool = False) -> str:
    """Key parts as one TOML key: a part with characters other than letters, digits, - and _ quoted
    (``keep_quoted``: a part written with its quotes already is kept as it is)."""
    return ".".join(
        part
        if re.fullmatch(r"[A-Za-z0-9_-]+", part) or (keep_quoted and part[:1] in "\"'")
        else json.dumps(part, ensure_ascii=False)
        for part in parts
    )


def key_parts(key: str) -> list[str]:
    """A valid dotted TOML key's parts, as TOML reads them: ``env."a.b".c`` is ``["env", "a.b", "c"]``."""
    node, parts = tomllib.loads(f"{key} = 0"), []
    while isinstance(node, dict):
        part, node = next(iter(node.items()))
        parts.append(part)
    return parts


def parse_override(override: str) -> tuple[list[str], dict[str, Any]]:
    """``section.key=value`` as ``(["section", "key"], {section: {key: value}})``: the key's parts (see
    :func:`key_parts`) and the value at them, read as :func:`apply_override` reads it."""
    key, sep, value = override.partition("=")
    key = key.strip()
    if not sep or "." not in key or not all(key.split(".")):
        raise ConfigError(
            f"--set {override!r} must look like section.key=value, e.g. agent.learning_rate=3e-5."
        )
    if "[" in key or "]" in key:
        raise ConfigError(
            f"--set {override!r}: a key cannot index a list ({key}); give the whole list, e.g. "
            f"--set '{key.split('[')[0]}=[...]' (as in the config file, one TOML line)."
        )
    try:
        parts = key_parts(key)  # the key alone: its error is not the value's
    except tomllib.TOMLDecodeError:
        quoted = dotted_key(key.split("."), keep_quoted=True)
        raise ConfigError(
            f"--set {override!r}: {key} is not a TOML key: a part with characters other than letters, digits, "
            f"- and _ is quoted, as in the file: {quoted}=..."
        ) from None
    try:
        parsed = tomllib.loads(f"{key} = {value}")
    except tomllib.TOMLDecodeError as exc:
        if value.strip()[:1] in ("[", "{", '"', "'"):  # meant as TOML, not a bare word: say so
            reason, _, where = str(exc).partition(" (at line 1, column ")
            if where[:-1].isdigit():  # its column counts from the "key = " put before the value
                reason += f" at character {int(where[:-1]) - len(key) - 3 + len(value) - len(value.lstrip())}"
            text = (
                ""
                if any(c in value for c in "{\"'=")
                else f"; for text, quote it: --set '{key}=\"{value.strip()}\"'"
            )
            if text and "," in value:  # [a, b]: more likely a list of texts
                text += f', or each text of a list: --set \'{key}=["a", "b"]\''
            raise ConfigError(f"--set {override!r}: the value is not valid TOML ({reason}){text}.") from None
        _check_bare_word(override, key, value.strip())
        parsed = value  # a bare word: a string
        for part in reversed(parts):
            parsed = {part: parsed}
    return parts, parsed


def check_keys(given: Mapping[str, Any], section: str, known: Mapping[str, Any], where: str) -> None:
    """Raise :class:`ConfigError` for the first key of a ``[section]`` table that is not one of ``known``."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key {section}.{unknown[0]}.{did_you_mean(unknown[0], known)} Keys: "
            f"{', '.join(known)}."
        )


def settings_table(given: Any, section: str, defaults: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A ``[section]`` settings table with ``defaults`` filled in (a copy), checked to be a table of known
    keys."""
    if not isinstance(given, Mapping):
        raise ConfigError(f"{where}: [{section}] must be a table, not {given!r}.")
    check_keys(given, section, defaults, where)
    return {**copy.deepcopy(dict(defaults)), **given}


def _check_bare_word(override: str, key: str, word: str) -> None:
    quote = f"""(for the text, quote it in TOML: --set "{key}='{word}'")"""
    if word.lower() in ("true", "false"):
        raise ConfigError(
            f"--set {override!r}: TOML writes booleans in lower case: {key}={word.lower()} {quote}."
        )
    if word.lower() in ("none", "null", "nil"):
        raise ConfigError(
            f"--set {override!r}: TOML has no null value: leave the key out of the config for its default, or "
            f"give a value {quote}."
        )
    try:
        number = float(word)
    except ValueError:
        return
    if word.lstrip("+-").isdigit():  # 007: a whole number TOML refuses for its leading zeros
        written = str(int(word))
    else:
        written = repr(number) if math.isfinite(number) else "nan" if math.isnan(number) else f"{number:f}"
    raise ConfigError(f"--set {override!r}: {word!r} is not a TOML number: write {key}={written} {quote}.")


def merge_tables(into: dict[str, Any], values: Mapping[str, Any], depth: int | None = None) -> None:
    """Merge ``values`` into ``into``, table by table; at ``depth`` (the dotted key's last part) a value
    replaces what was there, a table included."""
    for k, v in values.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict) and (depth is None or depth > 1):
            merge_tables(into[k], v, None if depth is None else depth - 1)
        else:
            into[k] = v


def validate(config: Mapping[str, Any], source: str = "the config") -> dict[str, Any]:
    unknown = set(config) - set(DEFAULTS)
    if unknown:
        bad = sorted(unknown)[0]
        close = difflib.get_close_matches(bad, DEFAULTS, n=1)
        hint = f" Did you mean [{close[0]}]?" if close else ""
        raise ConfigError(f"{source}: unknown section [{bad}].{hint} Sections: {', '.join(DEFAULTS)}.")
    resolved = copy.deepcopy(DEFAULTS)
    for section, values in config.items():
        if not isinstance(values, Mapping):
            raise ConfigError(f"{source}: [{section}] must be a table, not {toml_shown(values)}.")
        resolved[section].update(values)
    run = resolved["run"]
    check_keys(run, "run", DEFAULTS["run"], source)
    for key in POSITIVE_INTS:
        if not _is_int(run[key]) or run[key] < 1:
            raise ConfigError(f"{source}: run.{key} must be a positive integer, not {toml_shown(run[key])}.")
    if not _is_int(run["seed"]) or not 0 <= run["seed"] < MAX_SEED:
        raise ConfigError(
            f"{source}: run.seed must be an integer in [0, 2**32), not {toml_shown(run['seed'])}."
        )
    if run["output_dir"] is not None and not isinstance(run["output_dir"], str):
        raise ConfigError(
            f"{source}: run.output_dir must be a path (a string), not {toml_shown(run['output_dir'])}."
        )
    if not isinstance(run["report_to"], list) or not set(run["report_to"]) <= {"tensorboard"}:
        raise ConfigError(
            f"{source}: run.report_to must be a list of 'tensorboard', not {toml_shown(run['report_to'])}"
            + (': report_to = ["tensorboard"].' if run["report_to"] == "tensorboard" else ".")
        )
    if not isinstance(run["allow_env_import"], bool):
        raise ConfigError(
            f"{source}: run.allow_env_import must be true or false, not {toml_shown(run['allow_env_import'])}."
        )
    env = resolved["env"]
    if not _is_int(env["num_envs"]) or not 1 <= env["num_envs"] <= MAX_NUM_ENVS:
        raise ConfigError(
            f"{source}: env.num_envs must be an integer in [1, {MAX_NUM_ENVS}], not {toml_shown(env['num_envs'])}."
        )
    if not isinstance(env["id"], str) or not env["id"]:
        raise ConfigError(
            f"{source}: env.id must be a registered env id (a string), not {toml_shown(env['id'])}."
        )
    for key in ("max_new_tokens", "max_prompt_tokens"):
        if key in env and (not _is_int(env[key]) or env[key] < 1):
            raise ConfigError(f"{source}: env.{key} must be a positive integer, not {toml_shown(env[key])}.")
    length = env.get("max_new_tokens", 32) + env.get("max_prompt_tokens", 96)
    if env["num_envs"] * length * 9 > MAX_EPISODE_BYTES:
        raise ConfigError(
            f"{source}: env.num_envs={env['num_envs']} x (max_prompt_tokens + max_new_tokens = {length}) tokens "
            f"would need {env['num_envs'] * length * 9 / 2**30:.1f} GiB for observations alone; lower them."
        )
    if not isinstance(run["plugins"], list) or not all(isinstance(p, str) for p in run["plugins"]):
        raise ConfigError(
            f"{source}: run.plugins must be a list of plugin files, not {toml_shown(run['plugins'])}."
        )
    if not isinstance(resolved["agent"]["name"], str):
        raise ConfigError(
            f"{source}: agent.name must be an agent name, not {toml_shown(resolved['agent']['name'])}."
        )
    if "eval" in config:
        from textgym.eval_settings import check_eval_section

        resolved["eval"] = check_eval_section(config["eval"], source)
    else:
        del resolved["eval"]
    return resolved


def toml_shown(value: Any) -> str:
    """A config value as the file would write it where Python's repr differs: ``true``, not ``True``."""
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # TOML's true is not 1
