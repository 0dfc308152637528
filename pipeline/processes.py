"""Starting child processes: this interpreter's virtual environment first on PATH (`deepspeed`, `dvc`), and a free
TCP port for the ranks' rendezvous."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path


def with_venv_path(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: os.environ) with this interpreter's bin folder first on PATH."""
    env = dict(os.environ if env is None else env)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def free_port() -> int:
    """A TCP port free on this machine now (one node)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def leave_process_group() -> None:
    """End a rank together with the others: one that exits while gloo's threads still run can abort ("terminate
    called without an active exception", exit -6) after all its work is done, failing the launch."""
    import deepspeed.comm as dist

    dist.barrier()
    dist.destroy_process_group()
