"""One node of a `launcher=slurm` run, as srun starts it on every node of the allocation: DeepSpeed's per-node
`launch` with the node's rank from Slurm (SLURM_NODEID) and this node's own GPUs. DeepSpeed's launch sets the ranks'
CUDA_VISIBLE_DEVICES to the ids its world info lists for the node; listing 0..N-1 would ignore the GPUs Slurm gave
the job on a shared node, so each node lists the ones Slurm made visible to it."""

from __future__ import annotations

import argparse
import os
import sys


def node_ids(visible: str | None, ranks: int) -> list:
    """The accelerator ids for this node's `ranks`: the first of Slurm's visible devices (indices, or UUIDs as
    given), else 0..ranks-1."""
    given = [d.strip() for d in (visible or "").split(",") if d.strip()]
    if len(given) < ranks:
        return list(range(ranks))
    return [int(d) if d.isdigit() else d for d in given[:ranks]]


def launch_command(*, hosts: list[str], node: int, ranks: int, visible: str | None, rest: list[str]) -> list[str]:
    from deepspeed.launcher.runner import encode_world_info

    world = {host: list(range(ranks)) for host in hosts}
    world[hosts[node]] = node_ids(visible, ranks)  # only this node's entry sets its devices
    launch = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={encode_world_info(world)}"]
    return [*launch, f"--node_rank={node}", *rest]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hosts", required=True, help="the allocation's nodes, comma-separated, node 0 first")
    parser.add_argument("--ranks", type=int, required=True, help="ranks per node")
    args, rest = parser.parse_known_args()
    hosts = args.hosts.split(",")
    command = launch_command(hosts=hosts, node=int(os.environ["SLURM_NODEID"]), ranks=args.ranks,
                             visible=os.environ.get("CUDA_VISIBLE_DEVICES"), rest=rest)  # fmt: skip
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
