"""Tokenization of a stream of items (text documents, SFT rows or preference pairs) into part files in a work folder, a
chunk at a time, by worker processes on every core, resumably: a part is written under a temporary name and renamed, its
summary last, so a part whose summary exists is whole; a run killed after an hour starts again from the parts it
finished. The folder is keyed by everything the parts depend on (tokenizer, inputs, format, chunk size): a change of any
of them starts over. A part holds, as raw int32: `ids` (text: the documents' tokens, each ending with EOS; SFT: the
examples' tokens; preference: each kept pair's two examples, chosen then rejected), `lengths` (tokens per document or
example) and, for SFT and preference, `labels` (-100 on prompts)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from pipeline.data.inputs import Empty, Line, parsed

KEY_FILE = "key.json"


@dataclass(frozen=True)
class Job:
    """What the workers do to a chunk: the tokenizer folder, and the data format with its SFT settings."""

    tokenizer: str
    data_format: str
    template: str
    max_seq_len: int

    @property
    def family(self) -> str:
        return self.data_format if self.data_format in ("text", "preference") else "sft"


def chunks(items: Iterable, *, chunk_chars: int) -> Iterator[list]:
    """The items cut into lists of about `chunk_chars` characters (at least one item each)."""
    chunk, size = [], 0
    for item in items:
        chunk.append(item)
        size += _chars(item)
        if size >= chunk_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _chars(item) -> int:
    if isinstance(item, str):
        return len(item)
    if isinstance(item, Line):
        return len(item.text)
    if isinstance(item, Empty):
        return 0
    messages = item.get("messages") or []
    texts = [v for v in item.values() if isinstance(v, str)] + [m["content"] for m in messages]
    # a preference pair's responses given as assistant messages
    texts += [v["content"] for v in item.values() if isinstance(v, dict) and isinstance(v.get("content"), str)]
    return sum(map(len, texts))


def prepare(folder: Path, key: dict) -> None:
    """Keep the parts in `folder` if they were made for `key`, else start it empty."""
    path, key = folder / KEY_FILE, json.loads(json.dumps(key))  # as JSON keeps it (tuples are lists)
    if path.is_file() and json.loads(path.read_text(encoding="utf-8")) == key:
        return
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    path.write_text(json.dumps(key, sort_keys=True), encoding="utf-8")


def summary_path(folder: Path, index: int) -> Path:
    return folder / f"{index:06d}.json"


def array_path(folder: Path, index: int, name: str) -> Path:
    return folder / f"{index:06d}.{name}"


def done(folder: Path, index: int) -> dict | None:
    """The summary of part `index` if it is whole."""
    path = summary_path(folder, index)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def tokenize(folder: Path, job: Job, items: Iterable, *, total: int, workers: int, chunk_chars: int) -> list[dict]:
    """Tokenize `items` (`total` of them) into parts under `folder` (prepared), reusing the parts already whole;
    returns every part's summary in order. Progress (items, tokens/s, time left) goes to stderr."""
    progress = Progress(total)
    summaries: list[dict] = []
    pool = _pool(job, workers) if workers > 1 else None
    pending: deque[tuple[int, Future]] = deque()
    try:
        for index, chunk in enumerate(chunks(items, chunk_chars=chunk_chars)):
            if (summary := done(folder, index)) is not None:
                summaries.append({**summary, "reused": True})
                progress.add(summary, reused=True)
                continue
            if pool is None:
                summary = tokenize_part(folder, index, chunk, job)
                summaries.append(summary)
                progress.add(summary)
                continue
            pending.append((index, pool.submit(tokenize_part, folder, index, chunk)))
            while len(pending) >= 2 * workers:
                summaries.append(_settle(pending.popleft(), progress))
        while pending:
            summaries.append(_settle(pending.popleft(), progress))
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)
        progress.close()
    summaries.sort(key=lambda s: s["index"])
    return summaries


def _settle(entry: tuple[int, Future], progress: Progress) -> dict:
    summary = entry[1].result()
    progress.add(summary)
    return summary


