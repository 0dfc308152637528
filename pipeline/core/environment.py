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
    """A TCP port free on this machine now (one node) for a rendezvous, below the kernel's range of ephemeral ports.
    A port from that range (what binding port 0 gives) can, once its probe closes, become the local port of any
    process's next outgoing connection (a gloo pair, a store's client) before rank 0 listens on it, and rank 0 then
    fails with EADDRINUSE. Below the range, a port is taken only by whoever binds it. Drawn at random, so that two
    launches at once rarely draw the same one. Where the range leaves no room below it, the kernel's choice."""
    import random

    low = ephemeral_ports()[0]
    if low - PORTS_FROM >= 1024:
        draw = random.SystemRandom()
        for _ in range(64):
            if port_free(port := draw.randrange(PORTS_FROM, low)):
                return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


PORTS_FROM = 20000  # the lowest port a rendezvous takes: above the registered services most machines run


def ephemeral_ports(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux's default where it cannot be read)."""
    try:
        low, high = (int(n) for n in path.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def port_free(port: int) -> bool:
    """Whether `port` can be bound on the loopback address now."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
