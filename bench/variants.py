"""Step time and peak memory of each LoRA variant (DoRA, LoRA+, all-linear, QLoRA nf4/int8) against plain LoRA on
the default model: one process per variant, the base in bf16 (or quantized from bf16), AdamW on the trainable
tensors, forward + backward + step on random tokens. Also the base's weight memory: bf16 against nf4 and int8.
Needs the prepared base (`dvc repro prepare_base`, or BASE=folder).

    python -m bench.variants [--base artifacts/base] [--steps 4] [--variants lora dora nf4]
    python -m bench.variants --merge-gap
    python -m bench.variants --smoke [--results DIR]   # both, on the tiny pipeline's base, 1 step (make test)"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench.common import report, results_folder, run_measured, smoke_arguments, smoke_project

VARIANTS = {  # name: (lora spec changes, lr_ratio, quantization)
    "lora": ({}, None, None),
    "dora": ({"use_dora": True}, None, None),
    "loraplus": ({}, 16.0, None),
    "all_linear": ({"target_modules": "all-linear"}, None, None),
    "nf4": ({}, None, "nf4"),
    "int8": ({}, None, "int8"),
    "dora_nf4": ({"use_dora": True}, None, "nf4"),
}
# Plain LoRA (the reference) and the variants that between them take every option: LoRA+'s lr ratio, int8, DoRA on
# nf4 (dora, nf4 and all_linear alone add no code path); one process each.
SMOKE_VARIANTS = ["lora", "loraplus", "int8", "dora_nf4"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def one(base: Path, variant: str, steps: int, batch: int, tokens: int) -> dict:
    """Train `steps` steps of `variant` in this process; the median step time after a first (warm-up) step. A variant
    that quantizes nothing runs without bitsandbytes, as the train stage's ranks do (pipeline/core/imports.py)."""
    import torch

    from pipeline.core import imports

    changes, ratio, kind = VARIANTS[variant]
    if kind is None:
        imports.without_unused()
    from pipeline.model.lora import LoraSpec, count_parameters, load_lora_model, parameter_groups
    from pipeline.model.quantization import Quantization

    torch.set_num_threads(1)
    settings = {"r": 8, "alpha": 16, "dropout": 0.0, "use_rslora": False, "target_modules": TARGETS}
    lora = LoraSpec(**{**settings, "modules_to_save": [], **changes})
    rows = json.loads((base / "config.json").read_text())["vocab_size"]
    dtype = torch.bfloat16
    spec = Quantization(kind=kind, compute_dtype=dtype, storage_dtype=dtype) if kind else None
    model = load_lora_model(base_dir=base, vocab_rows=rows, lora=lora, seed=0, dtype=dtype, quantization=spec)
    base_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not p.requires_grad)
    trainable, _ = count_parameters(model)
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.0, lr=1e-4, lr_ratio=ratio), lr=1e-4)
    ids = torch.randint(0, rows, (batch, tokens), generator=torch.Generator().manual_seed(0))
    model.train()
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return {
        "step_seconds": round(statistics.median(times[1:]), 3),
        "base_weights_mb": round(base_bytes / 2**20, 1),
        "trainable": trainable,
    }


def merge_gap(base: Path, kind: str, workdir: Path) -> dict:
    """What merging a QLoRA adapter into the unquantized base changes against the quantized base it was trained on
    (quantized from bf16, as the stage loads it on a bf16 machine): an adapter at PEFT's initialisation (B = 0: the
    gap is the base's quantization alone), merged; merge_report.json's two measures."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pipeline.merge.fold import merge

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS)
    adapter = workdir / f"adapter_{kind}"
    get_peft_model(model, config).save_pretrained(str(adapter))
    variant = {"use_dora": False, "lr_ratio": None, "quantization": kind, "compute_dtype": "bf16", "load_dtype": "bf16"}
    (adapter / "variant.json").write_text(json.dumps(variant))
    merged = merge(base_dir=base, adapter_dir=adapter, out_dir=workdir / f"merged_{kind}")
    keys = ("max_abs_logit_diff", "mean_kl")
    return {
        "verification": {k: merged["verification"][k] for k in keys},
        "against_quantized_base": {k: merged["against_trained_base"][k] for k in keys},
    }


def measure(base: Path, variants: list[str], *, steps: int, batch: int, tokens: int) -> dict:
    """Every variant in its own measured process, and each against plain LoRA where it ran."""
    figures: dict[str, object] = {"batch": f"{batch} x {tokens} tokens, bf16, 1 thread", "steps": steps}
    for variant in variants:
        command = [sys.executable, "-m", "bench.variants", "--one", variant, "--base", str(base)]
        command += ["--steps", str(steps), "--batch", str(batch), "--tokens", str(tokens)]
        _, peak_mb, output = run_measured(command)
        result = json.loads(output.strip().splitlines()[-1])
        figures[variant] = {**result, "peak_rss_mb": round(peak_mb, 1)}
        print(variant, figures[variant], flush=True)
    plain = figures.get("lora")
    for variant in variants:
        if isinstance(plain, dict) and variant != "lora":
            figures[variant]["step_time_vs_lora"] = round(figures[variant]["step_seconds"] / plain["step_seconds"], 2)
            figures[variant]["peak_rss_vs_lora"] = round(figures[variant]["peak_rss_mb"] / plain["peak_rss_mb"], 2)
    return figures


def merge_gaps(base: Path) -> dict:
    """merge_gap of each quantization kind, in a temporary folder."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return {kind: merge_gap(base, kind, Path(tmp)) for kind in ("nf4", "int8")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, default=Path("artifacts/base"))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="default: all (--smoke: SMOKE_VARIANTS)")
    parser.add_argument("--merge-gap", action="store_true", help="only measure the QLoRA merge's gaps")
    parser.add_argument("--one", choices=list(VARIANTS), help=argparse.SUPPRESS)  # the worker process
    smoke_arguments(parser)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.base, args.one, args.steps, args.batch, args.tokens)))
        return
    results = results_folder(args)
    if args.smoke:  # 1 step of 1 x 32 tokens, then the merge gaps, on the tiny pipeline's base
        with smoke_project(args.project) as project:
            base = project / "artifacts/base"
            figures = measure(base, args.variants or SMOKE_VARIANTS, steps=1, batch=1, tokens=32)
            report("variants", {**figures, "smoke": True}, results)
            report("variants_merge_gap", {**merge_gaps(base), "smoke": True}, results)
        return
    if not (args.base / "config.json").is_file():
        raise SystemExit(f"{args.base}: no prepared base; run `dvc repro prepare_base` or pass --base")
    if args.merge_gap:
        report("variants_merge_gap", merge_gaps(args.base), results)
        return
    variants = args.variants or list(VARIANTS)
    figures = measure(args.base, variants, steps=args.steps, batch=args.batch, tokens=args.tokens)
    report("variants", figures, results)


if __name__ == "__main__":
    main()
