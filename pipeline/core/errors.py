"""Bad input ends a process with one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable


def guarded(call: Callable[[], object]) -> None:
    """Run `call`; a ValueError/FileNotFoundError (bad input) prints one line and exits 2."""
    try:
        call()
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
