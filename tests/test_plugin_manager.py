import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import textgym
from tests.conftest import reward_plugin
from textgym import plugin_files, plugin_manager
from textgym.cli import main
from textgym.errors import DuplicateNameError, PluginArgumentError, PluginError, UnknownNameError

BUILTIN_REWARDS = {
    "rm_score",
    "fluency",
    "safety",
    "length_penalty",
    "sentiment",
    "similarity",
    "match",
    "math",
}


def test_builtins_register_through_the_hooks():
    assert set(plugin_manager.registry("register_rewards").names()) == BUILTIN_REWARDS
    assert {"chat", "reviews", "arithmetic", "copy"} <= set(
        plugin_manager.registry("register_prompt_sources").names()
    )
    assert {"smollm2-135m-instruct", "tiny-random-llama", "tiny-char-llama"} <= set(
        plugin_manager.registry("register_models").names()
    )
    for name in plugin_manager.DEFAULT_PLUGINS:
        assert plugin_manager.describe_source(name) == "built-in"


def test_a_throwaway_reward_plugin_is_usable_by_name_and_gone_after(register):
    register(reward_plugin("twice", lambda ss: [2.0] * len(ss)), "twice-plugin")
    total, _ = textgym.build_reward_stack(["twice weight=3"]).score([textgym.Sample("p", "c")])
    assert total.tolist() == [6.0]
    plugin_manager.unregister_plugin("twice-plugin")
    with pytest.raises(UnknownNameError):
        textgym.make_reward("twice")


def test_duplicate_names_are_an_error_naming_both_plugins(register):
    register(reward_plugin("sentiment", lambda ss: [0.0] * len(ss)), "my-sentiment")
    with pytest.raises(DuplicateNameError) as err:
        plugin_manager.registry("register_rewards")
    assert "'textgym.plugins.sentiment' (built-in)" in str(err.value) and "'my-sentiment'" in str(err.value)


def test_a_registration_with_arguments_its_kind_does_not_take_or_a_spaced_name_is_refused(register):
    """register("x", X, weight=2) was accepted and the weight dropped (only an env's register() takes
    defaults); a reward called "my reward" could not be named in a reward spec, which splits on spaces."""

    class Weighted:
        @staticmethod
        @textgym.hookimpl
        def register_rewards(register):
            register(
                "weighted", lambda: textgym.FunctionReward("weighted", lambda ss: [0.0] * len(ss)), weight=2
            )

    register(Weighted(), "weighted-plugin")
    with pytest.raises(
        PluginError, match=r"registered reward 'weighted' with weight: a reward's register\(\) takes none"
    ):
        plugin_manager.registry("register_rewards")
    plugin_manager.unregister_plugin("weighted-plugin")
    # names no spec could use: 'a=b' read as a=b, '_private' refused where a spec named it, not here
    for name, message in [
        ("my reward", "invalid name 'my reward': a reward's name is a non-empty string without spaces"),
        ("a=b", "invalid name 'a=b': a reward's name is a non-empty string without spaces or '='"),
        ("_private", "registered the reward '_private': a reward's name cannot start with '_'"),
    ]:
        register(reward_plugin(name, lambda ss: [0.0] * len(ss)), "badly-named")
        with pytest.raises(PluginError, match=message):
            plugin_manager.registry("register_rewards")
        plugin_manager.unregister_plugin("badly-named")


