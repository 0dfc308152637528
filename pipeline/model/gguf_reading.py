"""Reading a GGUF file through transformers without reading it again: `read_once` around every load of one file."""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator


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
