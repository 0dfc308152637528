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


SHM = Path("/dev/shm")


def remove_stale_shm_buffers() -> list[Path]:
    """Delete the shared-memory files DeepSpeed's CPU all-reduce left behind. Every rank of a CPU launch creates
    /dev/shm/deepspeed_allreduce_buffer_UID_ADDR_PORT_RANK (about 69 MB, in RAM) and DeepSpeed never removes it:
    a few dozen launches fill the machine's memory. A file is stale when its launch is over, that is when nothing
    listens on its rendezvous port here any more."""
    removed = []
    for path in SHM.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"):
        *_, addr, port, _rank = path.name.split("_")
        if addr in ("127.0.0.1", "localhost", socket.gethostname()) and port.isdigit() and _port_free(int(port)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
