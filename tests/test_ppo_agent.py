import json
import math
import re

import numpy as np
import pytest
import torch
from conftest import reward_plugin
from lm_helpers import CHARS, char_llama, iterations, make_env
from stable_baselines3.common.callbacks import (
    BaseCallback,
    CheckpointCallback,
    EvalCallback,
    StopTrainingOnRewardThreshold,
)
from stable_baselines3.common.evaluation import evaluate_policy

from textgym import TextGenVectorEnv
from textgym.agents.base import COMMON_STATS
from textgym.agents.group import GroupConfig
from textgym.agents.ppo import LMPPO, LMPPOConfig
from textgym.agents.ppo_core import logprobs_from_logits
from textgym.errors import ConfigError
from textgym.models import load_model
from textgym.sb3 import TextGymVecEnv

FAST = dict(learning_rate=3e-3, kl_coef=0.0, verbose=0)


def scores_of(agent):
    return [h["reward"] for h in agent.history]


def test_seeded_ppo_raises_a_toy_reward_and_is_reproducible_bit_for_bit():
    def run():
        return scores_of(LMPPO(char_llama(), make_env(), seed=0, **FAST).learn(16 * 6 * 8))

    scores = run()
    assert np.mean(scores[-2:]) > scores[0] + 0.3, scores
    assert run() == scores


@pytest.mark.parametrize("padded", [0, 6], ids=["vocab-as-tokenizer", "vocab-padded-past-the-tokenizer"])
def test_ratio_is_one_before_the_first_update_and_values_start_at_zero(padded):
    """``padded``: the model's vocabulary is larger than its tokenizer's, as embeddings padded to a round size
    are (Qwen2.5, Pythia); the env's tokens are the tokenizer's, and so is the policy's distribution."""
    agent = LMPPO(char_llama(len(CHARS) + padded), make_env(), temperature=0.7, seed=0, verbose=0)
    b = agent.collect_rollouts()
    assert abs(b.stats["kl"]) < 1e-5  # the reference is the policy
    with torch.no_grad():
        logits, _ = agent.forward(agent.policy, b)
    new = logprobs_from_logits(logits, b.response_ids, 0.7) * b.response_mask
    ratio = (new - b.logprobs).exp()[b.response_mask.bool()]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    assert (b.values == 0).all()


def test_the_first_minibatch_inside_train_sees_a_ratio_of_one():
    """The update's own forward (micro-batches of rows in another order, the training temperature and mask),
    not one outside train(): its first and only minibatch is taken before any step, so its log ratio is
    rounding alone and nothing is clipped."""
    agent = LMPPO(
        char_llama(), make_env(8), temperature=0.7, n_epochs=1, micro_batch_size=3, seed=0, verbose=0
    )
    stats = agent.train(agent.collect_rollouts())
    assert stats["policy/approxkl_avg"] < 1e-12 and stats["policy/clipfrac_avg"] == 0


def test_micro_batches_accumulate_to_the_same_update_and_statistics():
    """Micro-batches of 3 rows hold different numbers of tokens: the update and its logged means over tokens
    (with whitened advantages the policy loss's is 0 before the step) are those of one forward."""

    def update(micro):
        agent = LMPPO(char_llama(), make_env(8), n_epochs=1, micro_batch_size=micro, seed=0, **FAST)
        stats = agent.train(agent.collect_rollouts())
        return [p.detach().clone() for p in agent.params], stats

    (whole, whole_stats), (parts, parts_stats) = update(None), update(3)
    for a, b in zip(whole, parts):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    keys = ["entropy", "loss/policy_avg", "loss/value_avg", "policy/clipfrac_avg", "policy/approxkl_avg"]
    assert [parts_stats[k] for k in keys] == pytest.approx([whole_stats[k] for k in keys], abs=1e-6)
    assert whole_stats["loss/policy_avg"] == pytest.approx(0.0, abs=1e-6)


def optimizer_steps(agent):
    """The optimizer steps of one update of ``agent``."""
    steps = []
    torch_optimizer = getattr(agent.optimizer, "optimizer", agent.optimizer)  # accelerate's wraps torch's
    torch_optimizer.register_step_post_hook(lambda *_: steps.append(1))
    agent.train(agent.collect_rollouts())
    return len(steps)


