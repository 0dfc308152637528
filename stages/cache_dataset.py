"""Stage cache_dataset: tokenize and pack the training data (one file, or a weighted mix of `data.sources`) into an
Arrow dataset (train/validation)."""

import argparse
import time
from pathlib import Path

from pipeline import config
from pipeline.atomic import atomic_path, read_json, write_json
from pipeline.dataset import build_instruction, build_pretraining, save_splits
from pipeline.textio import held_out, read_data
from pipeline.tokenizer import load_tokenizer
from stages._common import run


def training_items(d: config.DataConfig) -> list:
    """The training file's documents (or rows), less the held-out part when it is also the held-out file."""
    items = read_data(d.train_file, d.format)
    return held_out(items, d.heldout_fraction)[0] if d.heldout_file == d.train_file else items


def build_mix(tokenizer, d: config.DataConfig) -> tuple[dict, dict]:
    """The weighted mix of `data.sources` (every file read and checked before any tokenizing)."""
    from pipeline import mixing

    sources = mixing.resolve(d.sources)
    contents = [mixing.read_source(s, f"data.sources.{i}") for i, s in enumerate(sources)]
    if d.format == "text":
        return mixing.mix_text(
            tokenizer,
            sources,
            contents,
            block_size=d.block_size,
            tail=d.tail,
            validation_fraction=d.validation_fraction,
            seed=d.seed,
        )
    return mixing.mix_instruction(
        tokenizer,
        sources,
        contents,
        template=d.prompt_template,
        max_seq_len=d.max_seq_len,
        validation_fraction=d.validation_fraction,
        seed=d.seed,
    )


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    d = cfg.data
    positions = read_json(args.base_config)["max_position_embeddings"]
    key, length = ("data.block_size", d.block_size) if d.format == "text" else ("data.max_seq_len", d.max_seq_len)
    if length > positions:
        raise ValueError(f"{key}: {length} exceeds the model's max_position_embeddings ({positions})")
    tokenizer = load_tokenizer(args.tokenizer)
    start = time.perf_counter()
    if d.sources:
        tables, stats = build_mix(tokenizer, d)
    elif d.format == "text":
        documents = training_items(d)
        tables, stats = build_pretraining(
            tokenizer,
            documents,
            block_size=d.block_size,
            tail=d.tail,
            validation_fraction=d.validation_fraction,
            seed=d.seed,
        )
    else:
        rows = training_items(d)
        tables, stats = build_instruction(
            tokenizer,
            rows,
            template=d.prompt_template,
            max_seq_len=d.max_seq_len,
            validation_fraction=d.validation_fraction,
            seed=d.seed,
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
