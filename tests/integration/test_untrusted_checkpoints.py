"""Checkpoints from elsewhere are read as data, never as code (docs/checkpoints.md, "What we never execute"), tried as
an attacker would, with pickles written opcode by opcode from pickle's definition and whole files from torch's and
zip's writers (tests/helpers/crafted_pickles.py), on one real 2-rank ZeRO-2 checkpoint (the session's
`two_ranks_zero2`):

- every construct through every entry point that reads a pickle is refused: exit 2, the file and the construct
  named in one line, no traceback, nothing run, nothing written, every input as it was (one process for all cases:
  tests/helpers/untrusted_entries.py);
- the train stage, as a process, refuses the three holes reported in issue 42 before a rank reads anything;
- a real resume, of the same layout (DeepSpeed's `load_checkpoint`) and of another (the universal form), runs with
  every unpickling outside the loader made to fail in every process (tests/helpers/unpickling_guard): it trains on,
  and the ranks read their checkpoint files through the loader; the guard does trip on DeepSpeed's own loader;
- `--trust-pickles` lifts the check, for a user's own files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.checkpoints.consolidate import consolidate
from pipeline.checkpoints.universal import to_universal
from tests.conftest import REPO
from tests.helpers import crafted_pickles as crafted
from tests.helpers.training import ONE_RANK, TINY, TWO_RANKS, env, train, train_command

pytestmark = pytest.mark.integration
GUARD = REPO / "tests" / "helpers" / "unpickling_guard"
TAG = "step_000006"


@pytest.fixture(scope="module")
def universal_form(two_ranks_zero2, tmp_path_factory) -> Path:
    """The universal layout of the 2-rank ZeRO-2 run's last checkpoint."""
    out = tmp_path_factory.mktemp("universal") / "universal"
    to_universal(two_ranks_zero2 / "checkpoints" / TAG, out)
    return out


