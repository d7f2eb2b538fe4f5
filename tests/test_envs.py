import gymnasium
import numpy as np
import pytest
from gymnasium.error import InvalidAction, ResetNeeded
from gymnasium.utils.env_checker import check_env as gym_check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

import textgym
from textgym import FunctionReward, RewardStack, TextGenEnv, TextGenVectorEnv, plugin_manager
from textgym.errors import ConfigError, PromptError
from textgym.models import CharTokenizer

CHARS = CharTokenizer("abcdefgh")


def length_reward(samples):
    return [float(len(s.completion)) for s in samples]


class CountingReward:
    """Records the size of every batch it scores."""

    name = "counting"

    def __init__(self):
        self.batches = []

    def __call__(self, samples):
        self.batches.append([s.completion for s in samples])
        return [float(len(s.completion)) for s in samples]


def char_env(**kwargs):
    defaults = dict(
        model=CHARS, prompts=["abc", "de"], rewards=RewardStack([(FunctionReward("len", length_reward), 1)])
    )
    return TextGenEnv(**{**defaults, **kwargs})


@pytest.mark.parametrize("env_id", sorted(plugin_manager.registry("register_envs").names()))
def test_every_registered_env_passes_gymnasium_and_sb3_checkers(env_id):
    env = gymnasium.make(env_id, disable_env_checker=True)
    gym_check_env(env.unwrapped, skip_render_check=True)
    sb3_check_env(env.unwrapped, warn=False)


def test_default_env_needs_no_arguments(tokenizer):
    env = gymnasium.make("textgym/TextGen-v0")
    obs, info = env.reset(seed=0)
    assert env.action_space.n == len(tokenizer)
    assert obs["input_ids"].shape == (96 + 32,) and obs["input_ids"].dtype == np.int64
    assert obs["attention_mask"].dtype == np.int8
    assert "<|im_start|>user" in tokenizer.decode(
        obs["input_ids"][obs["attention_mask"] == 1]
    )  # chat template
    assert info["prompt"] in [p.text for p in textgym.load_prompts("chat")]
    assert env.unwrapped.reward_stack.names == ["sentiment", "length_penalty"]


def test_observation_layout_reward_on_last_step_and_termination_on_eos():
    env = char_env(max_new_tokens=5, max_prompt_tokens=4)
    obs, _ = env.reset(options={"prompt": 0})
    assert obs["input_ids"].tolist() == [0, 2, 3, 4, 0, 0, 0, 0, 0]  # pad, a, b, c | completion
    assert obs["attention_mask"].tolist() == [0, 1, 1, 1, 0, 0, 0, 0, 0]
    obs, reward, terminated, truncated, info = env.step(5)  # "d"
    assert (reward, terminated, truncated, info) == (0.0, False, False, {})
    assert obs["input_ids"][4] == 5 and obs["attention_mask"][4] == 1
    obs, reward, terminated, truncated, info = env.step(CHARS.eos_token_id)
    assert (terminated, truncated) == (True, False)
    assert info["completion"] == "d" and info["finish_reason"] == "stop"
    assert reward == 1.0 and info["reward_components"] == {"len": 1.0}


def test_a_prompt_option_that_is_a_source_prompts_text_keeps_its_metadata():
    """A text was always a new prompt without metadata: a reward reading its reference failed mid-step."""
    env = char_env(prompts=[{"prompt": "ab", "reference": "ab"}], rewards=[{"name": "match"}])
    env.reset(options={"prompt": "ab"})
    for token in [*CHARS.encode("ab"), CHARS.eos_token_id]:
        _, reward, terminated, _, info = env.step(token)
    assert terminated and reward == 1.0
    _, info = env.reset(options={"prompt": "ba"})  # another text: a prompt of its own, without a reference
    assert info["prompt"] == "ba" and env.unwrapped.episodes.n_source == 1


def test_truncation_at_the_token_limit():
    env = char_env(max_new_tokens=3)
    env.reset(seed=0)
    for _ in range(2):
        assert env.step(2)[2:4] == (False, False)
    _, reward, terminated, truncated, info = env.step(2)
    # terminated too: the whole return was paid on this step, nothing follows it to bootstrap
    assert (terminated, truncated, info["finish_reason"], info["completion"], reward) == (
        True,
        True,
        "length",
        "aaa",
        3.0,
    )