def test_n_minibatches_is_the_number_of_optimizer_steps_per_epoch():
    """5 minibatches of 16 episodes were 4 (ceil(16 / 5) = 4 episodes each); more minibatches than episodes
    silently gave one per episode."""
    agent = LMPPO(char_llama(), make_env(16), n_epochs=2, n_minibatches=5, seed=0, **FAST)
    assert optimizer_steps(agent) == 2 * 5
    with pytest.raises(ConfigError, match=r"^n_minibatches=32 splits a batch of 16 episodes \(num_envs\)"):
        LMPPO(char_llama(), make_env(16), n_minibatches=32, **FAST)


def test_the_progress_bar_ends_full_when_the_last_iteration_passes_the_budget(capsys):
    """An iteration of 16 episodes of up to 6 tokens passes a budget of 10: the bar went past its total, which
    tqdm shows as a bare count ("57tok") instead of a full bar."""
    agent = LMPPO(char_llama(), make_env(16), seed=0, **FAST).learn(10, progress_bar=True)
    end = agent.num_timesteps
    assert end > 10 and f"100%|██████████| {end}/{end} " in capsys.readouterr().err


def test_save_load_round_trip_gives_identical_predictions_and_resumes_bit_for_bit(tmp_path):
    straight = iterations(LMPPO(char_llama(), make_env(), seed=0, **FAST), 4)

    agent = iterations(LMPPO(char_llama(), make_env(), seed=0, **FAST), 2)
    agent.save(tmp_path / "ckpt")
    loaded = LMPPO.load(tmp_path / "ckpt", make_env())
    assert (loaded.num_timesteps, loaded.iteration) == (agent.num_timesteps, agent.iteration)
    obs, _ = make_env(4).reset(seed=1)
    np.testing.assert_array_equal(
        agent.predict(obs, deterministic=True)[0], loaded.predict(obs, deterministic=True)[0]
    )
    iterations(loaded, 2)
    assert scores_of(loaded) == scores_of(straight)  # the history travels in the checkpoint
    assert loaded.num_timesteps == straight.num_timesteps


def noisy(samples):
    """A reward that draws from the global random streams, as a sampling judge or a noisy proxy does."""
    import random

    return [random.random() + float(np.random.rand()) + float(torch.rand(())) for _ in samples]


def test_rewards_drawing_from_the_global_random_streams_resume_and_evaluate_without_changing_training(
    tmp_path,
):
    """The global streams were seeded once, when the agent was made: a resumed run's noisy rewards differed
    from the uninterrupted run's, and anything drawing from them between iterations (an [eval], samples)
    changed the training."""
    import random

    straight = scores_of(iterations(LMPPO(char_llama(), make_env(reward=noisy), seed=0, **FAST), 3))
    agent = iterations(LMPPO(char_llama(), make_env(reward=noisy), seed=0, **FAST), 1)
    agent.save(tmp_path / "ckpt")
    random.random(), np.random.rand(), torch.rand(3)  # the run between: an evaluation, another agent
    resumed = iterations(LMPPO.load(tmp_path / "ckpt", make_env(reward=noisy)), 2)
    assert scores_of(resumed) == straight
    agent = LMPPO(char_llama(), make_env(reward=noisy), seed=0, **FAST)
    for _ in range(3):
        iterations(agent, 1)
        random.random(), np.random.rand(), torch.rand(3)
    assert scores_of(agent) == straight


def test_the_agent_scores_its_actions_from_the_distribution_the_rollout_sampled(tmp_path):
    """Masked in the rollout, the env's disallowed tokens (pad, and those outside allowed_tokens) must be
    masked in every forward too: the PPO ratio is 1 before the first update, and the entropy is that of
    the three tokens allowed (a, b and EOS). A checkpoint loaded without an env (a bench's final evaluation)
    keeps the mask."""
    agent = LMPPO(char_llama(), make_env(16, allowed_tokens="ab"), seed=0, **FAST)
    batch, _ = agent.generate()
    logprobs, _ = agent.sequence_logprobs(agent.policy, batch)
    torch.testing.assert_close(logprobs, batch.logprobs * batch.action_mask, atol=1e-5, rtol=0)
    agent.save(tmp_path / "ckpt")
    loaded = LMPPO.load(tmp_path / "ckpt")
    torch.testing.assert_close(loaded.sequence_logprobs(loaded.policy, batch)[0], logprobs, atol=1e-6, rtol=0)
    _, entropy, _ = agent.policy_logprobs(batch)
    assert float(entropy[batch.action_mask.bool()].max()) <= np.log(3) + 1e-5
    obs, _ = make_env(16, allowed_tokens="ab").reset(seed=1)
    assert set(agent.predict(obs)[0].tolist()) <= {*CHARS.encode("ab"), CHARS.eos_token_id}


