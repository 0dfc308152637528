"""Training across nodes through the launchers clusters run, with the real parts: sshd on the loopback interface,
pdsh and DeepSpeed's multi-node runner (tests/helpers/nodes.py); the pre-flight's refusals, each with the message a
user needs, before any rank starts."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pipeline.core.atomic import read_json
from tests.conftest import REPO
from tests.helpers import nodes as cluster_nodes
from tests.helpers import slurm
from tests.helpers.training import TINY, assert_same_training, env, train_command

pytestmark = [
    pytest.mark.integration,
    pytest.mark.needs(cluster_nodes.missing()),
]
TWO_NODES = "localhost slots=1\n127.0.0.1 slots=1\n"
# The tiny pipeline's 4 steps, then 2 more: a run of its own (its finished checkpoint would be reported, not retrained)
LONGER = ("train.max_steps=6",)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    served = cluster_nodes.start(tmp_path_factory.mktemp("nodes"))
    for host in ("localhost", "127.0.0.1"):
        served.add(host)
    yield served
    served.stop()


def ssh_train(inputs, base, out, hostfile_text: str, nodes, extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    hostfile = out / "hostfile"
    out.mkdir(parents=True, exist_ok=True)
    hostfile.write_text(hostfile_text)
    overrides = [*TINY, "launcher=ssh", f"launcher.hostfile={hostfile}", "train.gradient_accumulation_steps=2",
                 "launcher.accelerator=cpu", *extra]  # fmt: skip
    command = train_command(inputs, base, out, overrides)
    return subprocess.run(command, cwd=REPO, env={**env(), **nodes.env}, capture_output=True, text=True)


def test_ssh_trains_across_two_nodes_as_one_rank_does(tmp_path, inputs, tiny_base_dir, reference, nodes):
    """launcher=ssh: the stage starts both nodes' ranks through DeepSpeed's pdsh runner (world size 2, one rank a
    node), and they train what one rank trains on the same global batch."""
    done = ssh_train(inputs, tiny_base_dir, tmp_path, TWO_NODES, nodes)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    plan = read_json(tmp_path / "checkpoints" / "plan.json")
    assert (plan["launch"]["world_size"], plan["launch"]["ranks_per_node"]) == (2, 1)
    left = {p.name for p in (tmp_path / "checkpoints").iterdir()}
    assert not left & {"launch.json", ".deepspeed_env", ".preflight"}, "nothing of the launch in the DVC output"
    assert_same_training(tmp_path, reference, atol=1e-5)
    assert "127.0.0.1: " in done.stdout + done.stderr  # pdsh names the node of each line


def refusal(done: subprocess.CompletedProcess) -> str:
    output = done.stdout + done.stderr
    assert done.returncode != 0 and "Traceback" not in output, output[-3000:]
    return output


def test_a_node_that_cannot_be_reached_is_named(tmp_path, inputs, tiny_base_dir, nodes):
    done = ssh_train(inputs, tiny_base_dir, tmp_path, "localhost slots=1\n127.0.0.9 slots=1\n", nodes)
    assert "launcher: node 127.0.0.9 cannot be reached over ssh (" in refusal(done)
    assert "expected passwordless ssh from this node to every host of the hostfile" in refusal(done)
    assert not (tmp_path / "checkpoints" / "plan.json").exists(), "refused before the run was planned"


def test_a_node_with_other_code_is_refused(tmp_path, inputs, tiny_base_dir, nodes):
    """Node 127.0.0.2 sees another checkout at the project's path: one comment more in pipeline/."""
    other = tmp_path / "other_pipeline"
    subprocess.run(["cp", "-r", str(REPO / "pipeline"), str(other)], check=True)
    with (other / "training" / "cluster.py").open("a") as f:
        f.write("# changed on this node only\n")
    nodes.add("127.0.0.2", mounts={REPO / "pipeline": other})
    done = ssh_train(inputs, tiny_base_dir, tmp_path, "localhost slots=1\n127.0.0.2 slots=1\n", nodes)
    assert f"launcher: node 127.0.0.2 has other code in {REPO} than this node" in refusal(done)
    assert "expected the same checkout on every node" in refusal(done)


