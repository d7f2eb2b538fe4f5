"""The fast paths of the model-based rewards give the scores of their definitions.

``fluency``, ``rm_score`` and ``similarity`` sort samples by length, run a shared prefix once, and (for
``fluency``) run the LM head on the positions that are read only. Each test here writes the slow definition
out, one sample at a time with no padding, and compares. No timings: those are in docs/performance.md.
"""

import copy
import json

import numpy as np
import pytest
import torch

from textgym import Sample, load_tokenizer, make_reward
from textgym.errors import PluginArgumentError
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
    distinct = [s(x.completion, f"{x.prompt} ({i})", x.finish_reason) for i, x in enumerate(SAMPLES)]
    assert not reward._has_groups([reward._ids(x) for x in distinct])  # the per-batch shared prefix only
    for samples in (SAMPLES, distinct):  # SAMPLES repeats prompts: each runs once (_grouped)
        for order in (samples, sorted(samples, key=lambda x: len(x.completion)), samples[::-1]):
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


def groups(prompts, per_prompt):
    """``per_prompt`` completions of each prompt, of different lengths and endings, the groups interleaved
    (as a group method's episodes may end in any order)."""
    texts = ["Blue.", "It is wide, deep and full of fish.", "", "Salty water, mostly", "Yes"]
    return [
        s(
            texts[(k + i) % len(texts)] * (1 + i % 2),
            prompt=prompt,
            finish_reason=("stop", "length")[(k + i) % 2],
        )
        for i in range(per_prompt)
        for k, prompt in enumerate(prompts)
    ]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("batch_size", [3, 32])
def test_fluency_runs_each_prompt_of_a_batch_once_with_the_same_scores(tiny, chat, batch_size, monkeypatch):
    prompts = ["Tell me about the sea.", "Tell me about cats, please.", "Hi", "Tell me about the sea!"]
    samples = [*groups(prompts, 3), s("Fine.", prompt="Is water wet?")]  # one prompt alone
    reward = make_reward("fluency", model="tiny-random-llama", chat_template=chat, batch_size=batch_size)
    widths = []  # the rows of each trunk forward
    forward = reward.split[0].forward
    monkeypatch.setattr(
        reward.split[0], "forward", lambda **kw: widths.append(kw["input_ids"].shape) or forward(**kw)
    )
    scores, rows = reward(samples), [shape[0] for shape in widths]
    np.testing.assert_allclose(scores, slow_fluency(reward, samples), rtol=0, atol=1e-5)
    # One batch: the prefix all prompts share (1 row; none without the chat template), the 5 prompts, the
    # 13 completions. Batches of 3, sorted by prompt length and prompt: three of one prompt's completions
    # (the prefix, the prompt, the completions), one of two prompts' completions, and a last row alone.
    expected = {
        (True, 32): [1, 5, 13],
        (False, 32): [5, 13],
        (True, 3): [1, 1, 3] * 3 + [1, 2, 3, 1],
        (False, 3): [1, 1, 3] * 3 + [2, 3, 1],  # "Hi" and "Is..." share no token: no prefix row
    }
    assert rows == expected[chat, batch_size]


def sliding_window_model(path, classify=False):
    """A tiny Mistral with a 4-token sliding window, scaled up so that its outputs depend on every token
    it sees: where a window counts cache slots, padding between a prompt and its completion would move it."""
    from transformers import MistralConfig, MistralForCausalLM, MistralForSequenceClassification

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=4, num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    model = (MistralForSequenceClassification if classify else MistralForCausalLM)(config)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(8)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("name", ["fluency", "rm_score"])
def test_a_sliding_window_model_keeps_the_per_batch_prefix_and_its_scores(name, tmp_path):
    model = sliding_window_model(tmp_path, classify=name == "rm_score")
    samples = groups(["Hi", "Tell me about the sea. And more, please, now."], 2)
    reward = make_reward(name, model=model, chat_template=True)  # the system prompt: a prefix all share
    assert reward.split is not None and not reward.group  # padding inside a row would move the window
    assert reward.share_prefix  # a prefix that every row of a batch starts with is still run once
    alone = make_reward(name, model=model, chat_template=True, batch_size=1, share_prefix=False)
    np.testing.assert_allclose(reward(samples), alone(samples), rtol=0, atol=1e-4)