def test_stop_strings_end_the_episode_and_are_cut_from_the_completion():
    env = char_env(stop=["cd"], max_new_tokens=10)
    env.reset(seed=0)
    for token in CHARS.encode("abc"):
        assert not env.step(token)[2]
    _, reward, terminated, _, info = env.step(CHARS.encode("d")[0])
    assert terminated and info["completion"] == "ab" and info["finish_reason"] == "stop" and reward == 2.0


@pytest.mark.parametrize("stop", ["答案：", "👍🏽", "정답:"])
def test_a_stop_string_of_many_byte_tokens_per_character_ends_the_episode_where_it_is(stop):
    """The window of tokens searched for a stop string was counted in characters; a byte-level BPE takes
    up to 4 tokens per character, so these never fit: the episode ran on to the token limit, trained on
    tokens that the completion's text then hid."""
    env = TextGenEnv(model="tiny-random-llama", prompts=["Hello"], max_new_tokens=64, stop=[stop],
                     chat_template=False, rewards=[{"name": "length_penalty", "target": 2}])  # fmt: skip
    head = env.tokenizer.encode(f"first {stop}", add_special_tokens=False)
    tail = env.tokenizer.encode(" after the stop string", add_special_tokens=False)
    env.reset(seed=0)
    steps = 0
    for token in head + tail:
        _, _, terminated, truncated, info = env.step(token)
        steps += 1
        if terminated or truncated:
            break
    assert terminated and steps == len(head)
    assert info["finish_reason"] == "stop" and info["completion"] == "first "


def test_a_stop_string_that_is_a_special_token_is_not_counted_as_completion_text():
    """The completion's text is decoded without special tokens, so such a stop string was never found in
    it: its token counted as text (length_penalty one token off)."""
    seen = []

    def spy(samples):
        seen.extend(samples)
        return [0.0] * len(samples)

    env = TextGenEnv(model="tiny-random-llama", prompts=["Capital of France?"], max_new_tokens=8,
                     stop=["<|im_start|>"], rewards=RewardStack([(FunctionReward("spy", spy), 1.0)]))  # fmt: skip
    env.reset(seed=0)
    for token in env.tokenizer.encode("Paris<|im_start|>", add_special_tokens=False):
        _, _, terminated, _, info = env.step(token)
    assert terminated and info["completion"] == "Paris" and info["finish_reason"] == "stop"
    assert seen[-1].stop_tokens == 1 and seen[-1].text_tokens() == len(seen[-1].completion_ids) - 1


def test_a_pad_or_other_special_token_the_policy_writes_stays_in_the_completions_text():
    """The text was decoded without special tokens: a pad token written by a policy without action masks
    (stock SB3 PPO) vanished, and "a<pad>bc" passed as an exact copy of "abc"."""
    env = TextGenEnv(model="chars", prompts=["abc"], max_new_tokens=6,
                     rewards=[{"name": "match", "reference": "abc"}])  # fmt: skip
    for written, completion, reward in [("a_bc", "a<pad>bc", 0.0), ("abc", "abc", 1.0)]:
        env.reset(seed=0)
        ids = [CHARS.pad_token_id if c == "_" else CHARS.encode(c)[0] for c in written]
        for token in [*ids, CHARS.eos_token_id]:
            _, r, terminated, _, info = env.step(token)
        assert terminated and info["completion"] == completion and r == reward
    llama = TextGenEnv(model="tiny-random-llama", prompts=["Hi"], max_new_tokens=8, chat_template=False,
                       rewards=[{"name": "length_penalty", "target": 2}])  # fmt: skip
    llama.reset(seed=0)
    tokens = llama.tokenizer.encode("Paris<|im_start|>x", add_special_tokens=False)
    for token in [*tokens, llama.tokenizer.eos_token_id]:
        *_, info = llama.step(token)
    assert info["completion"] == "Paris<|im_start|>x"  # not a stop string here: as written
    # a stop string that is no token of the vocabulary: convert_tokens_to_ids gave the unknown token's id
    # (here pad's too), which was then hidden from the text as if it were a stop token
    llama = TextGenEnv(model="tiny-random-llama", prompts=["Hi"], max_new_tokens=8, chat_template=False,
                       rewards=[{"name": "length_penalty", "target": 2}], stop=["Answer:"])  # fmt: skip
    llama.reset(seed=0)
    tok = llama.tokenizer
    for token in [*tok.encode("a", add_special_tokens=False), tok.pad_token_id, tok.eos_token_id]:
        *_, info = llama.step(token)
    assert info["completion"] == f"a{tok.pad_token}"


