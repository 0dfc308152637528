"""Files of rows with named columns, each read through the library that defines it, a batch of rows at a time (memory
holds a batch, never the file): Parquet (pyarrow); CSV and TSV (pyarrow's streaming CSV reader: a header row, quoted
fields holding delimiters, quotes and newlines, every cell the string it holds, an empty cell ""); and Arrow as
`datasets` writes it, memory-mapped by `datasets`: a `Dataset.save_to_disk` folder (state.json, dataset_info.json,
data-*.arrow), a `DatasetDict.save_to_disk` folder (dataset_dict.json, a folder per split; its `train` split is the
training data, its `test` split, else its `validation` split, the held-out part) or a bare `.arrow` file."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

BATCH_ROWS = 4096  # rows decoded at a time
CSV_BLOCK = 1 << 22  # bytes of CSV parsed at a time, a row longer than this refused; pyarrow keeps about 35 blocks
# in flight (measured, pyarrow 25: 143 MB at most reading 119 MB to 476 MB files), so this bounds its memory
TABLES = ("parquet", "csv", "tsv", "arrow")  # the kinds of file read here
MARKERS = ("state.json", "dataset_dict.json")  # what makes a folder a saved Dataset, a saved DatasetDict
LAYOUT_FILES = (*MARKERS, "dataset_info.json")  # files of datasets' layout, never data files of their own
HELD_OUT_SPLITS = ("test", "validation")  # a DatasetDict's split held out from training, the first present
SAVED = (
    "a folder written by datasets' Dataset.save_to_disk (state.json, dataset_info.json, data-*.arrow) or "
    "DatasetDict.save_to_disk (dataset_dict.json and a folder per split, one named 'train')"
)


def saved_dataset(folder: Path) -> Path | None:
    """The saved Dataset a folder is (itself), or holds as a DatasetDict's `train` split; None for another folder."""
    if (folder / "state.json").is_file():
        return folder
    if not (folder / "dataset_dict.json").is_file():
        return None
    names = splits(folder)
    if "train" not in names:
        raise ValueError(f"{folder}: a DatasetDict of split(s) {names}; expected a 'train' split (the training data)")
    return folder / "train"


def splits(folder: Path) -> list[str]:
    """The splits a DatasetDict folder names in its dataset_dict.json (as `DatasetDict.load_from_disk` reads it)."""
    return json.loads((folder / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]


def heldout_split(path: Path) -> Path | None:
    """A DatasetDict folder's held-out split (`test`, else `validation`); None for any other path or dict."""
    if not (path / "dataset_dict.json").is_file():
        return None
    return next((path / name for name in HELD_OUT_SPLITS if name in splits(path)), None)


def stray_layout(folder: Path, layout_file: Path) -> str:
    """Why a folder holding `layout_file` (a file of datasets' layout) among its data files is refused."""
    if layout_file.parent != folder:
        return (
            f"{folder}: {layout_file.parent} inside it is datasets' layout ({layout_file.name}); expected {SAVED} "
            "named on its own as the data path, or a folder of data files only"
        )
    return f"{folder}: holds {layout_file.name} but neither state.json nor dataset_dict.json; expected {SAVED}"


def columns(path: Path, kind: str) -> list[str]:
    """The columns of a table file (a CSV's header), read without its rows."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).schema_arrow.names
    if kind == "arrow":
        return _dataset(path).column_names
    return _csv_reader(path, kind, None).schema.names


def count(path: Path, kind: str) -> int | None:
    """How many rows a table file holds where its metadata says (Parquet, Arrow); None for CSV."""
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if kind == "arrow":
        return _dataset(path).num_rows
    return None


def rows(path: Path, kind: str, *, only: list[str] | None = None) -> Iterator[dict]:
    """The rows of a table file in order, each {column: value} (`only` those columns), a batch at a time."""
    for batch in _batches(path, kind, only):
        yield from batch.to_pylist()


def _batches(path: Path, kind: str, only: list[str] | None) -> Iterator[pa.RecordBatch | pa.Table]:
    if kind == "parquet":
        import pyarrow.parquet as pq

        yield from pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS, columns=only)
    elif kind == "arrow":
        dataset = _dataset(path)
        dataset = dataset.select_columns(only) if only else dataset
        yield from dataset.with_format("arrow").iter(batch_size=BATCH_ROWS)
    else:
        reader, read = _csv_reader(path, kind, only), 0
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                return
            except pa.ArrowInvalid as err:
                raise ValueError(_refusal(path, kind, err, read)) from None
            read += batch.num_rows
            yield batch


def _csv_reader(path: Path, kind: str, only: list[str] | None):
    """pyarrow's streaming reader of a CSV or TSV file (decompressed by its suffix; a leading byte order mark
    skipped), every column read as strings: a cell means the text it holds (an id "007" stays "007")."""
    import pyarrow.csv as csv

    parse = csv.ParseOptions(delimiter="\t" if kind == "tsv" else ",", newlines_in_values=True)
    read = csv.ReadOptions(block_size=CSV_BLOCK, use_threads=False)

    def opened(convert: csv.ConvertOptions | None = None):
        try:
            stream = pa.input_stream(str(path), compression="detect")
            return csv.open_csv(stream, read_options=read, parse_options=parse, convert_options=convert)
        except pa.ArrowInvalid as err:
            raise ValueError(_refusal(path, kind, err, 0)) from None

    names = opened().schema.names
    strings = {name: pa.string() for name in names}
    return opened(csv.ConvertOptions(column_types=strings, include_columns=only))


def _refusal(path: Path, kind: str, err: pa.ArrowInvalid, read: int) -> str:
    """What a CSV or TSV file pyarrow cannot read is refused with (its message quotes the row; `read` rows before
    it were read)."""
    past = f" (after row {read})" if read else ""
    if "straddl" in str(err):  # pyarrow's words for a row longer than a block
        return f"{path}: a row longer than {CSV_BLOCK >> 20} MB{past}; expected shorter rows (or the data as JSONL)"
    separated = "tab" if kind == "tsv" else "comma"
    return (
        f"{path}: {err}{past}; expected {kind.upper()}: a header row, then {separated}-separated fields, quoted where "
        "a field holds the separator, a quote or a newline"
    )


def _dataset(path: Path):
    """The `datasets.Dataset` a saved folder or a bare `.arrow` file holds, memory-mapped."""
    from datasets import Dataset

    try:
        return Dataset.load_from_disk(str(path)) if path.is_dir() else Dataset.from_file(str(path))
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(
            f"{path}: datasets cannot read it ({err}); expected {SAVED}, or a .arrow file datasets wrote"
        ) from None
