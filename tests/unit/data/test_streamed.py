"""The streamed cache_dataset (`streamed.build`) writes the bytes the in-memory builders write (save_to_disk's
layout), for any chunk size and number of workers, from every form of input users have (folders, globs, JSONL,
Parquet, compressed; rows with no text among them), and it resumes from the parts a killed run finished."""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import sys
import time
from itertools import islice
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipeline.check import check_file
from pipeline.core import config
from pipeline.data import streamed
from pipeline.data.assembly import Packing
from pipeline.data.inputs import items
from pipeline.data.mixing import Source
from pipeline.data.textio import held_out_count, verify
from pipeline.data.tokenizer import load_tokenizer
from tests.conftest import REPO
from tests.helpers.datasets import build_instruction, build_pretraining, mix_instruction, mix_text, save_splits


@pytest.fixture(scope="module")
def smol(smol_tokenizer_dir):
    return load_tokenizer(smol_tokenizer_dir)


def packing(data_format: str = "text", tail: str = "drop", template: str = "alpaca") -> Packing:
    return Packing(data_format, 64, tail, template, 96, validation_fraction=0.1, seed=3)


def folder_bytes(folder: Path) -> dict[str, object]:
    """Every file of a dataset folder, state.json without its fingerprint (a digest computed another way)."""
    found = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            content = path.read_bytes()
            if path.name == "state.json":
                content = {k: v for k, v in json.loads(content).items() if k != "_fingerprint"}
            found[str(path.relative_to(folder))] = content
    return found


def stream(tmp_path, smol_tokenizer_dir, spec, pack, *, workers=1, chunk_chars=10**9, heldout=None, name="s"):
    out = tmp_path / name
    figures = streamed.build(
        out,
        tokenizer_dir=smol_tokenizer_dir,
        train_file=str(spec),
        heldout_fraction=heldout,
        packing=pack,
        work=tmp_path / f"{name}.parts",
        workers=workers,
        chunk_chars=chunk_chars,
    )
    return out, figures


@pytest.mark.parametrize(("tail", "workers", "chunk_chars"), [("drop", 1, 10**9), ("drop", 2, 4000), ("pad", 1, 777)])
def test_text_equals_the_in_memory_build(tmp_path, smol, smol_tokenizer_dir, peoples_daily, tail, workers, chunk_chars):
    documents = peoples_daily[:300]
    (tmp_path / "pd.txt").write_text("\n".join(documents) + "\n", encoding="utf-8")
    pack = packing(tail=tail)
    tables, stats = build_pretraining(smol, documents, block_size=64, tail=tail, validation_fraction=0.1, seed=3)
    save_splits(tmp_path / "reference", tables)
    out, figures = stream(
        tmp_path, smol_tokenizer_dir, tmp_path / "pd.txt", pack, workers=workers, chunk_chars=chunk_chars
    )
    assert folder_bytes(out) == folder_bytes(tmp_path / "reference")
    assert {k: figures[k] for k in stats} == pytest.approx(stats)
    assert figures["parts"] > (1 if chunk_chars < 10**5 else 0)
    blocks = figures["blocks"]
    assert figures["tokens"] == blocks * 64 - figures["tokens_padded"] + figures["tokens_dropped"]  # every token
    assert (figures["tokens_padded"] > 0) == (tail == "pad") and (figures["tokens_dropped"] > 0) == (tail == "drop")


@pytest.mark.parametrize(("workers", "chunk_chars"), [(1, 10**9), (2, 4000)])
def test_whole_documents_equal_the_in_memory_build(tmp_path, smol, smol_tokenizer_dir, peoples_daily, workers,
                                                   chunk_chars):  # fmt: skip
    """data.packing=documents: a row per document, those past the block cut into blocks and their rest, every token
    of the stream in a row but a lone last EOS; the same bytes streamed as built in memory."""
    documents = peoples_daily[:300]
    (tmp_path / "pd.txt").write_text("\n".join(documents) + "\n", encoding="utf-8")
    tables, stats = build_pretraining(smol, documents, block_size=64, tail="drop", validation_fraction=0.1, seed=3,
                                      packing="documents")  # fmt: skip
    save_splits(tmp_path / "reference", tables)
    pack = Packing("text", 64, "drop", "alpaca", 96, validation_fraction=0.1, seed=3, packing="documents")
    out, figures = stream(tmp_path, smol_tokenizer_dir, tmp_path / "pd.txt", pack, workers=workers,
                          chunk_chars=chunk_chars)  # fmt: skip
    assert folder_bytes(out) == folder_bytes(tmp_path / "reference")
    assert {k: figures[k] for k in stats} == pytest.approx(stats)
    lengths = [len(ids) for table in tables.values() for ids in table.column("input_ids").to_pylist()]
    assert max(lengths) == 64 and min(lengths) >= 2 and len(set(lengths)) > 20
    assert stats["documents_cut"] > 0 and stats["rows"] == len(lengths)
    assert sum(lengths) + stats["tokens_dropped"] == stats["tokens"]


