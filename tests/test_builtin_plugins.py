"""The built-in reward plugins, each built by name as users do, on real inputs."""

import math

import numpy as np
import pytest
import torch

from textgym import Sample, build_reward_stack, make_reward
from textgym.errors import PluginArgumentError, RewardError


def s(completion, prompt="p", finish_reason="stop", completion_ids=None, **meta):
    ids = completion_ids if completion_ids is not None else tuple(range(len(completion.split()) + 1))
    return Sample(prompt, completion, (), tuple(ids), finish_reason, meta)


def test_sentiment_ranks_positive_above_negative_and_can_flip():
    samples = [s("I love this, it is wonderful!"), s("This is terrible and I hate it.")]
    pos, neg = make_reward("sentiment")(samples)
    assert pos > 0.5 and neg < -0.5
    assert make_reward("sentiment", target="negative")(samples) == [-pos, -neg]


def test_length_penalty_target_range_shapes_units_and_missing_eos():
    # completion_ids include EOS when finish_reason is "stop": 5 ids -> 4 tokens of text
    four = s("a b c d", completion_ids=(1, 2, 3, 4, 9))
    assert make_reward("length_penalty", target=4)([four]) == [0.0]
    assert make_reward("length_penalty", target=8)([four]) == [-0.5]
    assert make_reward("length_penalty", target=8, shape="quadratic")([four]) == [-0.25]
    assert make_reward("length_penalty", min=2, max=6)([four]) == [0.0]
    assert make_reward("length_penalty", min=6, max=10)([four]) == [-0.2]
    assert make_reward("length_penalty", target=2, unit="words")([four]) == [-1.0]
    cut = s("a b c d", finish_reason="length", completion_ids=(1, 2, 3, 4))
    assert make_reward("length_penalty", target=4, missing_eos_penalty=0.7)([cut]) == [-0.7]
    # a multi-turn episode's last agent turn ended on EOS too when its reply was withheld or did not fit
    for reason in ("max_turns", "overflow"):
        ended = s("a b c d", finish_reason=reason, completion_ids=(1, 2, 3, 4, 9))
        assert make_reward("length_penalty", target=4)([ended]) == [0.0]
    with pytest.raises(PluginArgumentError, match="either target, or min and/or max"):
        make_reward("length_penalty", target=4, max=3)
    # a negative missing_eos_penalty rewarded cut completions; a non-finite bound or scale made every score
    # NaN, reported at the first episode as the plugin's output, not its argument
    with pytest.raises(PluginArgumentError, match=r"missing_eos_penalty must be .* >= 0.*not -1"):
        make_reward("length_penalty", target=4, missing_eos_penalty=-1)
    for key, value in (("target", math.inf), ("scale", math.nan), ("min", math.nan)):
        with pytest.raises(PluginArgumentError, match=f"{key} must be a finite number, not {value}"):
            make_reward("length_penalty", **{"target": 4, key: value} if key != "min" else {"min": value})
    # counting tokens without token ids gave every text length 0: the same penalty whatever its length
    with pytest.raises(RewardError, match="has no completion_ids .*give unit = 'words'"):
        make_reward("length_penalty", target=4)([s("one two three", completion_ids=())])
    assert make_reward("length_penalty", target=4)([s("", completion_ids=())]) == [-1.0]  # empty: length 0


def test_match_modes_and_references():
    samples = [s(" 42 ", reference="42"), s("the answer is 42.", reference="42"), s("41", reference="42")]
    assert make_reward("match")(samples) == [1.0, 0.0, 0.0]
    assert make_reward("match", mode="contains")(samples) == [1.0, 1.0, 0.0]
    assert make_reward("match", mode="regex", reference=r"\b4\d\b")(samples) == [1.0, 1.0, 1.0]
    assert make_reward("match", partial=True)(samples)[2] == pytest.approx(0.5)
    with pytest.raises(RewardError, match="has no 'reference' in its metadata"):
        make_reward("match")([s("x")])
    # an invalid pattern was re's traceback: fixed (at construction) or a prompt's (naming the prompt)
    with pytest.raises(PluginArgumentError, match=r"reference '\[a-z' is not a valid regular expression"):
        make_reward("match", mode="regex", reference="[a-z")
    with pytest.raises(RewardError, match=r"prompt 'p'.*'reference' '\(4' is not a valid regular expression"):
        make_reward("match", mode="regex")([s("42", reference="(4")])
    # an empty reference (a JSONL null, an empty CSV cell) is no reference: not applicable, not "None" or ""
    for mode in ("exact", "contains"):
        empty = [
            s("None", reference=None),
            s("", reference=""),
            s("x", reference="  "),
            s("42", reference="42"),
        ]
        assert make_reward("match", mode=mode)(empty) == [None, None, None, 1.0]  # "  ": "contains" said 1.0
    with pytest.raises(PluginArgumentError, match="partial=True needs mode='exact'"):
        make_reward("match", mode="contains", partial=True)
    with pytest.raises(PluginArgumentError, match="reference ' ' is blank"):  # "contains" matched everything
        make_reward("match", mode="contains", reference=" ")
    # a number given as the fixed reference (TOML's `reference = 5`) is its text: "5" == 5 scored 0
    for kind in ("match reference=5 normalize=false", "match reference=5", "match mode=contains reference=5"):
        assert build_reward_stack([kind]).score([Sample("What is 2+3?", "5")])[0].tolist() == [1.0], kind


