"""Stage train: the run resolved into one plan, checked, then carried out by this node's DeepSpeed ranks (and every
other node's): `pipeline.training.recipe.run`."""

import argparse
import dataclasses
import sys
from pathlib import Path

from pipeline.core import config
from pipeline.training import plan, recipe
from stages._common import run


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    paths = plan.Paths(**{f.name: getattr(args, f.name, None) for f in dataclasses.fields(plan.Paths)})
    sections = {"train": cfg.train, "lora": cfg.lora, "deepspeed": cfg.deepspeed, "launcher": cfg.launcher}
    try:
        return recipe.run(paths=paths, **sections, tracking=cfg.tracking)
    except recipe.RanksFailed as failed:
        print(f"error: {failed}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    for name, meaning in (
        ("base", "prepared base model folder"),
        ("tokenizer", "prepared tokenizer folder"),
        ("dataset", "cached dataset folder"),
        ("checkpoints", "DeepSpeed checkpoint folder (kept across runs: resume)"),
        ("metrics", "training metrics JSON to write"),
        ("curve", "per-step CSV to write (a DVC plot)"),
    ):
        parser.add_argument(f"--{name}", type=Path, required=True, help=meaning)
    parser.add_argument("--final-state", type=Path, help="also write the gathered fp32 trainable tensors here")
    parser.add_argument("--loaded-state", type=Path, help="also write the state the run resumes from (+ moments)")
    parser.add_argument("--tensorboard", type=Path, help="TensorBoard folder (written when tracking.tensorboard)")
    run(main, parser, prefix="train")
