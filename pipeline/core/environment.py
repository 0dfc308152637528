"""The environment of child processes: this interpreter's virtual environment first on PATH (`deepspeed`, `dvc`),
its own folder of JIT-built ops, and a free TCP port for a rendezvous."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil


def extensions_dir() -> Path:
    """Where DeepSpeed's JIT-built ops (CPU Adam, the CPU all-reduce) live: inside this virtual environment. Shared
    under ~/.cache/torch_extensions, two environments rebuild each other's ops at every launch (about a minute)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(sys.prefix) / "torch_extensions")


def with_venv_path(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: os.environ) with this interpreter's bin folder first on PATH (once: an environment that has it
    first already is left as it is, so that nested calls give one environment) and its own ops folder."""
    env = dict(os.environ if env is None else env)
    entries, venv_bin = [e for e in env.get("PATH", "").split(os.pathsep) if e], str(Path(sys.executable).parent)
    if entries[:1] != [venv_bin]:  # an empty entry would be the working folder: none is added
        env["PATH"] = os.pathsep.join([venv_bin, *entries])
    env.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    return env


def clear_stale_build_locks(folder: Path | None = None, older_than: float = 30.0) -> list[Path]:
    """Remove the lock of an op build nobody is running any more. torch guards a JIT build with a `lock` file that
    only the builder removes: a launch killed while building (SIGKILL) leaves it, and from then on every launch
    waits for it forever, without a word. A lock is stale when it is older than `older_than` seconds and no living
    process works in its build folder (the compiler runs there)."""
    import time

    removed = []
    for lock in (folder or extensions_dir()).glob("*/lock"):
        if time.time() - lock.stat().st_mtime < older_than or working_in(lock.parent.resolve()):
            continue
        lock.unlink(missing_ok=True)
        print(f"note: removed {lock}, left by a DeepSpeed op build that was killed", file=sys.stderr)
        removed.append(lock)
    return removed


def working_in(folder: Path) -> list[psutil.Process]:
    """The living processes (psutil's) whose working folder is `folder` or below it."""
    import psutil

    found = []
    for process in psutil.process_iter():
        try:
            if Path(process.cwd()).resolve().is_relative_to(folder):
                found.append(process)
        except (psutil.Error, OSError):
            continue
    return found


def free_port() -> int:
    """A TCP port free on this machine now (one node)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
