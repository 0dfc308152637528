"""Stage cache_dataset: tokenize and pack the training data (one file, folder or glob, streamed in bounded memory by
every core, resumably; or a weighted mix of `data.sources`) into an Arrow dataset (train/validation)."""

import argparse
import os
import shutil
import time
from pathlib import Path

from pipeline.core import config
from pipeline.core.atomic import atomic_path, read_json, write_json
from pipeline.core.log import logger
from pipeline.data import assembly, mixing, streamed, truncation
from pipeline.data.formats import template_for
from pipeline.data.inputs import heldout_path, resolved_format
from stages._common import run

log = logger("cache_dataset")

CHUNK_CHARS = 1_000_000  # characters of input per part: what a worker holds, and what a kill can lose


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    d = cfg.data
    data_format = resolved_format(d.format, d.train_file, [s.format for s in d.sources])
    packing = assembly.Packing(
        data_format=data_format,
        block_size=d.block_size,
        tail=d.tail,
        template=template_for(data_format, d.prompt_template),
        max_seq_len=d.max_seq_len,
        validation_fraction=d.validation_fraction,
        seed=d.seed,
        packing=d.packing,
    )
    assembly.check_length(packing, read_json(args.base_config)["max_position_embeddings"])
    workers = args.workers or len(os.sched_getaffinity(0))
    work = args.out.with_name(f".{args.out.name}.parts")
    start = time.perf_counter()
    with atomic_path(args.out) as tmp:
        if d.sources:
            stats = streamed.build_mix(
                tmp,
                tokenizer_dir=args.tokenizer,
                sources=mixing.resolve(d.sources),
                packing=packing,
                work=work,
                workers=workers,
                chunk_chars=args.chunk_chars,
            )
        else:
            stats = streamed.build(
                tmp,
                tokenizer_dir=args.tokenizer,
                train_file=d.train_file,
                heldout_fraction=d.heldout_fraction if heldout_path(d.train_file, d.heldout_file) is None else None,
                packing=packing,
                work=work,
                workers=workers,
                chunk_chars=args.chunk_chars,
            )
    shutil.rmtree(work, ignore_errors=True)
    seconds = time.perf_counter() - start
    cautions = truncation.warnings(stats, max_seq_len=d.max_seq_len, sampled=False)
    metrics = {k: round(v, 6) if isinstance(v, float) else v for k, v in stats.items()}
    metrics |= {"format": data_format, "warnings": cautions}
    write_json(args.metrics, metrics)
    for name, share in stats.pop("sources", {}).items():
        log.info(
            f"source {name}: {share['planned_share']:.1%} of tokens planned, "
            f"{share['realised_share']:.1%} in the train split ({share['train_tokens']:,} tokens, "
            f"{share['items']} items)"
        )
    log.info(f"{stats}; {stats['tokens'] / seconds:,.0f} tokens/s ({seconds:.2f} s)")
    for caution in cautions:
        log.info(f"warning: {caution}")
    return metrics


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", type=Path, required=True, help="tokenizer folder")
    parser.add_argument("--base-config", type=Path, required=True, help="JSON with the base's max_position_embeddings")
    parser.add_argument("--out", type=Path, required=True, help="dataset folder to write")
    parser.add_argument("--metrics", type=Path, required=True, help="metrics JSON to write")
    parser.add_argument("--workers", type=int, default=0, help="tokenizing processes (default: one per core)")
    parser.add_argument(
        "--chunk-chars", type=int, default=CHUNK_CHARS, help="characters per part (the output does not depend on it)"
    )
    run(main, parser, prefix="dataset")
