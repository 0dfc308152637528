"""Naming the nodes of a rendezvous that did not complete, and a port that cannot be listened on."""

import pytest

from pipeline.launching.rendezvous import join, missing_nodes, node_of

HOSTS = ("gpu-a", "gpu-b", "gpu-c")


def test_a_rank_is_named_by_its_node_host_and_ranks():
    assert node_of(5, hosts=HOSTS, ranks_per_node=4) == "node 1 (gpu-b, ranks 4-7)"
    assert node_of(2, hosts=HOSTS, ranks_per_node=1) == "node 2 (gpu-c, rank 2)"


def test_each_node_with_a_missing_rank_is_named_once():
    joined = [True, True, False, False, True, True]
    assert missing_nodes(joined, hosts=HOSTS, ranks_per_node=2) == ["node 1 (gpu-b, ranks 2-3)"]
    assert missing_nodes([True, False, False, True], hosts=HOSTS, ranks_per_node=2) == [
        "node 0 (gpu-a, ranks 0-1)", "node 1 (gpu-b, ranks 2-3)"
    ]  # fmt: skip


def test_rank_0_whose_port_an_outgoing_connection_holds_says_so_at_once(monkeypatch):
    """What lost a whole tier's shared training runs (a port of the ephemeral range, chosen free, became a
    connection's local port before rank 0 listened): rank 0 names the port in use, not a node that never started."""
    import socket
    import time

    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        port = client.getsockname()[1]
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        start = time.monotonic()
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port} .*holds port {port}"):
            join(hosts=("localhost",), ranks_per_node=2, timeout_s=60)
        assert time.monotonic() - start < 30, "refused at the bind, not after the join timeout"
