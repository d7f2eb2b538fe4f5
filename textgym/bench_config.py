"""The designs file of ``textgym bench``, parsed and checked before anything trains.

```toml
[bench]                 # output_dir, seeds, eval_prompts, eval_episodes, eval_every, samples_in_report, threads
[run]  [env]  [agent]   # as textgym train takes them, shared by every run ([env] has no rewards)
[[agents]]              # optional: agents compared side by side (name, label, hyperparameters)
[[designs]]             # one per reward design: name, rewards
[metrics]               # rewards (held-out "gold" metrics, each with a label) and builtin metrics
[[reward_models]]       # optional: proxy reward models trained before the runs (textgym.bench_rm)
```

Everything a run could fail on later is checked here: names (rewards, metrics, agents, hyperparameters),
values, plugin files (loaded first, so designs may use their rewards), and every name that becomes a
directory. See docs/bench.md.
"""

from __future__ import annotations

import copy
import re
import tomllib
import unicodedata
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from textgym import plugin_manager
from textgym.bench_rm import check_reward_models
from textgym.composition import stack_table
from textgym.config import (
    MAX_SEED,
    apply_override,
    dotted_key,
    key_parts,
    merge_tables,
    parse_override,
    read_toml,
    resolve_paths,
    resolve_value,
    settings_table,
    validate,
)
from textgym.errors import ConfigError, TextgymError, UnknownNameError
from textgym.eval_settings import check_builtin, check_metric_specs, metric_specs
from textgym.launch import check_processes
from textgym.reward_functions import resolve_fn_paths
from textgym.rewards import check_reward_specs

BENCH_DEFAULTS: dict[str, Any] = {
    "output_dir": None,
    "seeds": [0, 1],
    "eval_prompts": None,
    "eval_episodes": 32,
    "eval_every": 10,
    "samples_in_report": 3,
    "threads": None,
}
SECTIONS = ("bench", "run", "env", "agent", "agents", "designs", "metrics", "reward_models")
DESIGN_KEYS = ("name", "rewards")
# A design or agent name is one directory name on every filesystem: no separators, no "." or "..", nothing
# a shell or Windows would mangle, and no two names that differ only in case or Unicode normal form.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]{0,99}")
SAFE_CHARS = "letters, digits and . _ + = -, starting with a letter or digit, at most 100 characters"


