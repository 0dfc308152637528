"""convert against what users run today: DeepSpeed's `python -m deepspeed.checkpoint.ds_to_universal
--inject_missing_state` (the flag an HF/PEFT checkpoint needs), on the train stage's newest checkpoint, in one run:
wall time and peak memory (summed over the process tree, sampled) ratios, with 1 and with 4 workers on each side
(targets: at most 1.0x each). The two outputs are compared tensor by tensor. Needs `make run` first.

    python -m bench.convert
    python -m bench.convert --smoke [--results DIR]   # the tiny pipeline's checkpoint, 1 and 2 workers (make test)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from bench.common import report, results_folder, run_tree_peak, side_by_side, smoke_arguments, smoke_project
from pipeline.checkpoints import safe_pickle
from pipeline.checkpoints.locate import resolve_tag

CHECKPOINTS = Path("artifacts/checkpoints")


def same_tensors(ours: Path, theirs: Path) -> int:
    """How many tensors of our universal folder equal DeepSpeed's (every one of ours must)."""
    count = 0
    for path in sorted((ours / "zero").rglob("*.pt")):
        mine = safe_pickle.load(path)
        other = safe_pickle.load(theirs / path.relative_to(ours))  # DeepSpeed's files: data only, as ours
        if isinstance(mine, dict):
            mine, other = mine["param"], other["param"]
        if not torch.equal(mine.float(), other.float()):
            raise SystemExit(f"{path.relative_to(ours)} differs from DeepSpeed's")
        count += 1
    return count


def measure(checkpoints: Path, workers: tuple[int, ...]) -> dict:
    """Both sides on the newest checkpoint of `checkpoints`, with each number of workers."""
    tag = checkpoints / resolve_tag(checkpoints, None)
    figures: dict[str, float | int | str] = {"checkpoint": str(tag)}
    with tempfile.TemporaryDirectory() as tmp:
        for count in workers:
            theirs, ours = Path(tmp) / f"deepspeed{count}", Path(tmp) / f"ours{count}"
            reference = [
                sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag),
                "--output_folder", str(theirs), "--inject_missing_state", "--num_extract_workers", str(count),
                "--num_merge_workers", str(count),
            ]  # fmt: skip
            seconds_reference, peak_reference = run_tree_peak(reference)
            command = [sys.executable, "-m", "pipeline", "convert", str(checkpoints), str(ours), "--to", "universal"]
            seconds_ours, peak_ours = run_tree_peak([*command, "--workers", str(count)])
            figures[f"workers{count}_tensors_equal"] = same_tensors(ours, theirs)
            figures.update(
                side_by_side(
                    reference_seconds=seconds_reference,
                    ours_seconds=seconds_ours,
                    reference_mb=peak_reference,
                    ours_mb=peak_ours,
                    prefix=f"workers{count}_",
                )
            )
    return {**figures, "target_ratio": 1.0}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    smoke_arguments(parser)
    args = parser.parse_args(argv)
    results = results_folder(args)
    if not args.smoke:
        report("convert", measure(CHECKPOINTS, (1, 4)), results)
        return
    with smoke_project(args.project) as project:
        report("convert", {**measure(project / CHECKPOINTS, (1, 2)), "smoke": True}, results)


if __name__ == "__main__":
    main()
