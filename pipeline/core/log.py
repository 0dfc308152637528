"""The one logger of the stages, the ranks and the CLI: `name: message` lines (a stage's name, `train`, `tracking`),
progress on stdout and warnings on stderr, written by global rank 0 only (a process that is no rank, such as a stage
or the CLI, counts as rank 0) and flushed at once, so that the lines of several processes interleave whole. Bad input
is not logged: `errors.guarded` prints it and exits."""

from __future__ import annotations

import functools
import logging
import os
import sys

ROOT = "pipeline"


def logger(name: str) -> logging.Logger:
    """The logger whose lines start with `name: `."""
    _install()
    return logging.getLogger(f"{ROOT}.{name}")


class _Lines(logging.Handler):
    """Each record as one line on the stream of the moment (stdout, stderr from WARNING up)."""

    def emit(self, record: logging.LogRecord) -> None:
        stream = sys.stderr if record.levelno >= logging.WARNING else sys.stdout
        print(f"{record.name.removeprefix(ROOT + '.')}: {record.getMessage()}", file=stream, flush=True)


def _rank_zero(_record: logging.LogRecord) -> bool:
    return os.environ.get("RANK", "0") == "0"


@functools.cache
def _install() -> None:
    root = logging.getLogger(ROOT)
    handler = _Lines()
    handler.addFilter(_rank_zero)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False
