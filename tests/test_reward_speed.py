"""The fast paths of the model-based rewards give the scores of their definitions.

``fluency``, ``rm_score`` and ``similarity`` sort samples by length, run a shared prefix once, and (for
``fluency``) run the LM head on the positions that are read only. Each test here writes the slow definition
out, one sample at a time with no padding, and compares. No timings: those are in docs/performance.md.
"""

import json

import numpy as np
import pytest
import torch

from textgym import Sample, load_tokenizer, make_reward
from textgym.scoring import (
    chat_prompt,
    length_sorted_batches,
    lm_head_split,
    resolve_bf16,
    shared_prefix_length,
)


def s(completion, prompt="p", finish_reason="stop", **meta):
    return Sample(prompt, completion, (), (), finish_reason, meta)


SAMPLES = [
    s("Hello there, how are you?", prompt="Tell me about the sea."),
    s("Fine.", prompt="Tell me about cats."),
    s("word word word word word word", prompt="Tell me about the sea.", finish_reason="length"),
    s("", prompt="Hi", finish_reason="length"),  # nothing generated: scored on EOS alone
    s("The sea is large, deep and blue, and it is full of fish and whales.", prompt="Tell me about the sea."),
    s("Yes.", prompt="Is water wet? Answer in one word, please."),
    s("No, not at all", prompt="Tell me about cats.", finish_reason="length"),  # no EOS
]


def slow_fluency(reward, samples):
    """The definition: the whole prompt + completion alone through the model, a log-softmax over the full
    vocabulary at every position, the mean over the completion's tokens (EOS included if it ended on it)."""
    tok, out = reward.tokenizer, []
    for x in samples:
        prompt = (
            tok.encode(chat_prompt(tok, x.prompt), add_special_tokens=False)
            if reward.chat
            else tok.encode(x.prompt)
        )
        completion = tok.encode(x.completion, add_special_tokens=False)
        if x.finish_reason == "stop" or not completion:
            completion.append(tok.eos_token_id)
        ids = torch.tensor([prompt + completion])  # (1, W)
        with torch.inference_mode():
            logp = torch.log_softmax(reward.model(input_ids=ids).logits[0, :-1].float(), dim=-1)  # (W-1, V)
        token_logp = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)  # (W-1,) log p(token t+1)
        out.append(token_logp[len(prompt) - 1 :].mean().item())
    return out


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_fluency_equals_the_full_log_softmax_formula(tiny, chat, batch_size):
    reward = make_reward("fluency", model="tiny-random-llama", chat_template=chat, batch_size=batch_size)
    assert reward.split is not None  # the LM head runs apart, on the read positions only
    for order in (SAMPLES, sorted(SAMPLES, key=lambda x: len(x.completion)), SAMPLES[::-1]):
        np.testing.assert_allclose(reward(order), slow_fluency(reward, order), rtol=0, atol=1e-5)