def test_every_end_id_a_model_directory_declares_ends_an_episode(tmp_path, tokenizer):
    """Llama 3 and Gemma instruct models end a reply on an end-of-turn token their generation config lists
    beside the tokenizer's EOS: the env ran past it to the token limit, scoring the rambling after it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from textgym.agents.ppo import LMPPO

    eot = tokenizer.convert_tokens_to_ids("<|im_start|>")  # standing in for <|eot_id|>
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=[tokenizer.eos_token_id, eot])  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    kwargs = dict(prompts=["Hi"], rewards=[{"name": "length_penalty", "target": 1}], max_new_tokens=8)
    env = TextGenEnv(model=str(tmp_path / "model"), chat_template=False, **kwargs)
    assert env.eos_token_ids == {tokenizer.eos_token_id, eot} and env.action_masks()[eot]
    env.reset(seed=0)
    for token in [*tokenizer.encode(" Paris", add_special_tokens=False), eot]:
        _, reward, terminated, truncated, info = env.step(token)
    assert (terminated, truncated, info["finish_reason"], info["completion"], reward) == (
        True,
        False,
        "stop",
        " Paris",
        0.0,
    )
    # an env made from the tokenizer alone does not know the id: the agent says so, not trains past it
    vector = TextGenVectorEnv(num_envs=2, model=tokenizer, autoreset_mode="Disabled", **kwargs)
    with pytest.raises(ConfigError, match=r"also ends replies on \['<\|im_start\|>'\]"):
        LMPPO(str(tmp_path / "model"), vector, verbose=0)


def test_a_stop_strings_tokens_are_not_counted_as_the_completions():
    seen = []

    def tokens(samples):
        seen.extend(samples)
        return [float(s.text_tokens()) for s in samples]

    stack = RewardStack(
        [(FunctionReward("tokens", tokens), 1), (textgym.make_reward("length_penalty", target=2), 1)]
    )
    env = char_env(stop=["cd"], max_new_tokens=10, rewards=stack)
    env.reset(seed=0)
    for token in CHARS.encode("abcd"):
        _, _, terminated, _, info = env.step(token)
    # "ab" and the stop string's 2 tokens: 2 tokens of text, which length_penalty took for 3 (4 less the 1
    # token that ends a completion on EOS)
    assert terminated and info["completion"] == "ab" and seen[0].completion_ids == tuple(CHARS.encode("abcd"))
    assert seen[0].stop_tokens == 2 and info["reward_components"] == {"tokens": 2.0, "length_penalty": 0.0}
    env.reset(seed=0)
    for token in [*CHARS.encode("ab"), CHARS.eos_token_id]:
        env.step(token)
    assert seen[1].stop_tokens == 1 and seen[1].text_tokens() == 2


def test_step_before_reset_and_after_the_end_need_reset():
    env = char_env(max_new_tokens=1)
    with pytest.raises(ResetNeeded):
        env.step(2)
    env.reset(seed=0)
    env.step(2)
    with pytest.raises(ResetNeeded, match="call reset"):
        env.step(2)


@pytest.mark.parametrize("action", [10, -1, 2.5, "a", [2, 3]])
def test_actions_outside_the_vocabulary_are_invalid(action):
    env = char_env()
    env.reset(seed=0)
    with pytest.raises(InvalidAction, match="token id|not a token"):
        env.step(action)
    env.step(2)  # a refused action changed nothing: the episode goes on


def test_long_prompts_are_truncated_from_the_left_with_a_warning_or_rejected():
    # every prompt of the source is checked when the env is made: one warning (or error) up front
    with pytest.warns(UserWarning, match="1 of 2 prompts have more than max_prompt_tokens=3 tokens; keeping"):
        env = char_env(prompts=["abcdefgh", "ab"], max_prompt_tokens=3)
    obs, _ = env.reset(options={"prompt": 0})
    assert CHARS.decode(obs["input_ids"][:3]) == "fgh"
    # a text given at reset
    with pytest.warns(UserWarning, match="has 9 tokens; keeping the last 3 tokens of its text"):
        env.reset(options={"prompt": "abcdefghh"})
    with pytest.raises(PromptError, match="8 tokens, more than max_prompt_tokens=3"):
        char_env(prompts=["abcdefgh"], max_prompt_tokens=3, prompt_overflow="error")


def test_a_long_prompt_is_cut_inside_its_chat_template_and_after_its_bos_token():
    """The last max_prompt_tokens of the templated ids were kept: the template's opening (the user turn's
    start, a system block) or the BOS token went, and a small limit left the assistant header alone."""
    text = "Please summarise this: " + " ".join(f"word{i}" for i in range(60))
    env = TextGenEnv(model="tiny-random-llama", prompts=[text], max_prompt_tokens=40, max_new_tokens=2)
    full = env.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)  # fmt: skip
    obs, _ = env.reset(seed=0)
    kept = env.tokenizer.decode(obs["input_ids"][:40][obs["attention_mask"][:40] == 1])
    assert kept.startswith(full[: full.index(text)]) and kept.endswith(
        "word59<|im_end|>\n<|im_start|>assistant\n"
    )
    assert "Please summarise" not in kept and len(kept) < len(full)
    with pytest.raises(
        PromptError, match=r"its framing alone \(the chat template: \d+ tokens\) leaves no room"
    ):
        TextGenEnv(model="tiny-random-llama", prompts=[text], max_prompt_tokens=3)
    # a template that changes the text it frames (a leading blank line merged with the header's newline;
    # Llama 3's trims it): its tokens were not found, and the templated ids were cut from the left whole
    for changed in ("\n\n" + text, text + " "):
        env = TextGenEnv(model="tiny-random-llama", prompts=[changed], max_prompt_tokens=40, max_new_tokens=2)
        obs, _ = env.reset(seed=0)
        kept = env.tokenizer.decode(obs["input_ids"][:40][obs["attention_mask"][:40] == 1])
        assert kept.startswith(full[: full.index(text)]) and kept.endswith("<|im_start|>assistant\n")
        assert "word59" in kept and "Please summarise" not in kept

    import copy

    from textgym.models import load_tokenizer

    bos = copy.deepcopy(load_tokenizer("tiny-random-llama"))  # the zoo's is shared
    bos.chat_template = None
    bos.add_bos_token = True
    if bos(text).input_ids[0] != bos.bos_token_id:
        pytest.skip("this tokenizer adds no BOS token")
    env = TextGenEnv(model=bos, prompts=[text], max_prompt_tokens=8, max_new_tokens=2)
    obs, _ = env.reset(seed=0)
    ids = obs["input_ids"][:8]
    assert ids[0] == bos.bos_token_id and bos.decode(ids[1:]).endswith("word59")


def test_prompts_the_tokenizer_cannot_encode_are_refused_when_the_env_is_made():
    with pytest.raises(PromptError, match=r"prompt 1 \('abz'\) cannot be tokenized: character 'z' is not in"):
        char_env(prompts=["abc", "abz"])
    # a text given to reset is no prompt of the source: it was named by an index the user never gave
    with pytest.raises(
        PromptError, match=r"^the prompt given in reset's options \('abz'\) cannot be tokenized"
    ):
        char_env(prompts=["abc"]).reset(options={"prompt": "abz"})


def test_absurd_sizes_are_refused_before_allocating():
    with pytest.raises(ConfigError, match=r"would need .* GiB for observations; lower them"):
        TextGenVectorEnv(num_envs=100_000, model=CHARS, prompts=["ab"], max_new_tokens=10_000)


def test_bad_constructor_arguments_are_clear_errors():
    with pytest.raises(ConfigError, match="prompt_overflow must be"):
        char_env(prompt_overflow="drop")
    with pytest.raises(ConfigError, match="max_new_tokens must be a positive integer, not 0"):
        char_env(max_new_tokens=0)
    with pytest.raises(ConfigError, match="has none"):
        char_env(chat_template=True)
    with pytest.raises(PromptError, match="is empty"):
        char_env(prompts=[])
    with pytest.raises(textgym.errors.UnknownNameError, match="unknown reward 'sentimen'"):
        char_env(rewards=[{"name": "sentimen"}])
    # a reward defined in a plugin file that was not loaded: how to load it
    with pytest.raises(
        textgym.errors.UnknownNameError, match=r"plugin file.*--plugin FILE.py, or run.plugins"
    ):
        char_env(rewards=[{"name": "exclaim"}])


def test_seeded_resets_are_reproducible_and_sequential_order_cycles():
    env = char_env(prompts=[c * 2 for c in "abcdefgh"])
    first = [env.reset(seed=7)[1]["prompt"]] + [env.reset()[1]["prompt"] for _ in range(5)]
    again = [env.reset(seed=7)[1]["prompt"]] + [env.reset()[1]["prompt"] for _ in range(5)]
    assert first == again and len(set(first)) > 1
    env = char_env(prompts=["ab", "cd"], prompt_order="sequential")
    assert [env.reset()[1]["prompt"] for _ in range(3)] == ["ab", "cd", "ab"]
    # a vector env also takes one seed per sub-env, as Gymnasium's SyncVectorEnv does
    vec = vector_char_env(3, prompts=[c * 2 for c in "abcdefgh"])
    prompts = [list(vec.reset(seed=s)[1]["prompt"]) for s in ([1, 2, 3], [1, 2, 3], [1, 2, 4])]
    assert prompts[0] == prompts[1] != prompts[2]
    with pytest.raises(ConfigError, match=r"a list of 3 of them \(None for a random one\), not \[1, 2\]"):
        vec.reset(seed=[1, 2])
    # None in the list is a random seed there, as in SyncVectorEnv (it was refused); all None: unseeded
    vec.reset(seed=[1, None, 3])
    vec.reset(seed=[None, None, None])
    with pytest.raises(ConfigError, match=r"not \[1, -2, None\]"):
        vec.reset(seed=[1, -2, None])


def test_vector_env_scores_all_episodes_ending_on_a_step_in_one_call():
    counting = CountingReward()
    env = TextGenVectorEnv(
        num_envs=4, model=CHARS, prompts=["ab"], rewards=RewardStack([(counting, 1.0)]), max_new_tokens=3
    )
    env.reset(seed=0)
    eos = CHARS.eos_token_id
    _, rewards, term, trunc, infos = env.step(np.array([eos, 2, eos, 2]))
    assert counting.batches == [["", ""]]  # one call, both finished episodes
    assert term.tolist() == [True, False, True, False] and not trunc.any()
    assert infos["_final_info"].tolist() == [True, False, True, False]
    assert infos["final_info"]["completion"][0] == "" and infos["final_info"]["finish_reason"][2] == "stop"
    env.step(np.array([2, 3, 2, 3]))
    _, rewards, term, trunc, infos = env.step(np.array([2, 4, 2, 4]))
    assert counting.batches[-1] == ["abc", "abc"]  # envs 1 and 3 hit the limit together
    assert trunc.tolist() == [False, True, False, True] and rewards.tolist() == [0, 3, 0, 3]
    assert infos["final_info"]["reward_components"]["counting"][1] == 3.0


def test_vector_env_same_step_autoreset_restarts_ended_episodes():
    env = TextGenVectorEnv(
        num_envs=2,
        model=CHARS,
        prompts=["ab"],
        rewards=[{"name": "match", "reference": "x"}],
        max_new_tokens=2,
    )
    obs, _ = env.reset(seed=0)
    eos = CHARS.eos_token_id
    obs, *_, infos = env.step(np.array([eos, 2]))
    assert infos["final_obs"][0]["input_ids"][96] == eos  # the ended episode's last observation
    assert obs["attention_mask"][0, 96:].sum() == 0  # env 0 already restarted
    assert obs["attention_mask"][1, 96:].sum() == 1


def test_vector_env_disabled_autoreset_idles_ended_envs_until_reset_mask():
    env = TextGenVectorEnv(
        num_envs=2,
        model=CHARS,
        prompts=["ab"],
        rewards=[{"name": "match", "reference": "a"}],
        max_new_tokens=3,
        autoreset_mode="Disabled",
    )
    env.reset(seed=0)
    eos = CHARS.eos_token_id
    _, _, term, _, infos = env.step(np.array([eos, 2]))
    assert term.tolist() == [True, False] and infos["completion"][0] == ""
    assert env.active.tolist() == [False, True]
    obs, rewards, _, _, _ = env.step(np.array([5, eos]))  # env 0 idle: its action is ignored
    assert obs["attention_mask"][0, 96:].sum() == 1 and rewards.tolist() == [0.0, 1.0]
    assert not env.active.any()
    env.reset(options={"reset_mask": np.array([True, False])})
    assert env.active.tolist() == [True, False]


def test_make_vec_returns_the_native_vector_env():
    env = gymnasium.make_vec("textgym/Copy-v0", num_envs=3)
    assert isinstance(env, TextGenVectorEnv) and env.num_envs == 3
    obs, _ = env.reset(seed=0)
    assert obs["input_ids"].shape == (3, 7)


def test_gymnasiums_vector_observation_wrappers_take_the_modes_the_readme_names():
    """The README says which autoreset modes Gymnasium's vector observation wrappers accept."""
    flatten = gymnasium.wrappers.vector.FlattenObservation
    with pytest.raises(ValueError, match="autoreset_mode"):  # the default, SameStep, is Gymnasium's refusal
        flatten(gymnasium.make_vec("textgym/Copy-v0", num_envs=2))
    for kwargs in ({"autoreset_mode": "Disabled"}, {"vectorization_mode": "sync"}):
        obs, _ = flatten(gymnasium.make_vec("textgym/Copy-v0", num_envs=2, **kwargs)).reset(seed=0)
        assert obs.shape == (2, 14)  # input_ids and attention_mask, 7 each


