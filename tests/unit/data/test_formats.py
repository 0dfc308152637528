"""The formats users bring (written as each ecosystem defines them: tests/helpers/user_data.py) are read into our rows
in every container, the same rows whatever the container; `data.format: auto` names each format from its first row
and refuses, naming the row and the fields, what fits none or several; JSON arrays are read an element at a time."""

from __future__ import annotations

import json

import pytest

from pipeline.core import config
from pipeline.data import formats, json_array
from pipeline.data.inputs import detected_format, items
from pipeline.data.textio import verify
from tests.conftest import REPO
from tests.helpers import user_data


@pytest.fixture(scope="module")
def texts(peoples_daily) -> list[str]:
    return [text for text in peoples_daily if len(text) > 100][:30]


@pytest.mark.parametrize("name", list(user_data.FORMATS))
def test_every_container_gives_the_same_rows_and_names_the_format(tmp_path, texts, name):
    make, data_format = user_data.FORMATS[name]
    rows = make(texts)
    read = {}
    for container in user_data.CONTAINERS:
        path = user_data.write(rows, tmp_path, f"{name}_{container}", container)
        assert detected_format(path) == data_format, container
        read[container] = list(items(path, data_format))
        assert verify(path, data_format) == len(rows), container
    assert all(found == read["jsonl"] for found in read.values())
    assert len(read["jsonl"]) == len(rows)


def test_rows_read_as_their_ecosystem_means_them(texts):
    """Each format's rows in our form, as the ecosystem defines them: Alpaca and OpenAI rows as they are; ShareGPT's
    human/gpt turns as user/assistant after its system prompt; TRL's conversational pairs as the prompt conversation
    and the assistant contents; its implicit prompt as the shared beginning (the space before the answers going to
    them, as trl's extract_prompt does), prompt + response giving back each whole text; Anthropic's hh-rlhf dialogues
    as the turns before the last Assistant one and the two answers after it."""
    at = "f:1"
    alpaca = user_data.stanford_alpaca(texts)[0]
    assert formats.canonical(alpaca, "alpaca", at) == alpaca
    chat = user_data.openai_messages(texts)[0]
    assert formats.canonical(chat, "chat", at) == chat
    share = user_data.sharegpt(texts)[0]
    turns = share["conversations"]
    assert formats.canonical(share, "chat", at)["messages"] == [
        {"role": "system", "content": share["system"]},
        *({"role": {"human": "user", "gpt": "assistant"}[t["from"]], "content": t["value"]} for t in turns),
    ]
    conversational = user_data.trl_conversational(texts)[0]
    assert formats.canonical(conversational, "preference", at) == {
        "messages": conversational["prompt"],
        "chosen": conversational["chosen"][0]["content"],
        "rejected": conversational["rejected"][0]["content"],
    }
    implicit_rows = user_data.trl_implicit(texts)
    for implicit, (question, answer, other) in zip(implicit_rows, user_data.answers(texts), strict=True):
        pair = formats.canonical(implicit, "preference", at)
        assert pair["prompt"] + pair["chosen"] == implicit["chosen"]
        assert pair["prompt"] + pair["rejected"] == implicit["rejected"]
        if answer[0] != other[0]:
            assert (pair["prompt"], pair["chosen"], pair["rejected"]) == (question, f" {answer}", f" {other}")
    implicit = user_data.trl_implicit_conversational(texts)[0]
    assert formats.canonical(implicit, "preference", at) == {
        "messages": implicit["chosen"][:1],
        "chosen": implicit["chosen"][1]["content"],
        "rejected": implicit["rejected"][1]["content"],
    }
    for hh, (question, answer, other) in zip(user_data.anthropic_hh(texts), user_data.answers(texts), strict=True):
        assert formats.canonical(hh, "preference", at) == {
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": other[:12]},
                {"role": "user", "content": "And then?"},
            ],
            "chosen": answer,
            "rejected": other,
        }
    llama_factory = user_data.sharegpt_pairs(texts)[0]
    assert formats.canonical(llama_factory, "preference", at) == {
        "messages": [{"role": "user", "content": llama_factory["conversations"][0]["value"]}],
        "chosen": llama_factory["chosen"]["value"],
        "rejected": llama_factory["rejected"]["value"],
    }


