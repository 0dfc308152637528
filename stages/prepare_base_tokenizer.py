"""Stage prepare_base_tokenizer: the base's tokenizer and context length alone, without torch or the weights, for
the data stages (prepare_base converts the weights beside them, only for training)."""

import argparse
from pathlib import Path

from pipeline.core import config, imports
from pipeline.core.atomic import write_json
from pipeline.core.log import logger
from pipeline.model import hub
from pipeline.model.base_tokenizer import import_base_tokenizer
from stages._common import run

log = logger("prepare_base_tokenizer")


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    imports.tokenizers_only()  # before transformers is imported: 120 MB rather than 450 MB for a GGUF's tokenizer
    summary = import_base_tokenizer(
        source=hub.base_source(cfg.model.path, checked=args.checked, weights=False),
        out_dir=args.out,
        context_file=args.context,
    )
    write_json(args.metrics, summary)
    log.info(f"{summary}")
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="the base's tokenizer folder to write")
    parser.add_argument("--context", type=Path, required=True, help="the base's context length and model type (JSON)")
    parser.add_argument("--metrics", type=Path, required=True, help="the tokenizer's figures (JSON)")
    parser.add_argument("--checked", type=Path, required=True, help="the check's output (a hub base's commit)")
    run(main, parser, prefix="base_tokenizer")
