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
import sys
from pipeline.data.textio import verify
from tests.helpers.peak_memory import reset_peak, status_mb
before = reset_peak()
print(verify(sys.argv[1], "text"), int(status_mb("VmHWM") - before))
"""


def test_memory_does_not_grow_with_the_file(tmp_path):
    """The reader's high-water mark is a few of its 4 MB blocks (the bytes, their text, the text's lines): measured
    25 MB over a 10 MB file and 29 MB over 40 MB; read whole, the 40 MB file alone would take more than 100 MB."""
    line = ("人民日报社论。" * 20 + "\n").encode()
    grown = {}
    for size in (10, 40):
        path = tmp_path / f"{size}.txt"
        with path.open("wb") as out:
            for _ in range(size * 2**20 // len(line)):
                out.write(line)
        done = subprocess.run([sys.executable, "-c", PEAK, str(path)], cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        count, grown[size] = map(int, done.stdout.split())
        assert count == size * 2**20 // len(line)
    assert grown[40] < grown[10] + 8 and grown[40] < 40, f"{grown} MB over files of 10 and 40 MB"
