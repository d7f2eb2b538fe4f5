"""What LMAgent gives every LM agent: reward composition over the whole batch, schedules, guards."""

import json
import math
import re
import sys
import warnings

import numpy as np
import pytest
import torch
from lm_helpers import CHARS, char_llama, iterations, make_env, share_of_a

from textgym import FunctionReward, RewardStack, TextGenVectorEnv
from textgym.agents.base import cpu_has_native_bf16
from textgym.agents.grpo import GRPO
from textgym.agents.ppo import LMPPO
from textgym.atomic import is_complete
from textgym.composition import WeightSchedule
from textgym.errors import ConfigError, TrainingError


def env_with(stack, n=16, **kwargs):
    return TextGenVectorEnv(
        num_envs=n, model=CHARS, prompts="copy", max_new_tokens=6, max_prompt_tokens=3, rewards=stack,
        autoreset_mode="Disabled", **kwargs,
    )  # fmt: skip


def length(samples):
    return [float(len(s.completion)) for s in samples]


def test_normalize_then_sum_standardises_over_the_whole_batch_not_per_step():
    stack = RewardStack(
        [(FunctionReward("a", share_of_a), 1.0), (FunctionReward("len", length), 1.0)],
        aggregate="normalize_then_sum",
    )
    agent = LMPPO(char_llama(), env_with(stack), verbose=0)
    batch = agent.collect_rollouts()
    components = {
        name: np.array([e["reward_components"][name] for e in batch.episodes], dtype=float)
        for name in ("a", "len")
    }
    assert len({e["num_tokens"] for e in batch.episodes}) > 1  # episodes ended on different steps
    expected = sum((v - v.mean()) / v.std() for v in components.values())
    np.testing.assert_allclose(batch.raw_scores.numpy(), expected, atol=1e-5)
    assert [e["reward"] for e in batch.episodes] == pytest.approx(expected.tolist(), abs=1e-5)


def test_weight_schedules_follow_training_progress():
    schedule = WeightSchedule(start=1.0, end=0.0)
    stack = RewardStack([(FunctionReward("a", share_of_a), schedule), (FunctionReward("len", length), 0.0)])
    env = env_with(stack)
    agent = GRPO(char_llama(), env, num_generations=4, verbose=0)
    agent.learn(16 * 6 * 3)
    assert 0.5 < stack.progress < 1.0  # set before the last iteration's rollout
    assert stack.weights["a"] == pytest.approx(1.0 - stack.progress)


def test_not_applicable_components_are_left_out_of_the_statistics():
    def only_short(samples):
        return [1.0 if len(s.completion) < 3 else None for s in samples]

    stack = RewardStack([(FunctionReward("short", only_short), 1.0), (FunctionReward("a", share_of_a), 1.0)])
    agent = LMPPO(char_llama(), env_with(stack), verbose=0)
    batch = agent.collect_rollouts()
    values = [e["reward_components"]["short"] for e in batch.episodes]
    assert None in values and 1.0 in values
    assert batch.stats["rewards/short/mean"] == 1.0 and batch.stats["rewards/short/std"] == 0.0


def test_a_component_that_applied_to_no_episode_has_no_std_and_a_batch_none_applied_to_is_warned_of():
    """Its std read 0.0 beside a NaN mean (as if the values had agreed), and a batch where no plugin
    applied trained on totals of 0 without a word."""

    calls = []

    def one_short(samples):  # applies to one episode of the batch: the first it scores
        calls.append(len(samples))
        return [1.0 if len(calls) == 1 and i == 0 else None for i in range(len(samples))]

    def never(samples):
        return [None] * len(samples)

    agent = LMPPO(char_llama(), env_with(RewardStack([(FunctionReward("one", one_short), 1.0),
                                                      (FunctionReward("never", never), 1.0)])), verbose=0)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one plugin applied: nothing to warn of
        stats = agent.collect_rollouts().stats
    assert stats["rewards/one/mean"] == 1.0 and math.isnan(stats["rewards/one/std"])
    assert math.isnan(stats["rewards/never/mean"]) and math.isnan(stats["rewards/never/std"])
    agent = LMPPO(char_llama(), env_with(RewardStack([(FunctionReward("never", never), 1.0)])), verbose=0)
    with pytest.warns(
        UserWarning, match=r"no reward plugin applied to any episode of a batch \(each of 'never'"
    ):
        batch = agent.collect_rollouts()
    assert (batch.raw_scores == 0).all()


def test_a_batch_of_one_episode_has_no_reward_std():
    """Its reward_std read 0.0, as if several returns had agreed, where its components' stds read nan."""
    stats = LMPPO(char_llama(), make_env(1), n_minibatches=1, verbose=0).collect_rollouts().stats
    assert math.isfinite(stats["reward"]) and math.isnan(stats["reward_std"])
    assert math.isnan(stats["rewards/share_of_a/std"])


