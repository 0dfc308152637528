"""Preference pairs (`data.format: preference`): each side is the SFT example its row renders, the prompt masked and
the same on both sides; pairs are cut and dropped together and counted; bad rows are named by file and line before
anything runs; the streamed cache holds a pair per row, whatever the workers and chunks."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.check import check_file
from pipeline.core import config
from pipeline.data.corpus import review_preferences
from pipeline.data.examples import IGNORE_INDEX, PAIR_COLUMNS, preference_arrays
from pipeline.data.saved_splits import SplitRows, split_indices
from pipeline.data.textio import read_data
from pipeline.data.tokenizer import load_tokenizer
from tests.conftest import REPO
from tests.helpers.datasets import build_sft
from tests.helpers.user_data import hh_dialogue
from tests.unit.data.test_streamed import folder_bytes, packing, stream


@pytest.fixture(scope="module")
def smol(smol_tokenizer_dir):
    return load_tokenizer(smol_tokenizer_dir)


PAIRS = [
    {"prompt": "判断情感：这本书很好看。", "chosen": "正面", "rejected": "负面"},
    {
        "messages": [
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi, how can I help?"},
            {"role": "user", "content": "Tell me a joke."},
        ],
        "chosen": {"role": "assistant", "content": "Why did the chicken cross the road?"},
        "rejected": "No.",
    },
]


def sides(arrays: dict) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, labels) of each example of `preference_arrays`' output, in order."""
    bounds = np.cumsum(arrays["lengths"])[:-1]
    return list(zip(np.split(arrays["ids"], bounds), np.split(arrays["labels"], bounds), strict=True))


def trained(tokenizer, ids: np.ndarray, labels: np.ndarray) -> str:
    return tokenizer.decode(ids[labels != IGNORE_INDEX].tolist())


def prompt_tokens(ids: np.ndarray, labels: np.ndarray) -> list[int]:
    """The untrained tokens before the first trained one."""
    return ids[: int(np.argmax(labels != IGNORE_INDEX))].tolist()


@pytest.mark.parametrize("template", ["alpaca", "chat"])
def test_both_sides_mask_the_same_prompt_and_train_their_response(smol, template):
    arrays, counts = preference_arrays(smol, PAIRS, template=template, max_seq_len=512)
    assert counts == {"pairs": 2, "truncated_pairs": 0, "dropped_pairs": 0}
    assert all(a.dtype == np.int32 for a in arrays.values()) and len(arrays["lengths"]) == 4
    (c0, r0, c1, r1) = sides(arrays)
    for chosen, rejected in ((c0, r0), (c1, r1)):
        assert prompt_tokens(*chosen) == prompt_tokens(*rejected)
        assert (chosen[1][: len(prompt_tokens(*chosen))] == IGNORE_INDEX).all()
    end = smol.eos_token if template == "alpaca" else "<|im_end|>\n"
    assert (trained(smol, *c0), trained(smol, *r0)) == ("正面" + end, "负面" + end)
    # a conversation trains its last reply alone: the earlier assistant turn belongs to the prompt
    assert trained(smol, *c1) == "Why did the chicken cross the road?<|im_end|>\n"
    assert trained(smol, *r1) == "No.<|im_end|>\n"
    assert "Hi, how can I help?" in smol.decode(prompt_tokens(*c1))


def test_each_side_is_the_sft_example_of_its_row(smol):
    """The tokens are SFT's for the same row (a prompt as an alpaca instruction, a conversation with the response as
    its last turn); the labels are SFT's on the final reply."""
    for template in ("alpaca", "chat", "Q: {instruction}\nA: "):
        arrays, _ = preference_arrays(smol, PAIRS[:1], template=template, max_seq_len=512)
        rows = [{"instruction": PAIRS[0]["prompt"], "output": side} for side in ("正面", "负面")]
        ids, labels, _ = build_sft(smol, rows, template=template, max_seq_len=512)
        assert [(i.tolist(), lab.tolist()) for i, lab in sides(arrays)] == list(zip(ids, labels, strict=True))
    arrays, _ = preference_arrays(smol, PAIRS[1:], template="alpaca", max_seq_len=512)
    conversation = [*PAIRS[1]["messages"], {"role": "assistant", "content": "No."}]
    ids, _, _ = build_sft(smol, [{"messages": conversation}], template="chat", max_seq_len=512)
    assert sides(arrays)[1][0].tolist() == ids[0]
    assert smol.decode(ids[0]) == smol.apply_chat_template(conversation, tokenize=False)


