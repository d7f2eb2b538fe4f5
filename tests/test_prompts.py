import json

import pytest

from textgym.errors import PromptError, UnknownNameError
from textgym.prompts import Prompt, load_prompts


def test_inline_list_of_strings_and_dicts():
    prompts = load_prompts(["hi", {"prompt": "2+2?", "reference": "4"}])
    assert prompts == [Prompt("hi", {}), Prompt("2+2?", {"reference": "4"})]


def test_txt_jsonl_csv_files_with_metadata(tmp_path):
    (tmp_path / "p.txt").write_text("first\n\nsecond\n")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "q", "reference": "a", "topic": "t"}) + "\n\n")
    (tmp_path / "p.csv").write_text("prompt,reference\nq1,a1\nq2,a2\n")
    assert [p.text for p in load_prompts(tmp_path / "p.txt")] == ["first", "second"]
    assert load_prompts(str(tmp_path / "p.jsonl")) == [Prompt("q", {"reference": "a", "topic": "t"})]
    assert load_prompts(tmp_path / "p.csv")[1] == Prompt("q2", {"reference": "a2"})


@pytest.mark.parametrize("name", ["chat", "reviews", "arithmetic", "copy"])
def test_shipped_prompt_sets(name):
    prompts = load_prompts(name)
    assert len(prompts) >= 16
    if name in ("arithmetic", "copy"):
        assert all("reference" in p.meta for p in prompts)


def test_default_is_the_chat_set():
    assert load_prompts() == load_prompts("chat")


def test_empty_sources_are_errors(tmp_path):
    with pytest.raises(PromptError, match="is empty"):
        load_prompts([])
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(PromptError, match="empty.txt' is empty"):
        load_prompts(tmp_path / "empty.txt")


def test_bad_records_and_files_are_errors(tmp_path):
    with pytest.raises(PromptError, match="prompt 1 of the prompt list"):
        load_prompts(["ok", {"text": "no prompt key"}])
    (tmp_path / "bad.csv").write_text("question\nq\n")
    with pytest.raises(PromptError, match="no 'prompt' column"):
        load_prompts(tmp_path / "bad.csv")
    (tmp_path / "multi.csv").write_text('prompt,reference\n"Line one.\nLine two.","a, b"\n')
    assert load_prompts(tmp_path / "multi.csv") == [Prompt("Line one.\nLine two.", {"reference": "a, b"})]
    for rows, match in [("q,a,extra", r"ragged.csv:2 has 3 cells for 2 columns"),
                        ("q", r"ragged.csv:2 has 1 cell for 2 columns"),
                        ('"open,a\nq,a', r"ragged.csv:3 is not valid CSV")]:  # fmt: skip
        (tmp_path / "ragged.csv").write_text(f"prompt,reference\n{rows}\n")
        with pytest.raises(PromptError, match=match):
            load_prompts(tmp_path / "ragged.csv")
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(PromptError, match="bad.jsonl:2 is not valid JSON"):
        load_prompts(tmp_path / "bad.jsonl")
    with pytest.raises(PromptError, match="does not exist"):
        load_prompts(tmp_path / "missing.txt")


def test_unknown_prompt_source_name_suggests():
    with pytest.raises(UnknownNameError, match="Did you mean 'reviews'"):
        load_prompts("reveiws")


def test_prompt_files_read_a_bom_as_no_text_and_split_lines_at_newlines_only(tmp_path):
    """A BOM became part of the first prompt (.txt) or of the 'prompt' column's name (.csv: "no 'prompt'
    column"); U+2028 and form feeds split a prompt in two (.txt) or a JSON row ("not valid JSON")."""
    (tmp_path / "p.txt").write_text("\ufeffHello\r\nfirst\u2028second\x0cthird\n", encoding="utf-8")
    assert [p.text for p in load_prompts(tmp_path / "p.txt")] == ["Hello", "first\u2028second\x0cthird"]
    (tmp_path / "p.csv").write_text("\ufeffprompt,reference\nhi,there\n", encoding="utf-8")
    assert [(p.text, p.meta) for p in load_prompts(tmp_path / "p.csv")] == [("hi", {"reference": "there"})]
    row = json.dumps({"prompt": "a\u2028b\x85c"}, ensure_ascii=False)
    (tmp_path / "p.jsonl").write_text(f"{row}\n", encoding="utf-8")
    assert [p.text for p in load_prompts(tmp_path / "p.jsonl")] == ["a\u2028b\x85c"]


def test_a_csv_column_named_twice_is_an_error(tmp_path):
    """The last column's cells won without a word."""
    (tmp_path / "p.csv").write_text("prompt,prompt\nreal,other\n")
    with pytest.raises(PromptError, match="has column 'prompt' more than once"):
        load_prompts(tmp_path / "p.csv")