def test_an_absurd_reward_stops_training_before_the_update_and_names_the_plugin():
    def huge(samples):
        return [1e20] * len(samples)

    stack = RewardStack([(FunctionReward("a", share_of_a), 1.0), (FunctionReward("huge", huge), 1.0)])
    agent = LMPPO(char_llama(), env_with(stack), verbose=0)
    before = [p.detach().clone() for p in agent.params]
    with pytest.raises(TrainingError, match=r"reward plugin 'huge' returned 1e\+20.*max_abs_score=1e\+06"):
        agent.learn(1)
    assert all(torch.equal(a, b) for a, b in zip(before, agent.params))


def test_an_absurd_turn_reward_names_the_responder_not_a_reward_plugin():
    from textgym import Reply

    def game(conversations):  # a game whose turn reward is (mis)scaled
        return [Reply("b", reward=1e6, done=c.agent_turns >= 2) for c in conversations]

    stack = RewardStack([(FunctionReward("share_of_a", share_of_a), 1.0)])
    env = TextGenVectorEnv(num_envs=4, model=CHARS, prompts=["ab"], rewards=stack, responder=game, max_new_tokens=8,
                           max_prompt_tokens=3, chat_template=False, autoreset_mode="Disabled")  # fmt: skip
    with pytest.raises(
        TrainingError, match=r"the responder's turn rewards sum to [12]e\+06 .*episode's return"
    ):
        LMPPO(char_llama(), env, verbose=0, n_epochs=1).learn(1)


@pytest.mark.parametrize("cls", [LMPPO, GRPO])
def test_a_diverging_learning_rate_stops_training_and_never_checkpoints_broken_weights(cls, tmp_path):
    kwargs = {"num_generations": 4} if cls is GRPO else {}
    agent = iterations(cls(char_llama(), make_env(), learning_rate=1e-3, verbose=0, **kwargs), 1)
    agent.save(tmp_path / "ckpt")
    saved = (tmp_path / "ckpt" / "state.json").read_text()
    for group in agent.optimizer.param_groups:
        group["lr"] = 1e6
    agent.config.learning_rate = 1e6
    # the advice is one a resume can follow: it refuses a new learning rate, and would diverge again
    advice = r"a --resume would diverge the same way\): start a new run with a lower learning_rate"
    with pytest.raises(
        TrainingError, match=r"no longer finite after iteration \d+: the update diverged.*" + advice
    ):
        for _ in range(5):
            agent.learn(1, reset_num_timesteps=False)
    with pytest.raises(TrainingError, match="No checkpoint was written"):
        agent.save(tmp_path / "ckpt")
    assert is_complete(tmp_path / "ckpt") and (tmp_path / "ckpt" / "state.json").read_text() == saved


def test_non_finite_losses_skip_the_optimizer_step_and_are_counted():
    agent = LMPPO(char_llama(), make_env(), verbose=0)
    agent.optimizer.zero_grad()
    assert not agent.backward(torch.tensor(math.nan, requires_grad=True))
    before = [p.detach().clone() for p in agent.params]
    assert not agent.optimizer_step()
    assert agent.skipped_steps == 1 and all(torch.equal(a, b) for a, b in zip(before, agent.params))


needs_bf16 = pytest.mark.skipif(
    not cpu_has_native_bf16(), reason="bf16 on a CPU without native bf16 is refused (torch would emulate it)"
)


def tiny_env(n=8, tokens=16):
    return TextGenVectorEnv(
        num_envs=n, model="tiny-random-llama", prompts="chat", max_new_tokens=tokens,
        rewards=[{"name": "length_penalty", "target": 8}], autoreset_mode="Disabled",
    )  # fmt: skip


@needs_bf16
@pytest.mark.parametrize(("cls", "kwargs"), [(LMPPO, {}), (GRPO, {"num_generations": 4})])
def test_in_bf16_the_rollout_samples_in_bf16_and_the_behaviour_logprobs_are_a_training_forwards(cls, kwargs):
    """Every forward of the policy runs in bf16, the rollout's included, with its linear weights cast once
    per rollout; the behaviour log-probs come from a whole-sequence forward like training's, so over the
    same rows the ratio before the first update is exactly 1 (from the rollout's own log-probs it was off by
    up to 1.7e-3 here)."""
    agent = cls("tiny-random-llama", tiny_env(), bf16=True, verbose=0, **kwargs)
    params = {name: (p, p.detach().clone()) for name, p in agent.rollout_model.named_parameters()}
    seen = []
    head = agent.rollout_model.get_output_embeddings()
    head.register_forward_hook(
        lambda m, i, o: seen.append((torch.is_autocast_enabled("cpu"), m.weight.dtype))
    )
    batch, _ = agent.generate()
    assert set(seen[:-1]) == {(True, torch.bfloat16)}  # the rollout's forwards, on the cast weights
    assert seen[-1] == (True, torch.float32)  # the whole-sequence forward, on the fp32 parameters
    for name, p in agent.rollout_model.named_parameters():  # the fp32 parameters are back, unchanged
        assert p is params[name][0] and p.dtype == torch.float32 and torch.equal(p, params[name][1])
    with torch.no_grad():
        logprobs, _, _ = agent.policy_logprobs(batch)
    assert torch.equal(logprobs * batch.action_mask, batch.logprobs)
    seen.clear()
    agent.predict(agent.env.reset(seed=0)[0])  # SB3's predict: in the agent's precision too
    assert seen == [(True, torch.float32)]