def test_trl_prompt_completion_rows_read_as_their_prompt_and_completion(texts):
    """TRL's SFT rows: a prompt (a string, or the conversation so far) and the completion that follows it, read as
    {prompt, completion: str} (a conversational completion's content); our form reads back as itself, and a row with
    chosen and rejected stays a preference pair whatever else it holds."""
    at = "f:1"
    for row in user_data.trl_prompt_completion(texts):
        assert formats.detect(row, at) == "prompt_completion"
        assert formats.canonical(row, "prompt_completion", at) == row
    for row in user_data.trl_conversational_prompt_completion(texts):
        assert formats.detect(row, at) == "prompt_completion"
        ours = formats.canonical(row, "prompt_completion", at)
        assert ours == {"prompt": row["prompt"], "completion": row["completion"][0]["content"]}
        assert formats.canonical(ours, "prompt_completion", at) == ours
    pair = {"prompt": "The sky is", "completion": " blue.", "chosen": " blue.", "rejected": " green."}
    assert formats.detect(pair, at) == "preference"
    assert formats.canonical(pair, "preference", at) == pair


def _chat(assistant: dict) -> dict:
    """An OpenAI chat row whose assistant message has `assistant`'s keys."""
    reply = {"role": "assistant", "content": "a", **assistant}
    return {"messages": [{"role": "user", "content": "q"}, reply]}


@pytest.mark.parametrize(
    ("row", "data_format", "message"),
    [
        ({"question": "q", "answer": "a"}, "auto", r"f:7: data.format=auto cannot tell the format of a row with field"),
        ({"text": "t", "messages": []}, "auto", r"f:7: data.format=auto finds a row that fits chat and text"),
        ({"instruction": "i"}, "alpaca", r"f:7: missing field\(s\) 'output'; data.format=alpaca expects 'instruction'"),
        ({"instruction": "i", "output": 3}, "alpaca", r"f:7: 'output' must be a string, got int"),
        ({"conversations": [{"from": "observation", "value": "{}"}]}, "chat", r"turn from 'observation'; expected"),
        ({"conversations": [{"speaker": "human"}]}, "chat", r"'conversations' must be a non-empty list of"),
        ({"prompt": "p", "chosen": ["a", "b"], "rejected": "r"}, "preference", r"'chosen' must be a string or one"),
        (
            {"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", "content": "r"}]},
            "preference",
            r"'chosen' and 'rejected' share no first message and there is no 'prompt'",
        ),
        ({"chosen": "x", "rejected": ["y"]}, "preference", r"two strings or two message lists \(TRL's implicit"),
        ({"prompt": "p", "completion": "c", "text": "t"}, "auto", r"fits prompt_completion and text"),
        ({"prompt": "p"}, "prompt_completion", r"f:7: missing field\(s\) 'completion'; data.format=prompt_completion"),
        ({"prompt": 3, "completion": "c"}, "prompt_completion", r"f:7: 'prompt' must be a string or a message list"),
        ({"prompt": "p", "completion": ["a", "b"]}, "prompt_completion", r"'completion' must be a string or one"),
        (
            {"prompt": "p", "completion": [{"role": "user", "content": "c"}]},
            "prompt_completion",
            r"'completion' must be a string or one assistant message",
        ),
        ({"prompt": [{"speaker": "u"}], "completion": "c"}, "prompt_completion", r"'prompt' must be a non-empty list"),
        ({"instruction": "i", "output": "o", "history": [["q"]]}, "alpaca", r"f:7: 'history' must be a list of \["),
        ({"instruction": "i", "output": "o", "images": ["a.png"]}, "alpaca", r"f:7: 'images': LLaMA-Factory's"),
        (
            {"instruction": "i", "history": [["q", "a"]], "chosen": "c", "rejected": "r"},
            "preference",
            r"f:7: an alpaca pair with 'system' or 'history'",
        ),
        (_chat({"weight": 0.5}), "chat", r"f:7: messages\[1\].weight must be 0 or 1 .* got 0.5"),
        (_chat({"weight": True}), "chat", r"f:7: messages\[1\].weight must be 0 or 1"),
        (_chat({"weight": 0}), "chat", r"f:7: every assistant message has 'weight': 0"),
        (
            _chat({"content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}),
            "chat",
            r"f:7: messages\[1\].tool_calls\[0\].function.arguments is not JSON",
        ),
        (_chat({"content": None}), "chat", r"f:7: 'messages' must be a non-empty list of"),
        ({**_chat({}), "functions": [{"name": "f"}]}, "chat", r"f:7: 'functions' \(OpenAI's deprecated"),
        ({**_chat({}), "tools": ["f"]}, "chat", r"f:7: 'tools' must be a list of"),
    ],
)
def test_a_row_that_fits_no_format_is_refused_naming_it(row, data_format, message):
    with pytest.raises(ValueError, match=message):
        if data_format == "auto":
            formats.detect(row, "f:7")
        else:
            formats.canonical(row, data_format, "f:7")