def test_load_of_an_incomplete_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "half").mkdir()
    with pytest.raises(ConfigError, match="not a complete LMPPO checkpoint"):
        LMPPO.load(tmp_path / "half")
    with pytest.raises(ConfigError, match="'.*nowhere' does not exist: give the directory LMPPO.save wrote"):
        LMPPO.load(tmp_path / "nowhere")


@pytest.mark.parametrize("bad", [-5, 1.5, float("nan"), True, "100"])
def test_learn_takes_a_whole_number_of_tokens(bad):
    """learn(-5) and learn(1.5) ran silently (1.5: a whole iteration); 1e5, as SB3 users write it, is fine."""
    agent = LMPPO(char_llama(), make_env(), seed=0, **FAST)
    with pytest.raises(ConfigError, match=re.escape(f"learn(total_timesteps={bad!r}): give a whole number")):
        agent.learn(bad)
    assert agent.learn(1e1).iteration == 1
    assert agent.learn(np.int64(10)).iteration == 2  # numpy's integers too


class Recorder(BaseCallback):
    """Records the callback events; stops training after ``stop_after`` steps."""

    def __init__(self, stop_after=None):
        super().__init__()
        self.events, self.stop_after = [], stop_after

    def _on_training_start(self):
        self.events.append("start")

    def _on_rollout_start(self):
        self.events.append("rollout_start")

    def _on_rollout_end(self):
        self.events.append("rollout_end")

    def _on_step(self):
        self.events.append(("step", self.num_timesteps))
        return self.stop_after is None or self.n_calls < self.stop_after

    def _on_training_end(self):
        self.events.append("end")


def test_sb3_callbacks_are_called_and_checkpoint_and_eval_callbacks_work(tmp_path):
    agent = LMPPO(char_llama(), make_env(), seed=0, **FAST)
    recorder = Recorder(stop_after=3)
    eval_env = TextGymVecEnv(make_env(4, autoreset_mode="SameStep"))
    callbacks = [
        recorder,
        CheckpointCallback(save_freq=2, save_path=str(tmp_path / "ckpts"), name_prefix="lmppo"),
        EvalCallback(eval_env, n_eval_episodes=4, eval_freq=3, log_path=str(tmp_path / "eval"), verbose=0),
    ]
    agent.learn(10_000, callback=callbacks)
    assert recorder.events[0] == "start" and recorder.events[-1] == "end"
    steps = [e for e in recorder.events if isinstance(e, tuple)]
    assert len(steps) == 3 and recorder.events[1:4] == ["rollout_start", "rollout_end", steps[0]]
    assert steps[-1][1] == agent.num_timesteps
    checkpoints = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    assert checkpoints == [f"lmppo_{agent.history[1]['timesteps']}_steps"]  # a directory, not a .zip
    assert LMPPO.load(tmp_path / "ckpts" / checkpoints[0]).iteration == 2
    assert (tmp_path / "eval" / "evaluations.npz").is_file()


def test_stop_training_on_reward_threshold():
    agent = LMPPO(char_llama(), make_env(), seed=0, **FAST)
    stop = StopTrainingOnRewardThreshold(reward_threshold=-1.0)  # any evaluation beats it
    eval_env = TextGymVecEnv(make_env(4, autoreset_mode="SameStep"))
    agent.learn(
        16 * 6 * 50,
        callback=EvalCallback(eval_env, callback_on_new_best=stop, eval_freq=1, n_eval_episodes=4, verbose=0),
    )
    assert agent.iteration == 1


def test_evaluate_policy_runs_on_the_agent():
    agent = LMPPO(char_llama(), make_env(), seed=0, **FAST)
    mean, std = evaluate_policy(
        agent, TextGymVecEnv(make_env(4, autoreset_mode="SameStep")), n_eval_episodes=8
    )
    assert 0.0 <= mean <= 1.0 and std >= 0.0