def test_document_rows_keep_documents_whole_up_to_the_block():
    from pipeline.data.whole_documents import document_rows

    starts, sizes, figures = document_rows([5, 10, 21, 1, 3], 10)  # 21 = 10 + 10 + 1: its last token left out
    assert starts.tolist() == [0, 5, 15, 25, 37] and sizes.tolist() == [5, 10, 10, 10, 3]
    assert figures == {"rows": 5, "documents_cut": 1, "tokens_dropped": 2}  # and the one-token document


@pytest.mark.parametrize("template", ["alpaca", "chat"])
def test_sft_equals_the_in_memory_build(tmp_path, smol, smol_tokenizer_dir, peoples_daily, template):
    rows = [
        {"instruction": q, "input": "", "output": a}
        for q, a in zip(peoples_daily[:120], peoples_daily[1:121], strict=True)
    ]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    tables, stats = build_instruction(
        smol, rows[:-12], template=template, max_seq_len=96, validation_fraction=0.1, seed=3
    )
    save_splits(tmp_path / "reference", tables)
    for workers, chunk_chars in ((1, 10**9), (2, 3000)):
        out, figures = stream(
            tmp_path, smol_tokenizer_dir, tmp_path / "sft.jsonl", packing("alpaca", template=template),
            workers=workers, chunk_chars=chunk_chars, heldout=0.1, name=f"s{workers}",
        )  # fmt: skip
        assert folder_bytes(out) == folder_bytes(tmp_path / "reference")
        assert {k: figures[k] for k in stats} == pytest.approx(stats)


