"""cache_dataset's memory is set by its chunk, not by the corpus: the high-water mark of its largest process (the
stage or a worker, as the kernel counts it) on a 40 MB input is within a stated bound of that on a 5 MB input, for
text and for SFT rows. Read whole, the 40 MB text alone would cost 600 MB more (about 104 bytes a token before)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from bench.common import run_measured
from pipeline.core import config
from tests.conftest import REPO

pytestmark = pytest.mark.integration
BOUND_MB = 40  # what may differ between the two sizes: allocator slack, the split indices, a longer progress line


def _text(path: Path, documents: list[str], megabytes: int) -> Path:
    block = ("\n".join(documents) + "\n").encode()
    with path.open("wb") as out:
        for _ in range(megabytes * 2**20 // len(block) + 1):
            out.write(block)
    return path


def _rows(path: Path, documents: list[str], megabytes: int) -> Path:
    pairs = [
        {"instruction": q, "input": "", "output": a} for q, a in zip(documents[:-1:2], documents[1::2], strict=False)
    ]
    block = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in pairs).encode()
    with path.open("wb") as out:
        for _ in range(megabytes * 2**20 // len(block) + 1):
            out.write(block)
    return path


def _peak_mb(tmp_path: Path, tokenizer: Path, base: Path, data: Path, data_format: str) -> tuple[float, dict]:
    raw = config.compose(REPO / "conf", ["tracking.uri=", "data.block_size=256", "data.max_seq_len=256"])
    raw["data"] |= {"train_file": str(data), "heldout_file": str(data), "format": data_format}
    params = tmp_path / f"{data.stem}.yaml"
    params.write_text(yaml.safe_dump(raw))
    out, metrics = tmp_path / f"{data.stem}_dataset", tmp_path / f"{data.stem}.json"
    command = [
        sys.executable, "-m", "stages.cache_dataset", "--params", str(params), "--tokenizer", str(tokenizer),
        "--base-config", str(base / "config.json"), "--out", str(out), "--metrics", str(metrics),
        "--run-id-file", str(tmp_path / "run.json"), "--workers", "2", "--chunk-chars", "1000000",
    ]  # fmt: skip
    _, peak, _ = run_measured(command)
    return peak, json.loads(metrics.read_text())


@pytest.mark.parametrize("data_format", ["text", "alpaca"])
def test_peak_memory_does_not_grow_with_the_corpus(
    tmp_path, smol_tokenizer_dir, tiny_base_dir, peoples_daily, data_format
):
    write = _text if data_format == "text" else _rows
    peaks = {}
    for megabytes in (5, 40):
        data = write(
            tmp_path / f"corpus_{megabytes}mb.{'txt' if data_format == 'text' else 'jsonl'}", peoples_daily, megabytes
        )
        peaks[megabytes], figures = _peak_mb(tmp_path, smol_tokenizer_dir, tiny_base_dir, data, data_format)
        assert figures["tokens"] > 0 and figures["parts"] >= megabytes // 4
    print(f"cache_dataset {data_format}: largest process peak 5 MB: {peaks[5]:.0f} MB, 40 MB: {peaks[40]:.0f} MB")
    assert peaks[40] - peaks[5] < BOUND_MB, peaks