def test_a_node_with_other_packages_is_refused(tmp_path, inputs, tiny_base_dir, nodes):
    """Node 127.0.0.4 sees another version of one package in the project's virtual environment."""
    from importlib import metadata

    installed = next(Path(str(metadata.distribution("hjson").locate_file(""))).glob("hjson-*.dist-info"))
    other = tmp_path / "other_dist_info"
    shutil.copytree(installed, other)
    text = (other / "METADATA").read_text(encoding="utf-8")
    (other / "METADATA").write_text(re.sub(r"(?m)^Version: .*$", "Version: 9.9.9", text), encoding="utf-8")
    nodes.add("127.0.0.4", mounts={installed: other})
    done = ssh_train(inputs, tiny_base_dir, tmp_path, "localhost slots=1\n127.0.0.4 slots=1\n", nodes)
    version = metadata.version("hjson")
    assert f"launcher: node 127.0.0.4 has other packages than this node (hjson 9.9.9 vs {version})" in refusal(done)
    assert "expected the same environment on every node" in refusal(done)
    assert not (tmp_path / "checkpoints" / "plan.json").exists(), "refused before the run was planned"


def test_a_checkpoint_folder_the_nodes_do_not_share_is_refused(tmp_path, inputs, tiny_base_dir, nodes):
    """Node 127.0.0.3 sees a disk of its own at the checkpoint folder's path (a node-local disk)."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "local_disk").mkdir()
    nodes.add("127.0.0.3", mounts={tmp_path / "checkpoints": tmp_path / "local_disk"})
    done = ssh_train(inputs, tiny_base_dir, tmp_path, "localhost slots=1\n127.0.0.3 slots=1\n", nodes)
    output = refusal(done)
    assert f"launcher: {tmp_path / 'checkpoints'} is not shared with node 127.0.0.3" in output
    assert "expected the checkpoint folder on storage every node sees" in output
    assert not (tmp_path / "checkpoints" / ".preflight").exists(), "the probes are removed"


def ranks_of(plan: Path) -> dict[int, int]:
    """{global rank: pid} of the rank processes training `plan`."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
        except (OSError, ValueError):
            continue
        if b"pipeline.training.rank" in cmdline and str(plan).encode() in cmdline and b"RANK" in environ:
            found[int(environ[b"RANK"])] = int(proc.name)
    return found


