"""Before ranks start on several nodes: every node reachable, running the same code and the same packages as this
one, and seeing the same checkpoint folder (every rank writes its own shards there, rank 0 the tag a resume reads).
Each node runs `python -m pipeline.launching.preflight` (over ssh, or through srun inside a Slurm allocation): it
reports its identity and whether it sees the head's probe file, and writes its own for the head to read. A node
that fails any of it is refused by name, with what to do, before the collective starts."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shlex
import socket
import subprocess
import sys
import uuid
from importlib import metadata
from pathlib import Path

from pipeline.launching.cluster import Cluster

CODE = ("pipeline", "stages")  # the folders whose Python the ranks and stages run; dvc.lock names the inputs
PROBES = ".preflight"
TIMEOUT_S = 60


def packages() -> dict[str, str]:
    """Every installed distribution's version, by name, and the interpreter's."""
    found = {d.metadata["Name"].lower(): d.version for d in metadata.distributions() if d.metadata["Name"]}
    return {**found, "python": sys.version.split()[0]}


def package_differences(there: dict[str, str], here: dict[str, str]) -> str:
    """The first few packages whose versions differ, `name theirs vs ours` ("" where none)."""
    names = sorted(n for n in {*there, *here} if there.get(n) != here.get(n))
    return ", ".join(f"{n} {there.get(n)} vs {here.get(n)}" for n in names[:5])


def code_digest(root: Path) -> str:
    """One digest of the project's code as this node sees it: every .py file of CODE and dvc.lock, by path."""
    digest = hashlib.sha256()
    files = sorted(p for folder in CODE for p in (root / folder).rglob("*.py")) + [root / "dvc.lock"]
    for path in files:
        if path.is_file():
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def report(*, root: Path, checkpoints: Path | None, token: str, node: int) -> dict:
    """This node's identity; and, with `checkpoints`, whether the head's probe is there (then this node's is too)."""
    sees = None
    if checkpoints is not None:
        probes = checkpoints / PROBES
        sees = (probes / token).is_file()
        if sees:
            (probes / f"{token}.node{node}").write_text(socket.gethostname(), encoding="utf-8")
    return {"host": socket.gethostname(), "code": code_digest(root), "packages": packages(), "sees_probe": sees}


def ssh_options() -> list[str]:
    """ssh's options as pdsh uses them (PDSH_SSH_ARGS_APPEND), never prompting, with a connection timeout."""
    extra = shlex.split(os.environ.get("PDSH_SSH_ARGS_APPEND", ""))
    return ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10", *extra]


def node_command(*, checkpoints: Path | None, token: str, node: str) -> str:
    """The shell command a node runs: this interpreter, in this folder (both at the same paths on every node)."""
    folder = [] if checkpoints is None else ["--checkpoints", str(checkpoints.resolve())]
    args = [sys.executable, "-m", "pipeline.launching.preflight", *folder, "--token", token, "--node", node]
    return f"cd {shlex.quote(str(Path.cwd()))} && {shlex.join(args)}"


def gather(cluster: Cluster, *, checkpoints: Path | None, token: str) -> list[tuple[str, int, str, str]]:
    """(host, exit code, stdout, stderr) of the pre-flight on every node of `cluster`."""
    if cluster.mode == "slurm":
        command = node_command(checkpoints=checkpoints, token=token, node="NODE").replace("NODE", "$SLURM_NODEID")
        done = subprocess.run(
            ["srun", "--nodes", str(len(cluster.hosts)), "--ntasks-per-node", "1", "--label", "sh", "-c", command],
            capture_output=True, text=True, timeout=TIMEOUT_S,
        )  # fmt: skip
        lines = {}
        for line in done.stdout.splitlines():  # --label: "TASK: output", task i on node i; a long line in pieces
            task, _, text = line.partition(": ")
            lines[int(task)] = lines.get(int(task), "") + text
        return [(host, done.returncode if i not in lines else 0, lines.get(i, ""), done.stderr)
                for i, host in enumerate(cluster.hosts)]  # fmt: skip
    results = []
    for i, host in enumerate(cluster.hosts):
        command = node_command(checkpoints=checkpoints, token=token, node=str(i))
        try:
            done = subprocess.run(["ssh", *ssh_options(), host, command], capture_output=True, text=True,
                                  timeout=TIMEOUT_S)  # fmt: skip
            results.append((host, done.returncode, done.stdout, done.stderr))
        except subprocess.TimeoutExpired:
            results.append((host, 255, "", f"no answer within {TIMEOUT_S} s"))
    return results


def check_nodes(cluster: Cluster, *, checkpoints: Path | None) -> None:
    """Refuse the run, naming the node and what to do, unless every node of `cluster` answers, runs this node's code
    and packages and (with `checkpoints`) shares that folder with this one."""
    token = uuid.uuid4().hex
    probes = None if checkpoints is None else checkpoints / PROBES
    if probes is not None:
        probes.mkdir(parents=True, exist_ok=True)
        (probes / token).write_text(socket.gethostname(), encoding="utf-8")
    try:
        here = report(root=Path.cwd(), checkpoints=None, token=token, node=-1)
        for node, (host, code, out, err) in enumerate(gather(cluster, checkpoints=checkpoints, token=token)):
            check_node(host, code, out, err, here=here)
            shared = probes is None or json.loads(out)["sees_probe"] and (probes / f"{token}.node{node}").is_file()
            if not shared:
                raise ValueError(
                    f"launcher: {checkpoints.resolve()} is not shared with node {host}: a file written on either side "
                    "is not there on the other; expected the checkpoint folder on storage every node sees (every rank "
                    "writes its shards there, and rank 0 the tag a resume reads)"
                )
    finally:
        if probes is not None:
            for probe in probes.glob(f"{token}*"):
                probe.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # another run's probes are still there
                probes.rmdir()


def check_node(host: str, code: int, out: str, err: str, *, here: dict) -> None:
    """One node's pre-flight answer against this node's identity."""
    last = (err.strip().splitlines() or ["(no output)"])[-1]
    if code == 255:
        raise ValueError(
            f"launcher: node {host} cannot be reached over ssh ({last}); expected passwordless ssh from this node to "
            "every host of the hostfile (~/.ssh/config, or ssh options in PDSH_SSH_ARGS_APPEND)"
        )
    if code != 0:
        raise ValueError(
            f"launcher: node {host} could not run the pre-flight in {Path.cwd()} ({last}); expected the project and "
            "its virtual environment at the same paths on every node"
        )
    there = json.loads(out)
    if there["code"] != here["code"]:
        raise ValueError(
            f"launcher: node {host} has other code in {Path.cwd()} than this node (digest {there['code'][:12]} vs "
            f"{here['code'][:12]} over {', '.join(CODE)} and dvc.lock); expected the same checkout on every node"
        )
    if differ := package_differences(there["packages"], here["packages"]):
        raise ValueError(
            f"launcher: node {host} has other packages than this node ({differ}); expected the same environment "
            "on every node (make setup from the same constraints.txt)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--checkpoints", type=Path)
    parser.add_argument("--token", required=True)
    parser.add_argument("--node", type=int, required=True)
    args = parser.parse_args()
    print(json.dumps(report(root=Path.cwd(), checkpoints=args.checkpoints, token=args.token, node=args.node)))


if __name__ == "__main__":
    main()
