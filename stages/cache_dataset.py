"""Stage cache_dataset: tokenize and pack the training data (one file, or a weighted mix of `data.sources`) into an
Arrow dataset (train/validation)."""

import argparse
import time
from pathlib import Path

from pipeline.core import config
from pipeline.core.atomic import atomic_path, read_json, write_json
from pipeline.data import assembly
from pipeline.data.dataset import save_splits
from pipeline.data.tokenizer import load_tokenizer
from stages._common import run


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    d = cfg.data
    packing = assembly.Packing(
        data_format=d.format,
        block_size=d.block_size,
        tail=d.tail,
        template=d.prompt_template,
        max_seq_len=d.max_seq_len,
        validation_fraction=d.validation_fraction,
        seed=d.seed,
    )
    assembly.check_length(packing, read_json(args.base_config)["max_position_embeddings"])
    tokenizer = load_tokenizer(args.tokenizer)
    start = time.perf_counter()
    tables, stats = assembly.build(
        tokenizer,
        sources=d.sources,
        train_file=d.train_file,
        heldout_file=d.heldout_file,
        heldout_fraction=d.heldout_fraction,
        packing=packing,
    )
    seconds = time.perf_counter() - start
    with atomic_path(args.out) as tmp:
        save_splits(tmp, tables)
    metrics = {k: round(v, 6) if isinstance(v, float) else v for k, v in stats.items()}
    write_json(args.metrics, metrics)
    for name, share in stats.pop("sources", {}).items():
        print(
            f"cache_dataset: source {name}: {share['planned_share']:.1%} of tokens planned, "
            f"{share['realised_share']:.1%} in the train split ({share['train_tokens']:,} tokens, "
            f"{share['items']} items)"
        )
    print(f"cache_dataset: {stats}; {stats['tokens'] / seconds:,.0f} tokens/s ({seconds:.2f} s)")
    return metrics


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", type=Path, required=True, help="tokenizer folder")
    parser.add_argument("--base-config", type=Path, required=True, help="base model config.json")
    parser.add_argument("--out", type=Path, required=True, help="dataset folder to write")
    parser.add_argument("--metrics", type=Path, required=True, help="metrics JSON to write")
    run(main, parser, prefix="dataset")
