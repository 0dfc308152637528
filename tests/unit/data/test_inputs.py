"""Input files as Windows editors, spreadsheets and pandas write them: a file's leading UTF-8 byte order mark is not
text (and nothing else of the text changes), and a row with no text (null or empty, an empty conversation) is dropped,
counted and named in the check's warning, not a reason to refuse the file; a malformed row is still refused with its
file and line. Read through the functions the check and the stages call."""

from __future__ import annotations

import codecs
import gzip
import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.check import check, check_file
from pipeline.core import config
from pipeline.data.inputs import Dropped, detected_format, items
from pipeline.data.textio import verify
from tests.conftest import REPO

BOM = codecs.BOM_UTF8
ALPACA = [
    {"instruction": "Give three tips for staying healthy.", "input": "", "output": "1. Eat a balanced diet."},
    {"instruction": "What is the capital of France?", "output": "Paris."},
]


def _jsonl(rows: list) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


@pytest.mark.parametrize(
    ("name", "content", "data_format"),
    [
        ("notes.txt", "中国人民站起来了。\n The second line. \n", "text"),
        ("rows.jsonl", _jsonl(ALPACA), "alpaca"),
        ("rows.json", json.dumps(ALPACA, indent=4), "alpaca"),  # an indented array, as alpaca_data.json
        ("rows.jsonl.gz", _jsonl(ALPACA), "alpaca"),  # the mark inside the compressed stream
    ],
)
def test_a_leading_byte_order_mark_is_not_text(tmp_path, name, content, data_format):
    plain, marked = tmp_path / "plain" / name, tmp_path / "marked" / name
    for path, data in ((plain, content.encode()), (marked, BOM + content.encode())):
        path.parent.mkdir()
        path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    assert detected_format(marked) == data_format
    assert list(items(marked, data_format)) == list(items(plain, data_format))
    assert list(items(marked, data_format, deferred=True))[-1:] != []  # the stage's reading starts as well
    assert verify(marked, data_format) == verify(plain, data_format) == 2
    assert check_file("data.train_file", str(marked), data_format, max_bad_rows=0.0) is None
    if data_format == "text":
        assert list(items(marked, "text"))[0] == "中国人民站起来了。"


def test_only_the_file_s_leading_mark_is_dropped(tmp_path):
    """A mark past the file's start is the text's own (U+FEFF in a document), or a JSONL line that is not JSON."""
    (tmp_path / "notes.txt").write_bytes(BOM + b"first\n" + BOM + b"second\n")
    assert list(items(tmp_path / "notes.txt", "text")) == ["first", "\ufeffsecond"]
    (tmp_path / "rows.jsonl").write_bytes(BOM + _jsonl(ALPACA[:1]).encode() + BOM + _jsonl(ALPACA[1:]).encode())
    with pytest.raises(ValueError, match=r"rows.jsonl:2: invalid JSON \(Unexpected UTF-8 BOM"):
        check_file("data.train_file", str(tmp_path / "rows.jsonl"), "alpaca", max_bad_rows=0.01)


EMPTY_ROWS = [  # (format, a row of it with no text)
    ("text", {"text": None}),
    ("text", {"text": ""}),
    ("alpaca", {"instruction": "Summarise.", "input": "", "output": None}),
    ("alpaca", {"instruction": "Summarise.", "output": ""}),
    ("alpaca", {"instruction": None, "output": "Paris."}),
    ("chat", {"messages": []}),
    ("chat", {"messages": None, "conversations": []}),
    ("prompt_completion", {"prompt": "The sky is", "completion": ""}),
    ("prompt_completion", {"prompt": [], "completion": [{"role": "assistant", "content": "Blue."}]}),
    ("preference", {"prompt": "The sky is", "chosen": None, "rejected": " green."}),
]
GOOD = {
    "text": {"text": "A document."},
    "alpaca": ALPACA[1],
    "chat": {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]},
    "prompt_completion": {"prompt": "The sky is", "completion": " blue."},
    "preference": {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
}


@pytest.mark.parametrize(("data_format", "empty"), EMPTY_ROWS)
def test_a_row_with_no_text_is_dropped_counted_and_named(tmp_path, data_format, empty):
    path = tmp_path / "rows.jsonl"
    good = GOOD[data_format]
    path.write_text(_jsonl([good, empty, good, empty]), encoding="utf-8")
    assert detected_format(path) == data_format
    dropped = Dropped()
    assert list(items(path, data_format, dropped=dropped)) == list(items(path, data_format))[:2]
    assert len(list(items(path, data_format))) == verify(path, data_format) == 2
    assert dropped.positions == [1, 3]
    assert check_file("data.train_file", str(path), data_format, max_bad_rows=0.5) == (  # 2 of 4: within the bound
        f"data.train_file: 2 row(s) with no text (null or empty, or an empty conversation) dropped: {path}:2, {path}:4"
    )


