"""consolidate against what users run today: DeepSpeed's zero_to_fp32.py --exclude_frozen_parameters, then a
script renaming the keys to PEFT's (drop the adapter name and `modules_to_save.`), on the train stage's 2-rank
checkpoint of the default model, in one run: wall time and peak memory ratios (targets: at most 0.7x each).
zero_to_fp32.py writes pytorch_model.bin: its --safe_serialization fails on the tied modules_to_save copies.
Needs `make run` first.

    python -m bench.consolidate
    python -m bench.consolidate --smoke [--results DIR]   # on the tiny pipeline's checkpoint (make test)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench.common import report, results_folder, run_measured, side_by_side, smoke_arguments, smoke_project

CHECKPOINTS = Path("artifacts/checkpoints")


def rename_to_peft(state_dir: Path, out: Path) -> None:
    """The hand-written step: zero_to_fp32's PEFT-internal names -> adapter_model.safetensors."""
    import torch
    from safetensors.torch import save_file

    state = torch.load(state_dir / "pytorch_model.bin", weights_only=True)
    renamed = {k.replace("modules_to_save.default.", "").replace(".default.", "."): v for k, v in state.items()}
    renamed = {k: v.clone() for k, v in renamed.items()}  # tied tensors share storage, which safetensors refuses
    out.mkdir(parents=True, exist_ok=True)
    save_file(renamed, str(out / "adapter_model.safetensors"))


def measure(checkpoints: Path) -> dict:
    """Both sides on the checkpoint folder `checkpoints`, each in its own measured process."""
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        stock = checkpoints / "zero_to_fp32.py"  # the copy DeepSpeed writes beside every checkpoint
        convert = [sys.executable, str(stock), str(checkpoints), str(work / "fp32"), "--exclude_frozen_parameters"]
        seconds_convert, peak_convert, _ = run_measured(convert)  # --safe_serialization fails on tied embeddings
        rename = [sys.executable, "-m", "bench.consolidate", "rename", str(work / "fp32"), str(work / "renamed")]
        seconds_rename, peak_rename, _ = run_measured(rename)
        ours = [sys.executable, "-m", "pipeline", "consolidate", str(checkpoints), str(work / "ours")]
        seconds_ours, peak_ours, _ = run_measured(ours)
    reference_seconds, reference_peak = seconds_convert + seconds_rename, max(peak_convert, peak_rename)
    figures = side_by_side(
        reference_seconds=reference_seconds, ours_seconds=seconds_ours, reference_mb=reference_peak, ours_mb=peak_ours
    )
    return {**figures, "target_ratio": 0.7}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    smoke_arguments(parser)
    args = parser.parse_args(argv)
    results = results_folder(args)
    if not args.smoke:
        report("consolidate", measure(CHECKPOINTS), results)
        return
    with smoke_project(args.project) as project:
        report("consolidate", {**measure(project / CHECKPOINTS), "smoke": True}, results)


if __name__ == "__main__":
    if sys.argv[1:2] == ["rename"]:
        rename_to_peft(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
