"""CSV, TSV and Arrow files as their own libraries write them (Python's csv module, pandas' to_csv, datasets'
save_to_disk and ArrowWriter) are read as the rows they hold, in order, with their fields, through the functions the
check and the stages call: a CSV's header, ids and other columns never reach the trained text (the check names the
columns a format does not read), a DatasetDict folder trains on its `train` split and holds out its `test` split, and
a folder of datasets' layout that is not a saved dataset is refused saying what was expected."""

from __future__ import annotations

import argparse
import csv
import gzip
import json

import pandas as pd
import pytest
from datasets import Dataset, DatasetDict
from datasets.arrow_writer import ArrowWriter

from pipeline.check import check, check_file
from pipeline.core import config
from pipeline.data import streamed, tables
from pipeline.data.assembly import Packing
from pipeline.data.inputs import Dropped, detected_format, heldout_path, items, stored_files, unused_columns
from pipeline.data.textio import verify
from stages import eval_set
from tests.conftest import REPO

DOCUMENTS = [  # a comma, a quote and a newline inside quoted fields, non-ASCII text
    {"id": "1", "text": "Hello, world: a field with a comma.", "source": "web"},
    {"id": "2", "text": 'She said "yes",\nthen left.', "source": "book, vol. 2"},
    {"id": "007", "text": "中国人民站起来了。", "source": "news"},
]
ALPACA = [
    {"instruction": "Name a colour, then a fruit.", "input": "", "output": "Red, then apple."},
    {"instruction": "Summarise:", "input": 'A "long"\ntext, in two lines.', "output": "Short."},
]


def python_csv(path, rows: list[dict], *, delimiter: str = ",") -> None:
    """As Python's csv module writes it (RFC 4180 quoting, CRLF rows), with Excel's byte order mark."""
    with path.open("w", newline="", encoding="utf-8-sig") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]), delimiter=delimiter)
        writer.writeheader()
        writer.writerows(rows)


def texts_of(rows: list[dict]) -> list[str]:
    return [row["text"].strip() for row in rows]


@pytest.mark.parametrize("name", ["docs.csv", "docs.tsv", "docs.csv.gz"])
def test_a_csv_s_text_column_is_the_text_and_nothing_else(tmp_path, name):
    plain = tmp_path / "plain"
    python_csv(plain, DOCUMENTS, delimiter="\t" if ".tsv" in name else ",")
    path = tmp_path / name
    path.write_bytes(gzip.compress(plain.read_bytes()) if name.endswith(".gz") else plain.read_bytes())
    assert detected_format(path) == "text"
    assert list(items(path, "text")) == texts_of(DOCUMENTS)  # no header, id or source among them
    assert verify(path, "text") == 3
    assert check_file("data.train_file", str(path), "text", max_bad_rows=0.01) is None
    assert unused_columns(path, "text") == ["id", "source"]
    assert list(items(path, "jsonl")) == DOCUMENTS  # every cell the string it holds: "007" stays "007"


def test_pandas_csv_and_tsv_rows_are_read_as_their_format(tmp_path):
    frame = pd.DataFrame(ALPACA)
    frame.to_csv(tmp_path / "rows.csv")  # pandas' default: the index as an unnamed first column
    frame.to_csv(tmp_path / "rows.tsv", sep="\t", index=False)
    for path in (tmp_path / "rows.csv", tmp_path / "rows.tsv"):
        assert detected_format(path) == "alpaca"
        assert [{field: row[field] for field in ALPACA[0]} for row in items(path, "alpaca")] == ALPACA
    assert list(items(tmp_path / "rows.tsv", "alpaca")) == ALPACA
    assert unused_columns(tmp_path / "rows.csv", "alpaca") == [""]
    assert unused_columns(tmp_path / "rows.tsv", "alpaca") == []