def test_math_verifies_answers_against_references_and_skips_prompts_without_one():
    samples = [
        s("The answer is -8.", reference="-8"),  # the shipped arithmetic prompts' form
        s("-7", reference="-8"),
        s("0.5", reference=r"\frac{1}{2}"),
        s(r"So it is $\boxed{\frac12}$.", reference="0.5"),
        s("12"),  # no reference: not applicable
        s("12", reference=""),
    ]
    assert make_reward("math")(samples) == [1.0, 0.0, 1.0, 1.0, None, None]
    assert make_reward("math", reference_key="answer")([s("3", answer="3")]) == [1.0]
    # references are math: "2^{10}" was read as 2 and "\sqrt{2}" as nothing (None: not applicable); answers
    # with a sign or brackets ("+29", "(29)", the typographic "−8") scored 0
    checks = [("1024", "2^{10}", 1.0), ("2", "2^{10}", 0.0), (r"\sqrt{2}", r"\sqrt{2}", 1.0), ("+29", "29", 1.0),
              ("(29)", "29", 1.0), ("−8", "-8", 1.0), ("29", "+29", 1.0), ("-8", "(-8)", 1.0),
              (r"\sqrt{2}", r"\sqrt{2}", 1.0), ("12 dollars", "12 dollars", 1.0), ("1 000", "1000", 1.0)]  # fmt: skip
    assert make_reward("math")([s(c, reference=r) for c, r, _ in checks]) == [want for *_, want in checks]
    # so are answers written the same way: the completion "2^{10}" was read as 2, where its reference was 1024
    latex = [("2^{10}", "1024", 1.0), ("The answer is 2^{10}.", "1024", 1.0), ("The answer is 2^{10}.", "2", 0.0),
             (r"The answer is \frac{1}{2}.", "0.5", 1.0), ("x=2^{3}", "8", 1.0)]  # fmt: skip
    assert make_reward("math")([s(c, reference=r) for c, r, _ in latex]) == [want for *_, want in latex]
    with pytest.warns(UserWarning, match=r"the reference '\?\?' does not parse, so its prompts score None"):
        assert make_reward("math")([s("1", reference="??")]) == [None]
    # prose is not math: read as if between $, "Paris" was the product P*a*r*i*s, equal to "Sirap"
    with pytest.warns(UserWarning, match="the reference 'Paris' does not parse"):
        assert make_reward("math")([s("Sirap", reference="Paris")]) == [None]
    with pytest.raises(PluginArgumentError, match="timeout must be a whole number of seconds"):
        make_reward("math", timeout=0.5)


def test_math_runs_off_the_main_thread_without_signal_timeouts():
    # math-verify's default timeouts use signal.alarm, which raises ValueError off the main thread
    from concurrent.futures import ThreadPoolExecutor

    reward = make_reward("math")
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(reward, [s("29", reference="29")]).result() == [1.0]


def test_safety_penalises_offensive_text():
    samples = [s("Have a lovely day, friend."), s("You are a stupid idiot, shut up.")]
    clean, offensive = make_reward("safety")(samples)
    assert -0.5 < clean <= 0 and offensive < -0.5
    assert list(make_reward("safety", shape="step", penalty=2.0)(samples)) == [0.0, -2.0]
    hinge = make_reward("safety", shape="hinge", threshold=0.5)(samples)
    assert hinge[0] == 0.0 and hinge[1] < 0
    with pytest.raises(PluginArgumentError, match="threshold must be in"):
        make_reward("safety", threshold=1.5)
    for penalty in (math.nan, math.inf, -1.0):  # NaN was accepted, and every score became NaN later
        with pytest.raises(PluginArgumentError, match="penalty must be a finite number >= 0"):
            make_reward("safety", penalty=penalty)
    assert len(make_reward("safety")([])) == 0  # sklearn's vectoriser raised on no texts


