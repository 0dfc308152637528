"""Naming the nodes of a rendezvous that did not complete."""

from pipeline.launching.rendezvous import missing_nodes, node_of

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
