"""Stage prepare_tokenizer: extend the base vocabulary with pieces learned on the training text (or pass it
through), and report vocabulary sizes and tokens per character on held-out text. Both are streamed: memory holds
the text the pieces are learned on (tokenizer.max_train_chars) and the held-out text measured (HELDOUT_CHARS)."""

import argparse
import shutil
from itertools import islice
from pathlib import Path

from pipeline.core import config
from pipeline.core.atomic import atomic_path, write_json
from pipeline.core.log import logger
from pipeline.data.inputs import heldout_path, resolved_format
from pipeline.data.textio import item_texts, split_count, stream
from pipeline.data.tokenizer import (
    META,
    first_chars,
    model_tokenizer,
    round_up,
    tokens_per_char,
    vocabulary_size,
    write_extended,
)
from stages._common import run

log = logger("prepare_tokenizer")

HELDOUT_CHARS = 8_000_000  # held-out characters the tokens per character are measured on (the first ones)


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    t, d = cfg.tokenizer, cfg.data
    base = model_tokenizer(args.base)  # the Rust tokenizer alone where it can: transformers costs 300 MB
    data_format = resolved_format(d.format, d.train_file, [s.format for s in d.sources])
    # the training data's files are read as its format (so that the held-out rows are those cache_dataset holds out)
    read_as = {path: "texts" if d.sources else data_format for path in (d.train_file, d.heldout_file)}
    train_as, heldout_as = read_as.get(t.train_file, "texts"), read_as.get(t.heldout_file, "texts")
    training, heldout = stream(t.train_file, train_as), stream(t.heldout_file, heldout_as)
    if t.heldout_file == t.train_file and (split := heldout_path(t.train_file, t.heldout_file)) is not None:
        heldout = stream(split, heldout_as)  # a DatasetDict folder's held-out split
    elif t.heldout_file == t.train_file:  # one file for both: its last part is held out, as cache_dataset does
        kept = split_count(t.train_file, train_as, d.heldout_fraction)
        training, heldout = islice(training, kept), islice(heldout, kept, None)
    heldout_texts = first_chars(item_texts(heldout), HELDOUT_CHARS)
    with atomic_path(args.out) as tmp:
        if t.extend:
            added = write_extended(
                args.base,
                tmp,
                first_chars(item_texts(training), t.max_train_chars),
                vocab_size=t.vocab_size,
                model_type=t.model_type,
                character_coverage=t.character_coverage,
            )
        else:
            shutil.copytree(args.base, tmp)
            added = 0
        extended = model_tokenizer(tmp)
        metrics = {
            "base_vocab_size": vocabulary_size(args.base),
            "vocab_size": vocabulary_size(tmp),
            "added_tokens": added,
            "padded_vocab_size": round_up(vocabulary_size(tmp), t.pad_to_multiple_of),
            "heldout_tokens_per_char_before": round(before := tokens_per_char(base, heldout_texts), 6),
            "heldout_tokens_per_char_after": round(tokens_per_char(extended, heldout_texts) if t.extend else before, 6),
        }  # the base passed through is the base: measured once
        write_json(tmp / META, {"extended": t.extend, **metrics})
    write_json(args.metrics, metrics)
    log.info(f"{metrics}")
    return metrics


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", type=Path, required=True, help="base tokenizer folder")
    parser.add_argument("--out", type=Path, required=True, help="tokenizer folder to write")
    parser.add_argument("--metrics", type=Path, required=True, help="metrics JSON to write")
    run(main, parser, prefix="tokenizer")