@needs_bf16
def test_bf16_linear_weights_give_autocasts_rollout_and_put_the_parameters_back():
    from textgym.agents.precision import bf16_linear_weights
    from textgym.models import load_model
    from textgym.sampling import rollout

    model, env = load_model("tiny-random-llama")[0], tiny_env(n=4, tokens=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = rollout(model, env, seed=3)
        with bf16_linear_weights(model):
            assert model.get_output_embeddings().weight.dtype == torch.bfloat16
            # tied: the embedding keeps fp32
            assert model.get_input_embeddings().weight.dtype == torch.float32
            got = rollout(model, env, seed=3)
    assert [e["completion"] for e in got.infos] == [e["completion"] for e in expected.infos]
    assert torch.equal(got.logprobs, expected.logprobs)  # bit for bit
    with pytest.raises(RuntimeError, match="inside"), bf16_linear_weights(model):
        raise RuntimeError("inside")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # tied again


def lora_model(**config):
    """tiny-random-llama with a LoRA adapter whose B is not zero, so that the adapter changes the outputs."""
    from peft import LoraConfig, get_peft_model

    from textgym.models import load_model

    torch.manual_seed(0)
    model = get_peft_model(
        load_model("tiny-random-llama")[0], LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **config)
    )
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name or "lora_magnitude" in name:
                parameter.normal_(0, 0.5)
    return model.eval()


def test_a_lora_rollout_samples_from_the_adapters_folded_into_the_bf16_copy():
    """In the bf16 copy the adapters are folded into the base weights and switched off: the logits are
    those of peft's own merge under autocast (bit for bit), not those of the base model; on exit the
    fp32 parameters and the adapters are back."""
    import copy

    from textgym.agents.lora import foldable_lora_layers
    from textgym.agents.precision import bf16_linear_weights

    model = lora_model()
    layers = foldable_lora_layers(model)
    assert len(layers) == 2 * model.config.num_hidden_layers
    merged = copy.deepcopy(model).merge_and_unload()
    ids = torch.randint(0, model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    before = dict(model.named_parameters())
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, through = merged(ids).logits, model(ids).logits
        with model.disable_adapter():
            base = model(ids).logits
        with bf16_linear_weights(model):
            got = model(ids).logits
            assert all(
                m.disable_adapters and m.get_base_layer().weight.dtype == torch.bfloat16 for m in layers
            )
    assert torch.equal(got, expected)
    assert (got - base).abs().max() > 20 * (got - through).abs().max()  # the adapter is in, up to bf16
    assert dict(model.named_parameters()) == before and {p.dtype for p in before.values()} == {torch.float32}
    assert not any(m.disable_adapters for m in layers)
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())


@pytest.mark.parametrize(
    "config",
    [{"use_dora": True}, {"modules_to_save": ["lm_head"]}, {"trainable_token_indices": [1, 2]}],
    ids=["dora", "modules_to_save", "trainable_tokens"],
)
def test_an_adapter_that_is_not_plain_lora_is_not_folded(config):
    """DoRA rescales the folded weight's columns, and with the adapters off peft runs the original of a
    module it trains a copy of: neither is a change of the base weights alone, so the rollout runs through
    the adapters (with the other weights still cast once)."""
    from textgym.agents.lora import foldable_lora_layers
    from textgym.agents.precision import bf16_linear_weights

    model = lora_model(**config)
    assert foldable_lora_layers(model) == [] and any(hasattr(m, "lora_A") for m in model.modules())
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), bf16_linear_weights(model):
        assert not any(m.disable_adapters for m in model.modules() if hasattr(m, "lora_A"))
        assert torch.isfinite(model(ids).logits).all()


