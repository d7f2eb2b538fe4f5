"""SB3's get_parameters, set_parameters and set_random_seed on the LM agents."""

import copy

import pytest
import torch
from lm_helpers import char_llama, iterations, make_env

from textgym import TextGenVectorEnv
from textgym.agents.grpo import GRPO
from textgym.agents.ppo import LMPPO
from textgym.errors import ConfigError

FAST = dict(learning_rate=3e-3, verbose=0)
LORA = {"r": 4, "target_modules": ["q_proj", "v_proj"]}


def weights(agent):
    """Every tensor of the agent's parameters, copied, by (name, key)."""
    params = agent.get_parameters()
    optimizer = params.pop("optimizer")
    out = {(name, k): v.clone() for name, sd in params.items() for k, v in sd.items()}
    for i, state in optimizer["state"].items():
        out.update({("optimizer", i, k): v.clone() for k, v in state.items()})
    return out


def assert_same(a, b):
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=str(key))


def differs(a, b):
    return any(not torch.equal(a[k], b[k]) for k in a.keys() & b.keys())


def lm_env(n=2):
    return TextGenVectorEnv(
        num_envs=n, model="tiny-random-llama", prompts=["Hi", "Why?"], max_new_tokens=4,
        rewards=[{"name": "length_penalty", "target": 2}], autoreset_mode="Disabled",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("cls", "names"), [(LMPPO, ["policy", "value_head", "optimizer"]), (GRPO, ["policy", "optimizer"])]
)
def test_get_parameters_names_the_policy_the_agents_modules_and_the_optimizer(cls, names):
    agent = cls(char_llama(), make_env(8), seed=0, **FAST)
    params = agent.get_parameters()
    assert list(params) == names
    assert params["policy"].keys() == agent.rollout_model.state_dict().keys()
    assert params["optimizer"].keys() == {"state", "param_groups"}


def test_set_parameters_from_another_agents_parameters_gives_its_weights_optimizer_and_actions():
    trained = iterations(LMPPO(char_llama(), make_env(8), seed=0, **FAST), 2)
    fresh = LMPPO(char_llama(), make_env(8), seed=1, **FAST)
    assert differs(weights(trained), weights(fresh))
    fresh.set_parameters(trained.get_parameters())
    assert_same(weights(fresh), weights(trained))
    obs, _ = make_env(8).reset(seed=0)
    assert (fresh.predict(obs, deterministic=True)[0] == trained.predict(obs, deterministic=True)[0]).all()
    assert fresh.iteration == 0  # counters stay the agent's


def test_a_deep_copied_snapshot_puts_the_weights_back_after_training_again_and_again():
    """The optimizer took the given state's tensors as its own: training after a restore changed the
    snapshot, and a second restore brought back moved moments (and two agents shared theirs)."""
    agent = iterations(LMPPO(char_llama(), make_env(8), seed=0, **FAST), 1)
    before = weights(agent)
    snapshot = copy.deepcopy(agent.get_parameters())
    for _ in range(2):
        iterations(agent, 1)
        assert differs(weights(agent), before)
        agent.set_parameters(snapshot)
        assert_same(weights(agent), before)
    other = LMPPO(char_llama(), make_env(8), seed=1, **FAST)
    other.set_parameters(agent.get_parameters())
    iterations(other, 1)
    assert_same(weights(agent), before)


def test_set_parameters_keeps_the_agents_learning_rate_and_weight_decay():
    """The optimizer state holds the settings it was saved with; the agent keeps its config's, as load does."""
    source = LMPPO(char_llama(), make_env(8), seed=0, **{**FAST, "learning_rate": 1e-2, "weight_decay": 0.5})
    agent = LMPPO(char_llama(), make_env(8), seed=0, **FAST)
    agent.set_parameters(source.get_parameters())
    settings = {(g["lr"], g["weight_decay"]) for g in agent.optimizer.param_groups}
    assert settings == {(3e-3, agent.config.weight_decay)} and agent.config.weight_decay != 0.5


def test_set_parameters_from_a_checkpoint_directory(tmp_path):
    trained = iterations(LMPPO(char_llama(), make_env(8), seed=0, **FAST), 2)
    trained.save(tmp_path / "ckpt")
    fresh = LMPPO(char_llama(), make_env(8), seed=1, **FAST)
    fresh.set_parameters(str(tmp_path / "ckpt.zip"))  # SB3's name for it, as load takes it
    assert_same(weights(fresh), weights(trained))


