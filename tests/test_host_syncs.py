"""On a GPU, every read of a device tensor by the host (``float(t)``, ``bool(t)``, ``t.item()``, ``t.cpu()``,
selecting with a boolean mask, whose result size the host must learn) and every copy from host memory
(``t.to(device)``) waits for the device to finish its queued work. A rollout step makes one such crossing, or
two after a step on which an episode ended; an update's reads do not grow with its micro-batches. (Its
copies do: each micro-batch's rows go from the host-resident batch to the device.) These tests count the
calls textgym's own code makes (not torch's or transformers'); ``benchmarks/gpu_check.py`` counts the syncs
themselves on a GPU."""

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from lm_helpers import char_llama, make_env

import textgym
from textgym.agents.grpo import GRPO
from textgym.agents.ppo import LMPPO
from textgym.agents.rloo import RLOO
from textgym.sampling import rollout

CROSSINGS = ("__float__", "__bool__", "__int__", "__index__", "item", "tolist", "cpu", "to", "__getitem__")
PACKAGE = (Path(textgym.__file__).parent, Path(sys.modules[LMPPO.__module__].__file__).parent)


@pytest.fixture
def crossings(monkeypatch):
    """A Counter of host-device crossings (by method) called from files under ``PACKAGE``'s directories."""
    counts = Counter()
    ours = {}

    def ours_called(frame):
        name = frame.f_code.co_filename
        if name not in ours:
            ours[name] = any(Path(name).is_relative_to(root) for root in PACKAGE)
        # LMAgent.forward reads the batch's prompt mask, which lives on the host, to drop padding columns
        return ours[name] and not (frame.f_code.co_name == "forward" and name.endswith("forwards.py"))

    for method in CROSSINGS:
        original = getattr(torch.Tensor, method)

        def counted(self, *args, _original=original, _method=method, **kwargs):
            if _method == "to":  # a move to a device, not a dtype cast
                moves = isinstance(args[0] if args else kwargs.get("device"), (str, torch.device))
            elif _method == "__getitem__":  # a boolean mask: the result's size comes from the device
                moves = isinstance(args[0], torch.Tensor) and args[0].dtype == torch.bool
            else:
                moves = True
            if moves and ours_called(sys._getframe(1)):
                counts[_method] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, method, counted)
    return counts


@pytest.mark.parametrize("keep_hidden", [False, True])
def test_a_rollout_step_crosses_between_host_and_device_once_unless_an_episode_ended(crossings, keep_hidden):
    """Each step the chosen tokens come down; the rows' state goes up only on steps after an episode
    ended. The tokens fed back, the log-probs and the hidden states stay on the device."""
    env = make_env(n=8, max_new_tokens=12)
    steps, ended = Counter(), Counter()

    def step(actions, step=env.step):
        out = step(actions)
        steps.update(["step"])
        ended.update(["ended"] * bool((out[2] | out[3]).any()))
        return out

    env.step = step
    rollout(char_llama(), env, temperature=1.0, seed=0, keep_hidden=keep_hidden)
    assert 0 < ended["ended"] < steps["step"], "the rollout must have steps with and without an ending"
    downloads = steps["step"] + 1  # + the log-probs at the end
    uploads = (
        3 + ended["ended"]
    )  # the prompts, the tokens the env allows and the first state, + the state after each ending
    assert crossings["cpu"] == downloads and crossings["to"] == uploads, (dict(crossings), steps, ended)
    # once per rollout: the prompt columns to drop (a host tensor), whether the logits stayed finite
    assert sum(crossings.values()) - crossings["cpu"] - crossings["to"] <= 2, dict(crossings)


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [(LMPPO, dict(n_epochs=2, n_minibatches=2)), (GRPO, dict(num_generations=4, beta=0.04)),
     (RLOO, dict(num_generations=4, beta=0.04))],
)  # fmt: skip
def test_an_updates_host_reads_do_not_grow_with_its_micro_batches(crossings, cls, kwargs):
    """Statistics stay tensors until the update ends; a step reads back one flag (were its losses and its
    gradient norm finite). So splitting a minibatch into 8 micro-batches reads no more than 1 does."""
    reads = {}
    for micro in (None, 2):  # one micro-batch per minibatch, then 16 / 2 / 2 or 16 / 2 = 8 of them
        agent = cls(char_llama(), make_env(n=16), verbose=0, micro_batch_size=micro, **kwargs)
        batch = agent.collect_rollouts()
        crossings.clear()
        agent.train(batch)
        reads[micro] = (sum(v for k, v in crossings.items() if k != "to"), dict(crossings))
    assert reads[2][0] == reads[None][0], reads


def test_the_weights_finite_check_reads_back_once(crossings):
    agent = LMPPO(char_llama(), make_env(n=4), verbose=0)
    crossings.clear()
    assert agent.weights_are_finite()
    assert crossings["__bool__"] == 1 and len(agent.params) > 1, dict(crossings)
