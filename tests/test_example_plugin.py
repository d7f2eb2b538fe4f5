"""The example plugin package in docs/ installs with pip and its reward is usable by name."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parents[1] / "docs" / "example-plugin"

USE_BY_NAME = """
import textgym
env = textgym.TextGenEnv(model="chars", prompts="copy",
                         rewards=[{"name": "keyword_bonus", "keywords": ["ab"], "bonus": 2.0}], max_new_tokens=3,
                         max_prompt_tokens=3)
env.reset(seed=0)
for token in env.tokenizer.encode("ab"):
    env.step(token)
print(env.step(env.tokenizer.eos_token_id)[1])
print(textgym.load_prompts("polite-requests")[0].text)
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target), str(EXAMPLE)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}
    env.pop("TEXTGYM_DISABLE_PLUGIN_AUTOLOAD", None)
    return env


def run(code_or_args, env):
    args = ["-c", code_or_args] if isinstance(code_or_args, str) else ["-m", "textgym", *code_or_args]
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=120)


def test_installed_plugin_reward_and_prompts_are_used_by_name(installed):
    result = run(USE_BY_NAME, installed)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["2.0", "Ask a neighbour to water your plants."]


def test_textgym_plugins_lists_the_entry_point(installed):
    result = run(["plugins", "--json"], installed)
    assert result.returncode == 0, result.stderr
    row = next(r for r in json.loads(result.stdout) if r["name"] == "example")
    assert row["source"] == "entry point textgym_example in textgym-example-plugin 0.1.0"
    assert row["registers"] == {"reward": ["keyword_bonus"], "prompt source": ["polite-requests"]}