def test_gpt_neo_local_attention_is_a_window_too(tmp_path):
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    from textgym.scoring import can_group

    config = GPTNeoConfig(
        vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, attention_types=[[["global", "local"], 1]],
        window_size=4, max_position_embeddings=64,
    )  # fmt: skip
    assert not can_group(GPTNeoForCausalLM(config).base_model)
    config.attention_types, config.attention_layers = [[["global"], 2]], ["global", "global"]
    config.window_size = 0  # no local layer: full attention everywhere
    assert can_group(GPTNeoForCausalLM(config).base_model)


@pytest.mark.parametrize(("kind", "groups_rows"), [("mpt", False), ("bloom", True)])
def test_alibi_by_slot_distance_keeps_the_per_batch_prefix_and_alibi_over_the_mask_groups(
    kind, groups_rows, tmp_path
):
    """MPT's ALiBi bias counts cache slots, so padding inside a row would move it; BLOOM counts its ALiBi
    positions over the attention mask, so masked padding is inert. Both give each row's own score."""
    from transformers import BloomConfig, BloomForCausalLM, MptConfig, MptForCausalLM

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    torch.manual_seed(0)
    if kind == "mpt":
        model = MptForCausalLM(MptConfig(vocab_size=len(tokenizer), d_model=32, n_heads=2, n_layers=2))
    else:
        model = BloomForCausalLM(BloomConfig(vocab_size=len(tokenizer), hidden_size=32, n_head=2, n_layer=2))
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(3)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reward = make_reward("fluency", model=str(tmp_path), chat_template=False)
    assert reward.group == groups_rows
    samples = groups(["Hi", "Tell me about the sea. And more, please, now."], 3)
    np.testing.assert_allclose(reward(samples), slow_fluency(reward, samples), rtol=0, atol=1e-5)


