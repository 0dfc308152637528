"""Packing loses and duplicates no token; SFT labels are masked exactly on prompt tokens (a prompt-completion row's
whole prompt); bad data is named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pipeline.data.encoding import tokenize_documents
from pipeline.data.examples import IGNORE_INDEX, completion_arrays, sft_arrays
from pipeline.data.inputs import detected_format, items
from pipeline.data.saved_splits import SplitRows, split_indices
from pipeline.data.textio import read_data, read_documents
from pipeline.data.tokenizer import load_tokenizer
from tests.helpers.datasets import build_instruction, build_pretraining, build_sft, pack_blocks, save_splits


@pytest.fixture(scope="module")
def smol(smol_tokenizer_dir):
    return load_tokenizer(smol_tokenizer_dir)


def test_the_stream_does_not_depend_on_the_chunk_of_documents_encoded_at_once(smol, peoples_daily):
    documents = peoples_daily[:150]
    whole, lengths = tokenize_documents(smol, documents, chunk=len(documents))
    assert len(lengths) == len(documents) and int(lengths.sum()) == len(whole)
    for chunk in (1, 7, 64):
        stream, sizes = tokenize_documents(smol, documents, chunk=chunk)
        assert np.array_equal(sizes, lengths) and stream.dtype == np.int32 and np.array_equal(stream, whole)
    empty, none = tokenize_documents(smol, [])
    assert none.size == 0 and empty.dtype == np.int32 and empty.size == 0


@pytest.mark.parametrize("tail", ["drop", "pad"])
def test_packing_loses_and_duplicates_no_token(smol, peoples_daily, tail):
    documents = peoples_daily[:200]
    stream, lengths = tokenize_documents(smol, documents)
    assert len(lengths) == 200
    assert int((stream == smol.eos_token_id).sum()) == 200
    expected = [t for doc in documents for t in smol(doc, add_special_tokens=False).input_ids + [smol.eos_token_id]]
    assert stream.tolist() == expected

    inputs, labels = pack_blocks(stream, block_size=128, tail=tail, pad_id=smol.pad_token_id)
    kept = labels[labels != IGNORE_INDEX]
    if tail == "drop":
        assert inputs.shape == (len(stream) // 128, 128)
        assert np.array_equal(inputs.ravel(), stream[: inputs.size])
    else:
        assert inputs.shape == (-(-len(stream) // 128), 128)
        assert np.array_equal(kept, stream), "every token appears once, in order"
        assert (labels[-1] == IGNORE_INDEX).sum() == inputs.size - len(stream)
    assert np.array_equal(kept, inputs[labels != IGNORE_INDEX])


def test_split_is_seeded_disjoint_and_complete():
    train, val = split_indices(100, 0.1, seed=3)
    assert len(val) == 10 and len(train) == 90
    assert sorted(np.concatenate([train, val]).tolist()) == list(range(100))
    again = split_indices(100, 0.1, seed=3)
    assert np.array_equal(train, again[0]) and np.array_equal(val, again[1])
    assert not np.array_equal(val, split_indices(100, 0.1, seed=4)[1])
    with pytest.raises(ValueError, match="data.validation_fraction: 1 row"):
        split_indices(1, 0.5, seed=0)


def test_pretraining_tables_hold_every_block(smol, peoples_daily):
    tables, stats = build_pretraining(
        smol, peoples_daily[:300], block_size=64, tail="drop", validation_fraction=0.1, seed=0
    )
    assert stats["train_rows"] + stats["validation_rows"] == stats["tokens"] // 64
    assert tables["train"].num_rows == stats["train_rows"]
    assert stats["tokens_dropped"] == stats["tokens"] % 64
    assert tables["train"].schema.field("input_ids").type.list_size == 64


def test_too_little_text_for_one_block(smol):
    with pytest.raises(ValueError, match="data.block_size: .* make no block of 4096"):
        build_pretraining(smol, ["short text"], block_size=4096, tail="drop", validation_fraction=0.0, seed=0)


ROWS = [
    {"instruction": "判断情感。", "input": "这本书很好看。", "output": "正面"},
    {"instruction": "Say hi.", "input": "", "output": "Hi there!"},
]


def _trained(tokenizer, ids, labels) -> str:
    return tokenizer.decode([t for t, lab in zip(ids, labels, strict=True) if lab != IGNORE_INDEX])


def _prompt(tokenizer, ids, labels) -> list[int]:
    return [t for t, lab in zip(ids, labels, strict=True) if lab == IGNORE_INDEX]


def test_alpaca_labels_mask_exactly_the_prompt(smol):
    inputs, labels, stats = build_sft(smol, ROWS, template="alpaca", max_seq_len=512)
    assert stats == {"examples": 2, "truncated_examples": 0, "dropped_examples": 0}
    for row, ids, lab in zip(ROWS, inputs, labels, strict=True):
        assert _trained(smol, ids, lab) == row["output"] + smol.eos_token
        first = next(i for i, t in enumerate(lab) if t != IGNORE_INDEX)
        assert all(t == IGNORE_INDEX for t in lab[:first]) and all(t != IGNORE_INDEX for t in lab[first:])
        assert "### Response:\n" in smol.decode(ids[:first])
        assert row["instruction"] in smol.decode(_prompt(smol, ids, lab))


def test_custom_template_and_truncation(smol):
    inputs, labels, stats = build_sft(smol, ROWS, template="Q: {instruction} {input}\nA: ", max_seq_len=8)
    assert all(len(ids) <= 8 for ids in inputs)
    assert stats["truncated_examples"] >= 1
    assert stats["examples"] == len(inputs) + stats["dropped_examples"]


def test_chat_masks_everything_but_assistant_turns(smol):
    conversation = {
        "messages": [
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi, how can I help?"},
            {"role": "user", "content": "Tell me a joke."},
            {"role": "assistant", "content": "Why did the chicken cross the road?"},
        ]
    }
    inputs, labels, _ = build_sft(smol, [conversation], template="chat", max_seq_len=1024)
    trained = _trained(smol, inputs[0], labels[0])
    assert trained == "Hi, how can I help?<|im_end|>\nWhy did the chicken cross the road?<|im_end|>\n"
    full = smol.apply_chat_template(conversation["messages"], tokenize=False)
    assert smol.decode(inputs[0]) == full
    assert "Tell me a joke." in smol.decode(_prompt(smol, inputs[0], labels[0]))


def _split(arrays: dict) -> list[tuple[list[int], list[int]]]:
    bounds = np.cumsum(arrays["lengths"])[:-1]
    ids, labels = (np.split(arrays[name], bounds) for name in ("ids", "labels"))
    return [(a.tolist(), b.tolist()) for a, b in zip(ids, labels, strict=True)]


TRL_STANDARD = [  # TRL's SFT prompt-completion rows, as its docs write them
    {"prompt": "The sky is", "completion": " blue."},
    {"prompt": "判断情感：这本书很好看。", "completion": "正面"},
]
TRL_CONVERSATIONAL = [
    {
        "prompt": [
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi, how can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
        "completion": [{"role": "assistant", "content": "Why did the chicken cross the road?"}],
    }
]


def _trl_file(tmp_path, rows: list[dict]):
    path = tmp_path / "trl.jsonl"
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.mark.parametrize("template", ["alpaca", "{instruction}", "chat"])
def test_prompt_completion_trains_the_completion_alone(smol, tmp_path, template):
    """TRL's standard rows, found by data.format=auto: each is an alpaca row whose instruction is the prompt (the same
    tokens and labels, under any template), every prompt token masked, the completion and what ends it trained; with
    the template '{instruction}' the text is TRL's own, the prompt then the completion."""
    path = _trl_file(tmp_path, TRL_STANDARD)
    assert detected_format(path) == "prompt_completion"
    rows = list(items(path, "prompt_completion"))
    arrays, counts = completion_arrays(smol, rows, template=template, max_seq_len=512)
    assert counts == {"examples": 2, "truncated_examples": 0, "dropped_examples": 0}
    alpaca = [{"instruction": row["prompt"], "output": row["completion"]} for row in TRL_STANDARD]
    same, _ = sft_arrays(smol, alpaca, template=template, max_seq_len=512)
    for name in ("ids", "labels", "lengths"):
        np.testing.assert_array_equal(arrays[name], same[name])
    end = "<|im_end|>\n" if template == "chat" else smol.eos_token
    for row, (ids, labels) in zip(TRL_STANDARD, _split(arrays), strict=True):
        assert _trained(smol, ids, labels) == row["completion"] + end
        first = next(i for i, t in enumerate(labels) if t != IGNORE_INDEX)
        assert all(t != IGNORE_INDEX for t in labels[first:]), "the completion is trained whole"
        if template == "{instruction}":
            assert smol.decode(ids) == row["prompt"] + row["completion"] + smol.eos_token


