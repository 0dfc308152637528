"""Node K of a `launcher=manual` run joins the world: `python -m pipeline.launching.manual_node --checkpoints DIR
--node-rank K`, started on every node but node 0 by you or your scheduler (node 0 runs `dvc repro`). It waits until
node 0's train stage opens a launch (launch.json beside the plan, in the checkpoint folder every node shares), checks
that this node runs node 0's code and packages, and starts this node's ranks with the environment node 0 gave them;
its exit code is theirs. It never runs a stage: the pipeline runs once, on node 0."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from pipeline.launching import preflight
from pipeline.launching.cluster import Cluster
from pipeline.launching.ranks import LAUNCH_FILE, launcher_command


def wait_for_launch(checkpoints: Path, timeout_s: float) -> dict:
    """Node 0's launch.json, once its train stage writes it."""
    path, deadline = checkpoints / LAUNCH_FILE, time.time() + timeout_s
    while not path.is_file():
        if time.time() > deadline:
            raise TimeoutError(
                f"join: no launch in {checkpoints} after {timeout_s:.0f} s; expected node 0's train stage "
                "(launcher=manual) to write its launch.json there, in the checkpoint folder every node shares"
            )
        time.sleep(1.0)
    return json.loads(path.read_text(encoding="utf-8"))


def check_same_node(launch: dict, node_rank: int) -> None:
    """This node against node 0: the same code and packages (what launch.json records of node 0)."""
    here = f"this node ({socket.gethostname()}, node {node_rank})"
    if preflight.code_digest(Path.cwd()) != launch["code"]:
        raise ValueError(f"join: {here} has other code in {Path.cwd()} than node 0; expected the same checkout")
    if differ := preflight.package_differences(preflight.packages(), launch["packages"]):
        raise ValueError(f"join: {here} has other packages than node 0 ({differ}); expected the same environment")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", type=Path, required=True, help="the run's checkpoint folder (shared)")
    parser.add_argument("--node-rank", type=int, required=True, help="this node's rank (1 .. nodes - 1)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for node 0's launch")
    args = parser.parse_args()
    try:
        launch = wait_for_launch(args.checkpoints, args.timeout)
        if not 0 < args.node_rank < len(launch["hosts"]):
            raise ValueError(f"join: --node-rank {args.node_rank}; expected 1 .. {len(launch['hosts']) - 1}")
        check_same_node(launch, args.node_rank)
    except (ValueError, TimeoutError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    nodes = Cluster(mode="manual", hosts=tuple(launch["hosts"]), slots=launch["ranks"],
                    master_addr=launch["master_addr"], master_port=launch["master_port"],
                    hostfile=Path(launch["hostfile"]))  # fmt: skip
    command = launcher_command(nodes, ranks=launch["ranks"], plan=Path(launch["plan"]),
                               port=launch["master_port"], node_rank=args.node_rank)  # fmt: skip
    return subprocess.run(command, env={**os.environ, **launch["environment"]}).returncode


if __name__ == "__main__":
    sys.exit(main())