def test_a_node_that_dies_stops_the_job_and_the_rerun_resumes_as_if_uninterrupted(
    tmp_path, inputs, tiny_base_dir, nodes
):
    longer = ("train.max_steps=24", "train.save_every=4")
    whole = ssh_train(inputs, tiny_base_dir, tmp_path / "whole", TWO_NODES, nodes, longer)
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    run = tmp_path / "killed"
    run.mkdir()
    (run / "hostfile").write_text(TWO_NODES)
    overrides = [*TINY, "launcher=ssh", f"launcher.hostfile={run / 'hostfile'}", "train.gradient_accumulation_steps=2",
                 "launcher.accelerator=cpu", *longer]  # fmt: skip
    command = train_command(inputs, tiny_base_dir, run, overrides)
    stage = subprocess.Popen(command, cwd=REPO, env={**env(), **nodes.env}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)  # fmt: skip
    latest, plan = run / "checkpoints" / "latest", (run / "checkpoints" / "plan.json").resolve()
    deadline = time.time() + 300
    while not (latest.is_file() and latest.read_text().strip() == "step_000004"):
        assert stage.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.05)
    os.kill(ranks_of(plan)[1], signal.SIGKILL)  # node 1 dies
    started = time.time()
    output = stage.communicate(timeout=120)[0]
    assert stage.returncode != 0 and time.time() - started < 120, output[-3000:]
    time.sleep(2)
    assert ranks_of(plan) == {}, "no rank of the job outlives it"
    resumed = subprocess.run(command, cwd=REPO, env={**env(), **nodes.env}, capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert read_json(run / "metrics.json")["resumed_from_step"] >= 4
    assert_same_training(run, tmp_path / "whole", atol=1e-5)


def test_one_dvc_exp_run_trains_across_the_nodes_and_runs_the_rest_once(tmp_path, tiny_pipeline, nodes):
    """The README's command on the tiny pipeline's project: only train and what follows it run again, train across
    two ssh nodes (world 2: that it trains as one rank does is the first test's), every other stage once, here."""
    project = tmp_path / "project"
    shutil.copytree(tiny_pipeline.roots[0], project, symlinks=True)
    (tmp_path / "hostfile").write_text(TWO_NODES)
    overrides = [*tiny_pipeline.overrides, *LONGER, "launcher=ssh", f"launcher.hostfile={tmp_path / 'hostfile'}",
                 "launcher.accelerator=cpu"]  # fmt: skip
    sets = [x for o in overrides for x in ("-S", o)]
    done = subprocess.run(["dvc", "exp", "run", *sets], cwd=project, env={**env(), **nodes.env}, capture_output=True,
                          text=True)  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    ran = re.findall(r"Running stage '([\w@.-]+)'", output)
    assert "train" in ran and len(ran) == len(set(ran)) and not {"prepare_base", "cache_dataset"} & set(ran), ran
    after = read_json(project / "metrics" / "train.json")
    assert (after["world_size"], after["steps"], after["resumed_from_step"]) == (2, 6, 0)
    launched = read_json(project / "artifacts" / "checkpoints" / "plan.json")["launch"]
    assert (launched["world_size"], launched["ranks_per_node"]) == (2, 1)  # one rank on each of the two nodes
    assert "reused_checkpoint" not in after, "trained, not reported"
    merge = read_json(project / "metrics" / "merge.json")
    assert merge["max_abs_logit_diff"] <= merge["limit_abs"]
    assert "up to date" in subprocess.run(["dvc", "status"], cwd=project, capture_output=True, text=True).stdout


@pytest.mark.needs(slurm.missing())
def test_the_sbatch_template_trains_across_two_slurm_nodes(tmp_path, tiny_pipeline):
    """tools/slurm_train.sbatch through a real Slurm of two nodes: the batch script runs the pipeline on the first
    node, the train stage one launcher per node through srun (world 2, one rank a node)."""
    slurm_env, daemons = slurm.start(folder := tmp_path / "slurm")
    try:
        project = tmp_path / "project"
        shutil.copytree(tiny_pipeline.roots[0], project, symlinks=True)
        overrides = [*tiny_pipeline.overrides, *LONGER, "launcher.accelerator=cpu", "launcher.ranks_per_node=1"]
        sets = [x for o in overrides for x in ("-S", o)]
        command = ["sbatch", "--wait", "--nodes=2", "tools/slurm_train.sbatch", *sets]
        done = subprocess.run(
            command, cwd=project, env={**env(), **slurm_env}, capture_output=True, text=True, timeout=900
        )  # a held job (its launch failed) would keep sbatch --wait forever
        logs = "".join(p.read_text() for p in project.glob("slurm-*.out"))
        assert done.returncode == 0, done.stdout + done.stderr + logs[-4000:]
    finally:
        slurm.stop(folder, daemons)
    after = read_json(project / "metrics" / "train.json")
    assert (after["world_size"], after["steps"], after["resumed_from_step"]) == (2, 6, 0)
    launched = read_json(project / "artifacts" / "checkpoints" / "plan.json")["launch"]
    assert (launched["world_size"], launched["ranks_per_node"]) == (2, 1)  # one rank on each of the two nodes
    assert "reused_checkpoint" not in after, "trained, not reported"
