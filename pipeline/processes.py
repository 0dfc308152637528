"""Starting child processes: this interpreter's virtual environment first on PATH (`deepspeed`, `dvc`), and a free
TCP port for the ranks' rendezvous."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path


def extensions_dir() -> Path:
    """Where DeepSpeed's JIT-built ops (CPU Adam, the CPU all-reduce) live: inside this virtual environment. Shared
    under ~/.cache/torch_extensions, two environments rebuild each other's ops at every launch (about a minute)."""
    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path(sys.prefix) / "torch_extensions")


def with_venv_path(env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: os.environ) with this interpreter's bin folder first on PATH and its own ops folder."""
    env = dict(os.environ if env is None else env)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    return env


def clear_stale_build_locks(folder: Path | None = None, older_than: float = 30.0) -> list[Path]:
    """Remove the lock of an op build nobody is running any more. torch guards a JIT build with a `lock` file that
    only the builder removes: a launch killed while building (SIGKILL) leaves it, and from then on every launch
    waits for it forever, without a word. A lock is stale when it is older than `older_than` seconds and no living
    process works in its build folder (the compiler runs there)."""
    import time

    import psutil

    removed = []
    for lock in (folder or extensions_dir()).glob("*/lock"):
        if time.time() - lock.stat().st_mtime < older_than:
            continue
        build = lock.parent.resolve()
        busy = False
        for process in psutil.process_iter():
            try:
                busy = Path(process.cwd()).resolve().is_relative_to(build)
            except (psutil.Error, OSError):
                continue
            if busy:
                break
        if not busy:
            lock.unlink(missing_ok=True)
            print(f"note: removed {lock}, left by a DeepSpeed op build that was killed", file=sys.stderr)
            removed.append(lock)
    return removed


def before_launch() -> None:
    """What a DeepSpeed launch needs cleared first: stale op-build locks and finished launches' shared memory."""
    clear_stale_build_locks()
    remove_stale_shm_buffers()


def free_port() -> int:
    """A TCP port free on this machine now (one node)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


RELEASE_FD = "TRAIN_RELEASE_FD"  # the pipe a rank started ahead of its launch waits on


class Ranks:
    """This node's ranks, started as DeepSpeed's launcher starts them for one node (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_SIZE, MASTER_ADDR/PORT, --local_rank), each then waiting in `released()` until the stage releases them:
    they import torch, DeepSpeed and transformers while the stage still checks the run (bench.train, bf16 text:
    wall 18.3-18.7 -> 17.2-18.3 s). Skips the `deepspeed` runner and its `launch` module, two more interpreters
    importing DeepSpeed one after the other (about 3 s per launch), and their 1 s polling."""

    def __init__(self, command: list[str], *, ranks: int, env: dict[str, str], master_addr: str, master_port: int):
        import subprocess

        common = {**env, "WORLD_SIZE": str(ranks), "LOCAL_SIZE": str(ranks), "CROSS_RANK": "0", "CROSS_SIZE": "1",
                  "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}  # fmt: skip
        self.children, self.pipes = [], []
        for rank in range(ranks):
            read, write = os.pipe()
            self.children.append(
                subprocess.Popen(
                    [*command, f"--local_rank={rank}"],
                    env={**common, "RANK": str(rank), "LOCAL_RANK": str(rank), RELEASE_FD: str(read)},
                    pass_fds=(read,),
                )
            )
            os.close(read)
            self.pipes.append(write)

    def release(self, message: dict) -> None:
        """Let every rank go on, with `message` (what it learns only now)."""
        data = json.dumps(message).encode()
        for pipe in self.pipes:
            os.write(pipe, data)
            os.close(pipe)
        self.pipes = []

    def cancel(self) -> None:
        """End the ranks if they were never released (closing their pipe empty would also end them, once their
        imports are done) or still run, and wait for them."""
        for pipe in self.pipes:
            os.close(pipe)
        self.pipes = []
        for child in self.children:
            if child.poll() is None:
                child.terminate()
            child.wait()

    def wait(self) -> int:
        """Wait for the released ranks; the first failure ends the others. Their exit code (0: all succeeded)."""
        import signal

        children = list(self.children)

        def stop(signum, _frame):
            for child in children:
                child.send_signal(signum)

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            code = 0
            while children:
                for child in list(children):
                    status = child.poll()
                    if status is None:
                        continue
                    children.remove(child)
                    if status != 0 and code == 0:
                        code = status
                        for other in children:
                            other.terminate()
                time.sleep(0.05)
            return code
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def released() -> dict:
    """In a rank started by `Ranks`: wait until the stage releases it and return its message; a stage that gives up
    (its checks failed, or the run is already done) closes the pipe empty, and the rank exits. {} at once in a rank
    started otherwise (the deepspeed launcher, on several nodes)."""
    fd = os.environ.pop(RELEASE_FD, None)
    if fd is None:
        return {}
    with os.fdopen(int(fd), "rb") as pipe:
        data = pipe.read()
    if not data:
        sys.exit(0)
    return json.loads(data)


def keep_freed_memory() -> None:
    """From now on keep freed memory in this process's heap (glibc): tensors up to 256 MB come from the heap, and it
    is returned to the system only above 1 GB free at its top. A training step frees and reallocates the same
    sizes each time; mapped and unmapped, each step pays the page faults of zeroing them again (bench.train, bf16
    text: 725 -> 842 tokens/s, peak memory per rank 1.61 -> 1.55 GB). No effect where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 1 << 28)
    mallopt(m_trim_threshold, 1 << 30)


def leave_process_group() -> None:
    """End a rank together with the others: one that exits while gloo's threads still run can abort ("terminate
    called without an active exception", exit -6) after all its work is done, failing the launch."""
    import deepspeed.comm as dist

    dist.barrier()
    dist.destroy_process_group()


def exit_rank() -> None:
    """End a finished rank without the interpreter's teardown: every output is written and closed by then, and the
    teardown is where C++ threads still alive (gloo's, bitsandbytes' CPU kernels under load) abort the process
    ("terminate called without an active exception", exit -6), failing a launch whose work was all done (seen
    once in a full test run, QLoRA on 2 CPU ranks, after leave_process_group)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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


def build_ops() -> None:
    """JIT-build, once per environment, the DeepSpeed ops the CPU ranks use (the all-reduce, CPU Adam for offload)
    and our own CPU kernels and allocator (pipeline/cpu_kernels.py), so that no stage pays for it or can be killed in
    the middle of it (`make setup` runs this)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    clear_stale_build_locks()
    from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, ShareMemCommBuilder

    for builder in (ShareMemCommBuilder(), CPUAdamBuilder()):
        builder.load(verbose=False)
    from pipeline import cpu_allocator, cpu_kernels

    cpu_kernels.load()
    cpu_kernels.build(cpu_allocator.SOURCE)


if __name__ == "__main__":
    build_ops()