def test_vector_env_rejects_bad_actions():
    env = TextGenVectorEnv(
        num_envs=2, model=CHARS, prompts=["ab"], rewards=[{"name": "match", "reference": "a"}]
    )
    with pytest.raises(ResetNeeded):
        env.step(np.array([2, 2]))
    env.reset(seed=0)
    with pytest.raises(InvalidAction, match=r"action 99 \(env 1\)"):
        env.step(np.array([2, 99]))
    with pytest.raises(InvalidAction, match="must be 2 integer token ids"):
        env.step(np.array([2]))
    env.step(np.array([2, 2]))  # a refused action changed nothing: the episodes go on


def vector_char_env(n=6, **kwargs):
    defaults = dict(
        model=CHARS, prompts=["abc", "de", "fgh", "hh"], max_new_tokens=3, max_prompt_tokens=3,
        rewards=RewardStack([(FunctionReward("len", length_reward), 1)]), autoreset_mode="Disabled",
    )  # fmt: skip
    return TextGenVectorEnv(num_envs=n, **{**defaults, **kwargs})


def prompts_of(infos, n):
    return [infos["prompt"][i] for i in range(n)]


def test_reset_with_one_prompt_per_sub_env_by_index_or_text():
    env = vector_char_env(3)
    _, infos = env.reset(options={"prompts": [2, "ed", 0]})
    assert prompts_of(infos, 3) == ["fgh", "ed", "abc"]
    _, infos = env.reset(options={"prompts": [1, 1], "reset_mask": np.array([True, False, True])})
    assert infos["prompt"][0] == infos["prompt"][2] == "de" and not infos["_prompt"][1]
    _, infos = env.reset(options={"prompts": np.array([2, 1, 0])})  # a numpy array was no list of prompts
    assert prompts_of(infos, 3) == ["fgh", "de", "abc"]