def test_fluency_of_one_prompts_group_shares_the_whole_prompt(tiny):
    group = [s(c, prompt="Tell me about the sea.") for c in ("Blue.", "It is wide and deep.", "Salty water")]
    group.append(s("", prompt="Tell me about the sea.", finish_reason="length"))
    for chat in (True, False):
        for share_prefix in (True, False):
            reward = make_reward(
                "fluency", model="tiny-random-llama", chat_template=chat, share_prefix=share_prefix
            )
            np.testing.assert_allclose(reward(group), slow_fluency(reward, group), rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def scaled_logits_model(tmp_path_factory):
    """A tiny Granite model: it divides the logits by ``logits_scaling`` after the LM head."""
    from transformers import GraniteConfig, GraniteForCausalLM

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    torch.manual_seed(0)
    config = GraniteConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, logits_scaling=4.0, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("granite")
    GraniteForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_fluency_on_a_model_that_changes_logits_after_the_head_uses_its_own_forward(scaled_logits_model):
    reward = make_reward("fluency", model=scaled_logits_model, batch_size=3)
    assert reward.split is None  # head(trunk(x)) is not this model's logits
    assert lm_head_split(make_reward("fluency", model="tiny-random-llama").model) is not None
    np.testing.assert_allclose(reward(SAMPLES), slow_fluency(reward, SAMPLES), rtol=0, atol=1e-5)


def test_fluency_bf16_is_opt_in_on_the_cpu_and_close(tiny):
    fp32 = make_reward("fluency", model="tiny-random-llama")
    bf16 = make_reward("fluency", model="tiny-random-llama", bf16=True)
    assert not fp32.bf16 and bf16.bf16
    a, b = np.array(fp32(SAMPLES)), np.array(bf16(SAMPLES))
    assert not np.array_equal(a, b)  # autocast did run in bf16
    np.testing.assert_allclose(a, b, rtol=0, atol=0.05)


def linear_dtypes(model):
    return {m.weight.dtype for m in model.modules() if isinstance(m, torch.nn.Linear)}


@pytest.mark.parametrize("name", ["fluency", "rm_score", "similarity"])
def test_bf16_casts_the_linear_weights_once_and_scores_as_autocast_did(name, tiny, reward_model_dir):
    kwargs = {"fluency": {"model": "tiny-random-llama"}, "rm_score": {"model": reward_model_dir}}.get(
        name, {}
    )
    samples = [s(x.completion, prompt=x.prompt, reference="A cat is sitting on a mat.") for x in SAMPLES]
    cast = make_reward(name, bf16=True, **kwargs)
    per_call = make_reward(name, **kwargs)
    per_call.bf16 = True  # autocast over fp32 weights, cast again at every call
    assert linear_dtypes(cast.model) == {torch.bfloat16} and linear_dtypes(per_call.model) == {torch.float32}
    assert cast.model.get_input_embeddings().weight.dtype == torch.float32  # autocast never casts it
    assert cast(samples) == per_call(samples)  # bit for bit


def test_a_reward_left_in_fp32_scores_in_fp32_inside_a_callers_bf16_autocast(tiny):
    reward = make_reward("fluency", model="tiny-random-llama")
    expected = reward(SAMPLES)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert reward(SAMPLES) == expected


def test_token_logprobs_in_chunks_equal_a_log_softmax():
    from textgym.plugins.fluency import LSE_ROWS, token_logprobs

    torch.manual_seed(0)
    logits, tokens = torch.randn(3 * LSE_ROWS + 5, 1000) * 4, torch.randint(0, 1000, (3 * LSE_ROWS + 5,))
    expected = torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, tokens), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(token_logprobs(logits.bfloat16(), tokens), expected, rtol=0, atol=0.1)


def test_bf16_default_and_bad_values():
    assert resolve_bf16(None, "cpu") is False
    assert resolve_bf16(None, "cuda") is True and resolve_bf16(None, "cuda:1") is True
    assert resolve_bf16(True, "cpu") is True and resolve_bf16(False, "cuda") is False
    with pytest.raises(ValueError, match="bf16 must be true, false or left unset"):
        resolve_bf16("yes", "cpu")