def test_auto_refuses_a_file_it_cannot_read_with_the_row(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('\n{"question": "q", "answer": "a"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"rows.jsonl:2: data.format=auto cannot tell .* \['answer', 'question'\]"):
        detected_format(path)
    (tmp_path / "notes.txt").write_text('{"text": "a"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"notes.txt:1: a JSON object with 'text' in a plain text file"):
        detected_format(tmp_path / "notes.txt")
    (tmp_path / "plain.txt").write_text("{braces} in prose\n", encoding="utf-8")
    assert detected_format(tmp_path / "plain.txt") == "text"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('[{"text": "a"},\n {"text": "b"} {"text": "c"}]', r"a.json:2: expected ',' or '\]' after element 2"),
        ('[{"text": "a"},\n\n {"text": "b",}]', r"a.json:element 2 \(line 3\): invalid JSON"),
        ('[{"text": "a"}, ["b"]]', r"a.json:element 2 \(line 1\): expected a JSON object, got list"),
        ('[{"text": "a"}', r"a.json:1: expected ',' or '\]' after element 1, found the end of the file"),
        ('[{"text": "a"}] {}', r"a.json:1: text after the JSON array's closing '\]'"),
        ('[{"text": "a"}, {"text": "b', r"a.json:element 2 \(line 1\): invalid JSON \(Unterminated string"),
    ],
)
def test_a_broken_json_array_is_refused_with_element_and_line(tmp_path, content, message):
    (tmp_path / "a.json").write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        list(items(tmp_path / "a.json", "text"))


def test_json_array_elements_across_blocks_are_read_whole(tmp_path, monkeypatch):
    """Elements longer than the block read at a time, and block edges inside strings, escapes and literals."""
    rows = [
        {"instruction": f"q{i} " + "\u4e2d" * (i * 7), "output": 'a\\"' * i + ".", "input": None} for i in range(60)
    ]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(rows, indent=4), encoding="utf-8")
    for block in (1, 7, 64, 1 << 22):
        monkeypatch.setattr(json_array, "BLOCK", block)
        assert list(items(path, "alpaca")) == rows, block
    assert list(items(tmp_path / "rows.json", "jsonl")) == rows
    (tmp_path / "empty.json").write_text(" [ ] \n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty.json: data file is empty"):
        verify(tmp_path / "empty.json", "alpaca")


