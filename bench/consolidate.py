"""consolidate against what users run today: DeepSpeed's zero_to_fp32.py --exclude_frozen_parameters, then a
script renaming the keys to PEFT's (drop the adapter name and `modules_to_save.`), on the train stage's 2-rank
checkpoint of the default model, in one run: wall time and peak memory ratios (targets: at most 0.7x each).
zero_to_fp32.py writes pytorch_model.bin: its --safe_serialization fails on the tied modules_to_save copies.
Needs `make run` first."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bench.common import report, run_measured, side_by_side

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


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        stock = CHECKPOINTS / "zero_to_fp32.py"  # the copy DeepSpeed writes beside every checkpoint
        convert = [sys.executable, str(stock), str(CHECKPOINTS), str(work / "fp32"), "--exclude_frozen_parameters"]
        seconds_convert, peak_convert, _ = run_measured(convert)  # --safe_serialization fails on tied embeddings
        rename = [sys.executable, "-m", "bench.consolidate", "rename", str(work / "fp32"), str(work / "renamed")]
        seconds_rename, peak_rename, _ = run_measured(rename)
        ours = [sys.executable, "-m", "pipeline", "consolidate", str(CHECKPOINTS), str(work / "ours")]
        seconds_ours, peak_ours, _ = run_measured(ours)
    reference_seconds, reference_peak = seconds_convert + seconds_rename, max(peak_convert, peak_rename)
    figures = side_by_side(
        reference_seconds=reference_seconds, ours_seconds=seconds_ours, reference_mb=reference_peak, ours_mb=peak_ours
    )
    report("consolidate", {**figures, "target_ratio": 0.7})


if __name__ == "__main__":
    if sys.argv[1:2] == ["rename"]:
        rename_to_peft(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        main()
