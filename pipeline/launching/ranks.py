"""Starting this node's DeepSpeed ranks (or every node's, through the cluster's launcher) and ending them cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from pipeline.core.environment import free_port, with_venv_path
from pipeline.launching.cluster import Cluster
from pipeline.launching.ops import before_launch, remove_stale_shm_buffers

RANK_MODULE = "pipeline.training.rank"
KEEP_BITSANDBYTES = "TRAIN_KEEP_BITSANDBYTES"  # "1": the ranks' base is quantized (they import it before the plan)


RELEASE_FD = "TRAIN_RELEASE_FD"  # the pipe a rank started ahead of its launch waits on


class Ranks:
    """This node's ranks, started as DeepSpeed's launcher starts them for one node (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_SIZE, MASTER_ADDR/PORT, --local_rank), each then waiting in `released()` until the stage releases them:
    they import torch, DeepSpeed and transformers while the stage still checks the run. Skips the `deepspeed`
    runner and its `launch` module, two more interpreters importing DeepSpeed one after the other, and their polling
    (figures: docs/training.md)."""

    def __init__(self, command: list[str], *, ranks: int, env: dict[str, str], master_addr: str, master_port: int):
        common = {**env, "WORLD_SIZE": str(ranks), "LOCAL_SIZE": str(ranks), "CROSS_RANK": "0", "CROSS_SIZE": "1",
                  "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}  # fmt: skip
        self.children, self.pipes = [], []
        for rank in range(ranks):
            read, write = os.pipe()
            argv, rank_env = [*command, f"--local_rank={rank}"], {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            self.children.append(subprocess.Popen(argv, env={**rank_env, RELEASE_FD: str(read)}, pass_fds=(read,)))
            os.close(read)
            self.pipes.append(write)

    def release(self, message: dict) -> None:
        """Let every rank go on, with `message` (what it learns only now)."""
        data = json.dumps(message).encode()
        for pipe in self.pipes:
            with contextlib.suppress(BrokenPipeError):  # a rank that died importing: `wait` gives its exit code
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


def leave_process_group() -> None:
    """End a rank together with the others: one that exits while gloo's threads still run can abort ("terminate
    called without an active exception", exit -6) after all its work is done, failing the launch."""
    import deepspeed.comm as dist

    dist.barrier()
    dist.destroy_process_group()


def exit_rank() -> None:
    """End a finished rank without the interpreter's teardown: every output is written and closed by then, and the
    teardown is where C++ threads still alive (gloo's, bitsandbytes' CPU kernels under load) abort the process
    ("terminate called without an active exception", exit -6), failing a launch whose work was all done."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank_environment(*, accelerator: str, ranks_per_node: int, kernels: str, keep_bitsandbytes: bool) -> dict:
    """The ranks' environment: the venv first on PATH, the accelerator, the node's cores shared among its ranks
    (each rank's threads would otherwise use every core: on a CPU that oversubscribes them while training, on 8 GPUs
    while loading; a value the user set is kept), and the variables the speed paths need from the process's start."""
    from pipeline import kernels as speed

    env = {**with_venv_path(), "DS_ACCELERATOR": accelerator}
    env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // ranks_per_node)))
    for name, value in speed.environment(device=accelerator, enabled=kernels).items():
        env.setdefault(name, value)
    if keep_bitsandbytes:
        env[KEEP_BITSANDBYTES] = "1"
    return env


def start_ranks(*, cluster: Cluster, ranks: int, plan: Path, env: dict[str, str]) -> Ranks | None:
    """On one node, its ranks started now: they import while the stage checks the run, and wait for `run_ranks` to
    release them. None on several nodes (a launcher starts them in `run_ranks`)."""
    if cluster.mode != "local":
        return None
    before_launch()
    command = [sys.executable, "-m", RANK_MODULE, "--plan", str(plan)]
    port = cluster.master_port or free_port()
    return Ranks(command, ranks=ranks, env=env, master_addr=cluster.master_addr, master_port=port)


