"""Stage prepare_base: import the base model once into a plain HF safetensors folder."""

import argparse
from pathlib import Path

from pipeline.core import config
from pipeline.core.atomic import write_json
from pipeline.core.log import logger
from pipeline.model import hub
from pipeline.model.base_import import import_base
from stages._common import run

log = logger("prepare_base")


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    summary = import_base(
        source=hub.base_source(cfg.model.path, checked=args.checked, weights=True),
        out_dir=args.out,
        tokenizer_dir=args.tokenizer,
        dtype=cfg.model.dtype,
        max_shard_size=cfg.model.max_shard_size,
    ) | hub.recorded(args.checked)  # a hub base's id and commit: base.json and the MLflow run name the weights
    write_json(args.metrics, summary)
    log.info(f"{summary}")
    return summary


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="HF model folder to write")
    parser.add_argument("--tokenizer", type=Path, required=True, help="the base's tokenizer (prepare_base_tokenizer)")
    parser.add_argument("--metrics", type=Path, required=True, help="the imported model's figures (JSON)")
    parser.add_argument("--checked", type=Path, required=True, help="the check's output (a hub base's commit)")
    run(main, parser, prefix="base", hides_unused=lambda cfg: True)  # no import quantizes; transformers would import
    # scipy for nothing (about 1 s of CPU)