def test_the_warning_names_the_first_rows_in_every_container(tmp_path):
    rows = [ALPACA[1], *[{"instruction": "Summarise.", "output": None}] * 7]
    (tmp_path / "rows.json").write_text(json.dumps(rows, indent=2), encoding="utf-8")
    assert check_file("data.train_file", str(tmp_path / "rows.json"), "alpaca", max_bad_rows=1.0) == (
        "data.train_file: 7 row(s) with no text (null or empty, or an empty conversation) dropped: "
        + ", ".join(f"{tmp_path / 'rows.json'}:element {n} (line {2 + 4 * (n - 1)})" for n in range(2, 7))
        + ", ..."
    )
    pq.write_table(pa.Table.from_pylist([ALPACA[1], {"instruction": "Summarise.", "output": ""}]), tmp_path / "r.pq")
    (tmp_path / "rows.parquet").write_bytes((tmp_path / "r.pq").read_bytes())
    warning = check_file("data.train_file", str(tmp_path / "rows.parquet"), "alpaca", max_bad_rows=1.0)
    assert warning.endswith(f"dropped: {tmp_path / 'rows.parquet'}:row 2")


@pytest.mark.parametrize(
    ("data_format", "bad", "message"),
    [
        ("text", {"text": 5}, r"rows.jsonl:3: 'text' must be a string, got int"),
        ("alpaca", {"instruction": "Summarise."}, r"rows.jsonl:3: missing field\(s\) 'output'"),
        ("alpaca", {"instruction": "Summarise.", "output": ["a"]}, r"rows.jsonl:3: 'output' must be a string"),
        ("chat", {"messages": [{"role": "user"}]}, r"rows.jsonl:3: 'messages' must be a non-empty list of"),
        ("prompt_completion", {"completion": "c"}, r"rows.jsonl:3: missing field\(s\) 'prompt'"),
        ("preference", {"prompt": "p", "chosen": "a"}, r"rows.jsonl:3: missing field\(s\) 'rejected'"),
    ],
)
def test_a_malformed_row_is_still_refused_with_file_and_line(tmp_path, data_format, bad, message):
    """Beside a row with no text (dropped), a malformed one still refuses the file."""
    path = tmp_path / "rows.jsonl"
    empty = next(row for name, row in EMPTY_ROWS if name == data_format)
    path.write_text(_jsonl([GOOD[data_format], empty, bad]), encoding="utf-8")
    with pytest.raises(ValueError, match=f"data.train_file: .*{message}"):
        check_file("data.train_file", str(path), data_format, max_bad_rows=1.0)


def test_check_warns_of_the_dropped_rows_once(tmp_path, tiny_base_dir):
    """`check` (the check stage's call) reads data=own's file under three keys (training data, held-out part,
    in-domain set) and warns once; the file is not remembered as verified, so the next check warns again. One row
    in 123 is within the default data.max_bad_rows."""
    path = tmp_path / "rows.jsonl"
    path.write_text(_jsonl([*ALPACA * 60, {"instruction": "Summarise.", "output": None}, *ALPACA]), encoding="utf-8")
    overrides = [f"model.path={tiny_base_dir}", "launcher.accelerator=cpu", "tracking.uri="]
    overrides += ["data=own", f"data.train_file={path}", "data.max_seq_len=256"]
    cfg = config.Config(**config.compose(REPO / "conf", overrides))
    defaults = config.validate(config.compose(REPO / "conf"), "conf/")
    produced = [REPO / "data" / "corpus"]  # the default's en_wiki set, which prepare_corpus writes
    found = check(cfg, defaults=defaults, produced=produced, known=set(), tokenizer_memo=None, pinned={})
    assert found.errors == []
    dropped = [w for w in found.warnings if "with no text" in w]
    assert dropped == [
        f"data.train_file: 1 row(s) with no text (null or empty, or an empty conversation) dropped: {path}:121"
    ]
    assert not any(str(path) in identity for identity in found.verified)