def test_a_lora_agents_parameters_come_from_its_checkpoints_adapter(tmp_path):
    env = lm_env()
    trained = LMPPO("tiny-random-llama", env, lora=LORA, seed=0, **FAST)
    iterations(trained, 2)
    trained.save(tmp_path / "lora")
    fresh = LMPPO("tiny-random-llama", env, lora=LORA, seed=1, **FAST)
    assert differs(weights(trained), weights(fresh))
    fresh.set_parameters(tmp_path / "lora")
    assert_same(weights(fresh), weights(trained))
    # the adapter goes onto this agent's base weights, with its scaling: both must be made alike
    for settings, seed, message in [
        ({**LORA, "r": 2}, 0, "was trained with lora = .*this agent has lora = .*'r': 2"),
        ({**LORA, "lora_alpha": 32}, 0, "was trained with lora = .*this agent has lora = .*'lora_alpha': 32"),
    ]:
        other = LMPPO("tiny-random-llama", env, lora=settings, seed=seed, **FAST)
        before = weights(other)
        with pytest.raises(ConfigError, match=message):
            other.set_parameters(tmp_path / "lora")
        assert_same(weights(other), before)
    pissa = {**LORA, "init_lora_weights": "pissa_niter_2"}  # the seed makes the residual base weights
    LMPPO("tiny-random-llama", env, lora=pissa, seed=0, **FAST).save(tmp_path / "pissa")
    with pytest.raises(
        ConfigError, match="trained from seed 0, this agent from 3: .*Make the agent with seed = 0"
    ):
        LMPPO("tiny-random-llama", env, lora=pissa, seed=3, **FAST).set_parameters(tmp_path / "pissa")
    LMPPO("tiny-random-llama", env, lora=pissa, seed=0, **FAST).set_parameters(tmp_path / "pissa")
    whole = LMPPO("tiny-random-llama", env, seed=0, **FAST)
    with pytest.raises(ConfigError, match="holds a LoRA adapter, and this agent trains the whole policy"):
        whole.set_parameters(tmp_path / "lora")


def test_another_agents_checkpoint_gives_its_policy_only_when_exact_match_is_off(tmp_path):
    grpo = iterations(GRPO(char_llama(), make_env(8), seed=0, num_generations=2, **FAST), 1)
    grpo.save(tmp_path / "grpo")
    agent = LMPPO(char_llama(), make_env(8), seed=1, **FAST)
    before = weights(agent)
    with pytest.raises(ValueError, match=r"lack 'value_head', 'optimizer' of this lmppo agent's"):
        agent.set_parameters(tmp_path / "grpo")
    assert_same(weights(agent), before)
    agent.set_parameters(tmp_path / "grpo", exact_match=False)
    after = weights(agent)
    assert_same(
        {k: v for k, v in after.items() if k[0] == "policy"},
        {k: v for k, v in weights(grpo).items() if k[0] == "policy"},
    )
    assert_same(
        {k: v for k, v in after.items() if k[0] != "policy"},
        {k: v for k, v in before.items() if k[0] != "policy"},
    )


def test_bad_parameters_are_refused_by_name_before_anything_changes():
    agent = LMPPO(char_llama(), make_env(8), seed=0, **FAST)
    other = LMPPO(char_llama(), make_env(8), seed=1, **FAST)
    before = weights(agent)
    good = other.get_parameters()
    small = char_llama(vocab_size=12).state_dict()  # another vocabulary: the embeddings' shape differs
    bad_optimizer = {
        **good["optimizer"],
        "param_groups": [{**good["optimizer"]["param_groups"][0], "params": [0]}],
    }
    cases = [
        ({**good, "critic": {}}, r"name 'critic', which this lmppo agent has not: it has \['policy', 'value_head', 'optimizer'\]"),
        ({k: v for k, v in good.items() if k != "value_head"}, r"lack 'value_head'"),
        ({**good, "policy": {k: v for k, v in good["policy"].items() if "layers.1." not in k}}, r"\['policy'\] does not fit the agent's policy: missing keys 'model.layers.1"),
        ({**good, "policy": small}, r"\['policy'\]\['model.embed_tokens.weight'\] has shape \(12, 32\), the agent's \(10, 32\)"),
        ({**good, "optimizer": bad_optimizer}, r"holds \[1\] parameters per group, the agent's optimizer \[\d+\]"),
        ({**good, "value_head": torch.zeros(3)}, r"\['value_head'\] must be a state dict, not Tensor"),
    ]  # fmt: skip
    for params, message in cases:
        with pytest.raises(ValueError, match=message):
            agent.set_parameters(params)
        assert_same(weights(agent), before)
    with pytest.raises(ValueError, match="has shape"):  # without exact_match too: a shape cannot load
        agent.set_parameters({"policy": small}, exact_match=False)
    # an optimizer's state of another model's parameters, as many of them: failed in a later step, or read
    # the wrong memory
    bigger = iterations(LMPPO(char_llama(vocab_size=12), make_env(8), seed=0, **FAST), 1)
    wrong = {"optimizer": bigger.get_parameters()["optimizer"]}
    with pytest.raises(
        ValueError, match=r"state 'exp_avg' of parameter 0 has shape \(12, 32\), the parameter \(10, 32\)"
    ):
        agent.set_parameters(wrong, exact_match=False)
    # keys that are all another model's (a LoRA policy's, given to a whole one) loaded nothing, silently
    renamed = {"base_model.model." + k: v for k, v in good["policy"].items()}
    with pytest.raises(ValueError, match=r"\['policy'\] shares no key with the agent's policy"):
        agent.set_parameters({"policy": renamed}, exact_match=False)
    # an array is no tensor: load_state_dict refused it after the policy had loaded
    arrays = {k: v.numpy() for k, v in good["value_head"].items()}
    with pytest.raises(ValueError, match=r"\['value_head'\]\['.*'\] is a ndarray, not a torch tensor"):
        agent.set_parameters({**good, "value_head": arrays})
    assert_same(weights(agent), before)


