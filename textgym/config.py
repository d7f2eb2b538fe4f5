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
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from textgym.errors import ConfigError

DEFAULTS: dict[str, dict[str, Any]] = {
    "run": {
        "output_dir": None,
        "total_timesteps": 4096,
        "seed": 0,
        "checkpoint_every": 5,
        "sample_prompts": 4,
        "plugins": [],
    },
    "env": {"id": "textgym/TextGen-v0", "num_envs": 8},
    "agent": {"name": "lmppo", "policy": None},
    "eval": {},  # optional: held-out evaluations during training (textgym.diagnostics)
}
POSITIVE_INTS = ("total_timesteps", "checkpoint_every", "sample_prompts")


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The config of ``path`` (or the defaults), with ``overrides`` (``"section.key=value"``, values
    parsed as TOML) applied, validated, and with defaults filled in."""
    config = read_toml(path, "config file") if path is not None else {}
    for override in overrides:
        apply_override(config, override)
    return validate(config, source=str(path) if path else "the config")


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """A TOML file as a dict; a missing or invalid file is a :class:`ConfigError` that names it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} does not exist.")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None


def apply_override(config: dict[str, Any], override: str) -> None:
    key, sep, value = override.partition("=")
    section, dot, name = key.strip().partition(".")
    if not sep or not dot or not name:
        raise ConfigError(
            f"--set {override!r} must look like section.key=value, e.g. agent.learning_rate=3e-5."
        )
    try:
        parsed = tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value  # a bare word: a string
    config.setdefault(section, {})[name] = parsed


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
            raise ConfigError(f"{source}: [{section}] must be a table, not {values!r}.")
        resolved[section].update(values)
    run = resolved["run"]
    unknown = set(run) - set(DEFAULTS["run"])
    if unknown:
        bad = sorted(unknown)[0]
        close = difflib.get_close_matches(bad, DEFAULTS["run"], n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{source}: unknown key run.{bad}.{hint} Keys: {', '.join(DEFAULTS['run'])}.")
    for key in POSITIVE_INTS:
        if not isinstance(run[key], int) or isinstance(run[key], bool) or run[key] < 1:
            raise ConfigError(f"{source}: run.{key} must be a positive integer, not {run[key]!r}.")
    if not isinstance(resolved["env"]["num_envs"], int) or resolved["env"]["num_envs"] < 1:
        raise ConfigError(
            f"{source}: env.num_envs must be a positive integer, not {resolved['env']['num_envs']!r}."
        )
    if not isinstance(run["plugins"], list):
        raise ConfigError(f"{source}: run.plugins must be a list of plugin files, not {run['plugins']!r}.")
    if "eval" in config:
        from textgym.evaluation import check_eval_section

        resolved["eval"] = check_eval_section(config["eval"], source)
    else:
        del resolved["eval"]
    return resolved