def test_conversational_prompt_completion_trains_the_completion_alone(smol, tmp_path):
    """TRL's conversational rows through the chat template: the tokens are the whole conversation's rendering, and
    only the completion (with its end of turn) is trained: the prompt's assistant turn is context, as TRL's
    completion mask has it (data.format=chat would train it); evaluate scores the same tokens."""
    from pipeline.evaluation.likelihood import set_examples

    path = _trl_file(tmp_path, TRL_CONVERSATIONAL)
    assert detected_format(path) == "prompt_completion"
    rows = list(items(path, "prompt_completion"))
    arrays, _ = completion_arrays(smol, rows, template="alpaca", max_seq_len=512)
    ((ids, labels),) = _split(arrays)
    conversation = TRL_CONVERSATIONAL[0]["prompt"] + TRL_CONVERSATIONAL[0]["completion"]
    assert smol.decode(ids) == smol.apply_chat_template(conversation, tokenize=False)
    assert _trained(smol, ids, labels) == "Why did the chicken cross the road?<|im_end|>\n"
    assert "Hi, how can I help?" in smol.decode(_prompt(smol, ids, labels))
    _, chat_labels, _ = build_sft(smol, [{"messages": conversation}], template="chat", max_seq_len=512)
    assert _trained(smol, ids, chat_labels[0]).startswith("Hi, how can I help?"), "chat trains every reply"
    (scored,) = set_examples(smol, rows, data_format="prompt_completion", template="alpaca", max_bytes=None)
    assert smol.decode([t for t, s in zip(scored.ids, scored.scored, strict=True) if s]) == _trained(smol, ids, labels)


