import os

# Tests see only the built-in plugins unless a test installs one on purpose.
os.environ["TEXTGYM_DISABLE_PLUGIN_AUTOLOAD"] = "1"
os.environ.pop("TEXTGYM_PLUGINS", None)

import contextlib

import pytest
import torch

import textgym
from textgym import plugin_manager

# `pytest -n N` (make test runs two workers): each worker, and every process a test starts, takes its share of
# the cores, so that a test comparing a run in this process to one in a subprocess compares like with like,
# and two workers' torch threads do not fight over the same cores.
if WORKERS := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // WORKERS)))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# The longest files first: `make test`'s workers each take one and the short ones fill in around them, so
# the workers finish together (tests of one file stay on one worker: --dist loadfile).
LONGEST_FIRST = ["test_distributed.py", "test_reliability.py"]


def pytest_collection_modifyitems(items):
    def rank(item):
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: the order within a file, and of the other files, is kept
    # DeepSpeed on CPUs compiles its communication op with the C++ compiler at first use: `make test` needs
    # nothing but Python and make, so without one its ZeRO-3 tests are skipped, saying why. CI installs g++
    # and sets TEXTGYM_REQUIRE_COMPILER: there a missing compiler fails them.
    import shutil

    if shutil.which(os.environ.get("CXX", "c++")) or os.environ.get("TEXTGYM_REQUIRE_COMPILER"):
        return
    skip = pytest.mark.skip(
        reason="DeepSpeed ZeRO-3 on CPUs compiles an op, and there is no C++ compiler (g++)"
    )
    for item in items:
        if "zero3" in item.nodeid:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _sb3_logs_in_pytests_temp_dir(tmp_path_factory):
    """Tests that train Stable-Baselines3's own agents (textgym's set their loggers) would each leave an empty
    SB3-<time> folder in the system's temp dir."""
    os.environ.setdefault("SB3_LOGDIR", str(tmp_path_factory.mktemp("sb3-logs")))


@pytest.fixture(scope="session")
def tokenizer():
    return textgym.load_tokenizer("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer) of the tiny random Llama."""
    return textgym.load_model("tiny-random-llama")


@pytest.fixture(autouse=True)
def _no_plugin_outlives_its_test():
    """Plugins a test loads (files, @textgym.reward modules) are unregistered after it, so no test sees
    another's names."""
    plugin_manager.load_plugins()
    before = {name for name, _ in plugin_manager.pm.list_name_plugin()}
    yield
    for name, _ in plugin_manager.pm.list_name_plugin():
        if name not in before:
            with contextlib.suppress(Exception):
                plugin_manager.unregister_plugin(name)


@pytest.fixture
def register():
    """Register throwaway plugins for one test: ``register(obj, name)``; all are unregistered afterwards."""
    names = []

    def _register(plugin, name):
        plugin_manager.register_plugin(plugin, name=name)
        names.append(name)
        return plugin

    yield _register
    for name in names:
        with contextlib.suppress(Exception):
            plugin_manager.unregister_plugin(name)


def reward_plugin(name, fn):
    """A plugin object that registers ``fn`` (a batched function) as reward ``name``."""

    class Plugin:
        @staticmethod
        @textgym.hookimpl
        def register_rewards(register):
            register(name, lambda: textgym.FunctionReward(name, fn))

    return Plugin()


@pytest.fixture(scope="module")
def one_thread():
    """torch on one thread for a module's tests: the tiny models run fastest on one (two threads on a busy
    2-core machine take twice as long)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