def test_a_lora_layer_over_a_scaled_linear_is_not_folded():
    """peft wraps any ``nn.Linear`` subclass (transformers' FP8 and quantized linears among them) in a
    plain LoRA layer; a fold of the weight alone would drop such a layer's own scales."""
    from peft import LoraConfig, get_peft_model

    from textgym.agents.lora import foldable_lora_layers

    class ScaledLinear(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 4.0

    plain = get_peft_model(torch.nn.Sequential(torch.nn.Linear(8, 8)), LoraConfig(r=2, target_modules=["0"]))
    scaled = get_peft_model(torch.nn.Sequential(ScaledLinear(8, 8)), LoraConfig(r=2, target_modules=["0"]))
    assert len(foldable_lora_layers(plain)) == 1 and foldable_lora_layers(scaled) == []


def test_switching_the_adapters_off_leaves_every_requires_grad_as_it_was():
    """peft's disable_adapter() turns requires_grad on for the active adapters' weights on exit, a frozen
    one's too; the reference pass and the folded rollout must not unfreeze what the user froze."""
    from textgym.agents.lora import adapters_disabled
    from textgym.agents.precision import bf16_linear_weights

    model = lora_model()
    frozen = [p for n, p in model.named_parameters() if "lora_A" in n]
    for parameter in frozen:
        parameter.requires_grad_(False)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with adapters_disabled(model):
        pass
    with bf16_linear_weights(model):
        pass
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags


def test_a_lora_policy_with_dropout_runs_in_eval_mode():
    """The adapters' dropout is off, like the model's: the rollout (folded or not) and the training
    forwards compute the same function."""
    agent = GRPO(
        "tiny-random-llama", tiny_env(n=4, tokens=4), num_generations=4, verbose=0,
        lora={"r": 4, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.1},
    )  # fmt: skip
    assert not [n for n, m in agent.rollout_model.named_modules() if m.training]
    agent.learn(16)  # lora_B is 0 at the start, when the adapters' dropout has nothing to drop
    batch = agent.collect_rollouts()
    with torch.no_grad():
        logprobs = agent.policy_logprobs(batch)[0] * batch.response_mask
    torch.testing.assert_close(logprobs, batch.logprobs * batch.response_mask, atol=1e-5, rtol=0)
    assert not [n for n, m in agent.rollout_model.named_modules() if m.training]


@needs_bf16
def test_a_bf16_lora_agent_rolls_out_with_the_adapters_folded_and_learns_through_them():
    seen = []
    agent = GRPO(
        "tiny-random-llama", tiny_env(n=4, tokens=4), num_generations=4, bf16=True, verbose=0,
        lora={"r": 4, "target_modules": ["q_proj", "v_proj"]},
    )  # fmt: skip
    layer = next(m for m in agent.rollout_model.modules() if hasattr(m, "lora_A"))
    layer.register_forward_hook(lambda m, args, out: seen.append(m.disable_adapters))
    agent.learn(16)
    assert True in seen and False in seen  # folded while sampling, through the adapter in the updates
    assert any(p.grad is not None for n, p in agent.rollout_model.named_parameters() if "lora_" in n)


def test_a_cast_that_fails_halfway_leaves_the_model_as_it_was():
    from textgym.scoring import bf16_linears

    class OutOfMemory(dict):  # the third layer's bf16 copy cannot be made
        def __setitem__(self, key, value):
            if value.dtype == torch.bfloat16:
                raise RuntimeError("out of memory")
            super().__setitem__(key, value)

    model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(3)))
    before = list(model.parameters())
    model[2]._parameters = OutOfMemory(model[2]._parameters)
    with pytest.raises(RuntimeError, match="out of memory"):
        bf16_linears(model)
    assert list(model.parameters()) == before and {p.dtype for p in model.parameters()} == {torch.float32}


@needs_bf16
def test_rewards_score_outside_the_agents_bf16_autocast():
    """The autocast covers the policy's forwards only: a reward runs in its own precision (a built-in one
    left in fp32 stays fp32 even inside a caller's autocast: tests/test_reward_speed.py)."""
    seen = []

    def probe(samples):
        seen.append(torch.is_autocast_enabled("cpu"))
        return [0.0] * len(samples)

    env = TextGenVectorEnv(
        num_envs=4, model="tiny-random-llama", prompts="chat", max_new_tokens=4, autoreset_mode="Disabled",
        rewards=RewardStack([(FunctionReward("probe", probe), 1.0)]),
    )  # fmt: skip
    GRPO("tiny-random-llama", env, bf16=True, num_generations=2, verbose=0).generate()
    assert seen and not any(seen)


def test_a_sharded_agents_autocast_keeps_no_cast_weights(monkeypatch):
    """Sharded, autocast's cache would hold a bf16 copy of every unit gathered in one autocast region."""
    agent = LMPPO(char_llama(), make_env(n=4), verbose=0)
    assert agent.autocast()._cache_enabled
    monkeypatch.setattr(LMPPO, "sharded", property(lambda self: True))
    assert not agent.autocast()._cache_enabled


@needs_bf16
def test_in_bf16_the_kl_to_an_unchanged_reference_is_exactly_zero():
    """Evaluation's KL: the policy's side comes from the same kind of forward as the reference's."""
    from textgym.agents.rollout_batch import RolloutBatch

    agent = LMPPO("tiny-random-llama", tiny_env(n=4), bf16=True, verbose=0)
    batch = RolloutBatch.from_rollout(agent.rollout(tiny_env(n=4), seed=1))
    assert batch.action_mask.sum() > 0 and torch.equal(agent.sequence_kl(batch), torch.zeros(4))


def test_an_accelerate_config_asking_for_megatron_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_MEGATRON_LM", "true")
    with pytest.raises(ConfigError, match="Megatron-LM .* is not supported.*FSDP2.*ZeRO-3"):
        LMPPO(char_llama(), env_with(RewardStack([(FunctionReward("a", share_of_a), 1.0)])), verbose=0)