def test_more_rows_with_no_text_than_data_max_bad_rows_refuse_the_file(tmp_path):
    """Past data.max_bad_rows (a share of the file's rows, kept and dropped) the rows with no text say the file is not
    what it seems: the check refuses it with the count, the first such row and the value that would drop them; at the
    bound it warns. A file of no row with text is refused as such at any bound, not as an empty file."""
    path = tmp_path / "rows.jsonl"
    empty = {"instruction": "Summarise.", "output": None}
    path.write_text(_jsonl([*ALPACA * 2, empty, *ALPACA * 46, ALPACA[0], empty, empty]), encoding="utf-8")  # 3 of 100
    warning = check_file("data.train_file", str(path), "alpaca", max_bad_rows=0.03)
    assert warning.startswith("data.train_file: 3 row(s) with no text") and warning.endswith(f"{path}:100")
    with pytest.raises(ValueError) as refused:
        check_file("data.train_file", str(path), "alpaca", max_bad_rows=0.02)
    assert str(refused.value) == (
        "data.train_file: 3 of 100 row(s) (3.0%) hold no text (null or empty, or an empty conversation), more than "
        f"data.max_bad_rows=0.02 of them; the first: {path}:5; expected rows with text, or -S data.max_bad_rows=0.03 "
        "to drop them"
    )
    with pytest.raises(
        ValueError, match=f"3 of 100 row.* more than data.max_bad_rows=0.0 of them; the first: {path}:5"
    ):
        check_file("data.train_file", str(path), "alpaca", max_bad_rows=0.0)
    path.write_text(_jsonl([empty] * 2), encoding="utf-8")  # not "empty": the file holds rows, none with text
    with pytest.raises(ValueError, match=r"rows.jsonl: none of its 2 row\(s\) holds text \(null or empty, or an"):
        check_file("data.train_file", str(path), "alpaca", max_bad_rows=1.0)


def test_the_check_stage_refuses_past_the_bound_without_a_traceback(tmp_path, tiny_base_dir):
    """The check stage (as dvc runs it) exits 2 with the refusal, said once for the file read under three keys, no
    traceback, and writes nothing."""
    path = tmp_path / "rows.jsonl"
    path.write_text(_jsonl([*ALPACA * 10, {"instruction": "Summarise.", "output": None}, *ALPACA]), encoding="utf-8")
    overrides = [f"model.path={tiny_base_dir}", "launcher.accelerator=cpu", "tracking.uri="]
    overrides += ["data=own", f"data.train_file={path}", "data.max_seq_len=256"]
    params = tmp_path / "params.yaml"
    params.write_text(yaml.safe_dump(config.compose(REPO / "conf", overrides)), encoding="utf-8")
    out = tmp_path / "checked.json"
    command = [sys.executable, "-m", "stages.check", "--params", str(params), "--out", str(out)]
    done = subprocess.run(
        [*command, "--produced", str(REPO / "data" / "corpus")], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert (
        "data.train_file: 1 of 23 row(s) (4.3%) hold no text (null or empty, or an empty conversation), more than "
        f"data.max_bad_rows=0.01 of them; the first: {path}:21; expected rows with text, or -S data.max_bad_rows=0.05"
    ) in done.stderr
    assert done.stderr.count("hold no text") == 1  # read as data.train_file, data.heldout_file, eval.sets.in_domain
    assert not out.exists()


def test_the_fields_a_json_file_s_format_does_not_read_are_named(tmp_path):
    """Nothing silent in JSON rows either: the fields of a JSONL or JSON array file's first row that its format does
    not read (an OpenAI row's metadata, an id) are named, those the format reads (LLaMA-Factory's system and history,
    OpenAI's tools) are not."""
    from pipeline.data.inputs import unused_columns

    alpaca = {"instruction": "Hi.", "input": "", "output": "Hello.", "system": "Be kind.", "history": [], "id": 7}
    (tmp_path / "alpaca.jsonl").write_text(json.dumps(alpaca) + "\n", encoding="utf-8")
    chat = {"messages": [{"role": "user", "content": "Hi."}], "tools": [], "parallel_tool_calls": False}
    (tmp_path / "chat.json").write_text(json.dumps([chat, {**chat, "metadata": {}}], indent=4), encoding="utf-8")
    (tmp_path / "plain.txt").write_text("a document\n", encoding="utf-8")
    assert unused_columns(tmp_path / "alpaca.jsonl", "alpaca") == ["id"]
    assert unused_columns(tmp_path / "chat.json", "chat") == ["parallel_tool_calls"]
    assert unused_columns(tmp_path / "plain.txt", "text") == []