def test_trls_ppo_statistics_have_trls_definitions(monkeypatch):
    import textgym.agents.ppo as ppo

    seen, real = [], ppo.policy_loss

    def recording(logprobs, old_logprobs, advantages, mask, clip_range):
        seen.append(((logprobs - old_logprobs).detach(), mask.bool()))
        return real(logprobs, old_logprobs, advantages, mask, clip_range)

    monkeypatch.setattr(ppo, "policy_loss", recording)
    agent = LMPPO(
        char_llama(), make_env(8), seed=0, learning_rate=3e-2, n_epochs=3, n_minibatches=2, verbose=0
    )
    batch = agent.collect_rollouts()
    stats = agent.train(batch)
    log_ratio = torch.cat([r[m] for r, m in seen])
    assert stats["policy/approxkl_avg"] == pytest.approx(float((0.5 * log_ratio**2).mean()), rel=1e-4)
    assert stats["policy/approxkl_k3"] == pytest.approx(
        float((log_ratio.exp() - 1 - log_ratio).mean()), rel=1e-4
    )
    minibatch_means = torch.stack([r[m].exp().mean() for r, m in seen])  # one micro-batch per minibatch
    assert stats["val/ratio_var"] == pytest.approx(float(minibatch_means.var()), rel=1e-4)
    mask = batch.action_mask.float()
    assert stats["objective/entropy"] == pytest.approx(
        float((-batch.logprobs * mask).sum(1).mean()), rel=1e-5
    )


def test_logger_writes_trl_stat_names_and_reward_components(tmp_path):
    agent = LMPPO(char_llama(), make_env(), seed=0, tensorboard_log=str(tmp_path), **{**FAST, "verbose": 0})
    agent.learn(16 * 6 * 2, tb_log_name="run")
    header = (tmp_path / "run_1" / "progress.csv").read_text().splitlines()[0].split(",")
    for name in (*(k for k in COMMON_STATS if k not in ("iteration", "timesteps")), "rewards/share_of_a/mean",
                 "rewards/share_of_a/std", "objective/kl", "objective/entropy", "objective/scores",
                 "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg",
                 "val/var_explained", "val/ratio"):  # fmt: skip
        assert name in header, name