def sharded_agent():
    return LMPPO(
        char_llama(), env_with(RewardStack([(FunctionReward("a", share_of_a), 1.0)]), n=4), verbose=0
    )


ZERO3 = ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed ZeRO-3")
FSDP = ("ACCELERATE_USE_FSDP", "FSDP")


@pytest.mark.parametrize(
    "engine, variable, value, key",
    [
        (ZERO3, "ACCELERATE_DEEPSPEED_ZERO_STAGE", "2", "zero_stage: 2"),
        (ZERO3, "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "cpu", "offload_optimizer_device: cpu"),
        (ZERO3, "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "nvme", "offload_param_device: nvme"),
        (ZERO3, "ACCELERATE_GRADIENT_CLIPPING", "1.0", "gradient_clipping: 1.0"),
        (ZERO3, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4", "gradient_accumulation_steps: 4"),
        (ZERO3, "ACCELERATE_MIXED_PRECISION", "bf16", "mixed_precision: bf16"),
        (ZERO3, "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", "true", "zero3_save_16bit_model: true"),
        (FSDP, "FSDP_VERSION", "1", "fsdp_version: 1"),
        (FSDP, "FSDP_OFFLOAD_PARAMS", "true", "fsdp_offload_params: true"),
        (FSDP, "FSDP_ACTIVATION_CHECKPOINTING", "true", "fsdp_activation_checkpointing: true"),
        (FSDP, "FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT", "fsdp_state_dict_type: SHARDED_STATE_DICT"),
        (FSDP, "FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP", "fsdp_auto_wrap_policy: SIZE_BASED_WRAP"),
        (FSDP, "FSDP_IGNORED_MODULES", "lm_head", "fsdp_ignored_modules: lm_head"),
        (FSDP, "ACCELERATE_MIXED_PRECISION", "bf16", "mixed_precision: bf16"),
    ],
)
def test_sharding_options_textgym_does_not_honour_are_refused_by_name(
    engine, variable, value, key, monkeypatch
):
    monkeypatch.setenv(engine[0], "true")
    monkeypatch.setenv(variable, value)
    named = f"{key} ({variable})" if engine is FSDP else key  # FSDP's refusals name the variable too
    with pytest.raises(
        ConfigError, match=re.escape(f"sets {named}, which textgym's {engine[1]} does not honour")
    ):
        sharded_agent()


def test_an_fsdp_config_without_fsdp_version_is_told_to_set_2(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "1")  # what `accelerate launch` sets for a config without the line
    with pytest.raises(ConfigError, match=r"set fsdp_version: 2 \(a config without an fsdp_version line"):
        sharded_agent()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_accelerate_mixed_precision_is_refused_without_sharding_too(precision, monkeypatch):
    # an Accelerator made with it would wrap the training forward in accelerate's autocast, unasked
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", precision)
    with pytest.raises(
        ConfigError, match=f"mixed_precision is '{precision}'.*bf16 = true, and mixed_precision: no"
    ):
        sharded_agent()


@pytest.mark.parametrize(
    "section, key",
    [
        ({"optimizer": {"type": "AdamW"}}, "optimizer"),
        ({"fp16": {"enabled": True}}, "fp16"),
        ({"gradient_clipping": 1.0}, "gradient_clipping"),
        ({"activation_checkpointing": {"partition_activations": True}}, "activation_checkpointing"),
        ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "offload_param_device"),
        ({"zero_optimization": {"stage": 2}}, "zero_stage"),
    ],
)
def test_a_deepspeed_config_file_setting_what_textgym_owns_is_refused_by_name(
    section, key, tmp_path, monkeypatch
):
    (tmp_path / "ds.json").write_text(json.dumps(section))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "ds.json"))
    # what the shipped zero3.yaml passes beside a deepspeed_config_file: the file must still be checked
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none")
    with pytest.raises(ConfigError, match=f"the DeepSpeed config .*ds.json sets {key}: .*does not honour"):
        sharded_agent()


def test_a_deepspeed_config_file_of_auto_values_passes_its_zero_section_on(tmp_path, monkeypatch):
    from textgym.agents.zero3 import zero3_requested

    config = {  # what DeepSpeed's and TRL's example configs hold
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_prefetch_bucket_size": "auto"},
    }  # fmt: skip
    (tmp_path / "ds.json").write_text(json.dumps(config))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "ds.json"))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "true")  # what it asks for, textgym does either way
    assert zero3_requested() == config["zero_optimization"]
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "missing.json"))
    with pytest.raises(ConfigError, match="cannot read the DeepSpeed config .*missing.json"):
        zero3_requested()


def test_deepspeed_asked_for_without_the_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ImportError
    with pytest.raises(
        ConfigError,
        match=r"the accelerate config \(or the environment\) asks for DeepSpeed \(ACCELERATE_USE_DEEPSPEED=true\), "
        r"which is not installed: `DS_BUILD_OPS=0 pip install --no-build",
    ):
        sharded_agent()