def test_instruction_tables_and_masked_fraction(smol):
    tables, stats = build_instruction(
        smol, ROWS * 10, template="chat", max_seq_len=256, validation_fraction=0.1, seed=0
    )
    assert (stats["train_rows"], stats["validation_rows"]) == (18, 2)
    assert 0.5 < stats["masked_fraction"] < 1.0
    assert tables["validation"].column_names == ["input_ids", "labels"]


def test_saved_dataset_is_byte_identical_across_runs(smol, peoples_daily, tmp_path):
    from datasets import load_from_disk

    for name in ("a", "b"):
        tables, _ = build_pretraining(
            smol, peoples_daily[:100], block_size=32, tail="pad", validation_fraction=0.2, seed=1
        )
        save_splits(tmp_path / name, tables)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    assert files
    for rel in files:
        assert (tmp_path / "a" / rel).read_bytes() == (tmp_path / "b" / rel).read_bytes(), rel
    loaded = load_from_disk(str(tmp_path / "a"))
    assert set(loaded) == {"train", "validation"}
    assert len(loaded["train"][0]["input_ids"]) == 32


def test_split_rows_are_datasets_rows(smol, peoples_daily, tmp_path):
    """What the train ranks read without datasets is what load_from_disk(...).with_format("numpy") reads: packed
    blocks (fixed-size lists) and SFT rows (variable length)."""
    from datasets import load_from_disk

    packed, _ = build_pretraining(smol, peoples_daily[:100], block_size=32, tail="pad", validation_fraction=0.2, seed=1)
    sft, _ = build_instruction(smol, ROWS * 10, template="chat", max_seq_len=256, validation_fraction=0.1, seed=0)
    for name, tables in (("packed", packed), ("sft", sft)):
        save_splits(tmp_path / name, tables)
        reference = load_from_disk(str(tmp_path / name)).with_format("numpy")
        for split in ("train", "validation"):
            rows = SplitRows(tmp_path / name / split)
            assert len(rows) == len(reference[split]) > 0
            for i in range(len(rows)):
                got, want = rows[np.int64(i)], reference[split][i]
                assert got.keys() == want.keys() == {"input_ids", "labels"}
                for key in got:
                    assert got[key].dtype == want[key].dtype and np.array_equal(got[key], want[key]), (name, i)
        if name == "sft":  # the rows really vary in length
            assert len({len(row["input_ids"]) for row in reference["train"]}) > 1


