"""Reading a GGUF file through transformers without reading it again (`read_once` around every load of one file),
and its config and tokenizer without torch (`without_torch`)."""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import struct
import sys
import types
from collections.abc import Container, Iterator
from pathlib import Path


@contextlib.contextmanager
def read_once(*, hand_over_reader: bool = False) -> Iterator[None]:
    """Within it, transformers' whole read of a GGUF file's metadata (load_gguf_checkpoint without tensors: gguf's
    pure-Python reader over every field, the vocabulary's too) is made once per file, not for the config and again
    for the tokenizer and the model (4.6 s of CPU each for SmolLM2-135M's 49,152 tokens), and gguf's tensor-name
    table is built once, not for every module transformers' name map recurses into (about 400 times: 7.9 s, 0.03 s
    once; the cost grows with modules x layers). The table is read only; each caller gets its own copy of the
    metadata. With `hand_over_reader`, that first read's parsed GGUFReader is kept for the read of the tensors, which
    then does not parse every field again (a reader holds about 160 MB for those 49,152 tokens until then: for a
    caller that reads the tensors through transformers). Within an outer one: the outer's."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    if getattr(hf_gguf.load_gguf_checkpoint, "reads_once", False):
        yield
        return
    table, read, reader_class = gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint, gguf.GGUFReader
    kept: dict[str, dict] = {}
    readers: dict = {}  # the metadata read's GGUFReader (hand_over_reader), until the read of the tensors takes it

    def kept_reader(path, *args, **kwargs):
        return readers.setdefault(str(path), reader_class(path, *args, **kwargs))

    def handed_reader(path, *args, **kwargs):
        return readers.pop(str(path), None) or reader_class(path, *args, **kwargs)

    def reading_once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            with _reader(gguf, handed_reader):
                return read(path, return_tensors, **kwargs)
        if str(path) not in kept:
            with _reader(gguf, kept_reader if hand_over_reader else reader_class):
                kept[str(path)] = read(path, return_tensors=False)
        return copy.deepcopy(kept[str(path)])

    reading_once.reads_once = True
    gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint = functools.cache(table), reading_once  # looked up at call
    try:
        yield
    finally:
        gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint = table, read


@contextlib.contextmanager
def _reader(gguf, make) -> Iterator[None]:
    """gguf.GGUFReader made by `make` within (transformers imports it from gguf at each call)."""
    reader_class, gguf.GGUFReader = gguf.GGUFReader, make
    try:
        yield
    finally:
        gguf.GGUFReader = reader_class


SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY = 8, 9  # GGUF's value types other than the fixed-size ones


def read_metadata(path: str | Path, string_arrays: Container[str] = ()) -> tuple[dict, tuple[str, ...]]:
    """A GGUF file's metadata and tensor names, as transformers' `read_gguf_metadata` returns them (an array of
    strings not in `string_arrays` as its length), read with `struct` alone: transformers' reader imports torch."""
    with open(path, "rb") as file:

        def read(size: int) -> bytes:
            if len(data := file.read(size)) < size:
                raise ValueError(f"{path}: ends inside its metadata; expected a whole GGUF file")
            return data

        def take(fmt: str) -> tuple:
            return struct.unpack(fmt, read(struct.calcsize(fmt)))

        def string() -> str:
            return read(take("<Q")[0]).decode("utf-8")

        def value(kind: int, keep_strings: bool):
            if kind in SCALARS:
                return take(SCALARS[kind])[0]
            if kind == STRING:
                return string()
            if kind != ARRAY:
                raise ValueError(f"{path}: GGUF metadata value of unknown type {kind}")
            element, count = take("<IQ")
            if element in SCALARS:
                return list(take(f"<{count}{SCALARS[element][1]}"))
            if element != STRING:
                raise ValueError(f"{path}: GGUF metadata array of type {element}; expected numbers or strings")
            if keep_strings:
                return [string() for _ in range(count)]
            for _ in range(count):
                file.seek(take("<Q")[0], os.SEEK_CUR)
            return count

        if file.read(4) != b"GGUF":
            raise ValueError(f"{path}: does not start with GGUF's magic bytes; expected a GGUF file")
        _version, tensor_count, value_count = take("<IQQ")
        metadata = {}
        for _ in range(value_count):
            key = string()
            metadata[key] = value(take("<I")[0], key in string_arrays)
        names = []
        for _ in range(tensor_count):
            names.append(string())
            file.seek(8 * take("<I")[0] + 12, os.SEEK_CUR)  # dimensions, type, offset
    return metadata, tuple(names)


@contextlib.contextmanager
def without_torch() -> Iterator[None]:
    """Within it, transformers reads a GGUF file's config and tokenizer in a process where torch is absent
    (`imports.tokenizers_only`): its metadata reader module, which imports torch at its top, is `read_metadata`, and
    the config reader of the architectures it has no new reader for (LLaMA's: guarded by torch's presence, though it
    reads no tensor without `return_tensors`) reads `MetadataFields` instead of gguf's reader, which parses every
    value into numpy arrays (about 200 MB for a 49,152-token vocabulary). Where torch is importable: nothing to do."""
    if sys.modules.get("torch", False) is not None:
        yield
        return
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    reader_module = types.ModuleType(READER)
    reader_module.read_gguf_metadata = read_metadata
    before = sys.modules.get(READER)
    sys.modules[READER], guard, hf_gguf.is_torch_available = reader_module, hf_gguf.is_torch_available, lambda: True
    try:
        with _reader(gguf, MetadataFields):
            yield
    finally:
        hf_gguf.is_torch_available = guard
        if before is None:
            del sys.modules[READER]
        else:
            sys.modules[READER] = before


READER = "transformers.integrations.gguf.reader"


class MetadataFields:
    """What transformers' config reader reads of gguf's GGUFReader (`fields`: parts, indexes of the values among
    them, types; `tensors`: names), made from `read_metadata`: a value's part is its bytes or a 1-tuple."""

    def __init__(self, path: str | Path, *_args, **_kwargs):
        metadata, names = read_metadata(path, string_arrays=_AllKeys())
        self.fields = {key: _field(value) for key, value in metadata.items()}
        self.tensors = [types.SimpleNamespace(name=name) for name in names]


class _AllKeys:
    def __contains__(self, _key: object) -> bool:
        return True


def _field(value) -> types.SimpleNamespace:
    def part(item):
        return item.encode("utf-8") if isinstance(item, str) else (item,)

    def kind(item) -> int:
        if isinstance(item, str):
            return STRING
        return {bool: 7, int: 11, float: 12}[type(item)]

    if isinstance(value, list):
        element = kind(value[0]) if value else 11
        return types.SimpleNamespace(parts=[part(v) for v in value], data=range(len(value)), types=[ARRAY, element])
    return types.SimpleNamespace(parts=[part(value)], data=[0], types=[kind(value)])
