"""Running the train stage in tests: the tiny settings, the command line, and comparisons of two trainings."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file

from pipeline.core import config
from pipeline.core.environment import with_venv_path
from tests.conftest import REPO

# Adam moves a parameter by lr * m / (sqrt(v) + eps). A gradient that is the fp32 rounding residue of a sum that
# cancels (|g| ~ 1e-8 from terms ~0.1: a token on both sides of a preference pair, a row reached only through the
# softmax) moves its parameter by up to lr a step whatever its sign under eps = 1e-8, so two summation orders (1 rank
# and 2, one CPU's kernels and another's) end up to lr x steps apart (1.2e-3 measured under ATEN_CPU_CAPABILITY=avx2).
# Under eps = 1e-4 the same residue moves it by lr x 1e-8 / 1e-4 a step: 5e-7 a step at lr 5e-3, below the 1e-5 the
# tests compare within after 6-10 steps (2.6e-6 measured), and the gradients of the trained tensors (above 1e-4)
# still train them as under 1e-8.
TINY = [
    "train.precision=fp32", "train.max_steps=6", "train.warmup_steps=1", "train.lr=5e-3", "train.save_every=3",
    "train.eval_every=3", "train.micro_batch_size=1", "train.global_batch_size=4", "lora.dropout=0.0",
    "lora.r=4", "launcher.accelerator=cpu", "lora.modules_to_save=[embed_tokens,lm_head]", "train.adam_epsilon=1e-4",
]  # fmt: skip
TWO_RANKS = ["launcher.ranks_per_node=2", "train.gradient_accumulation_steps=2"]
ONE_RANK = ["launcher.ranks_per_node=1", "train.gradient_accumulation_steps=4"]


def train_command(inputs: Path, base: Path, out: Path, overrides: list[str]) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    raw = config.compose(REPO / "conf", ["tracking.uri=", *overrides])
    (out / "params.yaml").write_text(yaml.safe_dump(raw))
    return [
        sys.executable, "-m", "stages.train", "--params", str(out / "params.yaml"), "--base", str(base),
        "--tokenizer", str(inputs / "tokenizer"), "--dataset", str(inputs / "dataset"),
        "--checkpoints", str(out / "checkpoints"), "--metrics", str(out / "metrics.json"),
        "--curve", str(out / "curve.csv"), "--run-id-file", str(out / "run_id.json"),
        "--final-state", str(out / "final.safetensors"),
    ]  # fmt: skip


def cache_rows(root: Path, *, inputs: Path, base: Path, overrides: list[str], source: Path | None = None) -> Path:
    """root/dataset: rows cached by the cache_dataset stage under `overrides`, with the tiny run's tokenizer
    (root/tokenizer); a `source` file is the train and the held-out file, a tenth of its rows for validation."""
    (root / "tokenizer").symlink_to(inputs / "tokenizer")
    files = [f"data.train_file={source}", f"data.heldout_file={source}", "data.validation_fraction=0.1"]
    raw = config.compose(REPO / "conf", ["tracking.uri=", *overrides, *(files if source else [])])
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    subprocess.run([
        sys.executable, "-m", "stages.cache_dataset", "--params", str(root / "params.yaml"),
        "--tokenizer", str(inputs / "tokenizer"), "--base-config", str(base / "config.json"),
        "--out", str(root / "dataset"), "--metrics", str(root / "dataset.json"),
        "--run-id-file", str(root / "run.json"),
    ], cwd=REPO, env=env(), check=True, capture_output=True)  # fmt: skip
    return root


def env() -> dict:
    return with_venv_path()


def train(
    inputs: Path,
    base: Path,
    out: Path,
    overrides: list[str],
    check: bool = True,
    extra: tuple[str, ...] = (),
    cwd: Path = REPO,
    refuse_torch: bool = False,
) -> subprocess.CompletedProcess:
    """The train stage as a process (its own params.yaml under `out`) run in `cwd` (a copy of the project's code:
    its `stages` and `pipeline` are the ones imported); `extra`: more stage arguments. `refuse_torch`: the stage's
    process fails if it imports torch (tests/helpers/without_torch.py; its ranks are not affected)."""
    args = [*train_command(inputs, base, out, overrides), *extra]
    if refuse_torch:
        args[1:2] = ["-m", "tests.helpers.without_torch"]
    done = subprocess.run(args, cwd=cwd, env=env(), capture_output=True, text=True)
    if check and done.returncode:
        raise AssertionError(f"train exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done


def killed_after_a_checkpoint(inputs: Path, base: Path, out: Path, overrides: list[str]) -> str:
    """Start the train stage and SIGKILL its whole process group once a checkpoint exists; that checkpoint's tag."""
    process = subprocess.Popen(
        train_command(inputs, base, out, overrides), cwd=REPO, env=env(), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not (out / "checkpoints" / "latest").exists():
        assert process.poll() is None and time.monotonic() < deadline, "no checkpoint before the run ended"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return (out / "checkpoints" / "latest").read_text()


def losses(out: Path) -> list[float]:
    rows = (out / "curve.csv").read_text().splitlines()[1:]
    return [float(r.split(",")[1]) for r in rows]


def assert_same_training(a: Path, b: Path, atol: float) -> None:
    """Losses and every trained tensor within atol."""
    torch.testing.assert_close(torch.tensor(losses(a)), torch.tensor(losses(b)), atol=atol, rtol=0)
    left, right = load_file(a / "final.safetensors"), load_file(b / "final.safetensors")
    assert left.keys() == right.keys()
    for name in left:
        torch.testing.assert_close(left[name], right[name], atol=atol, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
