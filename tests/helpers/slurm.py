"""A real Slurm on this machine for the cluster tests: munge, slurmctld and two slurmd (Debian's slurm-wlm is built
with multiple-slurmd), "node1" and "node2", both this machine at 127.0.0.1, each with 2 CPUs."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from pipeline.core.environment import free_port

NODES = ("node1", "node2")


def missing() -> str | None:
    """Why a Slurm cannot run here (None: it can): `make nodes` installs slurm-wlm and munge as root."""
    if not all(shutil.which(p) for p in ("slurmctld", "slurmd", "munged", "sbatch", "srun")):
        return "slurm-wlm and munge are not installed (make nodes installs them as root)"
    return None if os.getuid() == 0 else "slurmd runs jobs as root here; not root"


def config(folder: Path, spool: Path) -> str:
    host = subprocess.run(["hostname"], capture_output=True, text=True, check=True).stdout.strip()
    ports = [free_port() for _ in range(3)]
    nodes = "".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={p} CPUs=2 State=UNKNOWN\n"
                    for n, p in zip(NODES, ports[1:], strict=True))  # fmt: skip
    return (
        f"ClusterName=tests\nSlurmctldHost={host}(127.0.0.1)\nSlurmctldPort={ports[0]}\nSlurmUser=root\n"
        f"SlurmdUser=root\nAuthType=auth/munge\nStateSaveLocation={folder}/state\nSlurmdSpoolDir={spool}/%n\n"
        f"SlurmctldPidFile={folder}/slurmctld.pid\nSlurmdPidFile={folder}/slurmd-%n.pid\n"
        "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSwitchType=switch/none\nMpiDefault=none\n"
        "ReturnToService=2\nSchedulerType=sched/builtin\nSelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n"
        "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
        f"{nodes}PartitionName=tests Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP\n"
    )


def start(folder: Path) -> tuple[dict[str, str], list[subprocess.Popen]]:
    """Start munge (where it is not running), slurmctld and the two slurmd; the environment that reaches them
    (SLURM_CONF) and the processes to stop."""
    (folder / "state").mkdir(parents=True, exist_ok=True)
    # slurmstepd listens on SPOOL/NODE/NODE_JOB.STEP (a batch step is 4294967291): a socket's path holds 107 bytes,
    # which a pytest worker's folder overran (the job was held: "slurmstepd failed to send return code got 0")
    spool = Path(tempfile.mkdtemp(prefix="slurmd-"))
    (folder / "spool").symlink_to(spool)
    (folder / "slurm.conf").write_text(config(folder, spool))
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
    if subprocess.run(["sh", "-c", "munge -n | unmunge"], capture_output=True).returncode:
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        subprocess.run(["munged", "--force"], check=True, capture_output=True)
    log = (folder / "daemons.log").open("w")
    daemons = [subprocess.Popen(["slurmctld", "-c", "-D"], env=env, stdout=log, stderr=subprocess.STDOUT)]
    time.sleep(1)
    daemons += [subprocess.Popen(["slurmd", "-D", "-N", n], env=env, stdout=log, stderr=subprocess.STDOUT)
                for n in NODES]  # fmt: skip
    deadline = time.time() + 30
    while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T %D"], env=env, capture_output=True, text=True).stdout:
        if time.time() > deadline:
            raise RuntimeError(f"Slurm did not start: {(folder / 'daemons.log').read_text()[-2000:]}")
        time.sleep(0.3)
    return {"SLURM_CONF": env["SLURM_CONF"]}, daemons


def stop(folder: Path, daemons: list[subprocess.Popen]) -> None:
    for daemon in daemons:
        daemon.terminate()
        daemon.wait()
    shutil.rmtree((folder / "spool").resolve(), ignore_errors=True)