def test_a_reward_object_registered_where_its_factory_belongs_is_named(register):
    """register("shout", Shout()) failed when a config used it, with "Shout.__call__() missing 1 required
    positional argument: 'samples'"."""

    class Shout:
        name = "shout"

        def __call__(self, samples):
            return [float(s.completion.isupper()) for s in samples]

    class Plugin:
        @staticmethod
        @textgym.hookimpl
        def register_rewards(register):
            register("shout", Shout())

    register(Plugin(), "object-plugin")
    with pytest.raises(PluginError, match=r"registered reward 'shout' as an instance of Shout, which takes \(samples\): "
                       r"register what makes one.*register\('shout', Shout\) \(the class\)"):  # fmt: skip
        plugin_manager.registry("register_rewards")
    plugin_manager.unregister_plugin("object-plugin")

    class Factory:  # an object that makes rewards from a spec's keyword arguments is a factory
        def __call__(self, loud=True):
            return Shout()

    class Good:
        @staticmethod
        @textgym.hookimpl
        def register_rewards(register):
            register("shout", Shout)
            register("shout-made", Factory())

    register(Good(), "good-plugin")
    assert {"shout", "shout-made"} <= set(plugin_manager.registry("register_rewards").names())


def test_register_takes_the_positional_arguments_its_hookspec_documents(register):
    """register(env_id, entry_point, vector_entry_point) and register(name, loader, tokenizer_loader) are
    documented; a positional argument no kind takes is named."""
    import gymnasium

    class Positional:
        @staticmethod
        @textgym.hookimpl
        def register_envs(register):
            register(
                "tests/Positional-v0",
                "textgym.envs:TextGenEnv",
                "textgym.envs:TextGenVectorEnv",
                model="chars",
            )

    register(Positional(), "positional")
    entry = plugin_manager.registry("register_envs").get("tests/Positional-v0")
    assert entry.extra == {"vector_entry_point": "textgym.envs:TextGenVectorEnv", "model": "chars"}
    plugin_manager.unregister_plugin("positional")

    class Extra:
        @staticmethod
        @textgym.hookimpl
        def register_rewards(register):
            register("extra", lambda: None, 2.0)

    register(Extra(), "extra-plugin")
    with pytest.raises(
        PluginError, match=r"registered reward 'extra' with 1 more positional argument\(s\) than a reward's"
    ):
        plugin_manager.registry("register_rewards")
    gymnasium.registry.pop("tests/Positional-v0", None)


def test_a_class_plugin_is_refused_only_where_its_hooks_take_self():
    """A class whose hooks take no self works with pluggy (as staticmethods do); one that inherits hooks
    taking self cannot be the plugin itself."""
    from textgym.plugin_manager import _instance_hooks

    class NoSelf:
        @textgym.hookimpl
        def register_rewards(register):
            pass

    class WithSelf:
        @textgym.hookimpl
        def register_rewards(self, register):
            pass

    class Inherits(WithSelf):
        pass

    class Static:
        @staticmethod
        @textgym.hookimpl
        def register_rewards(register):
            pass

    assert _instance_hooks(NoSelf) == [] and _instance_hooks(Static) == []
    assert _instance_hooks(WithSelf) == _instance_hooks(Inherits) == ["register_rewards"]


def test_misspelled_hook_is_caught_by_check_pending():
    class Typo:
        @staticmethod
        @textgym.hookimpl
        def register_reward(register):  # missing "s"
            pass

    with pytest.raises(
        PluginError,
        match=r"registered in code defines a hook textgym does not have, 'register_reward'. Did you mean "
        r"'register_rewards'\? textgym's hooks are: register_rewards",
    ):
        plugin_manager.register_plugin(Typo(), name="typo")
    assert not plugin_manager.pm.has_plugin("typo")