def test_autoload_can_be_disabled(installed):
    result = run(["plugins", "--json"], {**installed, "TEXTGYM_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert "example" not in {r["name"] for r in json.loads(result.stdout)}


def a_distribution(site, group, value, module_text):
    """A distribution as pip installs it (the module and its .dist-info with entry_points.txt), in ``site``;
    returns the environment of a Python that sees it."""
    info = site / "wrongplug-0.1.dist-info"
    info.mkdir(parents=True)
    (site / "wrongplug.py").write_text(module_text)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: wrongplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{group}]\nwrong = {value}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    env.pop("TEXTGYM_DISABLE_PLUGIN_AUTOLOAD", None)
    return env


WRONG_PLUGIN = """
import textgym


class WrongPlugin:
    @textgym.hookimpl
    def register_rewards(self, register):
        register("wrongreward", lambda: textgym.FunctionReward("wrongreward", lambda ss: [1.0] * len(ss)))
"""


def test_an_entry_point_in_another_group_or_naming_a_class_is_said_plainly(tmp_path):
    """[project.entry-points."textgym.plugins"] was ignored without a word (the reward was just unknown), and
    an entry point naming a class failed with "register_rewards() missing 1 required positional argument"."""
    env = a_distribution(tmp_path / "a", "textgym.plugins", "wrongplug:WrongPlugin", WRONG_PLUGIN)
    result = run(["plugins"], env)
    assert result.returncode == 0, result.stderr
    assert (
        "entry points in group 'textgym.plugins' (wrong = wrongplug:WrongPlugin) are not loaded: textgym loads "
        "the group 'textgym'" in result.stderr
    )
    env = a_distribution(tmp_path / "b", "textgym", "wrongplug:WrongPlugin", WRONG_PLUGIN)
    result = run(["plugins"], env)
    assert result.returncode != 0
    assert (
        "plugin 'wrong' (entry point wrongplug:WrongPlugin in wrongplug 0.1) names the class WrongPlugin, whose "
        "hooks take self (register_rewards): name a module, or an instance" in result.stderr
    )
    fixed = WRONG_PLUGIN + "\n\nplugin = WrongPlugin()\n"
    env = a_distribution(tmp_path / "c", "textgym", "wrongplug:plugin", fixed)
    result = run(["plugins"], env)
    assert result.returncode == 0 and "wrongreward" in result.stdout, result.stderr


def test_importing_textgym_with_a_broken_installed_plugin_names_it(tmp_path):
    """`import textgym` went through silently and gymnasium.make("textgym/Copy-v0") then said only that the
    namespace was not found: the plugin that broke the loading was named nowhere."""
    env = a_distribution(tmp_path, "textgym", "wrongplug", "import numpyy\n")
    script = "import textgym, gymnasium\ngymnasium.make('textgym/Copy-v0')\n"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode != 0
    assert (
        "RuntimeWarning: textgym's plugins did not load, so its envs, rewards and agents are not registered: "
        "plugin 'wrong' (entry point wrongplug in wrongplug 0.1) failed to load: ModuleNotFoundError"
    ) in result.stderr
    cli = run(["plugins"], env)  # the CLI says it once, as its one-line error
    assert cli.returncode != 0 and "RuntimeWarning" not in cli.stderr and "plugin 'wrong'" in cli.stderr
    # that one package is skipped by name (TEXTGYM_DISABLE_PLUGIN_AUTOLOAD=1 skipped every installed one)
    assert "Fix or uninstall it, or skip it: TEXTGYM_BLOCK_PLUGINS=wrong." in cli.stderr
    skipped = run(["plugins"], {**env, "TEXTGYM_BLOCK_PLUGINS": "other, wrong"})
    assert skipped.returncode == 0, skipped.stderr
    assert (
        "TEXTGYM_BLOCK_PLUGINS names 'other', which no installed package's 'textgym' entry point"
        in skipped.stderr
    )
    assert (
        "wrong  (entry point wrongplug in wrongplug 0.1)\n    (skipped: TEXTGYM_BLOCK_PLUGINS)"
        in skipped.stdout
    )
    by_package = run(["plugins"], {**env, "TEXTGYM_BLOCK_PLUGINS": "wrongplug"})  # the package's name
    assert (
        "('wrongplug' is the package of entry point 'wrong'): give the entry point's name"
        in by_package.stderr
    )


def test_an_installed_plugin_that_takes_a_registered_name_can_be_skipped_alone(tmp_path):
    """A package registering a built-in's name broke every command, `textgym plugins` included, and the only
    way out turned off every installed plugin."""
    clash = WRONG_PLUGIN.replace('"wrongreward"', '"match"') + "\n\nplugin = WrongPlugin()\n"
    env = a_distribution(tmp_path, "textgym", "wrongplug:plugin", clash)
    result = run(["plugins"], env)
    assert result.returncode != 0
    assert "reward 'match' is registered twice" in result.stderr
    assert "(or skip it: TEXTGYM_BLOCK_PLUGINS=wrong)" in result.stderr
    assert run(["plugins", "match"], {**env, "TEXTGYM_BLOCK_PLUGINS": "wrong"}).returncode == 0
    # a package whose module registers the name with @textgym.reward: the hint names its entry point
    decorated = (
        "import textgym\n\n@textgym.reward('match')\ndef match(samples):\n    return [1.0] * len(samples)\n"
    )
    env = a_distribution(tmp_path / "d", "textgym", "wrongplug", decorated)
    result = run(["plugins"], env)
    assert "(or skip it: TEXTGYM_BLOCK_PLUGINS=wrong)" in result.stderr, result.stderr


def test_a_bench_runs_identity_holds_the_version_of_each_plugin_package_it_uses(tmp_path):
    """A new version of an installed plugin package was reused silently. A run's identity (and a metric's,
    and a proxy model's gold stack's) names the versions, and the code, of the packages that registered a
    name it uses, and only those."""
    fixed = WRONG_PLUGIN + "\n\nplugin = WrongPlugin()\n"
    env = a_distribution(tmp_path, "textgym", "wrongplug:plugin", fixed)
    script = (
        "import json\nfrom textgym.bench_identity import identity\n"
        "run = {'run': {}, 'env': {'id': 'textgym/Copy-v0', 'rewards': ['wrongreward weight=2', {'name': 'match'}]},"
        " 'agent': {'name': 'lmppo'}}\n"
        "plain = {'run': {}, 'env': {'id': 'textgym/Copy-v0', 'rewards': [{'name': 'match'}]}, 'agent': {}}\n"
        "print(json.dumps([identity(run).get('packages'), identity(plain).get('packages')]))\n"
    )
    read = lambda: subprocess.run(  # noqa: E731
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    result = read()
    assert result.returncode == 0, result.stderr
    first, plain = json.loads(result.stdout)
    assert list(first) == ["wrongplug"] and first["wrongplug"].startswith("0.1 (code ") and plain is None
    code = first["wrongplug"].split()[1:]  # (no RECORD hashes here: the module's file, as imported)
    metadata = tmp_path / "wrongplug-0.1.dist-info" / "METADATA"
    metadata.write_text(metadata.read_text().replace("Version: 0.1", "Version: 0.2"))
    assert json.loads(read().stdout)[0] == {"wrongplug": " ".join(["0.2", *code])}
    # a package whose module registers the reward with @textgym.reward (a plugin of its own, "FILE::fn")
    decorated = "import textgym\n\n@textgym.reward('wrongreward')\ndef wrongreward(samples):\n    return [1.0] * len(samples)\n"
    env.update(a_distribution(tmp_path / "d", "textgym", "wrongplug", decorated))
    assert json.loads(read().stdout)[0]["wrongplug"].startswith("0.1 (code ")


def test_textgym_plugins_lists_an_installed_packages_decorated_rewards_under_its_entry_point(tmp_path):
    """A package whose module registers its rewards with @textgym.reward was listed as "(registers nothing)",
    its rewards under a site-packages file of their own."""
    decorated = "import textgym\n\n@textgym.reward('wrongreward')\ndef wrongreward(samples):\n    return [1.0] * len(samples)\n"
    env = a_distribution(tmp_path, "textgym", "wrongplug", decorated)
    result = run(["plugins"], env)
    assert result.returncode == 0, result.stderr
    assert (
        "wrong  (entry point wrongplug in wrongplug 0.1)\n    (@textgym.reward: wrongreward)" in result.stdout
    )


EDITABLE_FINDER = """
import importlib.abc, importlib.util, sys

class Finder(importlib.abc.MetaPathFinder):  # as pip install -e's: after Python's own path finder
    def find_spec(self, name, path=None, target=None):
        if name == "wrongplug":
            init = {init!r}
            return importlib.util.spec_from_file_location(name, init, submodule_search_locations=[])

sys.meta_path.append(Finder())
"""


def test_an_installed_plugin_that_registers_nothing_is_said_with_the_folder_that_hid_it(tmp_path):
    """An editable install run from its project folder (`alignrew/alignrew/...`): Python's path finder
    found the project folder first, an empty namespace package; the plugin loaded, registered nothing, and
    its env was just 'not found'."""
    env = a_distribution(tmp_path / "site", "textgym", "wrongplug", "")
    (tmp_path / "site" / "wrongplug.py").unlink()  # found by the editable install's finder instead
    init = tmp_path / "src" / "wrongplug" / "__init__.py"
    init.parent.mkdir(parents=True)
    init.write_text(
        "import textgym\n\n@textgym.hookimpl\ndef register_rewards(register):\n"
        "    register('wrongreward', lambda: textgym.FunctionReward('wrongreward', lambda ss: [1.0] * len(ss)))\n"
    )
    script = EDITABLE_FINDER.format(init=str(init)) + (
        "import textgym.plugin_manager as m; m.load_plugins(); print('wrongreward' in m.registry('register_rewards'))"
    )

    def python(cwd):
        return subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
        )

    found = python(tmp_path)
    assert found.stdout.strip() == "True", found.stderr
    assert "registers nothing" not in found.stderr
    (tmp_path / "wrongplug").mkdir()  # the project folder, without __init__.py, in the current directory
    hidden = python(tmp_path)
    assert hidden.stdout.strip() == "False"
    assert (
        "plugin 'wrong' (entry point wrongplug in wrongplug 0.1) implements none of textgym's hooks "
        "(register_agents, register_envs, register_models, register_prompt_sources, register_responders, "
        "register_rewards), so it registers nothing: it imported as the folder 'wrongplug' in the current "
        "directory, which has no __init__.py"
    ) in " ".join(hidden.stderr.split())
    init.write_text("")  # a package with no hooks at all
    empty = python(tmp_path / "src")
    assert "so it registers nothing." in " ".join(empty.stderr.split())


def test_a_plugin_of_reward_functions_imported_before_textgym_loads_is_not_said_to_register_nothing(tmp_path):
    """Importing the package ran its @textgym.reward, which loaded the plugins while the package was half
    imported: its entry point had no hooks yet, and the warning said it registered nothing."""
    module = "import textgym\n\n@textgym.reward('wrongreward')\ndef wrongreward(samples):\n    return [1.0 for _ in samples]\n"
    env = a_distribution(tmp_path, "textgym", "wrongplug", module)
    script = "import wrongplug, textgym.plugin_manager as m; print('wrongreward' in m.registry('register_rewards'))"
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.stdout.strip() == "True", result.stderr
    assert "registers nothing" not in result.stderr