def test_folders_globs_jsonl_parquet_and_compression_read_as_one_plain_file(
    tmp_path, smol, smol_tokenizer_dir, peoples_daily
):
    documents = peoples_daily[:240]
    parts = [documents[:60], documents[60:120], documents[120:180], documents[180:]]
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    with gzip.open(corpus / "a.txt.gz", "wt", encoding="utf-8") as file:
        file.write("\n\n".join(parts[0]) + "\n")
    with pa.output_stream(str(corpus / "b.jsonl.zst"), compression="zstd") as file:
        file.write("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(parts[1])).encode())
    pq.write_table(pa.table({"text": parts[2], "n": list(range(60))}), corpus / "c.parquet", row_group_size=7)
    (corpus / "sub" / "d.txt").write_text("\n".join(parts[3]), encoding="utf-8")
    (corpus / "README.md").write_text("not data")
    (tmp_path / "plain.txt").write_text("\n".join(documents) + "\n", encoding="utf-8")
    reference, _ = stream(tmp_path, smol_tokenizer_dir, tmp_path / "plain.txt", packing(), name="plain")
    for spec in (corpus, f"{corpus}/**/*.*[!d]"):
        out, figures = stream(tmp_path, smol_tokenizer_dir, spec, packing(), name=f"s{len(str(spec))}")
        assert figures["documents"] == 240
        assert folder_bytes(out) == folder_bytes(reference)


@pytest.mark.parametrize(("workers", "chunk_chars"), [(1, 10**9), (2, 200)])
def test_rows_with_no_text_change_nothing_but_the_counts(tmp_path, smol_tokenizer_dir, workers, chunk_chars):
    """Rows with no text, wherever they lie (a chunk's edge, either side of the held-out boundary), are dropped: the
    dataset is the bytes of the file without them, the training part ends where eval_set's held-out part starts
    (both of the rows the check counts), and the dropped rows of each part are counted."""
    good = [{"prompt": f"Question {i}: what follows {i}?", "completion": f" {i + 1}."} for i in range(40)]
    empty = {"prompt": "Nothing to learn", "completion": None}
    dirty = [*good[:3], empty, *good[3:36], empty, empty, *good[36:], empty]  # 36 trained, 4 held out
    for name, rows in (("clean", good), ("dirty", dirty)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    path = tmp_path / "dirty.jsonl"
    warning = check_file("data.train_file", str(path), "prompt_completion", max_bad_rows=0.1)  # 4 of 44 rows
    assert warning.startswith("data.train_file: 4 row(s) with no text") and f"{path}:4, {path}:38" in warning
    count = verify(path, "prompt_completion")
    held_out = list(islice(items(path, "prompt_completion"), count - held_out_count(count, 0.1), None))  # eval_set
    assert (count, held_out) == (40, good[36:])
    pack = packing("prompt_completion")
    built = {}
    for name in ("clean", "dirty"):
        built[name] = stream(tmp_path, smol_tokenizer_dir, tmp_path / f"{name}.jsonl", pack, workers=workers,
                             chunk_chars=chunk_chars, heldout=0.1, name=name)  # fmt: skip
    assert folder_bytes(built["dirty"][0]) == folder_bytes(built["clean"][0])
    (_, clean), (_, figures) = built["clean"], built["dirty"]
    assert figures["documents"] == clean["documents"] == 36 and figures["examples"] == 36
    assert figures["dropped_rows"] == {"training_part": 1, "heldout_part": 3}  # eval_set's 4 rows less these 3
    assert clean["dropped_rows"] == {"training_part": 0, "heldout_part": 0}


def test_bad_rows_are_named_and_nothing_is_written(tmp_path, smol, smol_tokenizer_dir):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.jsonl").write_text('{"text": "fine"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"a.jsonl:2: a JSON object in a text source without a 'text' field"):
        stream(tmp_path, smol_tokenizer_dir, tmp_path / "corpus", packing())
    assert not (tmp_path / "s").exists()
    with pytest.raises(FileNotFoundError, match=r"no file matches this glob"):
        stream(tmp_path, smol_tokenizer_dir, tmp_path / "nothing*.txt", packing())


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_parts_and_writes_the_uninterrupted_bytes(
    tmp_path, tiny_base_dir, smol_tokenizer_dir, peoples_daily
):
    (tmp_path / "pd.txt").write_text("\n".join(peoples_daily[:3000]) + "\n", encoding="utf-8")
    raw = config.compose(REPO / "conf", ["tracking.uri=", "data.block_size=64"])
    raw["data"] |= {"train_file": str(tmp_path / "pd.txt"), "heldout_file": str(tmp_path / "pd.txt")}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))

    def command(out: str) -> list[str]:
        return [
            sys.executable, "-m", "stages.cache_dataset", "--params", str(tmp_path / "params.yaml"),
            "--tokenizer", str(smol_tokenizer_dir), "--base-config", str(tiny_base_dir / "config.json"),
            "--out", str(tmp_path / out), "--metrics", str(tmp_path / f"{out}.json"),
            "--run-id-file", str(tmp_path / "run.json"), "--workers", "1", "--chunk-chars", "2000",
        ]  # fmt: skip

    subprocess.run(command("whole"), cwd=REPO, check=True, capture_output=True)
    killed = subprocess.Popen(command("resumed"), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    work = tmp_path / ".resumed.parts"
    deadline = time.monotonic() + 120
    while len(list(work.glob("*.json"))) < 12 and killed.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert not (tmp_path / "resumed").exists(), "killed before it finished"
    finished = len(list(work.glob("0*.json")))
    subprocess.run(command("resumed"), cwd=REPO, check=True, capture_output=True)
    assert folder_bytes(tmp_path / "resumed") == folder_bytes(tmp_path / "whole")
    figures = json.loads((tmp_path / "resumed.json").read_text())
    assert figures["parts_reused"] == finished >= 10 and figures["parts"] > figures["parts_reused"]
    assert not work.exists(), "the parts are removed once the dataset is written"


@pytest.mark.slow
@pytest.mark.parametrize("family", ["text", "sft"])
def test_mixes_equal_the_in_memory_mix(tmp_path, smol, smol_tokenizer_dir, peoples_daily, family):
    """The streamed mix of `data.sources` (each source in parts of its own, rows read across them) writes the bytes
    and figures of mixing.mix_text / mix_instruction."""
    if family == "text":
        contents = [peoples_daily[:300], peoples_daily[300:380]]
        sources = [Source("pd", tmp_path / "pd.txt", "text", 3.0), Source("more", tmp_path / "more", "text", 1.0)]
        (tmp_path / "pd.txt").write_text("\n".join(contents[0]) + "\n", encoding="utf-8")
        (tmp_path / "more").mkdir()
        (tmp_path / "more" / "a.txt").write_text("\n".join(contents[1][:30]) + "\n", encoding="utf-8")
        (tmp_path / "more" / "b.txt").write_text("\n".join(contents[1][30:]) + "\n", encoding="utf-8")
        tables, stats = mix_text(
            smol, sources, contents, block_size=64, tail="pad", validation_fraction=0.1, seed=3
        )  # fmt: skip
        pack = packing(tail="pad")
    else:
        alpaca = [
            {"instruction": q, "input": "", "output": a}
            for q, a in zip(peoples_daily[:80], peoples_daily[1:81], strict=True)
        ]
        chat = [
            {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for q, a in zip(peoples_daily[100:150], peoples_daily[101:151], strict=True)
        ]
        contents = [alpaca, chat]
        sources = [Source("a", tmp_path / "a.jsonl", "alpaca", 1.0), Source("c", tmp_path / "c.jsonl", "chat", 2.0)]
        for source, rows in zip(sources, contents, strict=True):
            source.file.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        tables, stats = mix_instruction(
            smol, sources, contents, template="chat", max_seq_len=96, validation_fraction=0.1, seed=3
        )
        pack = packing("alpaca", template="chat")
    save_splits(tmp_path / "reference", tables)
    out = tmp_path / "streamed"
    figures = streamed.build_mix(
        out, tokenizer_dir=smol_tokenizer_dir, sources=sources, packing=pack, work=tmp_path / "parts", workers=2,
        chunk_chars=2500,
    )  # fmt: skip
    assert folder_bytes(out) == folder_bytes(tmp_path / "reference")
    assert figures.pop("sources") == stats.pop("sources")
    assert {k: figures[k] for k in stats} == pytest.approx(stats)