@pytest.mark.parametrize("order", ["random", "sequential"])
def test_group_size_gives_consecutive_sub_envs_the_same_prompt(order):
    env = vector_char_env(6, prompt_order=order)
    _, infos = env.reset(seed=3, options={"group_size": 3})
    prompts = prompts_of(infos, 6)
    assert prompts[0] == prompts[1] == prompts[2] and prompts[3] == prompts[4] == prompts[5]
    if order == "sequential":
        assert prompts == ["abc"] * 3 + ["de"] * 3
        _, infos = env.reset(options={"group_size": 2})
        assert prompts_of(infos, 6) == ["fgh", "fgh", "hh", "hh", "abc", "abc"]


def test_sharded_processes_draw_different_prompts_in_sequential_order_and_together_all_of_them():
    prompts = ["aa", "bb", "cc", "dd", "ee", "ff"]
    envs = [vector_char_env(2, prompts=prompts, prompt_order="sequential") for _ in range(2)]
    for process, env in enumerate(envs):
        env.shard_prompts(process, 2)
    drawn = []
    for _ in range(3):  # the two processes' batches, in step
        batches = [prompts_of(env.reset(options={"group_size": 1})[1], 2) for env in envs]
        assert not set(batches[0]) & set(batches[1])
        drawn += batches[0] + batches[1]
    assert sorted(drawn) == sorted(prompts * 2)  # 12 draws of 6 prompts: each twice
    envs[1].reset()  # process 1 drew bb, dd: its place is 2 draws on
    restored = vector_char_env(2, prompts=prompts, prompt_order="sequential")  # as a resume makes it
    restored.shard_prompts(1, 2)
    restored.prompt_cursor = envs[1].prompt_cursor  # the checkpoint's place
    assert prompts_of(restored.reset()[1], 2) == prompts_of(envs[1].reset()[1], 2) == ["ff", "bb"]
    with pytest.raises(ConfigError, match="process must be in 0..1, not 2"):
        envs[0].shard_prompts(2, 2)


