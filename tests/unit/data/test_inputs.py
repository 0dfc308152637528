"""Input files as Windows editors and spreadsheets write them: a file's leading UTF-8 byte order mark is not text (and
nothing else of the text changes). Read through the functions the check and the stages call."""

from __future__ import annotations

import codecs
import gzip
import json

import pytest

from pipeline.check import check_file
from pipeline.data.inputs import detected_format, items
from pipeline.data.textio import verify

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
    check_file("data.train_file", str(marked), data_format)
    if data_format == "text":
        assert list(items(marked, "text"))[0] == "中国人民站起来了。"


def test_only_the_file_s_leading_mark_is_dropped(tmp_path):
    """A mark past the file's start is the text's own (U+FEFF in a document), or a JSONL line that is not JSON."""
    (tmp_path / "notes.txt").write_bytes(BOM + b"first\n" + BOM + b"second\n")
    assert list(items(tmp_path / "notes.txt", "text")) == ["first", "\ufeffsecond"]
    (tmp_path / "rows.jsonl").write_bytes(BOM + _jsonl(ALPACA[:1]).encode() + BOM + _jsonl(ALPACA[1:]).encode())
    with pytest.raises(ValueError, match=r"rows.jsonl:2: invalid JSON \(Unexpected UTF-8 BOM"):
        check_file("data.train_file", str(tmp_path / "rows.jsonl"), "alpaca")
