"""A JSON array of rows (Stanford Alpaca's `alpaca_data.json`, LLaMA-Factory's files) read an element at a time, and a
JSON object of objects (chitchat_dataset's `dataset.json`) a member at a time, from a binary stream: memory holds a
block of the file and the value being read, never the file. Errors name the element (or member) and the line it
starts on."""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Iterator
from typing import BinaryIO

BLOCK = 1 << 22  # bytes read (and decoded) at a time
MAX_ELEMENT_CHARS = 1 << 26  # a longer element is refused (else a broken one would be read to the end of the file)
_BLANK = re.compile(r"[ \t\n\r]*")  # JSON's whitespace


def opens_array(file: BinaryIO) -> bool:
    """Whether the stream's first non-blank character opens a JSON array."""
    while block := file.read(4096):
        if stripped := block.lstrip():
            return stripped.startswith(b"[")
    return False


def elements(file: BinaryIO, name: str) -> Iterator[tuple[int, int, dict]]:
    """(element number, line, object) of the JSON array in `file` (`name` in errors), from its start."""
    decoder, text = json.JSONDecoder(), _Text(file, name)
    for number, line in _entries(text, "[]", "a JSON array", "element"):
        yield number, line, _value(decoder, text, f"{name}:element {number} (line {line})", dict)


def members(file: BinaryIO, name: str) -> Iterator[tuple[str, dict]]:
    """(key, object) of the JSON object of objects in `file` (`name` in errors), in the file's order."""
    decoder, text = json.JSONDecoder(), _Text(file, name)
    for number, line in _entries(text, "{}", "a JSON object", "member"):
        at = f"{name}:member {number} (line {line})"
        key = _value(decoder, text, at, str)
        text.expect(":", f"':' after member {number}'s key")
        text.skip()
        yield key, _value(decoder, text, at, dict)


def _entries(text: _Text, brackets: str, what: str, entry: str) -> Iterator[tuple[int, int]]:
    """(number, line) of each entry of the array or object (`brackets`) opened at the reading position, which is at
    the entry's start when it is yielded; the caller reads the entry before asking for the next."""
    opening, closing = brackets
    text.expect(opening, what)
    number = 0
    if text.skip() == closing:
        text.close()
        return
    while True:
        number += 1
        text.skip()
        yield number, text.lines
        if text.skip() == closing:
            text.close()
            return
        text.expect(",", f"',' or '{closing}' after {entry} {number}")


def _value(decoder: json.JSONDecoder, text: _Text, at: str, kind: type) -> dict | str:
    """The value (of `kind`) at the reading position, more blocks read while it is incomplete."""
    while True:
        try:
            value, end = decoder.raw_decode(text.buffer, text.pos)
            break
        except json.JSONDecodeError as err:
            near_end = err.pos >= len(text.buffer) - 8 or err.msg.startswith("Unterminated string")
            if not (near_end and text.more()):
                raise ValueError(f"{at}: invalid JSON ({err.msg})") from None
        if len(text.buffer) - text.pos > MAX_ELEMENT_CHARS:
            raise ValueError(f"{at}: an element longer than {MAX_ELEMENT_CHARS:,} characters, or not closed")
    if not isinstance(value, kind):
        expected = "a JSON object" if kind is dict else "a JSON string"
        raise ValueError(f"{at}: expected {expected}, got {type(value).__name__}")
    text.advance(end)
    return value


class _Text:
    """The stream's text read forward a block at a time: `buffer[pos:]` is what is left of the blocks read so far;
    `lines` counts the lines the reading position has passed (1-based)."""

    def __init__(self, file: BinaryIO, name: str):
        self.file, self.name = file, name
        self.decoder = codecs.getincrementaldecoder("utf-8")()
        self.buffer, self.pos, self.lines, self.eof = "", 0, 1, False

    def more(self) -> bool:
        """Read the next block onto the buffer (dropping what was read past); False at the end of the file."""
        if self.eof:
            return False
        block = self.file.read(BLOCK)
        self.eof = not block
        try:
            decoded = self.decoder.decode(block, final=self.eof)
        except UnicodeDecodeError:
            raise ValueError(f"{self.name}:{self.lines}: invalid UTF-8 after this line; expected UTF-8 text") from None
        self.buffer, self.pos = self.buffer[self.pos :] + decoded, 0
        return bool(block)

    def advance(self, end: int) -> None:
        self.lines += self.buffer.count("\n", self.pos, end)
        self.pos = end

    def skip(self) -> str:
        """Pass whitespace; the next character ('' at the end of the file)."""
        while True:
            self.advance(_BLANK.match(self.buffer, self.pos).end())
            if self.pos < len(self.buffer):
                return self.buffer[self.pos]
            if not self.more():
                return ""

    def expect(self, char: str, what: str) -> None:
        found = self.skip()
        if found != char:
            shown = repr(found) if found else "the end of the file"
            raise ValueError(f"{self.name}:{self.lines}: expected {what}, found {shown}")
        self.advance(self.pos + 1)

    def close(self) -> None:
        """The end of the array (or object): nothing but whitespace may follow."""
        closing = self.buffer[self.pos]
        self.advance(self.pos + 1)
        if self.skip():
            kind = "array" if closing == "]" else "object"
            raise ValueError(f"{self.name}:{self.lines}: text after the JSON {kind}'s closing {closing!r}")