def test_deepspeed_on_cpus_without_a_compiler_says_so(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("CXX", "/nonexistent/c++")  # DeepSpeed compiles its CPU communication op with it
    with pytest.raises(
        ConfigError, match="no C\\+\\+ compiler was found .*/nonexistent/c\\+\\+.*install one"
    ):
        sharded_agent()


def test_a_deepspeed_device_other_than_the_agents_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # the agent trains on the CPU here
    with pytest.raises(
        ConfigError, match="DS_ACCELERATOR=cuda in the environment, but the agent trains on cpu"
    ):
        sharded_agent()


def test_asking_for_fsdp_and_deepspeed_at_once_is_refused(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ConfigError, match="asks for both FSDP .* and DeepSpeed .*: set one"):
        sharded_agent()


def test_deepspeed_without_a_launcher_trains_unsharded(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    agent = sharded_agent()
    assert not agent.sharded and agent.sharding_engine is None


def test_fsdp_without_a_launcher_trains_unsharded(monkeypatch):
    # no process group to shard over (under a launcher with one process: test_distributed)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    agent = LMPPO(
        char_llama(), env_with(RewardStack([(FunctionReward("a", share_of_a), 1.0)]), n=4), verbose=0
    )
    assert not agent.sharded
    iterations(agent, 1)


def test_save_refuses_a_directory_that_is_not_a_checkpoint_and_keeps_its_files(tmp_path):
    """It renamed the directory aside and deleted it, whatever it held."""
    agent = LMPPO(char_llama(), make_env(8), verbose=0)
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="exists and is not a textgym checkpoint: save to a new or empty"):
        agent.save(mine)
    assert (mine / "notes.txt").read_text() == "keep me" and (mine / "sub").is_dir()
    (tmp_path / "empty").mkdir()
    agent.save(tmp_path / "empty")  # an empty directory is filled
    agent.save(tmp_path / "empty")  # and a checkpoint replaced
    assert is_complete(tmp_path / "empty")


def char_llama_env(n=8, alphabet=None):
    """An env tokenizing as tiny-char-llama does (or with ``alphabet``: the same size, other ids)."""
    from textgym.models import CharTokenizer

    return make_env(n, model="tiny-char-llama" if alphabet is None else CharTokenizer(alphabet))


def test_load_applies_a_learning_rate_and_kl_coef_given_over_the_saved_state(tmp_path):
    """The optimizer's saved state brought its old rate back, and the saved KL coefficient replaced the given
    one: overrides that were recorded in the config and never used."""
    agent = iterations(LMPPO("tiny-char-llama", char_llama_env(), learning_rate=1e-3, verbose=0), 1)
    agent.save(tmp_path / "ckpt")
    loaded = LMPPO.load(tmp_path / "ckpt", char_llama_env(), learning_rate=5e-2, kl_coef=0.5)
    assert {group["lr"] for group in loaded.optimizer.param_groups} == {5e-2}
    assert loaded.kl_ctl.kl_coef == 0.5
    kept = LMPPO.load(tmp_path / "ckpt", char_llama_env())
    assert {group["lr"] for group in kept.optimizer.param_groups} == {1e-3}
    assert kept.kl_ctl.kl_coef == agent.kl_ctl.kl_coef
    # SB3's load signature: custom_objects replace saved values, device comes third; its other arguments
    # were refused as unknown hyperparameters
    sb3 = LMPPO.load(tmp_path / "ckpt", char_llama_env(), "cpu", custom_objects={"learning_rate": 5e-2},
                     print_system_info=False, force_reset=True)  # fmt: skip
    assert {group["lr"] for group in sb3.optimizer.param_groups} == {5e-2} and sb3.device.type == "cpu"
    sb3.set_env(char_llama_env(), force_reset=False)


def test_load_checks_the_envs_tokenizer_as_a_new_agent_does(tmp_path):
    """Built from the checkpoint's weights (an object), the agent compared vocabulary sizes only: an env
    with other ids for the same characters was accepted."""
    LMPPO("tiny-char-llama", char_llama_env(), verbose=0).save(tmp_path / "ckpt")
    permuted = "zyxwvutsrqponmlkjihgfedcba .,!?"
    with pytest.raises(ConfigError, match="tokenizes differently"):
        LMPPO("tiny-char-llama", char_llama_env(alphabet=permuted), verbose=0)
    with pytest.raises(ConfigError, match="tokenizes differently"):
        LMPPO.load(tmp_path / "ckpt", char_llama_env(alphabet=permuted))


