"""Stage merge: fold the consolidated adapter into the base and verify the merged logits."""

import argparse
from pathlib import Path

from pipeline import config
from pipeline.atomic import write_json
from pipeline.merge import merge
from stages._common import run


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
    write_json(args.metrics, metrics)
    for note in report["notes"]:
        print(f"merge: note: {note}")
    print(f"merge: {report}")
    return metrics


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--base", type=Path, required=True, help="prepared base model folder")
    parser.add_argument("--adapter", type=Path, required=True, help="consolidated adapter folder")
    parser.add_argument("--out", type=Path, required=True, help="merged model folder to write")
    parser.add_argument("--metrics", type=Path, required=True, help="verification figures (DVC metrics)")
    run(main, parser, prefix="merge")