def test_every_construct_through_every_entry_point_is_refused(two_ranks_zero2, universal_form, tiny_base_dir, tmp_path):
    adapter = tmp_path / "adapter"
    consolidate(checkpoint_dir=two_ranks_zero2 / "checkpoints", output_dir=adapter)
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog, again and again\n" * 20)
    (tmp_path / "work").mkdir()
    config = {
        "checkpoints": str(two_ranks_zero2 / "checkpoints"), "universal": str(universal_form),
        "base": str(tiny_base_dir), "adapter": str(adapter), "text": str(tmp_path / "text.txt"),
        "work": str(tmp_path / "work"),
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    command = [sys.executable, "-m", "tests.helpers.untrusted_entries", str(tmp_path / "config.json")]
    done = subprocess.run(command, cwd=REPO, env=env(), capture_output=True, text=True)
    assert done.returncode == 0, f"the driver died (exit {done.returncode}): {done.stderr[-3000:]}"
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    entries = {r["entry"] for r in results}
    assert len(entries) == 14 and len(results) >= 150, (len(entries), len(results))
    failed = [r for r in results if r["problems"]]
    assert failed == [], json.dumps(failed[:10], indent=1)


def _their_folder(two_ranks_zero2: Path, folder: Path, file: str, construct: str, marker: Path) -> Path:
    """A copy of the fixture run's checkpoints (last tag) whose `file` carries `construct`."""
    folder.mkdir()
    shutil.copytree(two_ranks_zero2 / "checkpoints" / TAG, folder / TAG)
    (folder / "latest").write_text(TAG)
    payload, _ = crafted.payloads(marker)[construct]
    key = "extra"
    if file.startswith("rng_state"):  # its numpy entry: ('MT19937', an object array of forged pointers, 0, 0, 0.0)
        key, payload = "numpy", crafted.tuple_(crafted.text("MT19937"), payload, crafted.small(0), crafted.small(0))
    return crafted.carry(folder / TAG / file, key, payload)


@pytest.mark.parametrize(
    ("file", "construct", "named"),
    [
        ("zero_pp_rank_1_mp_rank_00_optim_states.pt", "INST os.system", "opcode STRING"),
        ("mp_rank_00_model_states.pt", "STACK_GLOBAL deepspeed.runtime.engine.os.system", "opcode STACK_GLOBAL"),
        ("rng_state_rank1.pt", "numpy array of object dtype", "numpy dtype 'O8'"),
    ],
)
def test_the_train_stage_refuses_the_reported_holes(
    two_ranks_zero2, inputs, tiny_base_dir, tmp_path, file, construct, named
):
    """Issue 42's three cases as a user meets them: train.resume_from a folder another tool or person wrote."""
    marker = tmp_path / "executed"
    target = _their_folder(two_ranks_zero2, tmp_path / "theirs", file, construct, marker)
    overrides = [*TINY, *TWO_RANKS, "deepspeed=zero2", f"train.resume_from={tmp_path / 'theirs'}"]
    done = train(inputs, tiny_base_dir, tmp_path / "run", overrides, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 2 and "Traceback" not in output, output[-3000:]
    assert any(str(target) in line and named in line for line in output.splitlines()), output[-3000:]
    assert not marker.exists(), "nothing was executed"
    assert not (tmp_path / "run" / "checkpoints").exists(), "refused before the run's folder was made"


def _guarded_run(inputs, base: Path, out: Path, overrides: list[str]) -> tuple[subprocess.CompletedProcess, dict]:
    """The train stage with every unpickling outside the loader failing in every process; {process argv: files it
    loaded through the loader} and the violations, from the guard's log."""
    log = out / "guard"
    log.mkdir(parents=True)
    guarded = {**env(), "PYTHONPATH": os.pathsep.join([str(GUARD), str(REPO)]), "UNPICKLING_GUARD_LOG": str(log)}
    done = subprocess.run(
        train_command(inputs, base, out, overrides), cwd=REPO, env=guarded, capture_output=True, text=True
    )
    loads = {}
    for path in log.glob("loads-*"):
        argv, *lines = path.read_text().splitlines()
        loads[argv] = [Path(line.removeprefix("restricted ")) for line in lines]
    violations = [path.read_text() for path in log.glob("violations-*")]
    return done, {"loads": loads, "violations": violations}


def _ranks(guard: dict) -> list[list[Path]]:
    return [files for argv, files in guard["loads"].items() if "--local_rank=" in argv]


def resumed_for(overrides: list[str], steps: int = 7) -> list[str]:
    return [o for o in overrides if not o.startswith("train.max_steps=")] + [f"train.max_steps={steps}"]


def test_a_resume_unpickles_nothing_outside_the_loader(two_ranks_zero2, inputs, tiny_base_dir, tmp_path):
    """Same layout: DeepSpeed's engine.load_checkpoint reads the model states and each rank's optimizer shard, then
    the RNG states are set; every one of those reads goes through the loader."""
    theirs = two_ranks_zero2 / "checkpoints"
    overrides = resumed_for([*TINY, *TWO_RANKS, "deepspeed=zero2", f"train.resume_from={theirs}"])
    done, guard = _guarded_run(inputs, tiny_base_dir, tmp_path / "run", overrides)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert guard["violations"] == [], guard["violations"][0][:3000]
    ranks = _ranks(guard)
    assert len(ranks) == 2, guard["loads"].keys()
    read = {p.name for files in ranks for p in files if p.parent == theirs / TAG}
    expected = {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)} | {"mp_rank_00_model_states.pt"}
    assert expected | {"rng_state_rank0.pt", "rng_state_rank1.pt"} <= read, read
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == 6 and metrics["steps"] == 7


def test_a_resume_under_another_layout_unpickles_nothing_outside_the_loader(
    two_ranks_zero2, inputs, tiny_base_dir, tmp_path
):
    """2 ranks -> 1: the tag is converted to the universal form beside it, which the rank places into its engine
    through the loader (every parameter's files, the model states)."""
    theirs = tmp_path / "theirs"
    shutil.copytree(two_ranks_zero2 / "checkpoints", theirs)
    overrides = resumed_for([*TINY, *ONE_RANK, "deepspeed=zero2", f"train.resume_from={theirs}"])
    done, guard = _guarded_run(inputs, tiny_base_dir, tmp_path / "run", overrides)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert guard["violations"] == [], guard["violations"][0][:3000]
    (rank,) = _ranks(guard)
    universal = theirs / f"{TAG}_universal"
    assert {p.name for p in rank if universal in p.parents} >= {"fp32.pt", "exp_avg.pt", "exp_avg_sq.pt", "step.pt"}
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["resumed_from_step"] == 6 and metrics["steps"] == 7


def test_the_guard_trips_on_deepspeeds_own_checkpoint_engine(two_ranks_zero2, tmp_path):
    """Without our checkpoint engine, DeepSpeed's TorchCheckpointEngine.load would unpickle the file itself: the
    guard of the two tests above stops it (so their silence means something)."""
    shard = two_ranks_zero2 / "checkpoints" / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    script = (
        "import sys\n"
        "from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine\n"
        "from pipeline.checkpoints.engine_loads import RestrictedLoads\n"
        "RestrictedLoads(TorchCheckpointEngine()).load(sys.argv[1])\n"
        "try:\n"
        "    TorchCheckpointEngine().load(sys.argv[1])\n"
        "except RuntimeError as err:\n"
        "    print('stopped:', err)\n"
    )
    guarded = {**env(), "PYTHONPATH": os.pathsep.join([str(GUARD), str(REPO)]), "UNPICKLING_GUARD_LOG": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, "-c", script, str(shard)], cwd=REPO, env=guarded, capture_output=True, text=True
    )
    assert "stopped: unpickling guard: torch.load(" in done.stdout, done.stdout + done.stderr[-2000:]
    assert len(list(tmp_path.glob("violations-*"))) == 1


def test_trust_pickles_lifts_the_check_for_your_own_files(two_ranks_zero2, tmp_path):
    marker, out = tmp_path / "executed", tmp_path / "adapter"
    _their_folder(
        two_ranks_zero2, tmp_path / "ckpt", "zero_pp_rank_1_mp_rank_00_optim_states.pt", "GLOBAL posix.system", marker
    )
    command = [sys.executable, "-m", "pipeline", "consolidate", str(tmp_path / "ckpt"), str(out)]
    refused = subprocess.run(command, cwd=REPO, env=env(), capture_output=True, text=True)
    assert refused.returncode == 2 and "GLOBAL posix.system" in refused.stderr and not marker.exists()
    done = subprocess.run([*command, "--trust-pickles"], cwd=REPO, env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert marker.exists() and (out / "adapter_model.safetensors").exists()