def test_public_accessors_describe_the_episodes():
    env = vector_char_env(2, max_new_tokens=5, max_prompt_tokens=4)
    assert (env.max_prompt_tokens, env.max_new_tokens) == (4, 5)
    assert (env.pad_token_id, env.eos_token_id, env.num_prompts) == (0, 1, 4)
    assert env.encode_prompt(0).tolist() == [2, 3, 4] and env.encode_prompt("ba").tolist() == [3, 2]
    env.reset(seed=0)
    for _ in range(5):
        env.step(np.array([2, 2]))
    assert env.reward_seconds > 0


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ("abc", "reset options must be a dict"),
        (
            {"promt": 0},
            "unknown reset option 'promt'; valid options: reset_mask, prompt, prompts, group_size",
        ),
        ({"prompt": 0, "group_size": 2}, "exclude each other"),
        ({"prompts": "abc"}, "must be a list of 4 prompts"),
        ({"prompts": [0, 1]}, "must be a list of 4 prompts"),
        ({"prompts": [0, 1, 2, 99]}, r"prompt index in \[0, 4\) or a non-empty text, not 99"),
        ({"prompt": True}, "not True"),
        ({"group_size": 3}, "divides the 4 sub-envs"),
        ({"group_size": 0}, "positive integer"),
        ({"reset_mask": [1, 0, 1, 0]}, "reset_mask must be a bool array of shape"),
    ],
)
def test_bad_reset_options_are_clear_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        vector_char_env(4).reset(options=options)


