"""The check stage's streaming reader (`textio.verify`) refuses what `read_data` refuses, with the same message
(file, line, byte offset), counts what it reads, and holds one line at a time."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pipeline.data.textio import read_data, verify
from tests.conftest import REPO

CASES = [
    ("text", "one\n\n two \r\nthree\u2028four\rfive\n".encode()),
    ("text", b"ok\ncaf\xe9\n"),
    ("text", b"ok\nline\r\n\xff\xfe\n"),
    ("text", b" \n\t\n"),
    ("text", b""),
    ("alpaca", b'{"instruction": "a", "output": "b"}\n\n{"instruction": "c"}\n'),
    ("alpaca", b'{"instruction": "a", "output": "b"}\r\n[1]\n'),
    ("chat", b'{"messages": [{"role": "user", "content": "hi"}]}\n{"messages": []}\n'),
    ("chat", b'{"messages": [{"role": "user", "content": "hi"}]}\nnot json\n'),
    ("texts", b'{"a": "x"}\n{"b": 1}\n'),
]


@pytest.mark.parametrize(("data_format", "content"), CASES)
def test_verify_refuses_what_read_data_refuses_with_the_same_message(tmp_path, data_format, content):
    path = tmp_path / ("data.txt" if data_format == "text" else "data.jsonl")
    path.write_bytes(content)
    try:
        expected = len(read_data(path, data_format))
    except ValueError as err:
        with pytest.raises(ValueError) as got:
            verify(path, data_format)
        assert str(got.value) == str(err)
    else:
        assert verify(path, data_format) == expected


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.txt: data file not found"):
        verify(tmp_path / "nothing.txt", "text")


PEAK = """
import resource, sys
from pipeline.data.textio import verify
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(verify(sys.argv[1], "text"), (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_memory_does_not_grow_with_the_file(tmp_path):
    """40 MB of text: the reader's high-water mark grows by a few MB, not by the file (read whole: 100 MB and more)."""
    path = tmp_path / "big.txt"
    line = ("人民日报社论。" * 20 + "\n").encode()
    with path.open("wb") as out:
        for _ in range(40 * 2**20 // len(line)):
            out.write(line)
    done = subprocess.run([sys.executable, "-c", PEAK, str(path)], cwd=REPO, capture_output=True, text=True, check=True)
    count, grown_mb = map(int, done.stdout.split())
    assert count == 40 * 2**20 // len(line)
    assert grown_mb < 8, f"{grown_mb} MB for a 40 MB file"
