"""What a DeepSpeed launch needs around it: the ops its ranks use built once per environment (`python -m
pipeline.launching.ops`, which `make setup` runs), and what killed or finished launches leave behind (op-build locks,
shared memory) cleared."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from pipeline.core.environment import clear_stale_build_locks, extensions_dir, port_free


def before_launch() -> None:
    """What a DeepSpeed launch needs cleared first: stale op-build locks and finished launches' shared memory."""
    clear_stale_build_locks()
    remove_stale_shm_buffers()


SHM = Path("/dev/shm")


def remove_stale_shm_buffers() -> list[Path]:
    """Delete the shared-memory files DeepSpeed's CPU all-reduce left behind. Every rank of a CPU launch creates
    /dev/shm/deepspeed_allreduce_buffer_UID_ADDR_PORT_RANK (in RAM) and DeepSpeed never removes it:
    a few dozen launches fill the machine's memory. A file is stale when its launch is over, that is when nothing
    listens on its rendezvous port here any more."""
    removed = []
    for path in SHM.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"):
        *_, addr, port, _rank = path.name.split("_")
        if addr in ("127.0.0.1", "localhost", socket.gethostname()) and port.isdigit() and port_free(int(port)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def build_ops() -> None:
    """JIT-build, once per environment, the DeepSpeed ops the CPU ranks use (the all-reduce, CPU Adam for offload)
    and our own CPU kernels and allocator (pipeline/kernels/csrc/), and where there is a GPU the CUDA build of CPU
    Adam that offload uses there, so that no stage pays for it or can be killed in the middle of it (`make setup`
    runs this). Each op compiles mostly on one core (torch's extension headers, one file after another): they build
    side by side, a forked process each, as many at once as there are cores (215 -> 176 s on 2 cores)."""
    import torch

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    clear_stale_build_locks()
    workers = min(len(CPU_OPS), os.cpu_count() or 1)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        for built in [pool.submit(_build_cpu_op, name) for name in CPU_OPS]:
            built.result()  # a build that raised raises here
    if torch.cuda.is_available():  # the accelerator is chosen once per process: the CUDA build in a process of its own
        code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(verbose=False)"
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "DS_ACCELERATOR": "cuda"}, check=True)


CPU_OPS = ("cpu_adam", "kernels", "shm_comm", "allocator")  # the longest build first


def _build_cpu_op(name: str) -> None:
    """Build one op of CPU_OPS (in a worker of build_ops)."""
    if name in ("cpu_adam", "shm_comm"):
        from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, ShareMemCommBuilder

        (CPUAdamBuilder if name == "cpu_adam" else ShareMemCommBuilder)().load(verbose=False)
        return
    from pipeline.kernels import allocator, cpp

    if name == "kernels":  # each None where it cannot be built (the eager path runs instead)
        cpp.load()
    else:
        cpp.build(allocator.SOURCE)


if __name__ == "__main__":
    build_ops()
