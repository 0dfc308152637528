"""Stage merge: fold the consolidated adapter into the base and verify the merged logits."""

import argparse
from pathlib import Path

from pipeline.core import config
from pipeline.core.atomic import read_json, write_json
from pipeline.core.log import logger
from pipeline.export import model_card
from pipeline.merge.fold import merge
from stages._common import run

log = logger("merge")


def hides_unused(cfg: config.Config) -> bool:
    """A base not quantized needs no bitsandbytes (PEFT would import it, and it torch's compiler: about 1 s)."""
    return cfg.lora.quantization == "none"


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    m = cfg.merge
    report = merge(
        base_dir=args.base,
        adapter_dir=args.adapter,
        out_dir=args.out,
        dtype=m.dtype,
        max_shard_size=m.max_shard_size,
        verify=m.verify,
        max_abs_logit_diff=m.max_abs_logit_diff,
        max_kl=m.max_kl,
    )
    metrics = {"vocab_rows": report["vocab_rows"], **report.get("verification", {})}
    figures = {"dataset": read_json(args.dataset_metrics), "training": read_json(args.train_metrics)}
    model_card.write(args.out, model_card.render(kind="merged", params=cfg.model_dump(), merge=metrics, **figures))
    write_json(args.metrics, metrics)
    for note in report["notes"]:
        log.info(f"note: {note}")
    log.info(f"{report}")
    return metrics


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", type=Path, required=True, help="prepared base model folder")
    parser.add_argument("--adapter", type=Path, required=True, help="consolidated adapter folder")
    parser.add_argument("--out", type=Path, required=True, help="merged model folder to write")
    parser.add_argument("--metrics", type=Path, required=True, help="verification figures (DVC metrics)")
    parser.add_argument("--dataset-metrics", type=Path, required=True, help="the dataset's figures (model card)")
    parser.add_argument("--train-metrics", type=Path, required=True, help="the training's figures (model card)")
    run(main, parser, prefix="merge", hides_unused=hides_unused)
