"""The nodes of a run as the launcher config names them: a hostfile read line by line, the rendezvous address
checked against the nodes, refusals that name the file, line or key."""

from __future__ import annotations

import pytest

from pipeline.core import config
from pipeline.launching import cluster
from tests.conftest import REPO


def launcher(*overrides: str) -> config.LauncherConfig:
    return config.Config(**config.compose(REPO / "conf", list(overrides))).launcher


def test_a_hostfile_gives_the_nodes_in_order_and_their_slots(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# the head first\nnode-a slots=8\n\nnode-b slots=8  # the second\n")
    assert cluster.read_hostfile(hostfile) == [("node-a", 8), ("node-b", 8)]
    nodes = cluster.resolve(launcher("launcher=ssh", f"launcher.hostfile={hostfile}"))
    assert (nodes.hosts, nodes.slots) == (("node-a", "node-b"), 8)
    assert (nodes.master_addr, nodes.master_port) == ("node-a", 29500)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("node-a slots=8\nnode-b 8\n", "line 2: 'node-b 8'; expected `host slots=N`"),
        ("node-a slots=0\n", "line 1: 'node-a slots=0'; expected `host slots=N`"),
        ("node-a slots=8\nnode-a slots=8\n", "line 2: node-a is named twice"),
        ("# nobody\n", "names no host"),
        ("node-a slots=8\nnode-b slots=4\n", "gives nodes different slots [4, 8]"),
    ],
)
def test_a_bad_hostfile_is_refused_by_line(tmp_path, text, message):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(text)
    with pytest.raises(ValueError, match=f"launcher.hostfile: {hostfile}.*{message}".replace("[", r"\[")):
        cluster.resolve(launcher("launcher=ssh", f"launcher.hostfile={hostfile}"))


def test_a_missing_hostfile_and_mismatched_counts_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="launcher.hostfile: /nonexistent: not found"):
        cluster.resolve(launcher("launcher=ssh", "launcher.hostfile=/nonexistent"))
    with pytest.raises(ValueError, match="launcher=ssh needs a hostfile"):
        cluster.resolve(launcher("launcher=ssh"))
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n127.0.0.1 slots=2\n")
    with pytest.raises(ValueError, match="launcher.ranks_per_node: 4, but .* gives slots=2"):
        cluster.resolve(launcher("launcher=ssh", f"launcher.hostfile={hostfile}", "launcher.ranks_per_node=4"))
    with pytest.raises(ValueError, match="launcher.num_nodes: 3, but .* names 2 hosts"):
        cluster.resolve(launcher("launcher=manual", f"launcher.hostfile={hostfile}", "launcher.num_nodes=3"))


def test_a_loopback_master_serves_only_nodes_on_this_machine(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    local = cluster.resolve(launcher("launcher=ssh", f"launcher.hostfile={hostfile}"))
    assert local.master_addr == "localhost" and local.master_port is None  # a free port of this machine
    hostfile.write_text("localhost slots=1\nnode-b.invalid slots=1\n")
    with pytest.raises(ValueError, match="launcher.master_addr: localhost is this machine's loopback, which node "
                       "node-b.invalid cannot reach"):  # fmt: skip
        cluster.resolve(launcher("launcher=ssh", f"launcher.hostfile={hostfile}"))


def test_several_nodes_need_a_launcher_that_starts_them():
    with pytest.raises(ValueError, match="launcher.num_nodes: 2 with launcher=local .* expected launcher=ssh"):
        launcher("launcher.num_nodes=2")


def test_a_slurm_node_launches_its_ranks_on_the_gpus_slurm_gave_it():
    """DeepSpeed's launch sets the ranks' CUDA_VISIBLE_DEVICES from the world info: each node lists its own."""
    import base64
    import json

    from pipeline.launching.slurm_node import launch_command, node_ids

    assert node_ids("2,3", 2) == [2, 3] and node_ids(None, 2) == [0, 1] and node_ids("5", 2) == [0, 1]
    assert node_ids("GPU-aa,GPU-bb", 2) == ["GPU-aa", "GPU-bb"]
    command = launch_command(hosts=["n1", "n2"], node=1, ranks=2, visible="4,5", rest=["--module", "m"])
    world = json.loads(base64.urlsafe_b64decode(command[4].removeprefix("--world_info=")))
    assert world == {"n1": [0, 1], "n2": [4, 5]} and command[5:] == ["--node_rank=1", "--module", "m"]