def test_set_parameters_of_a_checkpoint_that_is_not_there_or_not_complete(tmp_path):
    agent = LMPPO(char_llama(), make_env(8), seed=0, **FAST)
    with pytest.raises(ConfigError, match="does not exist: give the directory LMPPO.save wrote"):
        agent.set_parameters(tmp_path / "nope")
    (tmp_path / "half").mkdir()
    with pytest.raises(ConfigError, match="is not a complete LMPPO checkpoint"):
        agent.set_parameters(tmp_path / "half")


def test_a_sharded_agent_refuses_both_and_names_save_and_load(monkeypatch):
    agent = LMPPO(char_llama(), make_env(8), seed=0, **FAST)
    monkeypatch.setattr(LMPPO, "sharded", property(lambda self: True))
    monkeypatch.setattr(LMPPO, "sharding_engine", property(lambda self: "fsdp"))
    for call in (agent.get_parameters, lambda: agent.set_parameters({})):
        with pytest.raises(
            ConfigError, match=r"sharded over processes \(fsdp\): save\(\) and load\(\) gather"
        ):
            call()


def test_set_random_seed_reseeds_the_rollouts_and_is_saved(tmp_path):
    def rollout(agent):
        return agent.collect_rollouts().response_ids

    a = LMPPO(char_llama(), make_env(8), seed=0, **FAST)
    b = LMPPO(char_llama(), make_env(8), seed=1, **FAST)
    assert not torch.equal(rollout(a), rollout(b))
    a, b = LMPPO(char_llama(), make_env(8), seed=0, **FAST), LMPPO(char_llama(), make_env(8), seed=1, **FAST)
    b.set_random_seed(0)
    assert torch.equal(rollout(a), rollout(b))
    b.set_random_seed(None)  # SB3's: nothing changes
    assert b.config.seed == 0
    b.save(tmp_path / "b")
    assert LMPPO.load(tmp_path / "b").seed == 0
    with pytest.raises(ConfigError, match=r"seed must be an integer in \[0, 2\*\*32\), not -1"):
        b.set_random_seed(-1)
    assert b.seed == 0


def test_sb3_callbacks_find_the_episodes_in_ep_info_buffer_and_the_envs_spaces():
    """A callback of SB3's kind reads ``self.model.ep_info_buffer`` (Monitor's r and l) at the end of a rollout,
    and ``n_envs`` and the spaces: LM agents had none of them."""
    from stable_baselines3.common.callbacks import BaseCallback

    class MeanReturn(BaseCallback):
        def _on_rollout_end(self):
            self.seen = [dict(e) for e in self.model.ep_info_buffer]

        def _on_step(self):
            return True

    env = make_env(8)
    agent = LMPPO(char_llama(), env, seed=0, **FAST)
    assert (agent.n_envs, agent.observation_space, agent.action_space) == (
        8, env.single_observation_space, env.single_action_space
    )  # fmt: skip
    callback = MeanReturn()
    agent.learn(1, callback=callback)
    assert len(callback.seen) == 8 and {"r", "l", "t"} <= callback.seen[0].keys()
    assert sum(e["r"] for e in callback.seen) / 8 == pytest.approx(agent.history[-1]["reward"])
    assert [e["l"] for e in callback.seen] == [e["num_tokens"] for e in agent.last_episodes]
    for _ in range(13):  # the last 100 episodes, as SB3 keeps them
        agent.learn(1, reset_num_timesteps=False)
    assert len(agent.ep_info_buffer) == 100
    times = [e["t"] for e in agent.ep_info_buffer]
    assert times == sorted(times)  # seconds since the record began, through learn()s that continue it
    agent.learn(1)  # reset_num_timesteps=True: a new record, as SB3's
    assert len(agent.ep_info_buffer) == 8


def test_the_documented_export_of_a_randomized_pissa_run_is_the_trained_policy(tmp_path):
    """The advice was peft's merge_and_unload on the adapter: PeftModel.from_pretrained reruns a randomized
    PiSSA unseeded, onto another residual base. Loading with the agent class remakes it from the seed."""
    from textgym.models import load_model

    pissa = {**LORA, "init_lora_weights": "pissa_niter_2"}
    agent = iterations(
        LMPPO("tiny-random-llama", lm_env(4), lora=pissa, seed=3, learning_rate=5e-2, verbose=0), 2
    )
    batch = agent.collect_rollouts()
    trained = agent.sequence_logprobs(agent.rollout_model, batch)[0]
    agent.save(tmp_path / "ckpt")
    LMPPO.load(tmp_path / "ckpt").policy.merge_and_unload().save_pretrained(tmp_path / "merged")
    load_model("tiny-random-llama")[1].save_pretrained(tmp_path / "merged")
    merged, _ = load_model(str(tmp_path / "merged"))
    with torch.no_grad():
        torch.testing.assert_close(
            agent.sequence_logprobs(merged.eval(), batch)[0], trained, rtol=0, atol=1e-5
        )