def test_plugin_file_mistakes_name_the_fix(tmp_path):
    """A plugin file with postponed annotations and a dataclass failed to import ('NoneType' object has no
    attribute '__dict__': its module was not in sys.modules); a bare @textgym.reward registered nothing,
    silently; on a class it said "is a built-in class"; a hook taking self printed pluggy's words alone."""
    cases = {
        "future.py": "from __future__ import annotations\nimport dataclasses\nimport textgym\n\n"
        "@dataclasses.dataclass\nclass Bonus:\n    name: str = 'bonus'\n\n"
        "    def __call__(self, samples):\n        return [1.0 for _ in samples]\n\n"
        "@textgym.hookimpl\ndef register_rewards(register):\n    register('bonus', Bonus)\n",
        "bare.py": "import textgym\n\n@textgym.reward\ndef bad(samples):\n    return [0.0 for _ in samples]\n",
        "cls.py": "import textgym\n\n@textgym.reward('bad')\nclass Bad:\n    pass\n",
        "self.py": "import textgym\n\n@textgym.hookimpl\ndef register_rewards(self, register):\n    pass\n",
    }
    for file, text in cases.items():
        (tmp_path / file).write_text(text)
    name = plugin_manager.load_plugin_file(tmp_path / "future.py")
    try:
        assert textgym.make_reward("bonus")([]) == []
    finally:
        plugin_manager.unregister_plugin(name)
    # a scoring function registered where its factory belongs: "missing 1 required positional argument"
    (tmp_path / "scorer.py").write_text(
        "import textgym\n\ndef score(samples):\n    return [1.0 for _ in samples]\n\n"
        "@textgym.hookimpl\ndef register_rewards(register):\n    register('scorer', score)\n"
    )
    name = plugin_manager.load_plugin_file(tmp_path / "scorer.py")
    try:
        with pytest.raises(
            PluginArgumentError, match=r"registered the function score\(samples, ...\), which scores"
        ):
            textgym.make_reward("scorer")
    finally:
        plugin_manager.unregister_plugin(name)
    for file, says in [
        (
            "bare.py",
            r"@textgym.reward takes the plugin's name: write @textgym.reward\('bad'\) above `def bad`",
        ),
        (
            "cls.py",
            r"@textgym.reward decorates a batched function, not the class Bad: register a class from a",
        ),
        ("self.py", r"takes one parameter, named `register` \(and no `self`"),
    ]:
        with pytest.raises(PluginError, match=says):
            plugin_manager.load_plugin_file(tmp_path / file)


def test_a_hook_with_another_parameter_name_is_a_plugin_error():
    class Renamed:
        @staticmethod
        @textgym.hookimpl
        def register_rewards(reg):  # pluggy passes arguments by name: `register`
            pass

    with pytest.raises(PluginError, match="(?s)plugin .renamed. .*register_rewards.*reg"):
        plugin_manager.register_plugin(Renamed(), name="renamed")
    assert not plugin_manager.pm.has_plugin("renamed")


def test_unknown_agent_name_lists_known_agents(register):
    class Agents:
        @staticmethod
        @textgym.hookimpl
        def register_agents(register):
            register("my-ppo", object)

    register(Agents(), "agents-plugin")
    with pytest.raises(UnknownNameError, match="unknown agent 'my-pop'. Did you mean 'my-ppo'"):
        plugin_manager.get("register_agents", "my-pop")


def test_plugin_envs_are_registered_with_gymnasium(register):
    import gymnasium

    class Envs:
        @staticmethod
        @textgym.hookimpl
        def register_envs(register):
            register(
                "myproject/Short-v0",
                "textgym.envs:TextGenEnv",
                model="chars",
                prompts=["abc"],
                max_new_tokens=2,
            )

    register(Envs(), "env-plugin")
    env = gymnasium.make("myproject/Short-v0")
    assert env.observation_space["input_ids"].shape == (96 + 2,)
    plugin_manager.unregister_plugin("env-plugin")
    assert "myproject/Short-v0" not in gymnasium.registry


def test_a_bad_key_in_an_envs_registration_is_blamed_on_it_not_on_the_env_table(register, tmp_path, capsys):
    """The registration's `prompt` was reported as "[env]: unexpected keyword argument 'prompt'. Did you mean
    'prompt'?": the user's table had no such key, and the suggestion was the key itself."""

    class Envs:
        @staticmethod
        @textgym.hookimpl
        def register_envs(register):
            register("myproject/BadKey-v0", "textgym.envs:TextGenEnv",
                     vector_entry_point="textgym.envs:TextGenVectorEnv", model="chars", prompt="copy")  # fmt: skip

    register(Envs(), "bad-key")
    config = tmp_path / "env.toml"
    config.write_text(
        '[env]\nid = "myproject/BadKey-v0"\nnum_envs = 8\n[agent]\nname = "lmppo"\npolicy = "tiny-char-llama"\n'
    )
    assert main(["train", str(config), "--set", f"run.output_dir='{tmp_path / 'run'}'"]) == 2
    assert "argument 'prompt' (the env's registration passes it, not [env]). Did you mean 'prompts'?" in (
        capsys.readouterr().err
    )