@pytest.mark.parametrize("verbose", [0, 1])
def test_training_without_tensorboard_log_leaves_no_folder_in_the_temp_dir(
    tmp_path, monkeypatch, capsys, verbose
):
    """SB3's ``configure(None, ...)`` makes an empty ``SB3-<time>`` folder in the temp dir for every logger;
    the agent's default logger writes to stdout (when verbose) and nowhere else."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    agent = LMPPO(char_llama(), make_env(), seed=0, **{**FAST, "verbose": verbose})
    agent.learn(16 * 6)
    assert list(tmp_path.iterdir()) == []
    assert ("reward" in capsys.readouterr().out) == bool(verbose)


def test_lora_reference_is_the_adapter_free_model_and_trains(tmp_path):
    base = char_llama()
    agent = LMPPO(
        char_llama(),
        make_env(),
        lora={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        seed=0,
        **FAST,
    )
    assert agent.ref_policy is None
    assert list(agent.rollout_model.peft_config) == ["default"]  # no second adapter
    b = agent.collect_rollouts()
    with torch.no_grad():
        logits, _ = agent.forward(base, b)
    torch.testing.assert_close(
        agent.reference_logprobs(b), logprobs_from_logits(logits, b.response_ids) * b.response_mask
    )
    trainable = sum(p.numel() for p in agent.params)
    assert trainable < sum(p.numel() for p in base.parameters()) / 5
    agent.learn(16 * 6 * 2)
    # after training (B no longer 0) the adapters move the policy, and the reference is still the base model
    with torch.no_grad():
        reference = logprobs_from_logits(agent.forward(base, b)[0], b.response_ids) * b.response_mask
    torch.testing.assert_close(agent.reference_logprobs(b), reference)
    assert not torch.allclose(agent.sequence_logprobs(agent.rollout_model, b)[0], reference, atol=1e-4)
    with pytest.raises(ConfigError, match="LoRA policy needs the base model given by name"):
        agent.save(tmp_path / "lora")


@pytest.mark.parametrize("init", [True, "gaussian"])
def test_the_lora_initialisations_that_start_as_a_no_op_keep_the_adapter_disabled_reference(init):
    from textgym.agents.lora import adapters_disabled

    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": init}
    agent = LMPPO("tiny-random-llama", None, lora=lora, seed=0, verbose=0)
    model, ids = agent.rollout_model, torch.randint(0, 100, (2, 8))
    with torch.no_grad():
        start = model(input_ids=ids).logits
        with adapters_disabled(model):
            torch.testing.assert_close(model(input_ids=ids).logits, start, atol=1e-6, rtol=0)
    assert list(model.peft_config) == ["default"]


# "orthogonal": B A = 0 up to rounding only, which bf16 made a KL of 1e-3 before any update
@pytest.mark.parametrize("init", ["pissa", "pissa_niter_2", "olora", "orthogonal", False])
def test_a_lora_policy_that_does_not_start_at_its_base_keeps_where_it_started_as_the_reference(
    tmp_path, init
):
    """PiSSA and OLoRA move each adapted weight's principal part into the adapter (the base keeps the
    residual), and init_lora_weights = false starts from random adapters: switched off, the adapters leave a
    model that is not the policy training started from. The reference is that starting policy: the KL is 0
    before any update, the reference stays there while the policy moves, and a checkpoint keeps it."""
    env = TextGenVectorEnv(
        num_envs=4, model="tiny-random-llama", prompts=["Hi", "Why?"], max_new_tokens=4,
        rewards=[{"name": "sentiment"}], autoreset_mode="Disabled",
    )  # fmt: skip
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": init}
    agent = LMPPO("tiny-random-llama", env, lora=lora, seed=0, learning_rate=1e-2, kl_coef=0.1, verbose=0)
    batch = agent.collect_rollouts()
    start = agent.reference_logprobs(batch)
    torch.testing.assert_close(start, batch.logprobs, atol=1e-4, rtol=0)
    frozen = [p for n, p in agent.rollout_model.named_parameters() if ".reference." in n]
    assert frozen and not any(p.requires_grad for p in frozen)
    assert not {id(p) for p in frozen} & {id(p) for p in agent.params}  # never trained
    agent.learn(4 * 4 * 2)
    moved = agent.sequence_logprobs(agent.rollout_model, batch)[0]
    assert (moved - start).abs().max() > 1e-3  # the policy moved
    torch.testing.assert_close(agent.reference_logprobs(batch), start)  # the reference did not
    agent.save(tmp_path / "run")
    loaded = LMPPO.load(tmp_path / "run", env)
    torch.testing.assert_close(loaded.reference_logprobs(batch), start)
    torch.testing.assert_close(loaded.sequence_logprobs(loaded.rollout_model, batch)[0], moved)
    assert [tuple(p.shape) for p in loaded.params] == [tuple(p.shape) for p in agent.params]


@pytest.mark.parametrize(
    "name, value",
    [("max_grad_norm", -1.0), ("max_grad_norm", 0), ("score_clip", -1.0), ("score_scale", 0),
     ("score_scale", float("nan")), ("missing_eos_penalty", "big"), ("gamma", 2.0), ("gae_lambda", 5),
     ("vf_coef", -0.1), ("target_kl", 0), ("kl_target", -1.0), ("kl_horizon", 0), ("lora", 8),
     ("device", "gpu"), ("kl_coef", float("nan")), ("kl_coef", float("inf")), ("kl_coef", "0.1"),
     ("clip_range", "0.2"), ("clip_range", float("nan")), ("max_abs_score", "1e6"),
     # --set agent.score_norm=False gives the string "False": it switched score_norm on
     ("score_norm", "False"), ("bf16", "false"), ("whiten_rewards", 0), ("score_norm", None),
     ("weight_decay", -0.01), ("weight_decay", float("nan"))],
)  # fmt: skip
def test_hyperparameters_that_would_train_backwards_or_not_at_all_are_refused(name, value):
    """A negative max_grad_norm flips the gradients (torch scales them by max_norm / norm); a negative
    score_clip clamps every score to one value; gamma above 1 grows returns without bound; a NaN kl_coef
    makes every reward NaN; a string was a TypeError traceback ..."""
    with pytest.raises(ConfigError, match=f"^{name} must be"):
        LMPPOConfig(**{name: value})


def test_weight_decay_reaches_every_agents_optimizer():
    """AdamW's weight decay was torch's 0.01, fixed and unsaid (TRL's trainers use 0.0)."""
    from textgym.agents.grpo import GRPO

    assert LMPPO(char_llama(), None, verbose=0).optimizer.param_groups[0]["weight_decay"] == 0.01
    for cls in (LMPPO, GRPO):
        agent = cls(char_llama(), None, weight_decay=0.0, verbose=0)
        assert {g["weight_decay"] for g in agent.optimizer.param_groups} == {0.0}


def test_an_infinite_clip_range_or_score_limit_is_accepted_as_none():
    config = LMPPOConfig(clip_range=float("inf"), max_abs_score=float("inf"))  # no clipping, no limit
    assert config.clip_range == config.max_abs_score == float("inf")
    for bad in (float("nan"), "0.3"):
        with pytest.raises(ConfigError, match="^epsilon_high must be a number"):
            GroupConfig(epsilon_high=bad)
    with pytest.raises(ConfigError, match="^mask_truncated_completions must be true or false, not 'yes'"):
        GroupConfig(mask_truncated_completions="yes")
    assert LMPPOConfig(bf16=None).bf16 is None  # "auto" stays allowed where the default is None


def test_bad_lora_settings_are_config_errors_not_peft_tracebacks():
    with pytest.raises(ConfigError, match="lora.r must be a positive integer, not 0"):
        LMPPOConfig(lora={"r": 0})
    # peft's TypeError named no setting to use instead
    with pytest.raises(ConfigError, match="lora {'rr': 8}: unknown LoRA setting 'rr'. Did you mean 'r'?"):
        LMPPO(char_llama(), make_env(2), lora={"rr": 8})
    with pytest.raises(
        ConfigError, match=r"task_type is textgym's to set \('CAUSAL_LM' here\): leave it out"
    ):
        LMPPO(char_llama(), make_env(2), lora={"r": 4, "task_type": "CAUSAL_LM"})
    with pytest.raises(
        ConfigError, match=r"lora {'target_modules': \['nope'\]}: .*See peft's LoraConfig"
    ) as err:
        LMPPO(char_llama(), make_env(2), lora={"target_modules": ["nope"]})
    # what the model has to target, and one full stop (peft's message ends in one)
    assert "this model's linear layers: down_proj, gate_proj, k_proj" in str(err.value) and ".." not in str(
        err.value
    )
    # lora_alpha = 0 scales every adapter to nothing: it would train nothing
    with pytest.raises(ConfigError, match="lora.lora_alpha must be a number > 0, not 0"):
        LMPPOConfig(lora={"r": 4, "lora_alpha": 0})
    for init in ("corda", "loftq"):  # they need a preparation (preprocess_corda; bitsandbytes)
        with pytest.raises(ConfigError, match=f"init_lora_weights = '{init}' needs a preparation"):
            LMPPOConfig(lora={"init_lora_weights": init})


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_a_lora_bias_setting_that_trains_the_base_models_biases_is_refused(bias):
    """peft's bias = "all" / "lora_only" trains the base model's own biases, which stay on with the adapter
    switched off: the KL reference would move with the policy and the KL be understated."""
    with pytest.raises(ConfigError, match=f"lora.bias = '{bias}' trains the base model's biases"):
        LMPPO(char_llama(), make_env(2), lora={"r": 4, "bias": bias})
    agent = LMPPO(char_llama(), make_env(2), lora={"r": 4, "lora_bias": True}, verbose=0)  # the adapter's own
    assert not [n for n, p in agent.rollout_model.named_parameters() if p.requires_grad and "lora" not in n]


@pytest.mark.parametrize("lora", [None, {"r": 4}], ids=["without-lora", "with-lora"])
def test_a_peft_model_given_as_the_policy_is_refused(lora):
    """With ``lora`` its adapter was kept as it came, with the adapter-off model as the reference (not the
    policy as it started: a trained or PiSSA adapter starts elsewhere); without it, its checkpoint held
    only the adapter and could not be loaded."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(char_llama(), LoraConfig(r=4, init_lora_weights="pissa"))
    with pytest.raises(ConfigError, match=r"already a peft model .*merge_and_unload"):
        LMPPO(model, make_env(2), lora=lora)


def test_device_cuda_without_a_gpu_is_refused_not_run_on_the_cpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match='device = "cuda", but torch sees no CUDA GPU'):
        LMPPO(char_llama(), make_env(2), device="cuda")


def test_predict_with_diverged_weights_is_a_clear_error_greedy_or_not():
    from textgym.errors import TrainingError

    env = make_env(2)
    agent = LMPPO(char_llama(), env, verbose=0)
    with torch.no_grad():
        agent.rollout_model.lm_head.weight.fill_(math.nan)
    obs, _ = env.reset(seed=0)
    for deterministic in (True, False):  # greedy returned token 1 (EOS) of every NaN row
        with pytest.raises(TrainingError, match="next-token distribution is not finite"):
            agent.predict(obs, deterministic=deterministic)


def test_bad_hyperparameters_and_envs_are_clear_errors():
    with pytest.raises(ConfigError, match="temperature must be a finite number > 0 for training, not 0"):
        LMPPOConfig(temperature=0)
    with pytest.raises(ConfigError, match="temperature must be a finite number > 0 for training, not inf"):
        LMPPOConfig(temperature=math.inf)  # the rollout and the update masked tokens differently at inf
    with pytest.raises(ConfigError, match="n_minibatches must be a positive integer, not 0"):
        LMPPOConfig(n_minibatches=0)
    with pytest.raises(ConfigError, match="kl_estimator must be 'k1' or 'k3', not 'k2'"):
        LMPPOConfig(kl_estimator="k2")
    with pytest.raises(ConfigError, match="no hyperparameter 'learnin_rate'. Did you mean 'learning_rate'"):
        LMPPO(char_llama(), learnin_rate=1e-3)
    with pytest.raises(ConfigError, match="autoreset_mode='Disabled'"):
        LMPPO(char_llama(), make_env(2, autoreset_mode="SameStep"))


def test_score_shaping_order():
    agent = LMPPO(char_llama(), None, missing_eos_penalty=1.0, score_scale=2.0, score_clip=1.5, verbose=0)
    shaped = agent.shape_scores(torch.tensor([0.5, 1.0]), truncated=torch.tensor([True, False]))
    # (0.5 - 1) * 2 = -1 (a penalty after scaling would give 0); 1.0 * 2 = 2, clipped to 1.5 (a clip before
    # scaling would give 2)
    assert shaped.tolist() == [-1.0, 1.5]
    assert json.dumps(agent.config.__dict__)  # the config is JSON-serialisable for checkpoints


def test_a_checkpoints_policy_is_a_model_directory_with_its_tokenizer(tmp_path):
    env = TextGenVectorEnv(
        num_envs=2, model="tiny-random-llama", prompts=["Hi", "Why?"], max_new_tokens=4,
        rewards=[{"name": "sentiment"}], autoreset_mode="Disabled",
    )  # fmt: skip
    LMPPO("tiny-random-llama", env, seed=0, **FAST).save(tmp_path / "run")
    model, tokenizer = load_model(tmp_path / "run" / "policy")  # what `textgym sample --model` loads
    assert tokenizer("Why?").input_ids == env.tokenizer("Why?").input_ids
    assert tokenizer.pad_token_id == env.pad_token_id and model.config.vocab_size == len(tokenizer)


def test_lora_checkpoint_round_trip_by_model_name(tmp_path, register):
    # a score that differs between completions: the update moves the adapter (sentiment is 0 on all of them)
    register(reward_plugin("first_id", lambda ss: [s.completion_ids[0] / 1000 for s in ss]), "first-id")
    env = TextGenVectorEnv(
        num_envs=2, model="tiny-random-llama", prompts=["Hi", "Why?"], max_new_tokens=4,
        rewards=[{"name": "first_id"}], autoreset_mode="Disabled",
    )  # fmt: skip
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    agent = LMPPO("tiny-random-llama", env, lora=lora, seed=0, **FAST).learn(8)
    agent.save(tmp_path / "lora")
    assert (tmp_path / "lora" / "policy" / "adapter_config.json").is_file()
    assert not (tmp_path / "lora" / "reference").exists()  # the base model is reloaded by name
    loaded = LMPPO.load(tmp_path / "lora", env)
    obs, _ = env.reset(seed=0)
    np.testing.assert_array_equal(
        agent.predict(obs, deterministic=True)[0], loaded.predict(obs, deterministic=True)[0]
    )
    assert loaded.iteration == agent.iteration and loaded.ref_policy is None
    # the trained adapter itself came back (greedy actions rarely show one small update)
    b = agent.collect_rollouts()
    trained = agent.sequence_logprobs(agent.rollout_model, b)[0]
    torch.testing.assert_close(loaded.sequence_logprobs(loaded.rollout_model, b)[0], trained)
    assert not torch.allclose(trained, agent.reference_logprobs(b), atol=1e-6)


@pytest.mark.parametrize(("target_kl", "steps"), [(None, 8), (1e-9, 2)])
def test_target_kl_stops_the_epochs_once_an_epochs_mean_approx_kl_passes_it(target_kl, steps):
    """4 epochs of 2 minibatches: 8 optimizer steps, or 2 when the first epoch's mean approx-KL (above 0
    once the first step has moved the policy) passes 1.5 x target_kl."""
    agent = LMPPO(char_llama(), make_env(), seed=0, n_epochs=4, n_minibatches=2, target_kl=target_kl, **FAST)
    agent.learn(1)  # one iteration
    assert {int(state["step"]) for state in agent.optimizer.state.values()} == {steps}


def test_a_plugin_agents_hyperparameters_are_checked_by_their_annotations():
    """A plugin agent's `n_updates: int` took "two" and failed inside train(), after the model loaded; a
    built-in agent's fields are checked before anything starts."""
    from dataclasses import dataclass

    from textgym.agents.lm_config import LMAgentConfig, make_config

    @dataclass
    class ReinforceConfig(LMAgentConfig):
        n_updates: int = 1
        baseline: float = 0.5
        note: str | None = None
        anything: object = None  # not a plain type: left to the agent

    for name, value, said in [("n_updates", "two", "an integer"), ("n_updates", True, "an integer"),
                              ("baseline", "0.5", "a number"), ("note", 3, "a string (or none)")]:  # fmt: skip
        with pytest.raises(
            ConfigError, match=rf"^{name} must be {re.escape(said)}, not {re.escape(repr(value))}"
        ):
            make_config(ReinforceConfig, "reinforce", {name: value})

    @dataclass
    class Loose(LMAgentConfig):
        note: str = None  # a default its annotation does not cover is the agent's own, not user input

    assert make_config(Loose, "loose", {}).note is None
    config = make_config(
        ReinforceConfig, "reinforce", {"n_updates": 2, "baseline": 1, "note": None, "anything": []}
    )
    assert (config.n_updates, config.baseline, config.anything) == (2, 1, [])


