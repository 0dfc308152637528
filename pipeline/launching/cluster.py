"""The nodes a run trains on, as the `launcher` config group names them (`launcher=local|ssh|slurm|manual`): which
hosts, in node order, how many ranks each runs, and where they meet. Read from a hostfile (ssh, manual) or from the
Slurm allocation the stage runs in (slurm); refused, before anything runs, where the ranks could not meet: a
loopback rendezvous address while some node is another machine."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

MODES = ("local", "ssh", "slurm", "manual")
DEFAULT_PORT = 29500  # torch.distributed's, where the master is another machine (no free port can be read there)


@dataclass(frozen=True, kw_only=True)
class Cluster:
    mode: str
    hosts: tuple[str, ...]  # node 0 first
    slots: int | None  # ranks per node the hostfile or allocation gives (None: launcher.ranks_per_node decides)
    master_addr: str
    master_port: int | None  # None: a free port of this machine (the master runs here)
    hostfile: Path | None


def read_hostfile(path: Path) -> list[tuple[str, int]]:
    """(host, slots) per line of a DeepSpeed hostfile (`host slots=N`; blank lines and # comments skipped)."""
    if not path.is_file():
        raise FileNotFoundError(f"launcher.hostfile: {path}: not found; expected a file of `host slots=N` lines")
    hosts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        slots = fields[1].removeprefix("slots=") if len(fields) == 2 else ""
        if not slots.isdigit() or int(slots) < 1 or not fields[1].startswith("slots="):
            raise ValueError(f"launcher.hostfile: {path} line {number}: {line.strip()!r}; expected `host slots=N`")
        if fields[0] in (h for h, _ in hosts):
            raise ValueError(f"launcher.hostfile: {path} line {number}: {fields[0]} is named twice")
        hosts.append((fields[0], int(slots)))
    if not hosts:
        raise ValueError(f"launcher.hostfile: {path} names no host; expected `host slots=N` lines")
    return hosts


def slurm_nodes() -> dict[str, str]:
    """{node name: the address Slurm reaches it at (NodeAddr)} of the allocation this process runs in, in order."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise ValueError("launcher=slurm: SLURM_JOB_NODELIST is not set; expected to run inside an allocation (sbatch)")
    names = scontrol("show", "hostnames", nodelist).split()
    fields = (dict(f.split("=", 1) for f in scontrol("show", "node", n, "-o").split() if "=" in f) for n in names)
    return {name: node.get("NodeAddr", name) for name, node in zip(names, fields, strict=True)}


def scontrol(*args: str) -> str:
    done = subprocess.run(["scontrol", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise ValueError(f"launcher=slurm: `scontrol {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def is_loopback(host: str) -> bool:
    """Whether every address `host` resolves to is this machine's loopback (127.0.0.0/8, ::1)."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def resolve(launcher) -> Cluster:
    """The cluster of `launcher` (the config's LauncherConfig), checked."""
    mode = launcher.mode
    hostfile = Path(launcher.hostfile) if launcher.hostfile else None
    if mode == "local":
        return Cluster(mode=mode, hosts=("localhost",), slots=None, master_addr=launcher.master_addr,
                       master_port=launcher.master_port, hostfile=None)  # fmt: skip
    if mode == "slurm":
        addresses = slurm_nodes()
        hosts, slots = list(addresses), None
    else:
        if hostfile is None:
            raise ValueError(f"launcher.hostfile: launcher={mode} needs a hostfile of `host slots=N` lines, got null")
        listed = read_hostfile(hostfile)
        hosts = [host for host, _ in listed]
        counts = {n for _, n in listed}
        if len(counts) > 1:
            raise ValueError(f"launcher.hostfile: {hostfile} gives nodes different slots {sorted(counts)}; "
                             "expected the same number of ranks on every node")  # fmt: skip
        slots = counts.pop()
        addresses = {host: host for host in hosts}
    if mode == "manual" and launcher.num_nodes != len(hosts):
        raise ValueError(
            f"launcher.num_nodes: {launcher.num_nodes}, but {hostfile} names {len(hosts)} hosts; expected the same"
        )
    if launcher.ranks_per_node != "auto" and slots is not None and launcher.ranks_per_node != slots:
        raise ValueError(f"launcher.ranks_per_node: {launcher.ranks_per_node}, but {hostfile} gives slots={slots}; "
                         "expected auto or the same")  # fmt: skip
    master = addresses[hosts[0]] if launcher.master_addr == "auto" else launcher.master_addr
    check_rendezvous(master, list(addresses.values()))
    port = launcher.master_port
    if port is None and not is_loopback(master) and master != socket.gethostname():
        port = DEFAULT_PORT
    return Cluster(mode=mode, hosts=tuple(hosts), slots=slots, master_addr=master, master_port=port,
                   hostfile=hostfile)  # fmt: skip


def check_rendezvous(master: str, addresses: list[str]) -> None:
    """Every rank must reach the master: a loopback address serves only where every node is this machine."""
    elsewhere = [a for a in addresses if not is_loopback(a)]
    if is_loopback(master) and elsewhere:
        raise ValueError(
            f"launcher.master_addr: {master} is this machine's loopback, which node {elsewhere[0]} cannot reach; "
            "expected the address of node 0 on the network the nodes share (or auto: the hostfile's first host)"
        )
