"""What every stage entry point shares: argument parsing and turning bad input into a clean exit."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from pipeline import config
from pipeline.cli import guarded


def run(main: Callable[[argparse.Namespace, config.Config], None], parser: argparse.ArgumentParser) -> None:
    """Parse arguments, load params.yaml, run; a ValueError/FileNotFoundError prints one line and exits 2."""
    parser.add_argument("--params", default="params.yaml", help="composed config (default: params.yaml)")
    args = parser.parse_args()
    guarded(lambda: main(args, config.load(args.params)))
