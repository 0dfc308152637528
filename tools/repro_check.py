"""`make repro-check`: run the whole pipeline twice from scratch, in two fresh copies of the project, on a tiny config;
every output must have the same DVC hash in both dvc.lock files (outputs that record wall-clock measurements are
compared without those, with the reason printed), the evaluation figures must be equal, and `dvc status` must be
clean afterwards. Exit 0 when all holds, 1 with the differences listed otherwise.

    python -m tools.repro_check [--workdir DIR] [OVERRIDE ...]   (default: experiment=tiny on a tiny random LLaMA)
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from pipeline.core.atomic import read_json
from pipeline.core.environment import with_venv_path

REPO = Path(__file__).resolve().parents[1]
GIT = ["git", "-c", "user.name=pipeline", "-c", "user.email=pipeline@localhost", "-c", "commit.gpgsign=false"]
# Outputs that record measurements, each with what is compared instead of its hash.
MEASURED = {
    "artifacts/checkpoints": "trainer_state.json records wall-clock seconds; the adapter consolidated from it is "
    "compared by hash instead",
    "metrics/train.json": "tokens/s, seconds, peak memory and MFU are measurements; every other figure is compared",
    "metrics/dataset.json": "tokens/s per core, seconds and the worker count are measurements; every other figure is "
    "compared",
}
MEASUREMENT_KEYS = (
    "tokens_per_s", "steady_tokens_per_s", "train_seconds", "wall_seconds", "peak_memory_mb", "mfu",
    "peak_memory_mb_per_rank", "peak_gpu_memory_mb", "peak_gpu_memory_mb_per_rank", "load_before_mb_per_rank",
    "load_peak_mb_per_rank",
    "tokens_per_second_per_core", "tokenize_seconds", "workers", "parts_reused",
)  # fmt: skip


def sh(args: list[str], cwd: Path, *, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command with this interpreter's bin folder first on PATH; failures raise with the output."""
    done = subprocess.run(args, cwd=cwd, env={**with_venv_path(), **(env or {})}, capture_output=True, text=True)
    if check and done.returncode:
        raise RuntimeError(
            f"{' '.join(args)} exited {done.returncode} in {cwd}:\n{done.stdout[-5000:]}\n{done.stderr[-5000:]}"
        )
    return done


def copy_project(dst: Path, source: Path = REPO) -> Path:
    """Copy the project's files (tracked, and untracked but not ignored) into `dst`, a new git repository without
    pipeline outputs or dvc.lock: a fresh clone of the working tree."""
    listed = sh(["git", "ls-files", "--cached", "--others", "--exclude-standard"], source).stdout.splitlines()
    for rel in listed:
        if (source / rel).is_file() and rel != "dvc.lock":
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / rel, dst / rel)
    sh(["git", "init", "-q"], dst)
    sh([*GIT, "add", "-A"], dst)
    sh([*GIT, "commit", "-qm", "copy of the project"], dst)
    return dst


def run_pipeline(root: Path, overrides: list[str]) -> None:
    """Compose params.yaml with `overrides` (as `dvc exp run -S` would) and run every stage with `dvc repro`."""
    sh([sys.executable, "-m", "pipeline.core.config", *overrides], root)
    sh(["dvc", "repro"], root)


def _outputs(root: Path) -> dict[tuple[str, str], str]:
    lock = yaml.safe_load((root / "dvc.lock").read_text(encoding="utf-8"))
    return {(s, o["path"]): o["md5"] for s, entry in lock["stages"].items() for o in entry.get("outs", [])}


def _without_measurements(path: Path) -> dict:
    figures = read_json(path)
    return {k: v for k, v in figures.items() if k not in MEASUREMENT_KEYS}


def compare(first: Path, second: Path) -> tuple[list[str], list[str]]:
    """(report lines, differences) between the outputs of two pipeline folders that ran the same config."""
    report, differences = [], []
    a, b = _outputs(first), _outputs(second)
    if a.keys() != b.keys():
        differences.append(f"dvc.lock lists other outputs: {sorted(a.keys() ^ b.keys())}")
    for stage, path in sorted(a.keys() & b.keys()):
        if path in MEASURED:
            same = not path.endswith(".json") or _without_measurements(first / path) == _without_measurements(
                second / path
            )
            report.append(f"{stage:<18} {path:<34} {'same' if same else 'DIFFERENT'} (not by hash: {MEASURED[path]})")
        else:
            same = a[stage, path] == b[stage, path]
            report.append(f"{stage:<18} {path:<34} {'same hash' if same else 'DIFFERENT hash'} {a[stage, path]}")
        if not same:
            differences.append(f"{stage}: {path} differs between the two runs")
    evaluations = [read_json(root / "metrics/eval.json") for root in (first, second)]
    report.append(f"evaluation figures: {'equal' if evaluations[0] == evaluations[1] else 'DIFFERENT'}")
    if evaluations[0] != evaluations[1]:
        differences.append(f"metrics/eval.json: {evaluations[0]} != {evaluations[1]}")
    return report, differences


def unclean(root: Path) -> str | None:
    """What `dvc status` reports in `root`, unless it is clean."""
    status = sh(["dvc", "status"], root).stdout.strip()
    return None if "up to date" in status else status


def check(workdir: Path, overrides: list[str]) -> tuple[list[str], list[str]]:
    """Run the pipeline in two fresh copies under `workdir` and compare them."""
    roots = [copy_project(workdir / name) for name in ("first", "second")]
    for root in roots:
        run_pipeline(root, overrides)
    report, differences = compare(*roots)
    statuses = {root: unclean(root) for root in roots}
    differences += [f"{root}: `dvc status` is not clean after the run:\n{s}" for root, s in statuses.items() if s]
    report.append(f"dvc status: {'NOT clean' if any(statuses.values()) else 'clean in both'}")
    return report, differences


def tiny_model(workdir: Path) -> Path:
    """The tiny random LLaMA (SmolLM2's tokenizer) the default check trains."""
    from pipeline.core.assets import resolve
    from pipeline.data.tokenizer import load_tokenizer
    from tools.tiny_model import write_tiny_llama

    gguf = resolve(yaml.safe_load((REPO / "conf/model/smollm2_135m.yaml").read_text(encoding="utf-8"))["path"])
    load_tokenizer(gguf.parent, gguf_file=gguf.name).save_pretrained(str(workdir / "tokenizer"))
    write_tiny_llama(workdir / "tiny_model", workdir / "tokenizer")
    return workdir / "tiny_model"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, help="where the two copies go (default: a temporary folder, removed)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (default: experiment=tiny on a tiny model)")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="repro-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    overrides = args.overrides or ["experiment=tiny", f"model.path={tiny_model(workdir)}"]
    try:
        report, differences = check(workdir, overrides)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    print(f"repro-check: {' '.join(overrides)}, two runs from scratch")
    print("\n".join(report))
    if differences:
        print("repro-check: FAILED\n" + "\n".join(f"- {d}" for d in differences), file=sys.stderr)
        return 1
    print("repro-check: both runs gave the same outputs, evaluation figures and a clean `dvc status`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
