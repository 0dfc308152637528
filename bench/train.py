"""Training throughput and peak memory of our train stage against HF Trainer + DeepSpeed + PEFT
(bench/hf_trainer_clm.py): same model, dataset, world size (2 CPU ranks), ZeRO-2, fp32 and steps, both saving a
checkpoint at the end, in one run. Needs `make run` first (uses artifacts/base, tokenizer and dataset)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from bench.common import report
from pipeline import config
from pipeline import ds_config as dsc
from pipeline.atomic import read_json
from pipeline.tokenizer import META

STEPS, ACCUMULATION, RANKS = 6, 1, 2
ARTIFACTS = Path("artifacts")


def ours(workdir: Path) -> dict:
    raw = config.compose("conf", [
        f"train.max_steps={STEPS}", "train.warmup_steps=2", "train.lr=2e-4",
        f"train.gradient_accumulation_steps={ACCUMULATION}",
        f"train.global_batch_size={ACCUMULATION * RANKS}", f"launcher.ranks_per_node={RANKS}", "deepspeed=zero2",
        "train.precision=fp32", "train.gradient_checkpointing=false", f"train.eval_every={STEPS}",
        f"train.save_every={STEPS}", "train.eval_max_rows=2", "tracking.uri=",
    ])  # fmt: skip
    (workdir / "params.yaml").write_text(yaml.safe_dump(raw))
    subprocess.run([
        sys.executable, "-m", "stages.train", "--params", str(workdir / "params.yaml"), "--base", "artifacts/base",
        "--tokenizer", "artifacts/tokenizer", "--dataset", "artifacts/dataset", "--checkpoints", str(workdir / "ckpt"),
        "--metrics", str(workdir / "ours.json"), "--curve", str(workdir / "curve.csv"),
        "--run-id-file", str(workdir / "run.json"),
    ], check=True)  # fmt: skip
    return read_json(workdir / "ours.json")


def reference(workdir: Path) -> dict:
    ds_config = dsc.build(
        zero=dsc.ZeroSettings(stage=2),
        precision="fp32",
        micro=1,
        accumulation=ACCUMULATION,
        world_size=RANKS,
        lr=2e-4,
        weight_decay=0.0,
        max_grad_norm=1.0,
    )
    ds_config.update(train_batch_size="auto", train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")
    ds_config["optimizer"]["params"].update(lr="auto")
    (workdir / "ds_config.json").write_text(json.dumps(ds_config))
    vocab_rows = read_json(ARTIFACTS / "tokenizer" / META)["padded_vocab_size"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    env.pop("OMP_NUM_THREADS", None)
    subprocess.run([
        "deepspeed", "--num_gpus", str(RANKS), "--master_port", "29531", "bench/hf_trainer_clm.py",
        "--base", "artifacts/base", "--dataset", "artifacts/dataset", "--ds-config", str(workdir / "ds_config.json"),
        "--out", str(workdir), "--vocab-rows", str(vocab_rows), "--steps", str(STEPS),
        "--modules-to-save", *config.compose("conf", [])["lora"]["modules_to_save"],
        "--accumulation", str(ACCUMULATION),
    ], check=True, env=env)  # fmt: skip
    return read_json(workdir / "reference.json")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        ref = reference(Path(tmp))
        our = ours(Path(tmp))
    report(
        "train",
        {
            "steps": STEPS,
            "ranks": RANKS,
            "reference_tokens_per_s": round(ref["tokens_per_s"], 2),
            "ours_tokens_per_s": round(our["tokens_per_s"], 2),
            "speedup": round(our["tokens_per_s"] / ref["tokens_per_s"], 3),
            "target_speedup": 1.1,
            "reference_peak_memory_mb": round(ref["peak_memory_mb"], 1),
            "ours_peak_memory_mb": our["peak_memory_mb"],
            "memory_ratio": round(our["peak_memory_mb"] / ref["peak_memory_mb"], 3),
        },
    )


if __name__ == "__main__":
    main()
