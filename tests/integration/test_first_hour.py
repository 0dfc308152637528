"""A new user's first hour, through real `dvc exp run`: their own text and instruction files with nothing else set,
mistakes stopped before any output is deleted (and the one command that restores the workspace), readable results,
quiet output, and no silent hang after a launch killed while DeepSpeed built its ops."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from pipeline.core.atomic import read_json
from pipeline.core.environment import clear_stale_build_locks, extensions_dir, with_venv_path, working_in
from tools.repro_check import GIT, copy_project, sh

pytestmark = pytest.mark.integration
OWN = ["-S", "experiment=ci_own"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory, tiny_base_dir, peoples_daily) -> Path:
    """A git+DVC copy of the project, a user's text file and instruction file, and the experiment `ci_own`: the
    tiny experiment with `data=own` on the tiny LLaMA (tracking off)."""
    root = copy_project(tmp_path_factory.mktemp("first_hour"))
    user = root / "user"
    user.mkdir()
    (user / "notes.txt").write_text("\n".join(peoples_daily[:160]) + "\n", encoding="utf-8")
    rows = [{"instruction": "Summarise:", "input": text[:80], "output": text[:12]} for text in peoples_daily[:60]]
    (user / "instructions.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    experiment = {
        "defaults": ["tiny", {"override /data": "own"}],
        "model": {"path": str(tiny_base_dir)},
        "data": {"train_file": "user/notes.txt"},
        "tracking": {"uri": ""},
    }
    (root / "conf/experiment/ci_own.yaml").write_text("# @package _global_\n" + yaml.safe_dump(experiment))
    sh([*GIT, "add", "-A"], root)
    sh([*GIT, "commit", "-qm", "the user's data"], root)
    return root


@pytest.fixture(scope="module")
def own_run(repo) -> subprocess.CompletedProcess:
    """The whole pipeline (up to evaluate) on the user's text file, committed as the baseline."""
    done = sh(["dvc", "exp", "run", "evaluate", *OWN], repo)
    sh([*GIT, "add", "-A"], repo)
    sh([*GIT, "commit", "-qm", "own data, evaluated"], repo)
    return done


def test_own_text_file_in_one_step(repo, own_run):
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert params["data"]["train_file"] == params["data"]["heldout_file"] == params["tokenizer"]["train_file"]
    documents = (repo / "user/notes.txt").read_text(encoding="utf-8").splitlines()
    held = (repo / "artifacts/eval_sets/in_domain/items.jsonl").read_text(encoding="utf-8").splitlines()
    assert [json.loads(line)["text"] for line in held] == documents[-8:], "the last 5%: the in-domain set"
    evaluation = read_json(repo / "metrics/eval.json")
    assert set(evaluation) == {"in_domain", "en_wiki", "variant"} and evaluation["in_domain"]["adapter"]["bytes"] > 0
    assert read_json(repo / "metrics/dataset.json")["documents"] == 152, "the held-out documents are not trained on"
    output = own_run.stdout + own_run.stderr
    assert "FutureWarning" not in output and "CUDA_VISIBLE_DEVICES" not in output, "nothing a user can do nothing about"


def test_own_instruction_file_in_one_step(repo, own_run):
    jsonl = ["-S", "data.format=alpaca", "-S", "data.train_file=user/instructions.jsonl"]
    try:
        sh(["dvc", "exp", "run", "cache_dataset", "eval_set@in_domain", *OWN, *jsonl], repo)
        stats = read_json(repo / "metrics/dataset.json")
        assert stats["examples"] == 57 and stats["masked_fraction"] > 0.5, stats  # 3 of 60 rows held out
        held = (repo / "artifacts/eval_sets/in_domain/items.jsonl").read_text(encoding="utf-8").splitlines()
        assert [json.loads(line)["output"] for line in held] == [r[:12] for r in _documents(repo)[57:60]]
    finally:
        sh(["git", "checkout", "--", "."], repo)
        sh(["dvc", "checkout", "-q"], repo, check=False)


def _documents(repo: Path) -> list[str]:
    return (repo / "user/notes.txt").read_text(encoding="utf-8").splitlines()


