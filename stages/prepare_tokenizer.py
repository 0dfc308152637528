"""Stage prepare_tokenizer: extend the base vocabulary with pieces learned on the training text (or pass it
through), and report vocabulary sizes and tokens per character on held-out text."""

import argparse
import shutil
from pathlib import Path

from pipeline.core import config
from pipeline.core.atomic import atomic_path, write_json
from pipeline.core.log import logger
from pipeline.data.textio import held_out, read_texts
from pipeline.data.tokenizer import META, first_chars, load_tokenizer, round_up, tokens_per_char, write_extended
from stages._common import run

log = logger("prepare_tokenizer")


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    t = cfg.tokenizer
    base = load_tokenizer(args.base)
    training, heldout = read_texts(t.train_file), read_texts(t.heldout_file)
    if t.heldout_file == t.train_file:  # one file for both: its last part is held out, as cache_dataset does
        training, heldout = held_out(training, cfg.data.heldout_fraction)
    with atomic_path(args.out) as tmp:
        if t.extend:
            added = write_extended(
                args.base,
                tmp,
                first_chars(training, t.max_train_chars),
                vocab_size=t.vocab_size,
                model_type=t.model_type,
                character_coverage=t.character_coverage,
            )
        else:
            shutil.copytree(args.base, tmp)
            added = 0
        extended = load_tokenizer(tmp)
        metrics = {
            "base_vocab_size": len(base),
            "vocab_size": len(extended),
            "added_tokens": added,
            "padded_vocab_size": round_up(len(extended), t.pad_to_multiple_of),
            "heldout_tokens_per_char_before": round(tokens_per_char(base, heldout), 6),
            "heldout_tokens_per_char_after": round(tokens_per_char(extended, heldout), 6),
        }
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