def test_pairs_are_cut_at_max_seq_len_and_dropped_together(smol):
    short = {"prompt": "好", "chosen": "正面", "rejected": "负面"}
    long_rejected = {"prompt": "好", "chosen": "正面", "rejected": "这是一条很长的回答，" * 20}
    long_prompt = {"prompt": "这是一条很长的问题，" * 30, "chosen": "正面", "rejected": "负面"}
    rows = [short, long_rejected, long_prompt, short]
    template = "{instruction}\n"
    prompt_length = len(smol.encode("这是一条很长的问题，" * 30 + "\n", add_special_tokens=False))
    arrays, counts = preference_arrays(smol, rows, template=template, max_seq_len=32)
    assert prompt_length > 32, "the long prompt leaves neither side a trained token"
    assert counts == {"pairs": 4, "truncated_pairs": 2, "dropped_pairs": 1}
    assert (
        len(arrays["lengths"]) == 6
        and arrays["lengths"].max() == 32
        and int(arrays["lengths"].sum()) == len(arrays["ids"])
    )
    kept = sides(arrays)
    assert trained(smol, *kept[2]) == "正面" + smol.eos_token  # the long pair's chosen side, whole
    assert len(kept[3][0]) == 32 and trained(smol, *kept[3]).startswith("这是")  # its rejected side, cut
    assert [i.tolist() for i, _ in kept[4:]] == [i.tolist() for i, _ in kept[:2]]  # the last pair after the drop


def test_messages_need_a_chat_template(sp_tokenizer_dir):
    tokenizer = load_tokenizer(sp_tokenizer_dir)
    assert preference_arrays(tokenizer, PAIRS[:1], template="alpaca", max_seq_len=64)[1]["pairs"] == 1
    with pytest.raises(
        ValueError, match=r"rows with a conversation \('messages', .*\) need a tokenizer with a chat template"
    ):
        preference_arrays(tokenizer, PAIRS, template="alpaca", max_seq_len=64)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"prompt": "p", "chosen": "a"}, r"pref.jsonl:3: missing field\(s\) 'rejected'"),
        ({"prompt": "p"}, r"pref.jsonl:3: missing field\(s\) 'chosen', 'rejected'"),
        (
            {"chosen": "a", "rejected": "b"},
            r"pref.jsonl:3: neither 'prompt' nor 'messages', and 'chosen' and 'rejected' share no beginning",
        ),  # TRL's implicit prompt is their shared beginning: here there is none
        (
            {"prompt": "p", "messages": [{"role": "user", "content": "q"}], "chosen": "a", "rejected": "b"},
            r"pref.jsonl:3: both 'prompt' and 'messages'; expected one of them",
        ),
        (
            {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello!", "rejected": "\n\nHuman: Hey\n\nAssistant: Go away."},
            r"pref.jsonl:3: 'chosen' and 'rejected' are Anthropic HH dialogues .* that differ before their last "
            r"Assistant turn \('i' against 'ey'\)",
        ),  # hh-rlhf's two dialogues share every turn but the last answer
        (
            {"prompt": 3, "chosen": "a", "rejected": "b"},
            r"pref.jsonl:3: 'prompt' must be a string or a message list, got int",
        ),
        ({"messages": [{"role": "user"}], "chosen": "a", "rejected": "b"}, r"pref.jsonl:3: 'messages' must be"),
        (
            {"prompt": "p", "chosen": {"role": "user", "content": "a"}, "rejected": "b"},
            r"pref.jsonl:3: 'chosen' must be a string or one assistant message \(\{\"role\": \"assistant\", \"content",
        ),
    ],
)
def test_a_bad_row_is_refused_with_file_and_line(tmp_path, row, message):
    path = tmp_path / "pref.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n\n" + json.dumps(row) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        read_data(path, "preference")
    with pytest.raises(ValueError, match=f"data.train_file: .*{message}"):
        check_file("data.train_file", str(path), "preference", max_bad_rows=0.01)  # the check stage, before all