def test_length_sorted_batches_and_shared_prefix():
    assert list(length_sorted_batches([3, 9, 1, 9, 5], 2)) == [[1, 3], [4, 0], [2]]
    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 3], [1, 2, 5, 6]], 10) == 2
    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 3, 4]], 3) == 3  # the limit keeps a token per row
    assert shared_prefix_length([[7, 1], [8, 1]], 5) == 0
    assert shared_prefix_length([[1, 2]], -1) == 0


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    path = tmp_path_factory.mktemp("rm")
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def slow_rm_score(reward, samples):
    """Each text alone (no padding, no shared prefix) through the sequence-classification model."""
    out = []
    for x in samples:
        enc = reward.tokenizer(
            reward.format(x), truncation=True, max_length=reward.max_length, return_tensors="pt"
        )
        with torch.inference_mode():
            out.append(reward.model(**enc).logits[0, reward.label].item())
    return out


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"batch_size": 2},
        {"chat_template": False, "template": "Q: {prompt}\nA: {completion}"},
        # the pad token ends every text: the model scores the token before it, with or without a prefix
        {"chat_template": False, "template": "{prompt} {completion}<|endoftext|>"},
        {"max_length": 12},
    ],
)
def test_rm_score_is_the_score_of_each_text_alone(reward_model_dir, kwargs):
    reward = make_reward("rm_score", model=reward_model_dir, **kwargs)
    assert reward.share_prefix  # a causal model: the chat template's system prompt runs once
    np.testing.assert_allclose(reward(SAMPLES), slow_rm_score(reward, SAMPLES), rtol=0, atol=1e-5)
    probability = make_reward("rm_score", model=reward_model_dir, output="probability", **kwargs)
    np.testing.assert_allclose(
        probability(SAMPLES), torch.tensor(slow_rm_score(reward, SAMPLES)).sigmoid(), rtol=0, atol=1e-6
    )


def test_similarity_embeds_each_text_as_it_would_alone():
    samples = [s(x.completion, reference="A cat is sitting on a mat.") for x in SAMPLES]
    reward = make_reward("similarity", batch_size=3)
    texts = [x.completion for x in samples] + ["A cat is sitting on a mat."]
    batched = reward.embed(texts)
    alone = torch.cat([reward.embed([t]) for t in texts])
    torch.testing.assert_close(batched, alone, rtol=0, atol=1e-6)
    expected = (alone[:-1] * alone[-1]).sum(-1)
    np.testing.assert_allclose(reward(samples), expected, rtol=0, atol=1e-6)


def test_the_benchmark_baselines_are_the_former_formulas(tiny, reward_model_dir):
    from benchmarks.reward_throughput import fluency_before, make_samples, rm_score_before, similarity_before

    samples = make_samples(6)
    fluency = make_reward("fluency", model="tiny-random-llama", batch_size=4)
    np.testing.assert_allclose(fluency_before(fluency, samples), fluency(samples), rtol=0, atol=1e-5)
    rm = make_reward("rm_score", model=reward_model_dir, batch_size=4)
    np.testing.assert_allclose(rm_score_before(rm, samples), rm(samples), rtol=0, atol=1e-5)
    similarity = make_reward("similarity", batch_size=4)
    np.testing.assert_allclose(similarity_before(similarity, samples), similarity(samples), rtol=0, atol=1e-6)


def test_the_report_states_the_fluency_ratio_and_the_target(tmp_path, monkeypatch):
    from benchmarks.report import write_report

    row = {"reward": "fluency", "batch": 64, "samples_per_s": 40.0, "ms_per_batch": 1600.0}
    row.update(samples_per_s_before=10.0, samples_per_s_no_prefix=20.0, samples_per_s_bf16=80.0)
    row.update(
        speedup=4.0, speedup_bf16=8.0, max_score_difference_before=2e-6, max_score_difference_bf16=0.02
    )
    row["work"] = {"trunk_tokens_before": 400, "head_positions_before": 400, "trunk_tokens": 200}
    row["work"].update(head_positions=100, gflop_before=300.0, gflop=100.0)
    result = {"machine": {"torch_threads": 1}, "args": {"batch": 64, "repeats": 3}, "rows": [row]}
    (tmp_path / "reward_throughput.json").write_text(json.dumps(result))
    monkeypatch.setenv("TEXTGYM_BENCH_RESULTS", str(tmp_path))
    report = write_report(quick=True).read_text()
    assert "| fluency | 10.0 | 20.0 | 40.0 | 80.0 | **4.00x** | 8.00x | 2.0e-06, 2.0e-02 |" in report
    assert "4.0x the former throughput with the same scores" in report
    assert "in fp32 unless the column says bf16, with 1 torch thread." in report
    assert "at least 10x at batch 64 with the same scores: missed in fp32" in report
    assert (
        "the LM head over 100 positions (before: 400), 100 GFLOP of matmuls against 300: 3.00x less" in report
    )