def test_lora_settings_are_checked_when_the_agent_is_made_not_when_it_saves(tmp_path):
    """A set of target modules (peft takes one) trained, then failed the save: not JSON serializable."""
    agent = LMPPO("tiny-char-llama", char_llama_env(), lora={"r": 4, "target_modules": {"v_proj", "q_proj"}},
                  verbose=0)  # fmt: skip
    assert agent.config.lora["target_modules"] == ["q_proj", "v_proj"]
    agent.save(tmp_path / "ckpt")
    assert json.loads((tmp_path / "ckpt" / "state.json").read_text())["config"]["lora"]["r"] == 4
    with pytest.raises(
        ConfigError, match="lora.layers_pattern = <object .*> cannot be saved with a checkpoint"
    ):
        LMPPO("tiny-char-llama", char_llama_env(), lora={"r": 4, "layers_pattern": object()}, verbose=0)


def test_predict_of_an_agent_loaded_without_an_env_picks_only_the_envs_tokens(tmp_path):
    """A policy's vocabulary may be larger than the env's (padded embeddings): without the env, sampling ran
    over all of it and most actions were ids the env does not have."""
    env = make_env(8)
    LMPPO(char_llama(vocab_size=64), env, verbose=0).save(tmp_path / "ckpt")
    loaded = LMPPO.load(tmp_path / "ckpt")
    obs, _ = env.reset(seed=0)
    torch.manual_seed(0)
    actions = np.concatenate([loaded.predict(obs)[0] for _ in range(20)])
    assert actions.max() < env.single_action_space.n == len(CHARS)


@pytest.mark.parametrize(
    ("agent", "settings"), [(LMPPO, {}), (LMPPO, {"lora": {"r": 4}}), (GRPO, {"num_generations": 4})]
)
def test_load_refuses_a_policy_directory_that_changed_since_it_was_trained_from(tmp_path, agent, settings):
    """A load reads the KL reference (LoRA: the base weights) from the source directory again: its new
    weights were taken without a word, and the loaded agent was another one. Without either (GRPO at
    beta = 0) a resumed run's env still takes the source's tokenizer: a new one remapped every token."""
    from textgym.models import load_model

    source = tmp_path / "policy"
    model, tokenizer = load_model("tiny-char-llama")
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    agent(str(source), char_llama_env(), verbose=0, **settings).save(tmp_path / "ckpt")
    agent.load(tmp_path / "ckpt", char_llama_env())  # unchanged: loads
    (source / ".git").mkdir()
    (source / ".git" / "index").write_text("git status rewrote me")
    agent.load(tmp_path / "ckpt", char_llama_env())  # hidden files are not the model
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    model.save_pretrained(source)
    with pytest.raises(ConfigError, match=f"the policy directory '{source}' changed since this checkpoint"):
        agent.load(tmp_path / "ckpt", char_llama_env())


def test_a_resume_keeps_the_adapted_kl_coefficient_when_its_settings_are_passed_as_saved(tmp_path):
    """textgym train's resume passes every [agent] setting to load: kl_coef as configured replaced the
    coefficient the adaptive controller had reached. Only a value that differs from the saved one applies."""
    settings = {"kl_coef": 0.05, "kl_target": 0.01, "learning_rate": 1e-3}
    agent = iterations(LMPPO("tiny-char-llama", char_llama_env(), verbose=0, **settings), 2)
    assert agent.kl_ctl.kl_coef != 0.05  # adapted
    agent.save(tmp_path / "ckpt")
    resumed = LMPPO.load(tmp_path / "ckpt", char_llama_env(), **settings)
    assert resumed.kl_ctl.kl_coef == agent.kl_ctl.kl_coef
    assert {group["lr"] for group in resumed.optimizer.param_groups} == {
        group["lr"] for group in agent.optimizer.param_groups
    }


@pytest.mark.parametrize("tensorboard", [False, True], ids=["stdout", "stdout-and-tensorboard"])
def test_verbose_logging_takes_a_long_reward_name(tmp_path, capsys, tensorboard):
    """SB3's stdout table cut keys to 36 characters: rewards/<30-character name>/mean and /std became one key,
    and the first iteration's log dump raised (Python's default verbose=1)."""

    def completion_contains_the_capital_city(samples):
        return [float("Paris" in s.completion) for s in samples]

    log = {"tensorboard_log": str(tmp_path / "tb")} if tensorboard else {}
    agent = LMPPO(
        char_llama(), make_env(8, reward=completion_contains_the_capital_city), seed=0, verbose=1, **log
    )
    agent.learn(1)
    out = capsys.readouterr().out
    assert "rewards/" in out and "completion_contains_the_capital_city/mean" in out  # SB3 groups by prefix
    assert "completion_contains_the_capital_city/std" in out


