"""GPU training throughput of our train stage (runs only where CUDA is present): a randomly initialised model of
Llama-3-8B's shape, LoRA r=16 on every linear layer, bf16, packed 4096-token blocks of the embedded corpus, one GPU,
ZeRO-2, a few dozen steps through `python -m stages.train`. Reports tokens/s per GPU without the first (warm-up)
step, MFU with the LoRA convention of training.figures.flops_per_token (4 x the parameters that multiply, the input
embedding's lookup left out, + causal attention) over the card's peak (its name: PCIe and NVL H100s are lower), and
with 6N for comparison, and peak GPU memory; beside it, in the same run, the loop a user writes with transformers and
PEFT alone on the same model and settings (`eager_rate`), as a ratio. Goal on one H100: at least 12,500 tokens/s
(NVIDIA NeMo AutoModel's published LoRA figure for Llama-3-8B on one H100: 12,473) and 45% MFU.

    python -m bench.gpu_train [--steps 30] [--no-checkpointing] [--no-eager] [--profile] [-S train.kernels=off ...]
    python -m bench.gpu_train --smoke [--results DIR]   # a tiny random LLaMA, 3 steps of 64 tokens (make test, gpu)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from bench.common import report, results_folder, smoke_arguments, smoke_project
from bench.scale_check import SMOKE_SHAPE, write_random_llama
from pipeline.core import config
from pipeline.core.atomic import read_json
from pipeline.core.environment import with_venv_path
from pipeline.training.figures import peak_tflops
from pipeline.training.profile import VARIABLE as profiled_steps_variable

SHAPE = {  # Llama-3-8B
    "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False, "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}  # fmt: skip
BLOCK = 4096
SMOKE_BLOCK, SMOKE_STEPS, SMOKE_LINES = 64, 3, 200  # steps > the 2 warm-up steps; lines of the tiny corpus


def overrides(steps: int, checkpointing: bool, block: int = BLOCK) -> list[str]:
    return [
        f"data.block_size={block}", "lora.r=16", "lora.alpha=32", "lora.dropout=0.0", "lora.target_modules=all-linear",
        f"train.max_steps={steps}", "train.warmup_steps=2", "train.micro_batch_size=1", "train.global_batch_size=1",
        "train.precision=bf16", f"train.gradient_checkpointing={str(checkpointing).lower()}", "deepspeed=zero2",
        "launcher.accelerator=cuda", "launcher.ranks_per_node=1", f"train.eval_every={steps}",
        f"train.save_every={steps}", "train.eval_max_rows=1", "tracking.uri=", "tracking.tensorboard=false",
    ]  # fmt: skip


def measure(
    *,
    shape: dict,
    block: int,
    steps: int,
    checkpointing: bool,
    tokenizer: Path,
    data: tuple[str, ...] = (),
    eager: bool = True,
    profile: Path | None = None,
) -> dict:
    """Cache the corpus and train the random model of `shape` on one GPU, in a temporary folder; the figures.
    `data`: more overrides (other corpus files than params' default data/corpus/ from `make run`, train.kernels=off);
    `eager`: also run `eager_rate`; `profile`: a folder for the train stage's operator table (training.profile)."""
    with tempfile.TemporaryDirectory(prefix="gpu-train-") as tmp:
        work = Path(tmp)
        params = work / "params.yaml"
        composed = config.compose("conf", [*overrides(steps, checkpointing, block), *data])
        params.write_text(yaml.safe_dump(composed))
        n_params = write_random_llama(work / "base", tokenizer, shape=shape)
        env = with_venv_path() | ({profiled_steps_variable: str(profile.resolve())} if profile else {})
        subprocess.run([
            sys.executable, "-m", "stages.cache_dataset", "--params", str(params), "--tokenizer", str(tokenizer),
            "--base-config", str(work / "base" / "config.json"), "--out", str(work / "dataset"),
            "--metrics", str(work / "dataset.json"), "--run-id-file", str(work / "run.json"),
        ], check=True, env=env)  # fmt: skip
        subprocess.run([
            sys.executable, "-m", "stages.train", "--params", str(params), "--base", str(work / "base"),
            "--tokenizer", str(tokenizer), "--dataset", str(work / "dataset"), "--checkpoints",
            str(work / "ckpt"), "--metrics", str(work / "train.json"), "--curve", str(work / "curve.csv"),
            "--run-id-file", str(work / "run.json"),
        ], check=True, env=env)  # fmt: skip
        metrics = read_json(work / "train.json")
        baseline = None
        if eager:
            baseline = eager_rate(base=work / "base", block=block, steps=min(steps, 10), checkpointing=checkpointing)
    name = torch.cuda.get_device_name(0)
    peak = peak_tflops(name)
    tokens_per_s = metrics["steady_tokens_per_s"] or metrics["tokens_per_s"]  # without the warm-up step
    figures = {
        "device": name,
        "overrides": list(data),
        "parameters": n_params,
        "steps": steps,
        "block": block,
        "gradient_checkpointing": checkpointing,
        "tokens_per_s_per_gpu": round(tokens_per_s, 1),
        "mfu_4n_attention": metrics["mfu"],
        "mfu_6n": round(tokens_per_s * 6 * n_params / (peak * 1e12), 4) if peak else None,
        "peak_gpu_memory_mb": metrics.get("peak_gpu_memory_mb"),
        "target_tokens_per_s": 12_500,
        "target_mfu": 0.45,
    }
    if baseline is not None:
        figures["eager_tokens_per_s"] = round(baseline["tokens_per_s"], 1)
        figures["eager_peak_gpu_memory_mb"] = baseline["peak_gpu_memory_mb"]
        figures["speedup_vs_eager"] = round(tokens_per_s / baseline["tokens_per_s"], 3)
    return figures


def eager_rate(*, base: Path, block: int, steps: int, checkpointing: bool) -> dict:
    """The loop a user writes with transformers and PEFT alone, in its own process: the same LoRA (r=16 on every
    linear layer, PEFT's fp32 adapter over the bf16 base), SDPA, non-reentrant checkpointing as set, torch's fused
    AdamW, one sequence of `block` tokens a step; tokens/s without the first step, and its peak GPU memory."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_train", "--eager-worker", str(base), "--block", str(block), "--steps",
         str(steps), *([] if checkpointing else ["--no-checkpointing"])],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def eager_worker(base: Path, block: int, steps: int, checkpointing: bool) -> None:
    import time

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, device_map="cuda")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    model.train()  # from_pretrained leaves eval mode, where transformers skips the checkpointing
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=True)
    generator = torch.Generator(device="cuda").manual_seed(0)
    seconds = []
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (1, block), device="cuda", generator=generator)
        torch.cuda.synchronize()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20
    print(json.dumps({"tokens_per_s": block * (steps - 1) / sum(seconds[1:]), "peak_gpu_memory_mb": round(peak)}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--no-checkpointing", dest="checkpointing", action="store_false",
        help="keep activations instead of recomputing them (the GPU default recomputes them: measured as users run)",
    )  # fmt: skip
    parser.add_argument("--no-eager", dest="eager", action="store_false", help="skip the transformers + PEFT loop")
    parser.add_argument("-S", "--override", action="append", default=[], help="a params override (train.kernels=off)")
    parser.add_argument("--profile", type=Path, help="a folder for the train stage's operator table by device time")
    parser.add_argument("--tokenizer", type=Path, default=Path("artifacts/tokenizer"), help="from `make run`")
    parser.add_argument("--eager-worker", type=Path, help=argparse.SUPPRESS)  # eager_rate's process: a base folder
    parser.add_argument("--name", default="gpu_train", help="the results file's name (several runs in one folder)")
    parser.add_argument("--block", type=int, default=BLOCK, help=argparse.SUPPRESS)
    smoke_arguments(parser)
    args = parser.parse_args(argv)
    if args.eager_worker:
        eager_worker(args.eager_worker, args.block, args.steps, args.checkpointing)
        return
    if not torch.cuda.is_available():
        print("bench.gpu_train: no CUDA device here; nothing measured")
        return
    results = results_folder(args)
    if not args.smoke:
        figures = measure(
            shape=SHAPE, block=BLOCK, steps=args.steps, checkpointing=args.checkpointing, tokenizer=args.tokenizer,
            data=tuple(args.override), eager=args.eager, profile=args.profile,
        )  # fmt: skip
        report(args.name, figures, results)
        return
    with smoke_project(args.project) as project, tempfile.TemporaryDirectory(prefix="gpu-train-smoke-") as tmp:
        corpus = project / "data/corpus"
        train_file = Path(tmp) / "train.txt"
        lines = (corpus / "peoples_daily_train.txt").read_text(encoding="utf-8").splitlines(keepends=True)
        train_file.write_text("".join(lines[:SMOKE_LINES]), encoding="utf-8")
        data = (f"data.train_file={train_file}", f"data.heldout_file={corpus / 'peoples_daily_heldout.txt'}")
        figures = measure(
            shape=SMOKE_SHAPE, block=SMOKE_BLOCK, steps=SMOKE_STEPS, checkpointing=args.checkpointing,
            tokenizer=project / "artifacts/tokenizer", data=(*data, *args.override), eager=args.eager,
            profile=args.profile,
        )  # fmt: skip
    report(args.name, {**figures, "smoke": True}, results)


if __name__ == "__main__":
    main()