def test_a_json_object_s_members_are_read_one_at_a_time_as_json_reads_the_whole(tmp_path, monkeypatch):
    """chitchat_dataset's layout (an object of dialogues), across block edges; a key given twice keeps its last value,
    as json.load does; a broken member is named with its line."""
    text = json.dumps({f"k{i}": {"messages": [[{"text": "\u4e2d" * i + '\\"'}]]} for i in range(40)}, indent=2)
    path = tmp_path / "dialogues.json"
    path.write_text(text[:-1] + ', "k3": {"messages": []}}', encoding="utf-8")
    for block in (1, 5, 64, 1 << 22):
        monkeypatch.setattr(json_array, "BLOCK", block)
        with open(path, "rb") as file:
            assert dict(json_array.members(file, "d.json")) == json.loads(path.read_text(encoding="utf-8")), block
    for content, message in [
        (" { } ", None),
        ('{"a": {},\n "b": []}', r"d.json:member 2 \(line 2\): expected a JSON object, got list"),
        ('{"a" {}}', r"d.json:1: expected ':' after member 1's key"),
        ('{"a": {}} x', r"d.json:1: text after the JSON object's closing '}'"),
    ]:
        path.write_text(content, encoding="utf-8")
        with open(path, "rb") as file:
            if message is None:
                assert list(json_array.members(file, "d.json")) == []
            else:
                with pytest.raises(ValueError, match=message):
                    list(json_array.members(file, "d.json"))


def test_chat_brings_its_template_and_auto_validates():
    """data.format=chat needs no second key (the chat template renders it whatever prompt_template says; a template
    set with it is reported as without effect); data.format=auto composes with any objective (check decides)."""
    raw = config.compose(REPO / "conf", ["data=own", "data.train_file=x.jsonl", "data.format=chat"])
    cfg = config.validate(raw)
    assert formats.template_for(cfg.data.format, cfg.data.prompt_template) == "chat"
    assert formats.template_for("alpaca", "alpaca") == "alpaca"
    defaults = config.validate(config.compose(REPO / "conf"))
    custom = config.validate(
        config.compose(REPO / "conf", ["data.format=chat", "data.prompt_template='Q: {instruction}'"])
    )
    assert any("data.prompt_template" in w and "has no effect" in w for w in config.ineffective(custom, defaults)[1])
    own = config.validate(config.compose(REPO / "conf", ["data=own", "data.train_file=x.jsonl", "train.objective=dpo"]))
    assert own.data.format == "auto"


def test_truncation_is_counted_as_cache_dataset_counts_it_and_said_with_the_fix(smol_tokenizer_dir, texts):
    """The check's sample counts what sft_arrays / preference_arrays count at data.max_seq_len, and names the length
    that keeps 95% of the examples whole; a share of 5% or less says nothing; every example dropped is a refusal."""
    from pipeline.data import truncation
    from pipeline.data.examples import preference_arrays, sft_arrays
    from pipeline.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(smol_tokenizer_dir)
    rows = user_data.stanford_alpaca(texts)
    counts = truncation.sample(tokenizer, rows, data_format="alpaca", template="alpaca", max_seq_len=150)
    assert {k: v for k, v in counts.items() if k != "kept_whole_at"} == sft_arrays(
        tokenizer, rows, template="alpaca", max_seq_len=150
    )[1]
    whole = sft_arrays(tokenizer, rows, template="alpaca", max_seq_len=10_000)[0]["lengths"]
    assert (whole <= counts["kept_whole_at"]).mean() >= 0.95 > (whole <= counts["kept_whole_at"] - 1).mean()
    (warning,) = truncation.warnings(counts, max_seq_len=150, sampled=True)
    assert warning.startswith(f"data.max_seq_len=150 cuts {counts['truncated_examples']} of the first 30 examples")
    assert warning.endswith(f"-S data.max_seq_len={counts['kept_whole_at']} keeps 95% of them whole")
    roomy = truncation.sample(tokenizer, rows, data_format="alpaca", template="alpaca", max_seq_len=4096)
    assert truncation.warnings(roomy, max_seq_len=4096, sampled=False) == []
    pairs = user_data.trl_standard(texts)
    tight = truncation.sample(tokenizer, pairs, data_format="preference", template="alpaca", max_seq_len=16)
    assert (
        tight["dropped_pairs"]
        == 30
        == preference_arrays(tokenizer, pairs, template="alpaca", max_seq_len=16)[1]["dropped_pairs"]
    )
    assert "every one of all 30 pairs of data.train_file loses its response" in truncation.refusal(
        tight, max_seq_len=16, sampled=False
    )