def test_a_checkpoint_saved_on_a_gpu_loads_on_a_cpu(tmp_path):
    """Its value head and AdamW state were read back onto the device they were saved from: on a machine
    without CUDA, loading failed and called the checkpoint corrupt."""
    import torch.serialization

    agent = iterations(LMPPO("tiny-char-llama", char_llama_env(), verbose=0), 1)
    agent.save(tmp_path / "ckpt")
    tag = (0, lambda obj: "cuda:0", lambda obj, location: None)  # the location torch.save gives CUDA tensors
    torch.serialization._package_registry.insert(0, tag)
    try:
        for name in ("value_head.pt", "optimizer.pt"):
            torch.save(torch.load(tmp_path / "ckpt" / name, weights_only=True), tmp_path / "ckpt" / name)
    finally:
        torch.serialization._package_registry.remove(tag)
    with pytest.raises(RuntimeError, match="CUDA"):  # as written on a GPU
        torch.load(tmp_path / "ckpt" / "value_head.pt", weights_only=True)
    loaded = LMPPO.load(tmp_path / "ckpt", char_llama_env(), device="cpu")
    weight = loaded.modules["value_head"].linear.weight
    assert weight.device.type == "cpu"
    assert torch.equal(weight, agent.modules["value_head"].linear.weight)


def test_load_applies_every_optimizer_setting_of_the_config(tmp_path):
    """The optimizer's saved state brought its saved weight decay back over an override, and kept a linear
    schedule's annealed rate when the load asked for a constant one."""
    agent = LMPPO("tiny-char-llama", char_llama_env(), learning_rate=1e-3, lr_schedule="linear", verbose=0)
    iterations(agent, 2)
    assert {group["lr"] for group in agent.optimizer.param_groups} != {1e-3}  # annealed
    agent.save(tmp_path / "ckpt")
    loaded = LMPPO.load(tmp_path / "ckpt", char_llama_env(), weight_decay=0.0, lr_schedule="constant")
    assert {(group["lr"], group["weight_decay"]) for group in loaded.optimizer.param_groups} == {(1e-3, 0.0)}


def test_load_refuses_other_lora_settings_than_the_checkpoints(tmp_path):
    """The saved adapter was loaded as it was while the agent reported the new settings (and saved them
    with it); without lora, the adapter directory was read as a whole model and called corrupt."""
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    LMPPO("tiny-char-llama", char_llama_env(), lora=lora, verbose=0).save(tmp_path / "adapter")
    for other in ({**lora, "r": 8}, None):
        with pytest.raises(ConfigError, match=r"trained with lora = \{'r': 4.*cannot be loaded with lora ="):
            LMPPO.load(tmp_path / "adapter", char_llama_env(), lora=other)
    LMPPO("tiny-char-llama", char_llama_env(), verbose=0).save(tmp_path / "whole")
    with pytest.raises(ConfigError, match="trained with lora = None"):
        LMPPO.load(tmp_path / "whole", char_llama_env(), lora=lora)
    assert LMPPO.load(tmp_path / "adapter", char_llama_env(), lora=lora).config.lora == lora  # as saved
    for same in (
        {"r": 4, "target_modules": {"v_proj", "q_proj"}},
        {"r": 4, "target_modules": ["v_proj", "q_proj"]},
    ):
        LMPPO.load(
            tmp_path / "adapter", char_llama_env(), lora=same
        )  # the same modules, as a set or reordered


def test_a_policy_object_in_16_bits_is_refused_or_warned_of():
    """A policy loaded with from_pretrained keeps its saved dtype: bf16 weights trained with most updates
    rounded away, silently, and fp16 ones failed with an overflow in the sampler."""
    from textgym.models import load_model

    for cls in (LMPPO, GRPO):  # the warning points at the line that made the agent, whatever the class
        with pytest.warns(UserWarning, match="parameters are bfloat16: an optimizer step rounds") as seen:
            cls(load_model("tiny-char-llama", dtype=torch.bfloat16)[0], char_llama_env(), verbose=0)
        assert [w.filename for w in seen if "bfloat16" in str(w.message)] == [__file__]
    with pytest.raises(ConfigError, match=r"are float16.*Load it in fp32.*bf16 = true"):
        LMPPO(load_model("tiny-char-llama", dtype=torch.float16)[0], char_llama_env(), verbose=0)
    # a frozen fp16 base under fp32 adapters: its forwards overflow all the same
    with pytest.raises(ConfigError, match=r"are float16"):
        fp16 = load_model("tiny-char-llama", dtype=torch.float16)[0]
        LMPPO(fp16, char_llama_env(), lora={"r": 4, "target_modules": ["q_proj"]}, verbose=0)


def test_lora_settings_that_would_train_less_than_asked_are_refused():
    """A misspelt target module next to a valid one was dropped without a word (peft refuses only a list
    that matches nothing), and inference_mode froze the adapter: LMPPO then trained its value head alone."""
    with pytest.raises(ConfigError, match=r"target_modules \['v_prj'\] matched no layer.*v_proj"):
        LMPPO("tiny-char-llama", char_llama_env(), lora={"r": 4, "target_modules": ["q_proj", "v_prj"]})
    with pytest.raises(ConfigError, match="inference_mode = true freezes the adapter"):
        GRPO("tiny-char-llama", char_llama_env(), lora={"r": 4, "inference_mode": True}, num_generations=4)
    frozen = char_llama().requires_grad_(False)
    with pytest.raises(ConfigError, match="the policy has no trainable parameter"):
        LMPPO(frozen, make_env(8), verbose=0)