def _outputs(repo: Path) -> dict[str, str]:
    """Every output file's content hash (DVC deletes a stage's outputs before it re-runs it; a persistent output such
    as artifacts/checked.json is copied out of the cache first, which changes its time but not its bytes)."""
    files = sorted(p for folder in ("metrics", "artifacts", "data") for p in (repo / folder).rglob("*") if p.is_file())
    return {str(p.relative_to(repo)): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


@pytest.mark.parametrize(
    ("mistake", "message"),
    [
        (["train.lr=fast"], "train.lr: input should be a valid number, got 'fast'"),
        (["data.train_file=/nonexistent.txt"], "data.train_file: /nonexistent.txt: data file not found"),
        (["+lora.rank=8"], "unknown key 'lora.rank'; did you mean 'lora.r'?"),
        (["lora.rank=8"], "lora.rank"),  # Hydra's own refusal, before anything runs
        (["tokenizer.vocab_size=16000"], "tokenizer.vocab_size=16000 has no effect: tokenizer.extend is false"),
        (
            ["train.global_batch_size=3"],
            "train.global_batch_size: 3 is not a multiple of train.micro_batch_size (1) x world size (2)",
        ),  # on the 2 CPU ranks: found by check, not by train after DVC deleted its outputs
        (
            ["train.attention=flash_attention_2"],
            "train.attention: flash_attention_2 needs a CUDA accelerator; expected auto, sdpa or eager here",
        ),
        (
            ["lora.target_modules=[q_proj,qkv_proj]"],
            "lora.target_modules: ['qkv_proj'] match no Linear layer; "
            "available: ['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', 'up_proj', 'v_proj']",
        ),
    ],
)
def test_a_mistake_stops_before_any_output_is_deleted(repo, own_run, mistake, message):
    before = _outputs(repo)
    done = sh(["dvc", "exp", "run", "evaluate", *OWN, *(x for m in mistake for x in ("-S", m))], repo, check=False)
    output = done.stdout + done.stderr
    assert done.returncode != 0 and message in output, output[-2000:]
    assert "Traceback" not in output
    assert _outputs(repo) == before, "no output deleted or rewritten"
    sh(["git", "checkout", "--", "params.yaml"], repo)  # the README's way back
    assert "up to date" in sh(["dvc", "status", "evaluate"], repo).stdout


def test_report_fits_a_terminal(repo, own_run):
    done = subprocess.run(
        [sys.executable, "-m", "tools.report"], cwd=repo, env=with_venv_path(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert max(map(len, lines)) < 100 and lines[0].split()[:3] == ["set", "model", "bits/byte"]
    assert any(line.startswith("in_domain") and "adapter" in line for line in lines)
    assert any(line.startswith("merge proof: max |logit diff|") for line in lines)


def compilers_in(folder: Path, *, launch: int) -> list[psutil.Process]:
    """The processes working in `folder` outside the process group `launch` (ninja runs each compile in a group of
    its own, so killing a launch's group leaves its compilers running to their end)."""
    found = []
    for process in working_in(folder):
        with contextlib.suppress(OSError):
            if os.getpgid(process.pid) != launch:
                found.append(process)
    return found


def test_a_launch_killed_while_building_ops_leaves_no_hang(tmp_path):
    """SIGKILL a process in the middle of DeepSpeed's JIT build of its CPU all-reduce op: the lock it leaves is kept
    while the compilers it started still work in the build folder (stopped here, so that they cannot finish first),
    found stale and removed once they are gone, and the next launch then takes the lock and loads the op. Its build
    outputs are first copied from the environment's (make setup built them with the same commands): ninja finds
    nothing left to do, the lock is what this proves (a whole build again cost the suite about 60 s of CPU)."""
    env = {**with_venv_path(), "TORCH_EXTENSIONS_DIR": str(tmp_path), "DS_ACCELERATOR": "cpu"}
    build = "from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load(verbose=False)"
    process = subprocess.Popen([sys.executable, "-c", build], env=env, start_new_session=True)
    folder = tmp_path / "deepspeed_shm_comm"
    deadline = time.monotonic() + 120
    while not compilers_in(folder, launch=process.pid):
        assert process.poll() is None and time.monotonic() < deadline, "the build never started"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    compilers = compilers_in(folder, launch=process.pid)
    for compiler in compilers:
        compiler.suspend()
    try:
        assert (folder / "lock").exists(), "the killed build left its lock"
        assert compilers, "no compiler outlived the launch"
        assert clear_stale_build_locks(tmp_path, older_than=0) == [], "a lock removed while its compilers work"
    finally:
        for compiler in compilers:
            with contextlib.suppress(psutil.Error):
                compiler.kill()
        psutil.wait_procs(compilers, timeout=60)
    assert clear_stale_build_locks(tmp_path, older_than=0) == [folder / "lock"]
    for built in (extensions_dir() / folder.name).iterdir():
        if built.name != "lock":
            shutil.copy2(built, folder / built.name)
    done = subprocess.run([sys.executable, "-c", build], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