def test_single_env_rejects_unknown_reset_options():
    with pytest.raises(ConfigError, match="valid options: prompt"):
        char_env().reset(options={"prompts": [0]})


class _Passthrough(gymnasium.Wrapper):
    pass


def _deeply_wrapped(env, depth=12):
    for _ in range(depth):
        env = _Passthrough(env)
    return env


@pytest.mark.parametrize("how", ["make", "wrapper", "argument", "nested", "deep", "make_then_wrapper"])
def test_an_episode_cut_by_a_time_limit_is_still_scored(how):
    kwargs = dict(
        model=CHARS,
        prompts=["abc"],
        max_new_tokens=10,
        rewards=RewardStack([(FunctionReward("len", length_reward), 1)]),
    )
    if how == "make":
        env = gymnasium.make("textgym/TextGen-v0", max_episode_steps=3, disable_env_checker=True, **kwargs)
    elif how == "wrapper":
        env = gymnasium.wrappers.TimeLimit(TextGenEnv(**kwargs), max_episode_steps=3)
    elif how == "nested":  # the smallest limit counts, wherever it sits
        env = gymnasium.wrappers.TimeLimit(gymnasium.wrappers.TimeLimit(TextGenEnv(**kwargs), 5), 3)
    elif how == "deep":  # any number of wrappers between
        env = gymnasium.wrappers.TimeLimit(_deeply_wrapped(TextGenEnv(**kwargs)), max_episode_steps=3)
    elif how == "make_then_wrapper":
        env = gymnasium.make("textgym/TextGen-v0", max_episode_steps=5, disable_env_checker=True, **kwargs)
        env = gymnasium.wrappers.TimeLimit(env, max_episode_steps=3)
    else:
        env = TextGenEnv(max_episode_steps=3, **kwargs)
    for seed in (0, 1):  # the first reset runs through more frames (the env checker) than later ones
        env.reset(seed=seed)
        for _ in range(2):
            assert env.step(2)[1:4] == (0.0, False, False)
        _, reward, terminated, truncated, info = env.step(2)
        assert (reward, terminated, truncated) == (3.0, True, True)
        assert info["reward_components"] == {"len": 3.0} and info["finish_reason"] == "length"


