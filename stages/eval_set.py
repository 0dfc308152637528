"""Stage eval_set (one per `eval.sets` entry, `eval_set@NAME`): the set's file, read as evaluate will read it, copied
into the folder evaluate depends on. Declaring a set in the config is enough: the graph follows it."""

import argparse
import json
import shutil
from itertools import islice
from pathlib import Path

from pipeline.core import config
from pipeline.core.atomic import atomic_path
from pipeline.core.log import logger
from pipeline.data.inputs import items, kind
from pipeline.data.textio import held_out_count, verify
from stages._common import run

log = logger("eval_set")


def main(args: argparse.Namespace, cfg: config.Config) -> None:
    source, d = Path(args.file), cfg.data
    data_format = "jsonl" if kind(source) == "jsonl" else "text"
    try:
        count = verify(source, data_format)
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"eval.sets.{args.name}: {err}") from None
    with atomic_path(args.out) as tmp:
        tmp.mkdir()
        if args.file == d.train_file == d.heldout_file:  # the training file's held-out part, never trained on
            held = held_out_count(count, d.heldout_fraction)
            with (tmp / source.name).open("w", encoding="utf-8") as out:
                for item in islice(items(source, data_format), count - held, None):  # streamed: one item held
                    out.write((item if data_format == "text" else json.dumps(item, ensure_ascii=False)) + "\n")
            log.info(f"{args.name} = the last {held} item(s) of {source} (held out from training)")
        else:
            shutil.copy2(source, tmp / source.name)
            log.info(f"{args.name} = {source}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", required=True, help="the set's name in eval.sets")
    parser.add_argument("--file", required=True, help="its text (one document per line) or JSONL file")
    parser.add_argument("--out", type=Path, required=True, help="folder to copy it into")
    run(main, parser)
