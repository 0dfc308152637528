"""The ranks' world, joined under a short timeout whose failure names the node: each rank announces itself in node
0's rendezvous store and waits at most `launcher.join_timeout_s` for every other (a node that never starts, or cannot
reach node 0, is named with its host and ranks instead of hanging for torch's 30 minutes); then one all-reduce under
the same timeout proves the collective's transport between the nodes. Later collectives keep DeepSpeed's timeout."""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from datetime import timedelta

KEY = "joined/{}"


def node_of(rank: int, *, hosts: Sequence[str], ranks_per_node: int) -> str:
    """`node K (host, ranks A-B)` for the node that runs `rank` (the launchers number ranks node by node)."""
    node = rank // ranks_per_node
    first, last = node * ranks_per_node, (node + 1) * ranks_per_node - 1
    ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
    return f"node {node} ({hosts[node]}, {ranks})"


def missing_nodes(joined: Sequence[bool], *, hosts: Sequence[str], ranks_per_node: int) -> list[str]:
    """The nodes with a rank that has not joined, each named once."""
    named = [node_of(rank, hosts=hosts, ranks_per_node=ranks_per_node) for rank, ok in enumerate(joined) if not ok]
    return list(dict.fromkeys(named))


def join(*, hosts: Sequence[str], ranks_per_node: int, timeout_s: float) -> None:
    """Initialise torch.distributed for this rank (DeepSpeed's init_distributed then wraps it). A ValueError names
    the nodes missing at the rendezvous, or the transport that failed the first all-reduce."""
    import torch
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import default_pg_timeout

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    short, where = timedelta(seconds=timeout_s), f"{address}:{port}"
    hint = "launcher.join_timeout_s"
    try:
        store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=short, wait_for_workers=False)
    except (RuntimeError, dist.DistError) as err:
        if rank == 0 and "EADDRINUSE" in str(err):
            raise ValueError(
                f"train: node 0 ({hosts[0]}) cannot listen on {where} for the rendezvous: another process holds port "
                f"{port} (launcher.master_port: a free port, or null for one chosen at each launch)"
            ) from None
        raise ValueError(
            f"train: rank {rank} of {node_of(rank, hosts=hosts, ranks_per_node=ranks_per_node)} reached no "
            f"rendezvous at {where} within {timeout_s:g} s ({hint}): node 0 ({hosts[0]}) has not started its "
            f"ranks, or this node cannot reach it ({type(err).__name__})"
        ) from None
    store.set(KEY.format(rank), socket.gethostname())
    try:
        store.wait([KEY.format(r) for r in range(world)], short)
    except (RuntimeError, dist.DistError):
        try:
            joined = [store.check([KEY.format(r)]) for r in range(world)]
        except (RuntimeError, dist.DistError):  # node 0's rank 0 has already given up and closed the store
            joined = [r == rank for r in range(world)]
        absent = ", ".join(missing_nodes(joined, hosts=hosts, ranks_per_node=ranks_per_node))
        raise ValueError(
            f"train: {absent} did not join the rendezvous at {where} within {timeout_s:g} s ({hint}); expected "
            "its launcher to run (launcher=manual: `python -m pipeline.launching.manual_node` on that node) and to "
            f"reach {where}"
        ) from None
    backend = get_accelerator().communication_backend_name()
    if backend == "nccl":
        get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=default_pg_timeout)
    probe_group = dist.new_group(backend=backend, timeout=short)
    device = get_accelerator().current_device_name() if backend == "nccl" else "cpu"
    probe = torch.ones(1, device=device)
    try:
        dist.all_reduce(probe, group=probe_group)
        done = int(probe.item()) == world
    except (RuntimeError, dist.DistError):
        done = False
    if not done:
        raise ValueError(
            f"train: every rank joined at {where}, but the first all-reduce over {backend} did not complete within "
            f"{timeout_s:g} s ({hint}) on {node_of(rank, hosts=hosts, ranks_per_node=ranks_per_node)}: the nodes "
            "cannot open connections to one another; set NCCL_SOCKET_IFNAME (GPUs) or GLOO_SOCKET_IFNAME (CPU "
            "ranks) to the network interface every node shares"
        )
    dist.destroy_process_group(probe_group)
