"""Stage consolidate: the newest complete DeepSpeed checkpoint -> a verified PEFT adapter folder."""

import argparse
from pathlib import Path

from pipeline.checkpoints.consolidate import consolidate
from pipeline.core import config
from pipeline.core.atomic import read_json, write_json
from pipeline.core.log import logger
from pipeline.export import model_card
from stages._common import run

log = logger("consolidate")


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
    figures = {"dataset": read_json(args.dataset_metrics), "training": read_json(args.train_metrics)}
    model_card.write(args.out, model_card.render(kind="adapter", params=cfg.model_dump(), **figures))
    write_json(args.metrics, metrics)
    for note in manifest["notes"]:
        log.info(f"note: {note}")
    log.info(f"{source['tag']} (ZeRO-{source['zero_stage']}, {source['world_size']} rank(s)) -> {metrics}")
    return metrics


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoints", type=Path, required=True, help="DeepSpeed checkpoint folder (holds latest)")
    parser.add_argument("--out", type=Path, required=True, help="adapter folder to write")
    parser.add_argument("--metrics", type=Path, required=True, help="metrics JSON to write")
    parser.add_argument("--dataset-metrics", type=Path, required=True, help="the dataset's figures (model card)")
    parser.add_argument("--train-metrics", type=Path, required=True, help="the training's figures (model card)")
    run(main, parser, prefix="consolidate", hides_unused=lambda cfg: True)  # nothing a checkpoint holds is quantized