PLUGIN_FILE = """
import textgym

@textgym.reward("exclaim")
def exclaim(samples, per_mark=1.0):
    return [per_mark * s.completion.count("!") for s in samples]
"""


def test_reward_decorator_in_a_plain_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(PLUGIN_FILE)
    name = plugin_manager.load_plugin_file(path)
    try:
        reward = textgym.make_reward("exclaim", per_mark=0.5)
        assert list(reward([textgym.Sample("p", "hi!!")])) == [1.0]
        assert plugin_manager.get("register_rewards", "exclaim").plugin == f"{path.resolve()}::exclaim"
        with pytest.raises(textgym.errors.PluginArgumentError, match="Valid arguments: per_mark"):
            textgym.make_reward("exclaim", per_marks=2)
        assert plugin_manager.load_plugin_file(path) == name  # loading twice is a no-op
        # edited since (a notebook, between two bench calls): imported again, where the old code ran on
        path.write_text(PLUGIN_FILE.replace('count("!")', 'count("?")'))
        assert plugin_manager.load_plugin_file(path) == name
        assert list(textgym.make_reward("exclaim")([textgym.Sample("p", "hi!?")])) == [1.0]
        assert list(textgym.make_reward("exclaim")([textgym.Sample("p", "hi??")])) == [2.0]
        fn = textgym.reward_functions.load_function(f"{path}:exclaim")
        path.write_text(PLUGIN_FILE.replace('count("!")', "count('?') * 10"))
        assert textgym.reward_functions.load_function(f"{path}:exclaim") is not fn
        assert list(textgym.make_reward("exclaim")([textgym.Sample("p", "hi??")])) == [20.0]
    finally:
        plugin_manager.unregister_plugin(name)
        plugin_manager.unregister_plugin(f"{path.resolve()}::exclaim")


HELPED_FILE = """
import textgym
import scale_helper_{tag}
from unchanged_helper_{tag} import LOADS

@textgym.reward("helped_{tag}")
def helped(samples):
    return [scale_helper_{tag}.SCALE * len(s.completion) for s in samples]
"""


def test_a_helper_module_edited_since_its_plugin_file_loaded_is_imported_again(tmp_path):
    """A plugin file is imported again when it changes; the module it imports beside it was served from
    sys.modules, so a helper edited between two runs in one process (a notebook) trained with the old code
    while a bench recorded the new file's digest."""
    tag = tmp_path.name.replace("-", "_")
    path = tmp_path / "helped.py"
    path.write_text(HELPED_FILE.format(tag=tag))
    (tmp_path / f"scale_helper_{tag}.py").write_text("SCALE = 1.0\n")
    (tmp_path / f"unchanged_helper_{tag}.py").write_text("LOADS = []\nLOADS.append(1)\n")
    name = plugin_manager.load_plugin_file(path)
    try:
        reward = lambda: list(textgym.make_reward(f"helped_{tag}")([textgym.Sample("p", "abc")]))  # noqa: E731
        assert reward() == [3.0]
        unchanged = sys.modules[f"unchanged_helper_{tag}"]
        (tmp_path / f"scale_helper_{tag}.py").write_text("SCALE = 10.0\n")
        assert plugin_manager.load_plugin_file(path) == name
        assert reward() == [30.0]
        assert sys.modules[f"unchanged_helper_{tag}"] is unchanged and unchanged.LOADS == [1]  # not run again
        assert plugin_manager.load_plugin_file(path) == name and reward() == [30.0]  # unchanged: a no-op
    finally:
        plugin_manager.unregister_plugin(name)
        plugin_manager.unregister_plugin(f"{path.resolve()}::helped")