def load_designs(path: str | Path | Mapping[str, Any], overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Parse and check a designs file (or an already-parsed dict, relative paths then resolving against the
    current directory). Returns the bench spec: ``bench`` settings, the ``base`` run config, ``agents``
    (``label``, ``table``, ``lm``), ``designs``, ``metric_rewards``, ``builtin`` and ``agent_axis`` (whether
    the file has an ``[[agents]]`` list)."""
    if isinstance(path, Mapping):
        raw, source, base_dir = copy.deepcopy(dict(path)), "the designs", Path.cwd()
    else:
        source, base_dir = str(path), Path(path).resolve().parent
        raw = _resolve_paths(read_toml(path, "designs file"), base_dir)
    for override in overrides:  # paths given on the command line are relative to the working directory
        _apply_override(raw, override)
    if overrides:  # a bad value may come from either: both are named
        source += f" with --set {' '.join(overrides)}"
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        hint = " The bench evaluates with [metrics] and bench.eval_*." if unknown[0] == "eval" else ""
        raise ConfigError(f"{source}: unknown section [{unknown[0]}].{hint} Sections: {', '.join(SECTIONS)}.")
    bench = _bench_settings(raw.pop("bench", {}), source)
    # Plugin files first: designs and metrics may use the rewards (and agents) they register.
    run = raw.setdefault("run", {})
    if isinstance(run, Mapping) and isinstance(run.get("plugins"), list):
        run["plugins"] = [str(_resolve(p, base_dir)) for p in run["plugins"]]
        for file in run["plugins"]:
            plugin_manager.load_plugin_file(file)
    designs = _designs(raw.pop("designs", None), source, base_dir)
    metrics = raw.pop("metrics", {})
    if not isinstance(metrics, Mapping) or set(metrics) - {"rewards", "builtin"}:
        raise ConfigError(f"{source}: [metrics] takes 'rewards' and 'builtin' only, not {metrics!r}.")
    if not isinstance(metrics.get("rewards", []), list):
        raise ConfigError(
            f"{source}: [metrics] rewards must be a list of reward specs (each with a label), not "
            f"{metrics['rewards']!r}."
        )
    metric_rewards = metric_specs(
        [resolve_fn_paths(m, base_dir) if isinstance(m, Mapping) else m for m in metrics.get("rewards", [])],
        f"{source}: [metrics] rewards",
    )
    check_metric_specs(metric_rewards, f"{source}: [metrics] metric")
    builtin = check_builtin(
        metrics.get("builtin", ["kl", "length", "distinct_2", "eos_rate"]), f"{source}: [metrics] builtin"
    )
    reward_models = check_reward_models(raw.pop("reward_models", None), source)
    agents_raw = raw.pop("agents", None)
    shared_name = raw.get("agent", {}).get("name") if isinstance(raw.get("agent"), Mapping) else None
    if agents_raw is not None and shared_name is not None:
        raise ConfigError(
            f"{source}: [agent] name = {shared_name!r} would not be trained: with an [[agents]] list each entry "
            f"names its agent, and [agent] holds what they share. Add {{ name = {shared_name!r} }} to "
            f"[[agents]] to train it too, and remove name from [agent]."
        )
    if isinstance(raw.get("env"), Mapping) and "rewards" in raw["env"]:
        raise ConfigError(f"{source}: rewards belong to the [[designs]], not to [env].")
    base = validate(raw, source)  # [run], [env], [agent] as textgym train takes them
    from textgym.train_env import check_env_id, check_env_keys

    check_env_id(base["env"]["id"], base["run"]["allow_env_import"])
    try:
        check_env_keys(base["env"]["id"], base["env"])
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    agents = _agents(agents_raw, base, source)
    for agent in agents:
        for design in designs:
            if not agent["lm"] and stack_table(design["rewards"])["aggregate"] != "sum":
                raise ConfigError(
                    f"{source}: agent {agent['label']!r} cannot train design {design['name']!r}: its aggregate = "
                    f"'normalize_then_sum' standardises rewards over a batch of episodes, and a Stable-Baselines3 "
                    f"agent scores them step by step. Use 'sum' in that design, or LM agents only."
                )
    return {
        "bench": bench,
        "base": base,
        "agents": agents,
        "agent_axis": agents_raw is not None,
        "designs": designs,
        "metric_rewards": metric_rewards,
        "builtin": builtin,
        "reward_models": reward_models,
    }


ENTRY_LISTS = {
    "agents": "agent",
    "designs": "design",
}  # the lists of tables whose entries --set reaches by name


def _apply_override(raw: dict[str, Any], override: str) -> None:
    """``--set`` on a designs file: ``section.key=value`` as in ``textgym train``, and
    ``agents.<label>.key=value`` or ``designs.<name>.key=value`` for a key of the ``[[agents]]`` entry of that
    label (its name where it has none) or of the ``[[designs]]`` entry of that name."""
    written = override.partition("=")[0].strip()
    try:  # read as TOML reads it (agents . x, "agents".x)
        parts = key_parts(written)
    except tomllib.TOMLDecodeError:  # not a key: apply_override says what is wrong with it
        parts = [written]
    head = parts[0]
    if head not in ENTRY_LISTS:
        apply_override(raw, override, lambda given: _resolve_paths(given, Path.cwd()))
        return
    what, example = ENTRY_LISTS[head], "num_generations=4" if head == "agents" else "rewards=[{name='match'}]"
    if len(parts) < 2:
        raise ConfigError(
            f"--set {override!r}: [[{head}]] is set one entry's key at a time: --set {head}.<{what} name>.<key>=value "
            f"(e.g. {head}.x.{example}). To add or remove an entry, edit the file."
        )
    _, parsed = parse_override(override)
    entries = raw.get(head)
    if not isinstance(entries, list):
        hint = " (without an [[agents]] list, set the agent's own table: agent.<name>.key=value)"
        raise ConfigError(
            f"--set {override!r}: the designs file has no [[{head}]] list{hint if head == 'agents' else ''}."
        )

    def name_of(entry: Any) -> Any:
        return entry.get("label", entry.get("name")) if head == "agents" else entry.get("name")

    name, value = next(iter(parsed[head].items()))  # (TOML reads a quoted name with dots whole)
    entry = next((e for e in entries if isinstance(e, Mapping) and name_of(e) == name), None)
    if entry is None:
        names = [name_of(e) for e in entries if isinstance(e, Mapping)]
        odd = [n for n in names if isinstance(n, str) and dotted_key([n]) != n]
        quote = (
            f" A name with other characters than letters, digits, - and _ is quoted: {dotted_key([head, odd[0]])}"
            f".key=value."
            if odd
            else ""
        )
        raise ConfigError(
            f"--set {override!r}: no [[{head}]] entry is named {name!r}"
            f"{' (an agent is named by its label, by its name where it has none)' if head == 'agents' else ''}; "
            f"the entries: {', '.join(map(repr, names))}.{quote}"
        )
    if not isinstance(value, dict):
        raise ConfigError(f"--set {override!r}: set a key of the {what}, e.g. --set {head}.{name}.{example}.")
    # the value's paths against the working directory, as each entry's against the file
    patch = _resolve_paths({head: [value]}, Path.cwd())[head][0]
    if head == "designs" and isinstance(patch.get("rewards"), list):  # (the file's resolve against it later)
        patch["rewards"] = resolve_fn_paths(patch["rewards"], Path.cwd())
    # the dotted key's parts below the entry (an inline table at the last one replaces that table)
    merge_tables(entry, patch, depth=len(parts) - 2)


def _resolve_paths(raw: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """The paths in a designs file mean the same from any working directory, as in a ``textgym train``
    config: the relative ones that name a file or directory next to it are made absolute (prompt files,
    policy and reward-model directories, ``fn`` files; see :func:`textgym.config.resolve_paths`). Output
    directories (``bench.output_dir``, a reward model's ``output``) stay relative to the working directory."""
    raw = resolve_paths(raw, base_dir)  # [run] plugins, [env], [agent]
    # a proxy reward model's output is where the bench writes it, as designs name it: it exists from the
    # second call on, and its path must not change then
    outputs = {e["output"] for e in raw.get("reward_models") or [] if isinstance(e, dict) and "output" in e}
    bench = raw.get("bench")
    if isinstance(bench, dict) and "eval_prompts" in bench:
        bench["eval_prompts"] = resolve_value(bench["eval_prompts"], base_dir, key="prompts")
    if isinstance(raw.get("agents"), list):
        raw["agents"] = resolve_value(raw["agents"], base_dir)
    for design in raw.get("designs") or []:
        if isinstance(design, dict) and "rewards" in design:
            design["rewards"] = resolve_value(design["rewards"], base_dir, keep=outputs)
    metrics = raw.get("metrics")
    if isinstance(metrics, dict) and "rewards" in metrics:
        metrics["rewards"] = resolve_value(metrics["rewards"], base_dir, keep=outputs)
    for entry in raw.get("reward_models") or []:
        for key in ("pairs", "train"):
            if isinstance(entry, dict) and isinstance(entry.get(key), dict):
                entry[key] = resolve_value(entry[key], base_dir)
                if "rewards" in entry[key]:
                    entry[key]["rewards"] = resolve_fn_paths(entry[key]["rewards"], base_dir)
    return raw


def _resolve(path: Any, base_dir: Path) -> Path:
    if not isinstance(path, str):
        raise ConfigError(f"run.plugins: {path!r} is not a plugin file path.")
    p = Path(path).expanduser()
    return p if p.is_absolute() else base_dir / p


def _bench_settings(given: Any, source: str) -> dict[str, Any]:
    bench = settings_table(given, "bench", BENCH_DEFAULTS, source)
    seeds = bench["seeds"]
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < MAX_SEED for s in seeds)
    ):
        raise ConfigError(
            f"{source}: bench.seeds must be a non-empty list of integers in [0, 2**32), not {seeds!r}."
        )
    repeated = sorted({s for s in seeds if seeds.count(s) > 1})
    if repeated:
        raise ConfigError(
            f"{source}: bench.seeds repeats seed {repeated[0]} ({seeds!r}); a repeated seed would be trained "
            f"once and counted twice. Give distinct seeds."
        )
    for key, least in (("eval_episodes", 1), ("eval_every", 0), ("samples_in_report", 0)):
        value = bench[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            what = "a positive integer" if least else "a non-negative integer"
            raise ConfigError(f"{source}: bench.{key} must be {what}, not {value!r}.")
    threads = bench["threads"]
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ConfigError(f"{source}: bench.threads must be a positive integer, not {threads!r}.")
    if bench["eval_prompts"] is not None and not isinstance(bench["eval_prompts"], (str, list)):
        raise ConfigError(
            f"{source}: bench.eval_prompts must be a prompt source (a registered name or a file) or a list of "
            f"prompts, not {bench['eval_prompts']!r}."
        )
    if bench["eval_prompts"] is not None:  # a typo or an empty list fails now, not after the first run
        from textgym.prompts import load_prompts

        try:
            load_prompts(bench["eval_prompts"])
        except TextgymError as exc:
            raise ConfigError(f"{source}: bench.eval_prompts: {exc}") from None
    if bench["output_dir"] is not None and not isinstance(bench["output_dir"], str):
        raise ConfigError(f"{source}: bench.output_dir must be a path, not {bench['output_dir']!r}.")
    return bench


def check_name(name: Any, what: str, source: str) -> str:
    """``name`` if it is a safe single directory name, else a :class:`ConfigError` that says why."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{source}: every {what} needs a non-empty name, not {name!r}.")
    if not SAFE_NAME.fullmatch(name):
        raise ConfigError(
            f"{source}: {what} name {name!r} is not a safe directory name (its runs go to a directory named "
            f"after it). Use {SAFE_CHARS}."
        )
    return name


def check_unique(names: Sequence[str], what: str, source: str) -> None:
    """No two names may be equal, or map to the same directory on a case-insensitive filesystem."""
    seen: dict[str, str] = {}
    for name in names:
        key = unicodedata.normalize("NFC", name).casefold()
        if key in seen:
            same = "share the name" if seen[key] == name else "map to the same directory on some filesystems"
            raise ConfigError(
                f"{source}: {what}s {seen[key]!r} and {name!r} {same}; give every {what} its own name."
            )
        seen[key] = name


def _designs(designs: Any, source: str, base_dir: Path) -> list[dict[str, Any]]:
    if not designs or not isinstance(designs, list) or not all(isinstance(d, Mapping) for d in designs):
        raise ConfigError(f"{source}: give at least one [[designs]] table with a name and rewards.")
    out = []
    for design in designs:
        name = check_name(design.get("name"), "design", source)
        extra = sorted(set(design) - set(DESIGN_KEYS))
        if extra:
            raise ConfigError(
                f"{source}: design {name!r} has unknown keys {extra}; a design has {DESIGN_KEYS}."
            )
        if not design.get("rewards"):
            raise ConfigError(f"{source}: design {name!r} has no rewards.")
        # `fn` files resolve against the designs file, and are stored absolute so training agrees
        rewards = resolve_fn_paths(design["rewards"], base_dir)
        try:
            check_reward_specs(rewards, where=f"{source}: design {name!r}")  # all-metric stacks refused too
        except UnknownNameError as exc:  # which of the designs names it
            exc.args = (f"{source}: design {name!r}: {exc}",)
            raise
        out.append({"name": name, "rewards": rewards})
    check_unique([d["name"] for d in out], "design", source)
    return out


def _agents(agents: Any, base: Mapping[str, Any], source: str) -> list[dict[str, Any]]:
    """Each agent: ``label`` (its directory and report name), ``table`` (the ``[agent]`` table of its runs:
    the shared ``[agent]`` keys, then its own) and ``lm`` (an LM agent, or an SB3-style one)."""
    from textgym.agent_config import is_lm_agent, own_table_key, resolve_agent

    shared = {k: v for k, v in base["agent"].items() if k != "name"}
    if agents is None:
        tables = [dict(base["agent"])]
        # the agent's own table (what errors call it), as the config spells it ([agent.LMPPO] for lmppo)
        name = base["agent"].get("name")
        entries = [f"[agent.{(isinstance(name, str) and own_table_key(base['agent'], name)) or name}]"]
    elif not isinstance(agents, list) or not agents or not all(isinstance(a, Mapping) for a in agents):
        raise ConfigError(f"{source}: [[agents]] must be a list of tables, each with an agent name.")
    else:
        tables, entries = [], []
        for entry in agents:
            if not isinstance(entry.get("name"), str) or not entry["name"]:
                raise ConfigError(
                    f"{source}: [[agents]] entry {dict(entry)!r} needs name = a registered agent (a string), "
                    f"not {entry.get('name')!r}."
                )
            # the entry's keys become the agent's own table ([agent.<name>]), over the shared ones; the
            # shared policy (an LM) stays the env's tokenizer, as in `textgym train --agent`
            own = {k: v for k, v in entry.items() if k not in ("name", "label") and v is not None}
            # [agent.<name>] (as the config spells it: [agent.A2C] for a2c), e.g. from --set agent.a2c.n_steps=16
            key = own_table_key(shared, entry["name"]) or entry["name"]
            named = shared.get(key, {})
            clash = [k for k in own if isinstance(named, Mapping) and k in named and named[k] != own[k]]
            if clash:
                k = clash[0]
                raise ConfigError(
                    f"{source}: agent {entry['name']!r}: {k} is {named[k]!r} in [agent.{key}] and "
                    f"{own[k]!r} in its [[agents]] entry; set it in one place (the entry's value would win)."
                )
            table = {k: v for k, v in shared.items() if k != key}
            table.update(name=entry["name"], **{entry["name"]: {**named, **own}})
            if "label" in entry:
                table["label"] = entry["label"]
            tables.append(table)
            also = f" or [agent.{key}]" if named else ""  # (--set agent.<name>.key=... merged in)
            entries.append(f"its [[agents]] entry{also}")
    out = []
    for table, own_table in zip(tables, entries):
        label = check_name(table.pop("label", table["name"]), "agent", source)
        try:  # the agent's name (registered or an SB3 algorithm) and every hyperparameter's name
            agent_class, policy, hyperparameters = resolve_agent(table, own_table)
        except ConfigError as exc:
            raise ConfigError(f"{source}: agent {label!r}: {exc}") from None
        lm = is_lm_agent(agent_class)
        if lm:
            _check_lm_agent(agent_class, label, policy, hyperparameters, source)
        try:  # the batch's split over run.processes and into groups and minibatches, as each run will check it
            check_processes(
                {"run": dict(base["run"]), "env": base["env"]},
                1,
                False,
                agent_class,
                hyperparameters,
                table="",
            )
        except ConfigError as exc:
            raise ConfigError(f"{source}: agent {label!r}: {exc}") from None
        out.append({"label": label, "table": table, "lm": lm})
    check_unique([a["label"] for a in out], "agent", source)
    return out


def _check_lm_agent(
    agent_class: type, label: str, policy: Any, hyperparameters: Mapping[str, Any], source: str
) -> None:
    """An LM agent's policy and hyperparameter values, before any model loads."""
    from textgym.agents.lm_config import make_config

    if policy is None:
        raise ConfigError(
            f"{source}: agent {label!r} needs a policy: a zoo name (e.g. tiny-char-llama) or a model directory."
        )
    try:
        make_config(agent_class.config_class, label, dict(hyperparameters))
    except ConfigError as exc:
        raise ConfigError(f"{source}: agent {label!r}: {exc}") from None
