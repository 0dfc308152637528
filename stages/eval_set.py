"""Stage eval_set (one per `eval.sets` entry, `eval_set@NAME`): the set's data path, read as evaluate will read it (any
container cache_dataset reads: a folder, a glob, CSV, Parquet, Arrow, compressed, a JSON array), written in our form
into the folder evaluate depends on (`pipeline/data/eval_sets.py`); the training data's own path gives its held-out
part (a DatasetDict folder's: its test, else validation, split). Declaring a set in the config is enough: the graph
follows it."""

import argparse
from itertools import islice
from pathlib import Path

from pipeline.core import config
from pipeline.core.atomic import atomic_path
from pipeline.core.log import logger
from pipeline.data import eval_sets
from pipeline.data.inputs import heldout_path, items, resolved_format
from pipeline.data.textio import held_out_count, verify
from stages._common import run

log = logger("eval_set")


def main(args: argparse.Namespace, cfg: config.Config) -> None:
    d = cfg.data
    derived = args.file == d.train_file == d.heldout_file  # the training file's held-out part, never trained on
    try:
        source = (heldout_path(d.train_file, d.heldout_file) if derived else None) or args.file  # a DatasetDict's
        data_format = resolved_format(d.format, d.train_file, [s.format for s in d.sources])
        own = () if d.sources else (d.train_file, d.heldout_file)
        set_as = eval_sets.set_format(args.file, data_format=data_format, data_paths=own)
        count = verify(source, set_as)
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"eval.sets.{args.name}: {err}") from None
    found = items(source, set_as)  # streamed: one item held
    if derived and source == args.file:
        found = islice(found, count - held_out_count(count, d.heldout_fraction), None)
    with atomic_path(args.out) as tmp:
        written = eval_sets.write_set(tmp, found, data_format=set_as, source=args.file, held_out=derived)
    what = "held out from training" if derived else "all of it"
    log.info(f"{args.name} = {written} {set_as} item(s) of {args.file} ({what})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", required=True, help="the set's name in eval.sets")
    parser.add_argument(
        "--file", required=True, help="its data path (text, JSON(L), CSV, TSV, Parquet, Arrow; a folder, a glob)"
    )
    parser.add_argument("--out", type=Path, required=True, help="folder to write it into")
    run(main, parser)