def test_missing_and_empty_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="absent.txt: data file not found"):
        read_documents(tmp_path / "absent.txt")
    (tmp_path / "empty.txt").write_text("  \n\n")
    with pytest.raises(ValueError, match="empty.txt: data file is empty"):
        read_documents(tmp_path / "empty.txt")


def test_invalid_utf8_names_file_and_line(tmp_path):
    (tmp_path / "latin1.txt").write_bytes("first line\nsecond line\ncaf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt:3: invalid UTF-8 \(byte offset 26\)"):
        read_documents(tmp_path / "latin1.txt")


def test_jsonl_missing_field_names_file_and_line(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(
        json.dumps(ROWS[0]) + "\n\n" + json.dumps({"instruction": "x", "input": ""}) + "\n", encoding="utf-8"
    )
    with pytest.raises(ValueError, match=r"sft.jsonl:3: missing field\(s\) 'output'"):
        read_data(path, "alpaca")
    path.write_text("{not json}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"sft.jsonl:1: invalid JSON"):
        read_data(path, "alpaca")
    path.write_text(json.dumps({"messages": [{"role": "user"}]}) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"sft.jsonl:1: 'messages' must be a non-empty list"):
        read_data(path, "chat")


def _rss_file_mb() -> float:
    status = Path("/proc/self/status").read_text()
    return int(status.split("RssFile:")[1].split()[0]) / 1024


def test_opening_a_split_maps_none_of_its_rows(tmp_path):
    """A train rank opens its split without keeping the pages the kernel maps around each batch header: on rows
    of 8 tokens (64 KB batches), reading every header would otherwise map the whole 32 MB file."""
    from pipeline.data.saved_splits import to_table

    ids = np.arange(500_000 * 8, dtype=np.int32).reshape(-1, 8) % 50_000
    save_splits(tmp_path / "small_rows", {"train": to_table(ids, ids)})
    before = _rss_file_mb()
    rows = SplitRows(tmp_path / "small_rows" / "train")
    assert _rss_file_mb() - before < 8
    assert len(rows) == len(ids) and np.array_equal(rows[123_457]["labels"], ids[123_457])


def _reference_sft(tokenizer, rows: list[dict], *, template: str, max_seq_len: int):
    """SFT examples as the definition says, a row and a segment at a time: the prompt of each assistant turn (the
    conversation before it, with the generation prompt) untrained, the reply trained, BOS first where the tokenizer
    adds one; cut to max_seq_len, dropped when nothing trained is left."""
    from pipeline.data.templates import alpaca_messages, alpaca_prompt

    bos = tokenizer.bos_token_id
    start = [bos] if bos is not None and tokenizer.encode("x")[:1] == [bos] else []
    inputs, labels, truncated, dropped = [], [], 0, 0
    for row in rows:
        if template == "chat":
            messages, segments, done = row.get("messages") or alpaca_messages(row), [], ""
            for i, message in enumerate(messages):
                if message["role"] == "assistant":
                    prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
                    full = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
                    segments += [(prompt[len(done) :], False), (full[len(prompt) :], True)]
                    done = full
        else:
            segments = [(alpaca_prompt(row, template), False), (row["output"] + tokenizer.eos_token, True)]
        ids, lab = list(start), [IGNORE_INDEX] * len(start)
        for text, trained in segments:
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids, lab = ids + piece, lab + (piece if trained else [IGNORE_INDEX] * len(piece))
        truncated += len(ids) > max_seq_len
        ids, lab = ids[:max_seq_len], lab[:max_seq_len]
        if all(t == IGNORE_INDEX for t in lab):
            dropped += 1
            continue
        inputs.append(ids)
        labels.append(lab)
    return inputs, labels, {"examples": len(rows), "truncated_examples": truncated, "dropped_examples": dropped}


@pytest.mark.parametrize("bound", ["usual", "every row cut"])
@pytest.mark.parametrize("folder", ["smol_tokenizer_dir", "sp_tokenizer_dir"])
def test_sft_examples_are_the_reference_row_by_row(request, folder, bound, peoples_daily, monkeypatch):
    """The batched, array-built SFT examples equal the definition written out a row at a time, for short and long
    rows (truncated, or dropped when the prompt fills max_seq_len), multi-turn chats, with and without BOS, and
    where every conversation's rendering is cut by the character bound (then re-rendered whole if it fits)."""
    from pipeline.data import examples

    if bound != "usual":
        monkeypatch.setattr(examples, "RENDERED_CHARS_PER_TOKEN", 1)
    tokenizer = load_tokenizer(request.getfixturevalue(folder))
    texts = peoples_daily[:300]
    rows = [{"instruction": texts[i] * (1 + i % 5), "input": "", "output": texts[i + 1]} for i in range(0, 300, 3)]
    chats = [
        {"messages": [
            *([{"role": "system", "content": "Be brief."}] if i % 2 else []),
            *({"role": role, "content": texts[(i + k) % 300][: 20 + 30 * (k % 3)]}
              for k, role in enumerate(["user", "assistant"] * (1 + i % 3))),
        ]}
        for i in range(60)
    ]  # fmt: skip
    for template, usable in (("alpaca", rows), ("chat", rows[:20] + chats)):
        if template == "chat" and not tokenizer.chat_template:
            continue
        for max_seq_len in (24, 96, 4096):
            got = build_sft(tokenizer, usable, template=template, max_seq_len=max_seq_len)
            assert got == _reference_sft(tokenizer, usable, template=template, max_seq_len=max_seq_len)
            if max_seq_len == 24:
                assert got[2]["truncated_examples"] > 0 and got[2]["dropped_examples"] > 0


@pytest.mark.parametrize("light", [False, True], ids=["transformers_tokenizer", "light_tokenizer"])
@pytest.mark.parametrize(
    "template",
    [
        "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}{{ joiner.__init__.__globals__.os.popen('touch MARKER') }}",
    ],
    ids=["globals", "subclasses"],
)
def test_a_chat_template_that_reaches_for_python_is_refused_and_runs_nothing(
    smol_tokenizer_dir, tmp_path, light, template
):
    """A tokenizer folder from elsewhere: its chat template renders in transformers' sandbox, whose refusal is bad
    input naming the template, not a traceback; the command never runs."""
    from pipeline.data.tokenizer import light_tokenizer

    folder, marker = tmp_path / "tokenizer", tmp_path / "executed"
    folder.mkdir()
    for file in smol_tokenizer_dir.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    (folder / "chat_template.jinja").write_text(template.replace("MARKER", str(marker)))
    tokenizer = light_tokenizer(folder) if light else load_tokenizer(folder)
    assert tokenizer is not None and "__globals__" in tokenizer.chat_template
    conversation = {"messages": [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"}]}
    with pytest.raises(ValueError, match="chat template: refused by the sandbox it renders in"):
        build_sft(tokenizer, [conversation], template="chat", max_seq_len=64)
    assert not marker.exists()


def _spans(tokenizer, ids: list[int], labels: list[int]) -> list[str]:
    """The trained spans of an example, each decoded: what the loss is on, turn by turn."""
    spans, run = [], []
    for token, label in [*zip(ids, labels, strict=True), (None, IGNORE_INDEX)]:
        if label != IGNORE_INDEX:
            run.append(token)
        elif run:
            spans, run = [*spans, tokenizer.decode(run)], []
    return spans


def _rows_file(tmp_path, name: str, rows: list[dict]) -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


LLAMA_FACTORY_ALPACA = {  # LLaMA-Factory's alpaca format (data/README.md): system prompt and earlier turns
    "instruction": "And in French?",
    "input": "",
    "output": "Bonjour.",
    "system": "Answer in one word.",
    "history": [["Say hello.", "Hello."], ["In Spanish?", "Hola."]],
}


@pytest.mark.parametrize("chat_template", [True, False], ids=["chat_template", "no_chat_template"])
def test_llama_factory_alpaca_trains_each_response_of_its_conversation(smol_tokenizer_dir, tmp_path, chat_template):
    """An alpaca row with `system` and `history` is the conversation LLaMA-Factory makes of it: through the chat
    template (whatever data.prompt_template) its system turn, each history pair a user and an assistant turn, the row's
    instruction and output last; without one, each turn an alpaca prompt after the system text. Every response is
    trained, the history's too (LLaMA-Factory's default, mask_history false), each prompt masked. A row whose system
    and history are empty tokenizes as a Stanford Alpaca row."""
    tokenizer = load_tokenizer(smol_tokenizer_dir)
    if not chat_template:
        tokenizer.chat_template = None
    path = _rows_file(tmp_path, "lf.jsonl", [LLAMA_FACTORY_ALPACA])
    assert detected_format(path) == "alpaca"
    rows = list(items(path, "alpaca"))
    arrays, counts = sft_arrays(tokenizer, rows, template="alpaca", max_seq_len=512)
    assert counts == {"examples": 1, "truncated_examples": 0, "dropped_examples": 0}
    ((ids, labels),) = _split(arrays)
    end = "<|im_end|>\n" if chat_template else tokenizer.eos_token
    assert _spans(tokenizer, ids, labels) == [f"{reply}{end}" for reply in ("Hello.", "Hola.", "Bonjour.")]
    text, prompt = tokenizer.decode(ids), tokenizer.decode(_prompt(tokenizer, ids, labels))
    if chat_template:
        conversation = [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Say hello."},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "In Spanish?"},
            {"role": "assistant", "content": "Hola."},
            {"role": "user", "content": "And in French?"},
            {"role": "assistant", "content": "Bonjour."},
        ]
        assert text == tokenizer.apply_chat_template(conversation, tokenize=False)
    else:
        assert text.startswith("Answer in one word.\n\nBelow is an instruction")
        assert prompt.index("Say hello.") < prompt.index("In Spanish?") < prompt.index("And in French?")
    plain = {"instruction": "Say hi.", "input": "", "output": "Hi there!"}
    same, _ = sft_arrays(tokenizer, [{**plain, "system": "", "history": []}], template="alpaca", max_seq_len=512)
    today, _ = sft_arrays(tokenizer, [plain], template="alpaca", max_seq_len=512)
    for name in SFT:
        np.testing.assert_array_equal(same[name], today[name])


SFT = ("ids", "labels", "lengths")
OPENAI_WEIGHTED = {  # OpenAI's chat fine-tuning format: weight 0 on an assistant message means it is not trained
    "messages": [
        {"role": "system", "content": "Marv is a factual chatbot that is also sarcastic."},
        {"role": "user", "content": "What's the capital of France?"},
        {"role": "assistant", "content": "Paris", "weight": 0},
        {"role": "user", "content": "Can you be more sarcastic?"},
        {"role": "assistant", "content": "Paris, as if everyone doesn't know that already.", "weight": 1},
    ]
}


def test_openai_weight_zero_is_context_not_trained(smol, tmp_path):
    """An assistant message with weight 0 is masked like a prompt; weight 1 (or none) is trained; the text is the
    conversation's rendering, the weights no part of it; evaluate scores the same tokens."""
    from pipeline.evaluation.likelihood import set_examples

    path = _rows_file(tmp_path, "marv.jsonl", [OPENAI_WEIGHTED])
    rows = list(items(path, detected_format(path)))
    arrays, _ = sft_arrays(smol, rows, template="chat", max_seq_len=512)
    ((ids, labels),) = _split(arrays)
    unweighted = [{k: v for k, v in m.items() if k != "weight"} for m in OPENAI_WEIGHTED["messages"]]
    assert smol.decode(ids) == smol.apply_chat_template(unweighted, tokenize=False)
    assert _spans(smol, ids, labels) == ["Paris, as if everyone doesn't know that already.<|im_end|>\n"]
    assert "Paris<|im_end|>" in smol.decode(_prompt(smol, ids, labels))
    (scored,) = set_examples(smol, rows, data_format="chat", template="chat", max_bytes=None)
    assert smol.decode([t for t, s in zip(scored.ids, scored.scored, strict=True) if s]) == _trained(smol, ids, labels)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}
OPENAI_TOOLS = {  # OpenAI's chat fine-tuning format with tool calls (its function-calling example)
    "messages": [
        {"role": "user", "content": "What is the weather in San Francisco?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_id",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"location": "San Francisco, USA"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_id", "content": '{"temperature": 21, "unit": "celsius"}'},
        {"role": "assistant", "content": "It is 21 degrees celsius in San Francisco."},
    ],
    "tools": [WEATHER],
}


@pytest.fixture(scope="module")
def tool_tokenizer_dir(smol_tokenizer_dir, tmp_path_factory) -> Path:
    """SmolLM2's tokenizer with Qwen2.5-Instruct's chat template, which renders tools, tool calls and their results."""
    folder = tmp_path_factory.mktemp("tool_tokenizer")
    for file in smol_tokenizer_dir.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    (folder / "chat_template.jinja").write_bytes(
        (Path(__file__).parents[2] / "helpers/tool_template.jinja").read_bytes()
    )
    return folder


@pytest.mark.parametrize("light", [False, True], ids=["transformers_tokenizer", "light_tokenizer"])
def test_openai_tool_calls_train_the_calls_and_mask_the_results(tool_tokenizer_dir, tmp_path, light):
    """With a chat template that renders tools, a conversation with tool calls is its rendering with the row's tools
    (transformers' apply_chat_template(messages, tools=...)): the assistant's call (its arguments as the object they
    encode) and its answer are trained, the tools, the question and the tool's result are prompt; the cache_dataset
    workers' tokenizer (light) gives the same tokens."""
    from pipeline.data.tokenizer import light_tokenizer

    tokenizer = light_tokenizer(tool_tokenizer_dir) if light else load_tokenizer(tool_tokenizer_dir)
    reference = load_tokenizer(tool_tokenizer_dir)
    path = _rows_file(tmp_path, "tools.jsonl", [OPENAI_TOOLS])
    assert detected_format(path) == "chat"
    rows = list(items(path, "chat"))
    arrays, _ = sft_arrays(tokenizer, rows, template="chat", max_seq_len=1024)
    ((ids, labels),) = _split(arrays)
    messages = json.loads(json.dumps(OPENAI_TOOLS["messages"]))
    messages[1]["tool_calls"][0]["function"]["arguments"] = {"location": "San Francisco, USA"}
    expected = reference.apply_chat_template(messages, tools=[WEATHER], tokenize=False)
    assert reference.decode(ids) == expected
    assert _spans(reference, ids, labels) == [
        '<tool_call>\n{"name": "get_weather", "arguments": {"location": "San Francisco, USA"}}\n</tool_call>'
        "<|im_end|>\n",
        "It is 21 degrees celsius in San Francisco.<|im_end|>\n",
    ]
    prompt = reference.decode(_prompt(reference, ids, labels))
    assert '"name": "get_weather"' in prompt and '<tool_response>\n{"temperature": 21' in prompt


def test_tool_calls_with_a_template_that_cannot_render_them_are_refused_naming_the_row(smol, tmp_path):
    """SmolLM2's chat template never reads tool_calls: its rendering would train an empty reply where the call was,
    so the row is refused, named by its file and line, with the reason."""
    path = _rows_file(tmp_path, "tools.jsonl", [OPENAI_WEIGHTED, OPENAI_TOOLS])
    rows = list(items(path, "chat"))
    with pytest.raises(ValueError, match=r"tools.jsonl:2: a conversation with tool calls .* never reads 'tool_calls'"):
        sft_arrays(smol, rows, template="chat", max_seq_len=1024)


def test_the_check_refuses_tool_calls_the_base_cannot_render_naming_the_row(tiny_base_dir, tmp_path):
    """The check stage, before anything runs: the base's (SmolLM2's) chat template never reads tool_calls, so a file
    whose second row calls a tool is refused with that row's file and line and the reason."""
    from pipeline.check import check
    from pipeline.core import config
    from tests.conftest import REPO

    rows = [OPENAI_WEIGHTED, OPENAI_TOOLS] * 8
    path = _rows_file(tmp_path, "tools.jsonl", rows)
    chosen = ["experiment=tiny", "data=own", f"data.train_file={path}", f"model.path={tiny_base_dir}"]
    cfg = config.Config(**config.compose(REPO / "conf", [*chosen, "launcher.accelerator=cpu"]))
    defaults = config.Config(**config.compose(REPO / "conf", []))
    corpus = [Path("data")]  # the default corpora, which prepare_corpus writes
    found = check(cfg, defaults=defaults, produced=corpus, known=set(), tokenizer_memo=None, pinned={})
    assert any(
        e.startswith(f"data.train_file: {path}:2: a conversation with tool calls") and "never reads 'tool_calls'" in e
        for e in found.errors
    ), found.errors