PACKAGED_FILE = """
import textgym
import pkg_{tag}.sub
from pkg_{tag} import other

@textgym.reward("packaged_{tag}")
def packaged(samples):
    return [pkg_{tag}.sub.SCALE * other.OFFSET for s in samples]
"""


def test_an_edited_local_package_is_imported_again_whole(tmp_path):
    """Dropping only the edited module from sys.modules broke `import pkg.sub` (a new pkg without its sub,
    an AttributeError in the reward) and kept `from pkg import other` on the old code (pkg's attribute)."""
    tag = tmp_path.name.replace("-", "_")
    path = tmp_path / "packaged.py"
    path.write_text(PACKAGED_FILE.format(tag=tag))
    package = tmp_path / f"pkg_{tag}"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "sub.py").write_text("SCALE = 2.0\n")
    (package / "other.py").write_text("OFFSET = 1.0\n")
    name = plugin_manager.load_plugin_file(path)
    try:
        reward = lambda: list(textgym.make_reward(f"packaged_{tag}")([textgym.Sample("p", "a")]))  # noqa: E731
        assert reward() == [2.0]
        (package / "__init__.py").write_text("VERSION = 2\n")
        plugin_manager.load_plugin_file(path)
        assert reward() == [2.0] and sys.modules[f"pkg_{tag}"].VERSION == 2
        (package / "other.py").write_text("OFFSET = 5.0\n")
        plugin_manager.load_plugin_file(path)
        assert reward() == [10.0]
        (package / "sub.py").write_text("SCALE = 3.0\n")  # still followed after a reload
        plugin_manager.load_plugin_file(path)
        assert reward() == [15.0]
    finally:
        plugin_manager.unregister_plugin(name)
        plugin_manager.unregister_plugin(f"{path.resolve()}::packaged")


