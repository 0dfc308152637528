"""Stage consolidate: the newest complete DeepSpeed checkpoint -> a verified PEFT adapter folder."""

import argparse
from pathlib import Path

from pipeline import config
from pipeline.atomic import write_json
from pipeline.checkpoints.consolidate import consolidate
from stages._common import run


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    manifest = consolidate(checkpoint_dir=args.checkpoints, output_dir=args.out)
    source = manifest["source"]
    metrics = {
        "tensors": len(manifest["tensors"]),
        "elements": manifest["elements"],
        "step": source["step"],
        "world_size": source["world_size"],
        "zero_stage": source["zero_stage"],
    }
    write_json(args.metrics, metrics)
    for note in manifest["notes"]:
        print(f"consolidate: note: {note}")
    print(f"consolidate: {source['tag']} (ZeRO-{source['zero_stage']}, {source['world_size']} rank(s)) -> {metrics}")
    return metrics


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoints", type=Path, required=True, help="DeepSpeed checkpoint folder (holds latest)")
    parser.add_argument("--out", type=Path, required=True, help="adapter folder to write")
    parser.add_argument("--metrics", type=Path, required=True, help="metrics JSON to write")
    run(main, parser, prefix="consolidate")
