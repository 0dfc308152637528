"""`python -m pipeline COMMAND ...`: the library's commands, and the one way bad input ends a process."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def guarded(call: Callable[[], object]) -> None:
    """Run `call`; a ValueError/FileNotFoundError (bad input) prints one line and exits 2."""
    try:
        call()
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def _consolidate(args: argparse.Namespace) -> None:
    from pipeline.consolidate import consolidate

    manifest = consolidate(args.checkpoint_dir, args.output_dir, args.tag, args.adapter_config, args.dtype)
    source = manifest["source"]
    print(
        f"consolidate: {len(manifest['tensors'])} tensors ({manifest['elements']:,} elements) from "
        f"{source['tag']} (ZeRO-{source['zero_stage']}, {source['world_size']} rank(s)) -> {args.output_dir}"
    )


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="python -m pipeline", description=__doc__)
    commands = top.add_subparsers(dest="command", required=True)
    consolidate = commands.add_parser("consolidate", help="DeepSpeed ZeRO checkpoint -> PEFT adapter folder")
    consolidate.add_argument("checkpoint_dir", type=Path, help="DeepSpeed checkpoint folder (holds `latest`)")
    consolidate.add_argument("output_dir", type=Path, help="adapter folder to write")
    consolidate.add_argument("--tag", help="checkpoint tag (default: the one `latest` names)")
    consolidate.add_argument("--adapter-config", type=Path, help="adapter_config.json (default: the checkpoint's)")
    consolidate.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="output dtype")
    consolidate.set_defaults(handler=_consolidate)
    return top


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    guarded(lambda: args.handler(args))