def test_padding_after_a_short_completion_stays_within_the_learned_positions(tmp_path):
    """GPT-2 learns 64 positions here; rows of up to 64 tokens fill them. The padding after a short
    completion would otherwise take positions past them."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=64)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    reward = make_reward("fluency", model=str(tmp_path), chat_template=False, max_length=64)
    assert reward.group
    long_prompt, long_reply = "word " * 40, "more " * 40
    samples = [
        s("Yes", prompt="Hi"),
        s(long_reply, prompt="Hi"),
        s("No", prompt=long_prompt),
        s("Ok", prompt=long_prompt),
    ]
    np.testing.assert_allclose(reward(samples), slow_fluency(reward, samples), rtol=0, atol=1e-5)


def test_a_model_whose_cache_cannot_be_repeated_across_rows_scores_each_row_whole(tmp_path):
    from transformers import Lfm2Config, Lfm2ForCausalLM

    tokenizer = load_tokenizer("smollm2-135m-instruct")
    torch.manual_seed(0)
    config = Lfm2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, layer_types=["conv", "full_attention"],
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    Lfm2ForCausalLM(config).save_pretrained(tmp_path)  # a convolution state in its cache
    tokenizer.save_pretrained(tmp_path)
    reward = make_reward("fluency", model=str(tmp_path))  # the chat template's system prompt is shared...
    assert not reward.share_prefix and not reward.group  # ...but LFM2's cache cannot be repeated
    samples = groups(["Tell me about the sea.", "Hi"], 2)
    np.testing.assert_allclose(reward(samples), slow_fluency(reward, samples), rtol=0, atol=1e-5)


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


def test_bf16_default_and_bad_values(monkeypatch):
    assert resolve_bf16(None, "cpu") is False
    # on GPUs that compute bf16 natively (Ampere or newer); torch emulates it on older ones, slower than fp32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for native in (True, False):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True, n=native: n)
        assert resolve_bf16(None, "cuda") is native and resolve_bf16(None, "cuda:1") is native
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


@pytest.mark.parametrize(
    ("kwargs", "forwards"),
    [
        ({}, [1, 5, 13]),  # the prefix all texts share, the 5 prompts, the 13 completions
        (
            {"chat_template": False, "template": "{prompt} {completion}<|endoftext|>"},
            [5, 13],
        ),  # no shared prefix
        (
            {"max_length": 12},
            [],
        ),  # texts cut to their last 12 tokens share no prompt: the model's own forward
    ],
)
def test_rm_score_runs_each_prompt_of_a_batch_once_with_the_same_scores(
    reward_model_dir, kwargs, forwards, monkeypatch
):
    prompts = ["Tell me about the sea.", "Tell me about cats, please.", "Hi", "Tell me about the sea!"]
    samples = [*groups(prompts, 3), s("Fine.", prompt="Is water wet?")]  # one prompt alone
    reward = make_reward("rm_score", model=reward_model_dir, batch_size=32, **kwargs)
    assert reward.split is not None  # Llama's score head, on the trunk's output where the model reads
    rows = []  # the rows of each trunk forward that rm_score runs itself (the model passes input_ids positionally)
    forward = reward.split[0].forward
    monkeypatch.setattr(
        reward.split[0],
        "forward",
        lambda *a, **kw: (
            rows.extend([kw["input_ids"].shape[0]] if "input_ids" in kw else []) or forward(*a, **kw)
        ),
    )
    scores = reward(samples)
    monkeypatch.undo()
    np.testing.assert_allclose(scores, slow_rm_score(reward, samples), rtol=0, atol=1e-5)
    assert rows == forwards


def test_score_head_split_only_where_the_head_on_the_trunk_is_the_models_own_score(reward_model_dir):
    from transformers import AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification

    from textgym.scoring import score_head_split

    llama = AutoModelForSequenceClassification.from_pretrained(reward_model_dir)
    trunk, score = score_head_split(llama)
    assert trunk is llama.model and score is llama.score

    class Rescaled(type(llama)):  # a score changed after the head: the head alone does not give it
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = 2 * out.logits + 1
            return out

    assert score_head_split(Rescaled.from_pretrained(reward_model_dir)) is None
    bert = BertForSequenceClassification(
        BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    )
    assert score_head_split(bert) is None  # its head is `classifier`, on the pooled first token


def test_similarity_embeds_each_text_as_it_would_alone():
    samples = [s(x.completion, reference="A cat is sitting on a mat.") for x in SAMPLES]
    reward = make_reward("similarity", batch_size=3)
    texts = [x.completion for x in samples] + ["A cat is sitting on a mat."]
    batched = reward.embed(texts)
    alone = torch.cat([reward.embed([t]) for t in texts])
    torch.testing.assert_close(batched, alone, rtol=0, atol=1e-6)
    expected = (alone[:-1] * alone[-1]).sum(-1)
    np.testing.assert_allclose(reward(samples), expected, rtol=0, atol=1e-6)


def test_an_empty_batch_scores_nothing(tiny, reward_model_dir):
    for reward in (
        make_reward("fluency", model="tiny-random-llama"),
        make_reward("rm_score", model=reward_model_dir),
        make_reward("similarity"),
    ):
        assert reward([]) == []


def test_the_benchmark_baselines_are_the_former_formulas(tiny, reward_model_dir):
    from benchmarks.reward_throughput import (
        fluency_before,
        make_group_samples,
        make_samples,
        rm_score_before,
        similarity_before,
    )

    samples = make_samples(6)
    fluency = make_reward("fluency", model="tiny-random-llama", batch_size=4)
    np.testing.assert_allclose(fluency_before(fluency, samples), fluency(samples), rtol=0, atol=1e-5)
    grouped = make_group_samples(12, group=4)  # 3 prompts, each prompt's 4 completions different
    assert [x.prompt for x in grouped[::4]] == [x.prompt for x in samples[:3]]
    assert len({x.prompt for x in grouped}) == 3 and len({x.completion.split()[0] for x in grouped}) == 4
    assert fluency._has_groups([fluency._ids(x) for x in grouped])  # scored through the grouped path
    np.testing.assert_allclose(fluency_before(fluency, grouped), fluency(grouped), rtol=0, atol=1e-5)
    rm = make_reward("rm_score", model=reward_model_dir, batch_size=4)
    np.testing.assert_allclose(rm_score_before(rm, samples), rm(samples), rtol=0, atol=1e-5)
    assert rm._has_groups([x.prompt for x in grouped])
    np.testing.assert_allclose(rm_score_before(rm, grouped), rm(grouped), rtol=0, atol=1e-5)
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
    row["work"].update(head_positions=100, gflop_before=300.0, gflop=100.0, gflop_floor=60.0)
    row["work"].update(trunk_tokens_floor=150, head_positions_floor=90)
    row.update(ms_per_batch_before=6400.0)
    group = {**row, "case": "8 completions per prompt", "speedup": 5.0, "speedup_bf16": 12.0}
    group["work"] = {**row["work"], "trunk_tokens": 150, "gflop": 80.0}
    result = {"machine": {"torch_threads": 1}, "args": {"batch": 64, "repeats": 3}, "rows": [row, group]}
    result.update(matmul_gflops=70.0, workload={"prompts": 5, "completion_tokens": [3, 9]})
    (tmp_path / "reward_throughput.json").write_text(json.dumps(result))
    monkeypatch.setenv("TEXTGYM_BENCH_RESULTS", str(tmp_path))
    report = write_report(quick=True).read_text()
    assert "| fluency | 10.0 | 20.0 | 40.0 | 80.0 | **4.00x** | 8.00x | 2.0e-06, 2.0e-02 |" in report
    assert "4.0x the former throughput with the same scores" in report
    assert "in fp32 unless the column says bf16, with 1 torch thread." in report
    assert (
        "Batch 64: the 5 shipped chat prompts, cycled, each with a different completion of 3-9 tokens"
        in report
    )
    row.update(speedup=12.0)  # the target met: no paragraph on why it is out of reach
    (tmp_path / "reward_throughput.json").write_text(json.dumps(result))
    assert "Why 10x is out of reach" not in write_report(quick=True).read_text()
    assert "at least 10x at batch 64 with the same scores: missed in fp32" in report
    assert (
        "the LM head over 100 positions (before: 400), 100 GFLOP of matmuls against 300: 3.00x less" in report
    )
    # 300 GFLOP in 6.4 s before, 100 in 1.6 s now; the floor, 60 GFLOP at 70 GFLOP/s, takes 0.86 s: 7.5x
    assert "150 positions through the trunk (every distinct prefix" in report
    assert "and 90 through the head (those that predict a completion token), 60 GFLOP. At the rate" in report
    assert "(70 GFLOP/s; the former code's matmuls over its whole call time come to 47, the current" in report
    assert "that takes 0.86 s against the former code's 6.40 s per call: at most 7.5x." in report
    assert "| fluency, 8 completions per prompt | 10.0 | 20.0 | 40.0 | 80.0 | **5.00x** | 12.00x |" in report
    assert "`fluency`, 8 completions per prompt (GRPO's default group)" in report
    assert "The trunk runs over 150 row-tokens (before: 400), 80 GFLOP against 300; measured 5.00x" in report


def test_rm_score_pads_with_the_id_the_classifier_reads_past(reward_model_dir, tmp_path):
    """A reward model whose tokenizer has no pad token (Llama, Mistral) and whose config names one: padding
    with EOS left a short text in a batch with a longer one read on its padding, so its score depended on
    its batch-mates."""
    import shutil

    from transformers import AutoTokenizer

    shutil.copytree(reward_model_dir, tmp_path, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token_id is None
    assert json.loads((tmp_path / "config.json").read_text())["pad_token_id"] != tokenizer.eos_token_id
    reward = make_reward("rm_score", model=str(tmp_path), share_prefix=False)
    np.testing.assert_allclose(reward(SAMPLES), slow_rm_score(reward, SAMPLES), rtol=0, atol=1e-5)
    # a pad id past the tokenizer's tokens (in an embedding padded to a round size) cannot pad its texts
    from transformers import LlamaConfig, LlamaForSequenceClassification

    beyond = len(tokenizer) + 10
    config = LlamaConfig(
        vocab_size=len(tokenizer) + 64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=beyond,
    )  # fmt: skip
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "padded")
    tokenizer.save_pretrained(tmp_path / "padded")
    with pytest.raises(PluginArgumentError, match=f"names pad_token_id = {beyond} in its config.json"):
        make_reward("rm_score", model=str(tmp_path / "padded"))


@pytest.mark.parametrize(
    ("share_prefix", "pad"), [(True, None), (False, None), (True, "own"), (False, "own")]
)
def test_rm_score_of_a_model_that_names_no_pad_token_reads_each_text_at_its_last_token(
    reward_model_dir, tmp_path, share_prefix, pad
):
    """No pad token in the config nor the tokenizer: rm_score padded with EOS, so a text that ends on EOS
    (a template that closes the reply with it) was read at the token before, unlike the model alone. With a
    tokenizer pad token of its own (not EOS), that token went into the model's config, and a text ending on
    it (a completion that wrote it) was read a token early."""
    import shutil

    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    shutil.copytree(reward_model_dir, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "pad_token_id": None}))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    tokenizer.pad_token = None if pad is None else tokenizer.convert_ids_to_tokens(3)
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token_id == (None if pad is None else 3)
    end = tokenizer.eos_token if pad is None else tokenizer.pad_token
    template = "{prompt} {completion}" + end
    reward = make_reward("rm_score", model=str(tmp_path), chat_template=False, template=template,
                         share_prefix=share_prefix, batch_size=4)  # fmt: skip
    alone = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()  # no pad: its last token
    assert alone.config.pad_token_id is None
    expected = []
    for x in SAMPLES:
        ids = tokenizer(reward.format(x), return_tensors="pt")
        assert (
            ids["input_ids"][0, -1]
            == tokenizer.convert_tokens_to_ids(end)
            != (tokenizer.eos_token_id if pad else -1)
        )
        with torch.inference_mode():
            expected.append(alone(**ids).logits[0, 0].item())
    np.testing.assert_allclose(reward(SAMPLES), expected, rtol=0, atol=1e-5)


def test_fluency_scores_without_a_pad_token_and_after_an_empty_prompt(tmp_path):
    """Most base models' tokenizers name no pad token: fluency padded with None and crashed. An empty prompt
    (tiny-char-llama adds no BOS) left nothing to predict the first completion token: NaN, or a mean without
    it. max_length = 1 left nothing to score."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = copy.deepcopy(load_tokenizer("smollm2-135m-instruct"))  # (the zoo's is shared: left as it is)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path).pad_token_id is None
    fluency = make_reward("fluency", model=str(tmp_path), chat_template=False)
    np.testing.assert_allclose(fluency(SAMPLES), slow_fluency(fluency, SAMPLES), rtol=0, atol=1e-5)

    char = make_reward("fluency", model="tiny-char-llama")
    tok = char.tokenizer
    assert tok.encode("") == []  # no BOS
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    slow = []
    for completion in ([tok.eos_token_id], [*tok.encode("ab"), tok.eos_token_id], tok.encode("ab")):
        ids = torch.tensor([[start, *completion]])
        with torch.inference_mode():
            logp = torch.log_softmax(char.model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        slow.append(logp.gather(-1, ids[0, 1:, None]).mean().item())
    empty = [s("", prompt=""), s("ab", prompt=""), s("ab", prompt="", finish_reason="length")]
    np.testing.assert_allclose(char(empty), slow, rtol=0, atol=1e-5)
    with pytest.raises(PluginArgumentError, match="max_length must be at least 2"):
        make_reward("fluency", model="tiny-char-llama", max_length=1)


def test_the_benchmark_refuses_an_unknown_reward_in_only(monkeypatch, capsys):
    from benchmarks import reward_throughput

    argv = ["reward_throughput", "--rm-model", "x", "--only", "fluency", "flency"]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(SystemExit):
        reward_throughput.main()
    assert "--only: no reward ['flency'] here; choose from" in capsys.readouterr().err