def test_similarity_to_reference_and_to_a_fixed_target():
    samples = [
        s("A cat sits on the mat.", reference="A cat is sitting on a mat."),
        s("Stock markets fell sharply.", reference="A cat is sitting on a mat."),
    ]
    same, other = make_reward("similarity")(samples)
    assert same > 0.7 and other < 0.3
    fixed = make_reward("similarity", target="The weather is sunny today.")
    assert fixed([s("It is sunny and warm today.")])[0] > fixed([s("The cat sleeps.")])[0]
    with pytest.raises(RewardError, match="or the reward a fixed `target`"):
        make_reward("similarity")([s("x")])
    similarity = make_reward("similarity")
    mixed = [s("None", reference=None), s("A cat sits on the mat.", reference="A cat is sitting on a mat.")]
    assert similarity(mixed)[0] is None and similarity(mixed)[1] == pytest.approx(same, abs=1e-5)
    # a blank reference is none, as for match
    assert similarity([s("x", reference=""), s("x", reference="  ")]) == [None, None]
    with pytest.raises(PluginArgumentError, match="target '' is blank"):  # an empty completion scored 1.0
        make_reward("similarity", target="")
    with pytest.raises(PluginArgumentError, match="max_length=1000 is more than the model's 512 positions"):
        make_reward("similarity", max_length=1000)


def test_similarity_keeps_scoring_once_its_reference_cache_is_full(monkeypatch):
    import textgym.plugins.similarity as module

    monkeypatch.setattr(module, "CACHE_SIZE", 2)
    similarity = make_reward("similarity")
    cached = [s("x", reference="calm sea"), s("y", reference="warm sun")]
    first = similarity(cached)
    again = similarity([s("x", reference="calm sea"), s("z", reference="cold rain")])  # past the cache's size
    assert again[0] == pytest.approx(first[0])


def test_fluency_on_the_tiny_model_is_a_mean_log_prob_and_batch_independent(tiny):
    fluency = make_reward("fluency", model="tiny-random-llama", batch_size=2)
    samples = [
        s("Hello there, how are you?"),
        s("Fine."),
        s("word word word word word word", finish_reason="length"),
    ]
    scores = fluency(samples)
    assert all(np.isfinite(scores)) and all(x < 0 for x in scores)
    one_by_one = [make_reward("fluency", model="tiny-random-llama", batch_size=1)([x])[0] for x in samples]
    np.testing.assert_allclose(scores, one_by_one, rtol=1e-4)
    penalised = make_reward("fluency", model="tiny-random-llama", repetition_penalty=1.0)(samples)
    assert penalised[2] == pytest.approx(scores[2] - 0.8, rel=1e-4)  # distinct-2 of "word word ..." is 1/5
    assert penalised[0] == pytest.approx(scores[0], rel=1e-5)
    # a multi-turn episode's last agent turn ended on EOS as a stopped one did, when its reply was withheld
    # (max_turns) or did not fit (overflow): p(EOS) counts; a cut one's does not
    stopped = fluency([s("Fine.")])
    assert fluency(
        [s("Fine.", finish_reason="max_turns"), s("Fine.", finish_reason="overflow")]
    ) == pytest.approx(stopped * 2, rel=1e-5)
    assert fluency([s("Fine.", finish_reason="length")])[0] != pytest.approx(stopped[0], rel=1e-3)
    # cut inside a character ("案" is 3 bytes, 3 tokens of a byte-level BPE): its first bytes decode to U+FFFD,
    # which was scored as a token the policy never wrote
    cut, whole = s("好的答\ufffd", finish_reason="length"), s("好的答", finish_reason="length")
    assert fluency([cut]) == pytest.approx(fluency([whole]), rel=1e-6)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tokenizer):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_labels=2, pad_token_id=tokenizer.pad_token_id,
        id2label={0: "NEGATIVE", 1: "POSITIVE"}, label2id={"NEGATIVE": 0, "POSITIVE": 1},
    )  # fmt: skip
    path = tmp_path_factory.mktemp("rm")
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_rm_score_labels_outputs_and_batching(reward_model_dir):
    samples = [s("I like it."), s("No."), s("A much longer completion that goes on and on.")]
    logits = make_reward("rm_score", model=reward_model_dir, label="POSITIVE", batch_size=2)(samples)
    same = make_reward("rm_score", model=reward_model_dir, label=1, batch_size=1)(samples)
    np.testing.assert_allclose(logits, same, rtol=1e-4, atol=1e-5)
    probs = make_reward("rm_score", model=reward_model_dir, label="POSITIVE", output="probability")(samples)
    negs = make_reward("rm_score", model=reward_model_dir, label="NEGATIVE", output="probability")(samples)
    np.testing.assert_allclose(np.add(probs, negs), 1.0, rtol=1e-5)
    plain = make_reward(
        "rm_score",
        model=reward_model_dir,
        label=1,
        chat_template=False,
        template="Q: {prompt}\nA: {completion}",
    )
    assert plain.format(samples[0]) == "Q: p\nA: I like it."
    chat = make_reward("rm_score", model=reward_model_dir, label=1)
    assert "<|im_start|>assistant\nI like it." in chat.format(samples[0])
    truncated = make_reward("rm_score", model=reward_model_dir, label=1, max_length=8)(samples)
    assert np.isfinite(truncated).all()