def test_blank_trailing_csv_columns_are_not_a_column_named_twice(tmp_path):
    (tmp_path / "p.csv").write_text("prompt,reference,,\nhi,there,,\n")  # a spreadsheet's export
    assert load_prompts(tmp_path / "p.csv") == [Prompt("hi", {"reference": "there"})]  # no '' metadata key


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("p.jsonl", '{"prompt": "a"}\n\n{"text": "missing"}\n', "p.jsonl:3"),
        ("p.csv", "prompt,reference\nq1,a1\n,a2\n", "p.csv:3"),
    ],
)
def test_a_file_row_without_a_prompt_names_its_line(tmp_path, name, text, where):
    """It was named by its place among the records ("prompt 1"), which blank lines and the header shift."""
    (tmp_path / name).write_text(text)
    with pytest.raises(PromptError, match=f"{where}: each row needs a non-empty 'prompt' string"):
        load_prompts(tmp_path / name)


def test_the_copy_split_gives_every_letter_every_position_equally_often_in_both_parts():
    """Every 8th string in order held out the words ending in "h" alone: training never had an "h" last."""
    from collections import Counter

    train, held_out = load_prompts("copy-train"), load_prompts("copy-heldout")
    assert len(held_out) == 64 and len(train) == 448
    assert {p.text for p in train}.isdisjoint(p.text for p in held_out)
    assert {p.text for p in train} | {p.text for p in held_out} == {p.text for p in load_prompts("copy")}
    for part, n in ((held_out, 8), (train, 56)):
        for position in range(3):
            assert Counter(p.text[position] for p in part) == dict.fromkeys("abcdefgh", n)


@pytest.mark.parametrize("source", [{"prompt": "What is 2+2?", "reference": "4"}, Prompt("x"), b"hi", 3])
def test_a_single_prompt_or_another_non_list_is_refused_not_read_as_its_keys(source):
    with pytest.raises(
        PromptError, match=r"prompts must be a name, a file, or a list of prompts.*\[\.\.\.\]"
    ):
        load_prompts(source)


def test_a_registered_prompt_source_that_returns_no_list_names_the_source(register):
    """A source whose factory returned a string gave one prompt per character, a dict one per key."""
    import textgym

    class Sources:
        @textgym.hookimpl
        def register_prompt_sources(self, register):
            register("one-string", lambda: "Hi")
            register("one-dict", lambda: {"prompt": "Say hi", "reference": "hi"})
            register("nothing", lambda: None)
            register("a-generator", lambda: (f"prompt {i}" for i in range(2)))

    register(Sources(), "sources")
    for name, kind in (("one-string", "str"), ("one-dict", "dict"), ("nothing", "NoneType")):
        with pytest.raises(
            PromptError, match=f"prompt source '{name}' \\(plugin 'sources'\\) returned a {kind} "
        ):
            load_prompts(name)
    assert [p.text for p in load_prompts("a-generator")] == ["prompt 0", "prompt 1"]


def test_an_empty_name_and_a_directory_that_is_no_saved_dataset_are_said_plainly(tmp_path, monkeypatch):
    """ "" was the current directory, and a folder of .txt files was 'a saved dataset' needing datasets (or,
    with datasets installed, its FileNotFoundError: a traceback from the command line)."""
    with pytest.raises(PromptError, match="prompts is an empty string: give a registered name"):
        load_prompts("")
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "a.txt").write_text("Hi\n")
    with pytest.raises(
        PromptError, match="'.*files' is a directory but not a dataset saved with save_to_disk"
    ):
        load_prompts(tmp_path / "files")


def test_a_carriage_return_inside_a_line_or_a_quoted_csv_cell_is_kept(tmp_path):
    """The files were read with universal newlines: a lone "\\r" split a prompt, and one in a quoted CSV cell
    became "\\n"."""
    (tmp_path / "p.txt").write_bytes(b"a\rb\r\nc\n")
    assert [p.text for p in load_prompts(tmp_path / "p.txt")] == ["a\rb", "c"]
    (tmp_path / "p.csv").write_bytes(b'prompt,reference\r\n"a\rb","x\r\ny"\r\n')
    assert [(p.text, p.meta) for p in load_prompts(tmp_path / "p.csv")] == [("a\rb", {"reference": "x\r\ny"})]


def test_a_saved_dataset_with_splits_takes_its_one_split_or_asks_for_one(tmp_path):
    datasets = pytest.importorskip("datasets")  # (an optional dependency: not installed by make test)
    one = datasets.Dataset.from_dict({"prompt": ["Hi", "Why?"], "reference": ["a", "b"]})
    one.save_to_disk(str(tmp_path / "plain"))
    assert [(p.text, p.meta) for p in load_prompts(tmp_path / "plain")] == [
        ("Hi", {"reference": "a"}),
        ("Why?", {"reference": "b"}),
    ]
    datasets.DatasetDict({"train": one}).save_to_disk(str(tmp_path / "single"))
    assert [p.text for p in load_prompts(tmp_path / "single")] == ["Hi", "Why?"]
    datasets.DatasetDict({"train": one, "test": one}).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(
        PromptError, match=r"holds the splits train, test: give one of them, as '.*splits/train'"
    ):
        load_prompts(tmp_path / "splits")
    assert [p.text for p in load_prompts(tmp_path / "splits" / "train")] == ["Hi", "Why?"]