def test_annotations_written_with_the_typing_module_are_checked_as_their_pipe_spelling():
    """`Optional[float]` (how much plugin code still writes it) was not read as a plain type: "0.5" went
    unchecked into the agent."""
    import typing

    from textgym.config import annotation_mismatch

    spellings = [typing.Optional[float], "Optional[float]", typing.Union[float, None], "None | float"]  # noqa: UP007, UP045
    for annotation in spellings:
        assert annotation_mismatch(annotation, "0.5") == "a number (or none)", annotation
        assert annotation_mismatch(annotation, None) is None and annotation_mismatch(annotation, 0.5) is None
    assert annotation_mismatch(typing.List[str], "a") == "a list"  # noqa: UP006
    assert annotation_mismatch("list[int | None] | None", 3) == "a list (or none)"
    assert annotation_mismatch("int | str", []) is None  # not one plain type: left to the plugin


def test_a_lora_agent_is_made_without_a_deprecation_notice_the_user_cannot_act_on():
    """peft's call of transformers' deprecated is_gradient_checkpointing printed a FutureWarning at every
    LoRA agent made or loaded."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        LMPPO("tiny-random-llama", None, lora={"r": 4, "target_modules": ["q_proj", "v_proj"]}, verbose=0)
    assert not [w for w in seen if "is_gradient_checkpointing" in str(w.message)]


def test_a_lora_dropout_that_does_nothing_is_said_once():
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        LMPPO("tiny-random-llama", None, lora={"r": 4, "lora_dropout": 0.1}, verbose=0)
    said = [
        w
        for w in seen
        if "lora_dropout = 0.1 has no effect: textgym trains with dropout off" in str(w.message)
    ]
    assert len(said) == 1