def _pool(job: Job, workers: int) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(workers, mp_context=get_context("spawn"), initializer=_start_worker, initargs=(job,))


_WORKER: dict = {}


def _start_worker(job: Job) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: the workers are the parallelism
    _WORKER.update(job=job, tokenizer=_tokenizer(job))


def _tokenizer(job: Job):
    """The Rust tokenizer with its special tokens and template where it reads as transformers reads it (no torch in
    the worker), else the HF tokenizer."""
    from pipeline.data.tokenizer import light_tokenizer, load_tokenizer

    return light_tokenizer(Path(job.tokenizer)) or load_tokenizer(Path(job.tokenizer))


def tokenize_part(folder: Path, index: int, chunk: list, job: Job | None = None) -> dict:
    """Tokenize one chunk into part `index` (in a worker, with its tokenizer, or here with `job`'s); its rows with no
    text are dropped and counted."""
    if job is not None and _WORKER.get("job") != job:
        _WORKER.update(job=job, tokenizer=_tokenizer(job))
    job, tokenizer = _WORKER["job"], _WORKER["tokenizer"]
    found = [parsed(item, job.data_format) for item in chunk]
    chunk = [item for item in found if not isinstance(item, Empty)]
    if job.family == "text":
        arrays, summary = _text_part(tokenizer, chunk)
    else:
        arrays, summary = _sft_part(tokenizer, chunk, job)
    summary = {"index": index, "items": len(chunk), "dropped_rows": len(found) - len(chunk), **summary}
    for name, array in arrays.items():
        tmp = array_path(folder, index, f"{name}.tmp")
        array.astype(np.int32).tofile(tmp)
        tmp.replace(array_path(folder, index, name))
    tmp = summary_path(folder, index).with_suffix(".tmp")
    tmp.write_text(json.dumps(summary), encoding="utf-8")
    tmp.replace(summary_path(folder, index))
    return summary


def _text_part(tokenizer, documents: list[str]) -> tuple[dict[str, np.ndarray], dict]:
    from pipeline.data.encoding import tokenize_documents

    ids, lengths = tokenize_documents(tokenizer, documents)
    return {"ids": ids, "lengths": lengths}, {"tokens": int(len(ids))}


def _sft_part(tokenizer, rows: list[dict], job: Job) -> tuple[dict[str, np.ndarray], dict]:
    """SFT examples (prompt-completion rows: the completion), or a preference chunk's pairs as two examples each
    (`examples.arrays_for`)."""
    from pipeline.data.examples import arrays_for

    arrays, counts = arrays_for(job.data_format)(tokenizer, rows, template=job.template, max_seq_len=job.max_seq_len)
    return arrays, {**counts, "tokens": int(arrays["lengths"].sum())}


class Progress:
    """Items done of `total`, tokens/s and the time left, on stderr (every few seconds when not a terminal)."""

    def __init__(self, total: int):
        from tqdm import tqdm

        self.bar = tqdm(
            total=total,
            unit=" items",
            desc="cache_dataset",
            file=sys.stderr,
            mininterval=0.5 if sys.stderr.isatty() else 10,
            dynamic_ncols=True,
        )
        self.start, self.tokens = time.perf_counter(), 0

    def add(self, summary: dict, *, reused: bool = False) -> None:
        if not reused:
            self.tokens += summary["tokens"]
        seconds = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / seconds:,.0f} tokens/s", refresh=False)
        self.bar.update(summary["items"] + summary.get("dropped_rows", 0))

    def close(self) -> None:
        self.bar.close()


def key(job: Job, *, inputs: list[Path], limit: int, chunk_chars: int) -> dict:
    """What the parts depend on: the job, each input file's identity, the items used and the chunking."""
    tokenizer = Path(job.tokenizer)
    files = sorted(p for p in tokenizer.iterdir() if p.is_file())
    return {
        "job": asdict(job),
        "tokenizer_files": [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files],
        "inputs": [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in inputs],
        "items": limit,
        "chunk_chars": chunk_chars,
    }