def test_an_empty_cell_is_a_dropped_row_and_a_broken_row_is_refused(tmp_path):
    path = tmp_path / "docs.csv"
    python_csv(path, [DOCUMENTS[0], {"id": "2", "text": "", "source": "web"}, DOCUMENTS[2]])
    dropped = Dropped()
    assert list(items(path, "text", dropped=dropped)) == texts_of([DOCUMENTS[0], DOCUMENTS[2]])
    assert check_file("data.train_file", str(path), "text", max_bad_rows=1.0).endswith(f"dropped: {path}:row 2")
    (tmp_path / "bad.csv").write_text("id,text\n1,fine\n2,a, stray comma\n", encoding="utf-8")
    with pytest.raises(
        ValueError,
        match=r"train_file: .*bad.csv: CSV parse error: Row #3: Expected 2 columns, got 3: 2,a, stray comma; expected",
    ):
        check_file("data.train_file", str(tmp_path / "bad.csv"), "text", max_bad_rows=0.01)
    python_csv(tmp_path / "long.csv", [DOCUMENTS[0], {**DOCUMENTS[1], "text": "a, b\n" * (tables.CSV_BLOCK // 2)}])
    with pytest.raises(ValueError, match=r"long.csv: a row longer than 4 MB \(after row 1\); expected shorter rows"):
        check_file("data.train_file", str(tmp_path / "long.csv"), "text", max_bad_rows=0.01)
    python_csv(tmp_path / "rows.csv", [{"instruction": row["instruction"]} for row in ALPACA])
    with pytest.raises(ValueError, match=r"rows.csv: no column\(s\) 'output' \(it has \['instruction'\]\)"):
        check_file("data.train_file", str(tmp_path / "rows.csv"), "alpaca", max_bad_rows=0.01)
    python_csv(tmp_path / "chat.csv", [{"messages": ""}, {"messages": '[{"role": "user", "content": "Hi"}]'}])
    with pytest.raises(ValueError, match=r"chat.csv:row 2: 'messages' must be a non-empty list of messages"):
        check_file("data.train_file", str(tmp_path / "chat.csv"), "chat", max_bad_rows=0.01)


def test_streamed_build_of_a_csv_trains_the_text_column_only(tmp_path, smol_tokenizer_dir):
    """cache_dataset's build writes the same bytes from the CSV as from JSONL rows holding only its texts."""
    python_csv(tmp_path / "docs.csv", DOCUMENTS * 20)
    (tmp_path / "docs.jsonl").write_text(
        "".join(json.dumps({"text": row["text"]}) + "\n" for row in DOCUMENTS * 20), encoding="utf-8"
    )
    pack = Packing("text", 16, "drop", "alpaca", 96, validation_fraction=0.1, seed=3)
    written = {}
    for name in ("docs.csv", "docs.jsonl"):
        out = tmp_path / f"out_{name}"
        streamed.build(
            out,
            tokenizer_dir=smol_tokenizer_dir,
            train_file=str(tmp_path / name),
            heldout_fraction=0.1,
            packing=pack,
            work=tmp_path / f"work_{name}",
            workers=1,
            chunk_chars=10**9,
        )
        written[name] = [p.read_bytes() for p in sorted(out.rglob("*.arrow"))]
    assert written["docs.csv"] == written["docs.jsonl"]


def test_a_saved_dataset_and_a_bare_arrow_file_are_their_rows(tmp_path):
    Dataset.from_list(ALPACA * 3).save_to_disk(str(tmp_path / "saved"))
    with ArrowWriter(path=str(tmp_path / "rows.arrow")) as writer:
        for row in ALPACA * 3:
            writer.write(row)
        writer.finalize()
    for path in (tmp_path / "saved", tmp_path / "rows.arrow"):
        assert detected_format(path) == "alpaca"
        assert list(items(path, "alpaca")) == ALPACA * 3
        assert verify(path, "alpaca") == 6
        assert check_file("data.train_file", str(path), "alpaca", max_bad_rows=0.01) is None
    assert [p.name for p in stored_files(tmp_path / "saved")] == [
        "data-00000-of-00001.arrow",
        "dataset_info.json",
        "state.json",
    ]


def test_a_dataset_dict_trains_on_train_and_holds_out_test(tmp_path):
    splits = {"train": ALPACA * 4, "test": ALPACA[1:], "validation": ALPACA[:1]}
    folder = tmp_path / "dd"
    DatasetDict({name: Dataset.from_list(rows) for name, rows in splits.items()}).save_to_disk(str(folder))
    assert detected_format(folder) == "alpaca"
    assert list(items(folder, "alpaca")) == splits["train"]
    assert heldout_path(str(folder), str(folder)) == str(folder / "test")
    assert heldout_path(str(folder), "/elsewhere.jsonl") == "/elsewhere.jsonl"
    assert heldout_path(str(tmp_path / "rows.jsonl"), str(tmp_path / "rows.jsonl")) is None
    DatasetDict({"train": Dataset.from_list(ALPACA), "validation": Dataset.from_list(ALPACA[:1])}).save_to_disk(
        str(tmp_path / "tv")
    )
    assert heldout_path(str(tmp_path / "tv"), str(tmp_path / "tv")) == str(tmp_path / "tv" / "validation")
    DatasetDict({"test": Dataset.from_list(ALPACA)}).save_to_disk(str(tmp_path / "no_train"))
    with pytest.raises(ValueError, match=r"no_train: a DatasetDict of split\(s\) \['test'\]; expected a 'train'"):
        items(tmp_path / "no_train", "alpaca").__next__()


def test_the_stages_hold_out_a_dataset_dict_s_test_split(tmp_path, tiny_base_dir):
    """With data=own on a DatasetDict folder, the check reads both splits and names what no format or split reads;
    the eval_set stage writes the test split as the in-domain set (the training split whole: never its tail)."""
    rows = [{**row, "id": str(i)} for i, row in enumerate(ALPACA * 10)]
    folder = tmp_path / "dd"
    parts = {"train": rows[:16], "test": rows[16:], "validation": rows[:2]}
    DatasetDict({name: Dataset.from_list(split) for name, split in parts.items()}).save_to_disk(str(folder))
    overrides = [f"model.path={tiny_base_dir}", "launcher.accelerator=cpu", "tracking.uri="]
    overrides += ["data=own", f"data.train_file={folder}", "data.max_seq_len=256"]
    cfg = config.Config(**config.compose(REPO / "conf", overrides))
    defaults = config.validate(config.compose(REPO / "conf"), "conf/")
    produced = [REPO / "data" / "corpus"]
    found = check(cfg, defaults=defaults, produced=produced, known=set(), tokenizer_memo=None, pinned={})
    assert found.errors == []
    assert f"data.train_file: split(s) 'validation' of {folder} are not used (training: 'train')" in found.warnings
    unread = [w for w in found.warnings if "are not used by data.format" in w]
    assert unread == ["data.train_file: column(s) 'id' are not used by data.format=alpaca"]
    args = argparse.Namespace(name="in_domain", file=str(folder), out=tmp_path / "in_domain")
    eval_set.main(args, cfg)
    written = [json.loads(line) for line in (tmp_path / "in_domain" / "items.jsonl").read_text().splitlines()]
    assert written == parts["test"]


def test_a_folder_of_datasets_layout_that_is_no_saved_dataset_is_refused(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "dataset_info.json").write_text("{}", encoding="utf-8")
    (tmp_path / "cache" / "rows.jsonl").write_text(json.dumps(ALPACA[0]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"holds dataset_info.json but neither state.json nor dataset_dict.json; exp"):
        verify(tmp_path / "cache", "alpaca")
    Dataset.from_list(ALPACA).save_to_disk(str(tmp_path / "mixed" / "saved"))
    (tmp_path / "mixed" / "rows.jsonl").write_text(json.dumps(ALPACA[0]) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"mixed/saved inside it is datasets' layout .* named on its own"):
        check_file("data.train_file", str(tmp_path / "mixed"), "alpaca", max_bad_rows=0.01)