@pytest.mark.parametrize("kwargs", [{}, {"model": "smollm2-135m-instruct"}])
def test_rm_score_without_a_reward_model_directory_says_how_to_make_one(kwargs):
    with pytest.raises(
        PluginArgumentError, match=r"sequence-classification model: train one with `textgym train-rm`"
    ):
        make_reward("rm_score", **kwargs)


def test_rm_score_bad_arguments(reward_model_dir, tmp_path):
    with pytest.raises(PluginArgumentError, match=r"has 2 labels .*choose one with `label`"):
        make_reward("rm_score", model=reward_model_dir)
    with pytest.raises(
        PluginArgumentError, match=r"'HAPPY' is not one of the model's labels \['NEGATIVE', 'POSITIVE'\]"
    ):
        make_reward("rm_score", model=reward_model_dir, label="HAPPY")
    with pytest.raises(PluginArgumentError, match="is not a local directory"):
        make_reward("rm_score", model=str(tmp_path / "nothing"))
    with pytest.raises(PluginArgumentError, match=r"device must be 'auto', 'cpu' or a GPU .*not 'tpu'"):
        make_reward("rm_score", model=reward_model_dir, label=1, device="tpu")
    with pytest.raises(PluginArgumentError, match=r"label must be a label index or name, not True"):
        make_reward("rm_score", model=reward_model_dir, label=True)
    with pytest.raises(
        PluginArgumentError, match=r"label 2 is out of range: the model has 2 labels \(0 to 1\)"
    ):
        make_reward("rm_score", model=reward_model_dir, label=2)
    # the model's chat template formats its texts: a template given without chat_template=false went unused
    with pytest.raises(PluginArgumentError, match=r"template 'Q: \{prompt\} A: \{completion\}' is not used"):
        make_reward("rm_score", model=reward_model_dir, label=1, template="Q: {prompt} A: {completion}")


def test_rm_score_refuses_a_model_that_would_score_noise_or_crash(reward_model_dir, tokenizer, tmp_path):
    """A causal LM's directory loaded with a new random score head, and scored noise that changed with every
    load; a tokenizer with more tokens than the model embeds raised IndexError at the first score."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    small = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **small)).save_pretrained(tmp_path / "lm")
    tokenizer.save_pretrained(tmp_path / "lm")
    with pytest.raises(
        PluginArgumentError,
        match=r"not a trained sequence-classification model: its weights lack score.weight",
    ):
        make_reward("rm_score", model=str(tmp_path / "lm"), label=0)
    config = LlamaConfig(vocab_size=64, num_labels=1, pad_token_id=0, **small)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "other")
    tokenizer.save_pretrained(tmp_path / "other")
    with pytest.raises(
        PluginArgumentError, match=rf"its tokenizer has {len(tokenizer)} tokens, its model embeds 64"
    ):
        make_reward("rm_score", model=str(tmp_path / "other"))


def test_rm_score_scores_at_the_max_length_the_model_was_trained_with(reward_model_dir, tmp_path):
    """train_rm.json records --max-length; rm_score cut texts at its own 512 unless told the same again."""
    import json
    import shutil

    trained = tmp_path / "rm"
    shutil.copytree(reward_model_dir, trained)
    (trained / "train_rm.json").write_text(json.dumps({"settings": {"max_length": 8}}))
    assert make_reward("rm_score", model=str(trained), label=1).max_length == 8
    assert make_reward("rm_score", model=str(trained), label=1, max_length=16).max_length == 16
    assert make_reward("rm_score", model=reward_model_dir, label=1).max_length == 512


@pytest.mark.slow
def test_fluency_on_the_embedded_model_prefers_fluent_text():
    fluency = make_reward("fluency")
    fluent, garbled = fluency(
        [
            s("The sea was calm and blue.", prompt="Describe the sea."),
            s("sea blue the calm was and.", prompt="Describe the sea."),
        ]
    )
    assert fluent > garbled