def test_local_imports_are_found_where_python_finds_them_beside_any_plugin_file(tmp_path):
    """Every plugin file's directory joins sys.path: a module beside one plugin is importable from another."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "plugin_a.py").write_text("import shared\nfrom pkg import sub\n")
    (tmp_path / "b" / "plugin_b.py").write_text("")
    (tmp_path / "b" / "shared.py").write_text("import deeper\n")
    (tmp_path / "b" / "deeper.py").write_text(
        "x = 1 +" + " 1 +" * 100_000 + " 1\n"
    )  # (ast's recursion limit)
    (tmp_path / "a" / "pkg").mkdir()
    (tmp_path / "a" / "pkg" / "__init__.py").write_text("")
    (tmp_path / "a" / "pkg" / "sub.py").write_text("from . import sibling\n")
    (tmp_path / "a" / "pkg" / "sibling.py").write_text("")
    found = plugin_files.local_imports([tmp_path / "a" / "plugin_a.py", tmp_path / "b" / "plugin_b.py"])
    assert sorted(p.relative_to(tmp_path).as_posix() for p in found) == [
        "a/pkg/__init__.py", "a/pkg/sibling.py", "a/pkg/sub.py", "b/deeper.py", "b/shared.py"
    ]  # fmt: skip
    alone = plugin_files.local_imports([tmp_path / "a" / "plugin_a.py"], roots=[tmp_path / "b"])
    assert sorted(alone) == sorted(found)


def test_bad_plugin_files_are_errors(tmp_path):
    with pytest.raises(PluginError, match="does not exist"):
        plugin_manager.load_plugin_file(tmp_path / "nope.py")
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(PluginError, match="failed to import: ModuleNotFoundError"):
        plugin_manager.load_plugin_file(tmp_path / "broken.py")


def run_textgym(args, env_extra, cwd):
    env = {**os.environ, **env_extra}
    return subprocess.run(
        [sys.executable, "-m", "textgym", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )


def test_cli_plugin_flag_and_env_var_and_listing(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(PLUGIN_FILE)
    by_flag = run_textgym(["plugins", "--json", "--plugin", str(path)], {}, tmp_path)
    before_command = run_textgym(["--plugin", str(path), "plugins", "--json"], {}, tmp_path)
    by_var = run_textgym(["plugins", "--json"], {"TEXTGYM_PLUGINS": str(path)}, tmp_path)
    for result in (by_flag, before_command, by_var):
        assert result.returncode == 0, result.stderr
        report = {row["name"]: row for row in json.loads(result.stdout)}
        row = report[f"{path.resolve()}::exclaim"]
        assert (
            row["registers"] == {"reward": ["exclaim"]}
            and row["source"] == f"@textgym.reward in {path.resolve()}"
        )
        assert report["textgym.plugins.sentiment"]["registers"] == {"reward": ["sentiment"]}


def test_the_plugin_file_of_the_docs_registers_through_its_module_level_hook(tmp_path):
    docs = (Path(__file__).parents[1] / "docs" / "plugins.md").read_text()
    block = "# my_plugin.py" + docs.split("```python\n# my_plugin.py", 1)[1].split("```", 1)[0]
    path = tmp_path / "my_plugin.py"
    path.write_text(block)
    result = run_textgym(["--plugin", str(path), "plugins", "--json"], {}, tmp_path)
    assert result.returncode == 0, result.stderr
    report = {row["name"]: row for row in json.loads(result.stdout)}
    assert report[str(path.resolve())]["registers"] == {"reward": ["shouting"]}


def test_cli_plugins_json_into_a_closed_pipe_ends_without_a_traceback(monkeypatch, capsys):
    """`textgym plugins --json | head` printed a BrokenPipeError traceback."""
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as closed:
        monkeypatch.setattr(sys, "stdout", closed)
        assert main(["plugins", "--json"]) == 1
    assert capsys.readouterr().err == ""
    read, write = os.pipe()  # a command cut short says so, in one line
    os.close(read)
    with os.fdopen(write, "w") as closed:
        monkeypatch.setattr(sys, "stdout", closed)
        argv = [
            "sample",
            "--model",
            "tiny-random-llama",
            "--num",
            "1",
            "--max-new-tokens",
            "2",
            "--reward",
            "sentiment",
        ]
        assert main(argv) == 1
    assert capsys.readouterr().err.endswith(
        "textgym: stopped: sample's output was closed (a pipe's reader exited)\n"
    )


def test_cli_help_shows_what_each_option_does_and_its_default(capsys):
    with pytest.raises(SystemExit):
        main(["sample", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--top-k TOP_K sample from the k likeliest tokens (0: all) (default: 0)" in out
    assert "--max-new-tokens MAX_NEW_TOKENS the most tokens a completion has (default: 32)" in out
    assert "(default: None)" not in out and "``" not in out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "``" not in capsys.readouterr().out


def test_cli_plugins_text_listing(capsys, tmp_path):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "textgym.plugins.match  (built-in)\n    rewards: match" in out
    assert "envs: textgym/TextGen-v0, textgym/Copy-v0" in out
    (tmp_path / "my_rewards.py").write_text(PLUGIN_FILE)
    (tmp_path / "empty.py").write_text("import textgym\n")
    (tmp_path / "both.py").write_text(
        PLUGIN_FILE.replace("exclaim", "shout") + "\n@textgym.responder('again')\n"
        "def again(conversations):\n    return [textgym.Reply('ok', done=True) for _ in conversations]\n"
    )
    files = [str(tmp_path / name) for name in ("my_rewards.py", "empty.py", "both.py")]
    assert main(["plugins", *(option for file in files for option in ("--plugin", file))]) == 0
    out = capsys.readouterr().out
    assert f"(file {(tmp_path / 'my_rewards.py').resolve()})\n    (@textgym.reward: exclaim)" in out
    both = (
        f"(file {(tmp_path / 'both.py').resolve()})\n    (@textgym.reward: shout; @textgym.responder: again)"
    )
    assert both in out
    assert f"(file {(tmp_path / 'empty.py').resolve()})\n    (registers nothing)" in out


def test_cli_plugins_name_shows_its_arguments_defaults_and_documentation(capsys, tmp_path):
    """The README's table names a reward's main arguments only: `textgym plugins NAME` says what each takes,
    with its defaults, and what it computes."""
    assert main(["plugins", "length_penalty"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "reward length_penalty  (plugin textgym.plugins.length_penalty: built-in)\n    arguments: ("
    )
    assert "missing_eos_penalty: 'float' = 1.0" in out and "is subtracted when the completion hit" in out
    # the spec's own keys, which the arguments do not show; math's timeout is its own
    assert "spec keys: weight (default 1.0), timeout (seconds each call may take; default none)" in out
    assert main(["plugins", "math"]) == 0
    assert "spec keys: weight (default 1.0), timeout (the argument above)" in capsys.readouterr().out
    assert main(["plugins", "textgym/Copy-v0"]) == 0
    assert "registered with: model='chars', prompts='copy'" in capsys.readouterr().out
    assert main(["plugins", "echo", "--json"]) == 0
    assert [row["kind"] for row in json.loads(capsys.readouterr().out)] == ["prompt source", "responder"]
    (tmp_path / "mine.py").write_text(
        "import textgym\n\n@textgym.reward('politeness')\ndef politeness(samples, bonus: float = 1.0):\n"
        '    """bonus per \'please\'."""\n    return [bonus * s.completion.count(\'please\') for s in samples]\n'
    )
    assert main(["plugins", "--plugin", str(tmp_path / "mine.py"), "politeness"]) == 0
    out = capsys.readouterr().out
    assert "arguments: (*, bonus: float = 1.0)" in out and "bonus per 'please'." in out
    assert main(["plugins", "lenght_penalty"]) == 2
    assert "unknown plugin name 'lenght_penalty'. Did you mean 'length_penalty'?" in capsys.readouterr().err
    # an LM agent's hyperparameters are its config's fields (its signature is **hyperparameters); an SB3
    # algorithm, which --agent takes by name, is described too
    assert main(["plugins", "grpo"]) == 0
    out = capsys.readouterr().out
    assert (
        "hyperparameters (defaults):\n" in out
        and "        beta = 0.0\n" in out
        and "num_generations = 8" in out
    )
    assert main(["plugins", "a2c"]) == 0
    out = capsys.readouterr().out
    assert (
        out.startswith("agent a2c  (plugin stable_baselines3: Stable-Baselines3 algorithm")
        and "n_steps: int = 5" in out
    )


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    assert main(["plugins", "--plugin", str(tmp_path / "missing.py")]) == 2
    assert "textgym: error: plugin file" in capsys.readouterr().err


def test_check_pending_runs_for_plugin_files(tmp_path):
    (tmp_path / "typo.py").write_text(
        textwrap.dedent(
            """
            import textgym
            @textgym.hookimpl
            def register_reward(register):
                pass
            """
        )
    )
    result = run_textgym(["plugins", "--plugin", str(tmp_path / "typo.py")], {}, tmp_path)
    assert (
        result.returncode == 2 and "textgym: error:" in result.stderr and "register_reward" in result.stderr
    )


def test_unknown_env_and_model_names_suggest_the_closest():
    with pytest.raises(
        UnknownNameError, match="unknown env 'textgym/Copy-v1'. Did you mean 'textgym/Copy-v0'"
    ):
        plugin_manager.get("register_envs", "textgym/Copy-v1")
    with pytest.raises(
        UnknownNameError,
        match="Known models: chars, smollm2-135m-instruct, tiny-char-llama, tiny-random-llama",
    ):
        plugin_manager.get("register_models", "gpt2")