def run_ranks(started: Ranks | None, *, cluster: Cluster, ranks: int, plan: Path, env: dict[str, str]) -> int:
    """Release this node's ranks, or start every node's through the cluster's launcher (DeepSpeed's runner over
    ssh, one launcher per node through srun, or this node's alone where each node is started by hand); wait for
    them and clear what they leave; their exit code."""
    if started is not None:
        started.release({})
        code = started.wait()
    else:
        import tempfile

        before_launch()
        port = cluster.master_port or free_port()
        if cluster.mode == "manual":
            announce(cluster=cluster, ranks=ranks, plan=plan, env=env, port=port)
        with tempfile.TemporaryDirectory(prefix="deepspeed-env-") as tmp:  # DeepSpeed's runner exports it over ssh
            env_file = Path(tmp) / ".deepspeed_env"
            env_file.write_text("".join(f"{k}={shlex.quote(v)}\n" for k, v in remote_environment(env).items()))
            try:
                command = launcher_command(cluster, ranks=ranks, plan=plan, port=port)
                code = subprocess.run(command, env={**env, "DS_ENV_FILE": str(env_file)}).returncode
            finally:
                (plan.parent / LAUNCH_FILE).unlink(missing_ok=True)
    remove_stale_shm_buffers()
    return code


LAUNCH_FILE = "launch.json"  # beside the plan while a launcher=manual launch runs: what joining nodes need
REMOTE_ENVIRONMENT = ("PATH", "TORCH_EXTENSIONS_DIR", "DS_ACCELERATOR", "OMP_NUM_THREADS", KEEP_BITSANDBYTES)
CPU_PATH_PREFIXES = ("ATEN_", "ONEDNN_", "DNNL_", "PIPELINE_KERNELS_")  # the CPU code paths (kernels/cpu_paths.py)
REMOTE_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "HF_", "TRANSFORMERS_", "TOKENIZERS_", "MALLOC_", "MKL_", "KMP_",
                   *CPU_PATH_PREFIXES)  # fmt: skip


def remote_environment(env: dict[str, str]) -> dict[str, str]:
    """What the ranks of another node need of this node's rank environment: the venv first on PATH, the accelerator,
    thread counts, the allocator's variables, every NCCL/gloo/torch setting and the CPU paths forced (never this
    machine's own: HOME, the GPUs it sees)."""
    return {k: v for k, v in env.items() if k in REMOTE_ENVIRONMENT or k.startswith(REMOTE_PREFIXES)}


def announce(*, cluster: Cluster, ranks: int, plan: Path, env: dict[str, str], port: int) -> None:
    """Write beside the plan what the joining nodes of a launcher=manual run need (launch.json): where the ranks
    meet, their environment, and node 0's code and packages to compare theirs with."""
    from pipeline.launching import preflight

    carried = remote_environment(env)
    launch = {"plan": str(plan.resolve()), "ranks": ranks, "hosts": list(cluster.hosts), "hostfile":
              str(cluster.hostfile.resolve()) if cluster.hostfile else None, "master_addr": cluster.master_addr,
              "master_port": port, "environment": carried, "code": preflight.code_digest(Path.cwd()),
              "packages": preflight.packages()}  # fmt: skip
    (plan.parent / LAUNCH_FILE).write_text(json.dumps(launch, indent=2), encoding="utf-8")


def launcher_command(cluster: Cluster, *, ranks: int, plan: Path, port: int, node_rank: int = 0) -> list[str]:
    """The command that starts the ranks of `cluster` (on node `node_rank` only where each node is started apart)."""
    rank = ["--module", RANK_MODULE, "--plan", str(plan.resolve())]
    rendezvous = ["--master_addr", cluster.master_addr, "--master_port", str(port)]
    if cluster.mode == "ssh":
        return ["deepspeed", "--log_level", "warning", "--hostfile", str(cluster.hostfile), "--launcher", "pdsh",
                "--no_ssh_check", *rendezvous, *rank]  # fmt: skip
    if cluster.mode == "slurm":  # each node: DeepSpeed's launch with its rank and GPUs from Slurm
        node = [sys.executable, "-m", "pipeline.launching.slurm_node", "--hosts", ",".join(cluster.hosts), "--ranks",
                str(ranks), f"--master_addr={cluster.master_addr}", f"--master_port={port}", *rank]  # fmt: skip
        return ["srun", "--nodes", str(len(cluster.hosts)), "--ntasks-per-node", "1", "--kill-on-bad-exit=1",
                "--export=ALL", *node]  # fmt: skip
    return ["deepspeed", "--log_level", "warning", "--num_gpus", str(ranks), "--num_nodes", str(len(cluster.hosts)),
            "--hostfile", str(cluster.hostfile), "--no_ssh", "--node_rank", str(node_rank), *rendezvous,
            *rank]  # fmt: skip
