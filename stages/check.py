"""Stage check (the first): the whole configuration and every input file it names, checked before any stage runs,
so that a bad value stops the pipeline before DVC deletes a single output (`pipeline.check`). Unknown keys get the
closest known one suggested (when params.yaml is loaded); the data's format is found from its first row
(data.format=auto) and its first rows are tokenized as the stages will."""

import argparse
from pathlib import Path

from pipeline.check import check
from pipeline.core import config
from pipeline.core.atomic import write_json
from pipeline.core.log import logger
from pipeline.data import verified
from pipeline.model import hub
from stages._common import run

log = logger("check")


def main(args: argparse.Namespace, cfg: config.Config) -> None:
    known = verified.load(args.memo) if args.memo else set()
    defaults = config.validate(config.compose(args.conf), "conf/")
    tokenizer_memo = args.memo.with_name("check_tokenizer") if args.memo else None
    found = check(
        cfg,
        defaults=defaults,
        produced=args.produced,
        known=known,
        tokenizer_memo=tokenizer_memo,
        pinned=hub.recorded(args.out),  # a hub base stays at the commit first seen (persist: kept between runs)
    )
    for warning in found.warnings:
        log.info(f"warning: {warning}")
    if found.errors:
        raise ValueError("\n".join(found.errors))
    if args.memo:
        verified.save(args.memo, known | found.verified)
    model = {"model": found.model} if found.model else {}  # the hub commit the stages after this one read
    write_json(args.out, {"checked": "params.yaml and the input files it names", **model})
    log.info("the configuration and its input files are fine")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--conf", type=Path, default=Path("conf"), help="the config groups (their defaults)")
    parser.add_argument("--produced", type=Path, nargs="*", default=[], help="folders earlier stages write")
    parser.add_argument("--out", type=Path, required=True, help="written when every check passed")
    parser.add_argument("--memo", type=Path, help="input files already verified (by size and time): not read again")
    run(main, parser)