def test_parquet_pairs_are_read_and_checked(tmp_path):
    rows = [PAIRS[0], {**PAIRS[0], "prompt": "再来一条"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pref.parquet")
    assert read_data(tmp_path / "pref.parquet", "preference") == rows
    pq.write_table(pa.table({"prompt": ["p"], "chosen": ["a"]}), tmp_path / "half.parquet")
    with pytest.raises(ValueError, match=r"half.parquet: no column\(s\) 'rejected'"):
        read_data(tmp_path / "half.parquet", "preference")


def test_the_config_takes_preference_data_and_refuses_mixes():
    raw = config.compose(REPO / "conf", ["data=reviews_pref"])["data"]
    data = config.DataConfig.model_validate(raw)
    assert (data.format, data.prompt_template) == ("preference", "alpaca")
    source = {"file": "a.jsonl", "format": "alpaca", "weight": 1.0}
    with pytest.raises(ValueError, match="data.sources: data.format=preference trains on data.train_file alone"):
        config.DataConfig.model_validate({**raw, "sources": [source]})


def test_review_pairs_choose_the_correct_label():
    rows = [
        {"instruction": "判断。", "input": "很好", "output": "正面"},
        {"instruction": "判断。", "input": "很差", "output": "负面"},
    ]
    assert review_preferences(rows) == [
        {"prompt": "判断。\n\n很好", "chosen": "正面", "rejected": "负面"},
        {"prompt": "判断。\n\n很差", "chosen": "负面", "rejected": "正面"},
    ]


def pair_rows(texts: list[str]) -> list[dict]:
    """Prompts and conversations of every length: some pairs fit, some are cut, some lose their responses."""
    rows = []
    for i in range(150):
        if i % 3 == 0:
            messages = [
                {"role": "user", "content": texts[i][:5]},
                {"role": "assistant", "content": texts[i + 1][:5]},
                {"role": "user", "content": texts[i + 2][: 2 + 6 * (i % 7)]},
            ]
            rows.append({"messages": messages, "chosen": {"role": "assistant", "content": texts[i + 3][:8]}})
            rows[-1]["rejected"] = texts[i + 4][:4]
        else:
            prompt, rejected = texts[i][: 4 * (1 + i % 8)], texts[i + 2][: 4 + 8 * (i % 4)]
            rows.append({"prompt": prompt, "chosen": texts[i + 1][:8], "rejected": rejected})
    return rows


def test_anthropic_hh_pairs_train_the_last_answer_after_the_conversation(tmp_path, smol, smol_tokenizer_dir):
    """hh-rlhf's rows (two whole dialogues sharing every turn but the last answer) cache as the pair they mean: the
    prompt is the conversation up to the last Assistant turn, rendered by the chat template, and each side trains
    exactly its answer, even where the answers begin alike (1899/1889 share "18", where a character prefix cut)."""
    first, question = ("Who wrote Dracula?", "Bram Stoker."), "When was it first published?"
    answers = [("It was first published in 1897.", "It was first published in 1899."), ("1899.", "1889.")]
    rows = [
        {"chosen": hh_dialogue([first, (question, good)]), "rejected": hh_dialogue([first, (question, bad)])}
        for good, bad in answers
    ]
    (tmp_path / "hh.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out, figures = stream(tmp_path, smol_tokenizer_dir, tmp_path / "hh.jsonl", packing("preference"))
    assert (figures["pairs"], figures["truncated_pairs"], figures["dropped_pairs"]) == (2, 0, 0)
    conversation = [
        {"role": "user", "content": first[0]},
        {"role": "assistant", "content": first[1]},
        {"role": "user", "content": question},
    ]
    prompt = smol.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith(f"{question}<|im_end|>\n<|im_start|>assistant\n")
    found = set()
    for split in ("train", "validation"):
        cached = SplitRows(out / split)
        for k in range(len(cached)):
            row = cached[np.int64(k)]
            sides = [(row["input_ids"], row["labels"]), (row["rejected_input_ids"], row["rejected_labels"])]
            for ids, labels in sides:
                assert smol.decode(prompt_tokens(ids, labels)) == prompt  # the conversation, untrained, whole
            found.add(tuple(trained(smol, ids, labels) for ids, labels in sides))
    assert found == {(good + "<|im_end|>\n", bad + "<|im_end|>\n") for good, bad in answers}


def test_streamed_pairs_do_not_depend_on_workers_or_chunks(tmp_path, smol, smol_tokenizer_dir, peoples_daily):
    rows = pair_rows(peoples_daily)
    (tmp_path / "pref.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    pack = packing("preference", template="alpaca")
    outs = {}
    for workers, chunk_chars in ((1, 10**9), (2, 700)):
        outs[workers] = stream(
            tmp_path, smol_tokenizer_dir, tmp_path / "pref.jsonl", pack, workers=workers, chunk_chars=chunk_chars,
            name=f"s{workers}",
        )  # fmt: skip
    (one, figures), (two, split_figures) = outs[1], outs[2]
    assert split_figures["parts"] > 4 and figures["parts"] == 1
    assert folder_bytes(one) == folder_bytes(two)
    stable = ("documents", "tokens", "pairs", "truncated_pairs", "dropped_pairs", "train_rows", "validation_rows")
    assert {k: figures[k] for k in stable} == {k: split_figures[k] for k in stable}

    arrays, counts = preference_arrays(smol, rows, template="alpaca", max_seq_len=96)
    assert {k: figures[k] for k in counts} == counts
    assert counts["truncated_pairs"] > 0 and counts["dropped_pairs"] > 0 and figures["documents"] == 150
    examples = sides(arrays)
    pairs = list(zip(examples[0::2], examples[1::2], strict=True))  # (chosen, rejected) per kept pair
    train, validation = split_indices(len(pairs), 0.1, 3)
    assert (figures["train_rows"], figures["validation_rows"]) == (len(train), len(validation))
    for split, indices in (("train", train), ("validation", validation)):
        rows_read = SplitRows(one / split)
        assert tuple(rows_read.columns) == PAIR_COLUMNS and len(rows_read) == len(indices)
        for column in rows_read.columns.values():
            assert column.type == pa.list_(pa.int32())
        for k, index in enumerate(indices):
            (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = pairs[index]
            row = rows_read[np.int64(k)]
            assert row.keys() == set(PAIR_COLUMNS) and all(v.dtype == np.int64 for v in row.values())
            assert np.array_equal(row["input_ids"], chosen_ids) and np.array_equal(row["labels"], chosen_labels)
            assert np.array_equal(row["rejected_input_ids"], rejected_ids)
            assert np.array_equal(row["rejected_labels"], rejected_labels)
    chosen_labels = np.concatenate([pairs[i][0][1] for i in train])
    assert figures["masked_fraction"] == pytest.approx(float((chosen_labels == IGNORE_INDEX).mean()))


def test_split_rows_read_a_pair_as_datasets_does(tmp_path, smol_tokenizer_dir):
    from datasets import load_from_disk

    rows = [{**PAIRS[0], "prompt": f"{PAIRS[0]['prompt']}{i}"} for i in range(20)]
    (tmp_path / "pref.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    out, _ = stream(tmp_path, smol_tokenizer_dir, tmp_path / "pref.jsonl", packing("preference"))
    reference = load_from_disk(str(out)).with_format("numpy")
    for split in ("train", "validation"):
        rows_read = SplitRows(out / split)
        assert len(rows_read) == len(reference[split]) > 0
        for i in range(len(rows_read)):
            got, want = rows_read[i], reference[split][i]
            assert got.keys() == want.keys() == set(PAIR_COLUMNS)
            assert all(got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]) for k in got)