def test_a_time_limit_around_another_env_does_not_cut_this_one():
    kwargs = dict(model=CHARS, prompts=["abc"], max_new_tokens=4)

    class Outer(gymnasium.Wrapper):  # a wrapper whose reset resets an unrelated inner env first
        def __init__(self, env, inner):
            super().__init__(env)
            self.inner = inner

        def reset(self, **kw):
            self.inner.reset(seed=0)
            return super().reset(**kw)

    inner = TextGenEnv(**kwargs)
    env = gymnasium.wrappers.TimeLimit(Outer(TextGenEnv(**kwargs), inner), max_episode_steps=2)
    env.reset(seed=0)
    assert [inner.step(2)[3] for _ in range(4)] == [False, False, False, True]


def test_make_vec_passes_max_episode_steps_to_the_vector_env():
    env = gymnasium.make_vec("textgym/Copy-v0", num_envs=2, max_episode_steps=2, autoreset_mode="Disabled")
    env.reset(seed=0)
    env.step(np.array([2, 2]))
    _, _, terminated, truncated, infos = env.step(np.array([2, 2]))
    assert terminated.all() and truncated.all() and "reward_components" in infos


def test_the_vector_env_renders_text_and_declares_render_fps():
    env = vector_char_env(2, render_mode="ansi")
    env.reset(options={"prompts": [0, 1]})
    env.step(np.array([2, 3]))
    assert env.render() == ("abca", "deb")
    assert env.metadata["render_fps"] and TextGenEnv.metadata["render_fps"]
    with pytest.raises(ConfigError, match="render_mode must be None or 'ansi'"):
        vector_char_env(2, render_mode="human")
    # a TypeError as well: SB3's make_vec_env tries render_mode="rgb_array" and goes on without it on one
    with pytest.raises(TypeError, match="not 'rgb_array'"):
        char_env(render_mode="rgb_array")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(allowed_tokens=5), r"allowed_tokens must be a list of token ids or token strings.*not 5"),
        (dict(max_new_tokens=True), r"max_new_tokens must be a positive integer, not True"),
    ],
)
def test_settings_of_the_wrong_kind_are_named_not_taken_or_tracebacks(kwargs, message):
    """allowed_tokens=5 was "'int' object is not iterable"; True was taken as 1."""
    with pytest.raises(ConfigError, match=message):
        char_env(**kwargs)
    with pytest.raises(ConfigError, match="num_envs must be a positive integer, not True"):
        TextGenVectorEnv(
            num_envs=True, model=CHARS, prompts=["ab"], rewards=[{"name": "length_penalty", "target": 2}]
        )


def test_a_non_ascii_stop_string_is_found_with_a_byte_fallback_tokenizer():
    """Llama 2, Mistral and Gemma write characters outside their vocabulary as byte tokens, and their decoder
    makes a run of byte tokens that starts inside a character U+FFFD, the stop string's own bytes too: a
    window of the last tokens that began inside "案" missed "：", and the episode ran on to the limit."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, **{f"<0x{b:02X}>": 4 + b for b in range(256)}}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    raw.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>")  # fmt: skip
    env = TextGenEnv(model=tok, prompts=["a"], rewards=[{"name": "length_penalty", "target": 6}], stop=["："],
                     max_new_tokens=24, max_prompt_tokens=4)  # fmt: skip
    env.reset(seed=0)
    written = tok.encode("答案：", add_special_tokens=False)
    assert len(written) == 9  # a byte token each
    for token in written:
        _, _, terminated, _, info = env.step(token)
    assert terminated and info["finish_reason"] == "stop" and info["completion"] == "答案"
