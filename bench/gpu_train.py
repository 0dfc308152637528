"""GPU training throughput of our train stage against the loop a user writes with transformers + PEFT, and against
our own previous path, in one run on one card: a randomly initialised model of Llama-3-8B's shape (written once,
shared by every variant), LoRA r=16 on every linear layer, bf16, 4,096-token sequences of the embedded corpus, one
GPU. Each variant is one `python -m stages.train` run; each reports tokens/s without the first (warm-up) step, MFU
(4N + causal attention, training.figures.flops_per_token, over the card's dense bf16 peak), peak GPU memory, how
activation checkpointing was decided, and from a profile of two steps (CUDA activity only) the kernels launched, the
GPU's busy time and its idle time per step.

Variants (`--variants`, in this order by default):
- previous: the path before issue 45 (no fused step tail, no compiled layers), checkpointing off;
- tail: the fused step tail, no compiled layers, checkpointing off;
- default: the defaults (every kernel path `auto` installs; checkpointing auto: off where the run fits);
- low_memory: the defaults with checkpointing on (train.gradient_checkpointing=true);
- zero3: the defaults under ZeRO-3 (LoRA's tensors kept whole, a layer prefetched);
- zero3_no_fetch: zero3 without the zero3_fetch patch (DeepSpeed's own fetch: its effect measured in the same call);
- zero3_no_release: zero3 without the zero3_release patch (DeepSpeed's own release, measured the same way);
- zero3_no_flags: zero3 without the zero3_flags patch (DeepSpeed's walk of the modules at each forward);
- dpo: DPO (reference precomputed) on pairs of two 2,048-token sides, the LM step's 4,096 tokens a step;
- nemo: NeMo AutoModel's published shape (micro-batch 2 x 4,096, 16 micro-batches a step), 3 steps;
- eager: transformers + PEFT's own loop (SDPA, torch's fused AdamW), checkpointing off.

    python -m bench.gpu_train [--variants default,eager] [--steps 20] [--work DIR]   # on a CUDA machine
    python -m bench.gpu_train --smoke [--results DIR]   # the variants' paths on CPU ranks, a tiny random LLaMA
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from bench.common import report, results_folder, smoke_arguments, smoke_project
from bench.scale_check import SMOKE_SHAPE, write_random_llama
from pipeline.core import config
from pipeline.core.atomic import read_json, write_json
from pipeline.core.environment import with_venv_path
from pipeline.training.figures import peak_tflops
from pipeline.training.profile import SUMMARY
from pipeline.training.profile import VARIABLE as PROFILE_VARIABLE

SHAPE = {  # Llama-3-8B
    "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False, "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}  # fmt: skip
BLOCK = 4096
SMOKE_BLOCK, SMOKE_STEPS, SMOKE_LINES = 64, 3, 200  # steps > the 2 warm-up steps; lines of the tiny corpus
PREVIOUS = ["train.kernels_skip=[zero_tail,compiled_layers]"]
OFF = ["train.gradient_checkpointing=false"]
VARIANTS = {  # name: (overrides, data: lm | dpo)
    "previous": ([*PREVIOUS, *OFF], "lm"),
    "tail": (["train.kernels_skip=[compiled_layers]", *OFF], "lm"),
    "default": ([], "lm"),
    "low_memory": (["train.gradient_checkpointing=true"], "lm"),
    "zero3": (["deepspeed=zero3"], "lm"),
    "zero3_no_fetch": (["deepspeed=zero3", "train.kernels_skip=[zero3_fetch]"], "lm"),
    "zero3_no_release": (["deepspeed=zero3", "train.kernels_skip=[zero3_release]"], "lm"),
    "zero3_no_flags": (["deepspeed=zero3", "train.kernels_skip=[zero3_flags]"], "lm"),
    "dpo": (["train.objective=dpo", "train.reference=precomputed", "train.beta=0.1"], "dpo"),
    "nemo": (["train.micro_batch_size=2", "train.gradient_accumulation_steps=16", "train.global_batch_size=32"], "lm"),
}
ALL = (
    "previous",
    "tail",
    "default",
    "eager",
    "zero3",
    "zero3_no_fetch",
    "zero3_no_release",
    "zero3_no_flags",
    "dpo",
    "low_memory",
    "nemo",
)
SMOKE_VARIANTS = ("previous", "default", "eager", "dpo")  # make test: each path, at CI's cost
NEMO_STEPS = 3  # 131,072 tokens a step: the first warms up
FIGURES = ("steady_tokens_per_s", "tokens_per_s", "mfu", "peak_gpu_memory_mb", "peak_memory_mb", "final_train_loss",
           "gradient_checkpointing", "checkpointed_layers", "kernels", "compiled_graphs")  # fmt: skip


def overrides(*, steps: int, block: int, accelerator: str, corpus: Path) -> list[str]:
    """What every variant shares: r=16 on every linear layer, bf16, one sequence of `block` tokens a step, ZeRO-2,
    one rank."""
    return [
        f"data.block_size={block}", f"data.max_seq_len={block // 2}", "lora.r=16", "lora.alpha=32",
        "lora.dropout=0.0", "lora.target_modules=all-linear", f"train.max_steps={steps}", "train.warmup_steps=1",
        "train.micro_batch_size=1", "train.global_batch_size=1", "train.gradient_accumulation_steps=1",
        "train.precision=bf16", "deepspeed=zero2", f"launcher.accelerator={accelerator}", "launcher.ranks_per_node=1",
        f"train.eval_every={steps}", f"train.save_every={steps}", "train.eval_max_rows=1", "tracking.uri=",
        "tracking.tensorboard=false", f"data.train_file={corpus / 'peoples_daily_train.txt'}",
        f"data.heldout_file={corpus / 'peoples_daily_heldout.txt'}",
    ]  # fmt: skip


def preference_pairs(corpus: Path, out: Path, *, pairs: int, characters: int) -> Path:
    """`pairs` preference rows whose two responses are each `characters` characters of the corpus (each side,
    prompt included, within data.max_seq_len tokens: the pair about as long as one LM block)."""
    text = (corpus / "peoples_daily_train.txt").read_text(encoding="utf-8").replace("\n", "")
    rows = []
    for i in range(pairs):
        start = 2 * i * characters
        rows.append({"prompt": f"续写第{i}段。", "chosen": text[start : start + characters],
                     "rejected": text[start + characters : start + 2 * characters]})  # fmt: skip
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return out


def train(*, work: Path, name: str, base: Path, tokenizer: Path, settings: list[str], profile: bool) -> dict:
    """One variant through the data and train stages in `work/name`: its figures (an error's tail if it failed)."""
    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    params = folder / "params.yaml"
    params.write_text(yaml.safe_dump(config.compose("conf", settings)))
    env = with_venv_path() | ({PROFILE_VARIABLE: str(folder / "profile")} if profile else {})
    common = ["--params", str(params), "--tokenizer", str(tokenizer), "--run-id-file", str(folder / "run.json")]
    start = time.perf_counter()
    for command in (
        [sys.executable, "-m", "stages.cache_dataset", *common, "--base-config", str(base / "config.json"),
         "--out", str(folder / "dataset"), "--metrics", str(folder / "dataset.json")],
        [sys.executable, "-m", "stages.train", *common, "--base", str(base), "--dataset", str(folder / "dataset"),
         "--checkpoints", str(folder / "ckpt"), "--metrics", str(folder / "train.json"), "--curve",
         str(folder / "curve.csv")],
    ):  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        (folder / "log.txt").open("a").write(done.stdout + done.stderr)
        if done.returncode:
            return {"failed": (done.stdout + done.stderr)[-1500:]}
    metrics = read_json(folder / "train.json")
    figures = {k: metrics[k] for k in FIGURES if k in metrics}
    figures["seconds_with_load"] = round(time.perf_counter() - start, 1)
    if profile and (folder / "profile" / SUMMARY).is_file():
        figures["profile"] = read_json(folder / "profile" / SUMMARY)
    return figures


def eager_rate(*, base: Path, block: int, steps: int, device: str) -> dict:
    """The loop a user writes with transformers and PEFT alone, in its own process: the same LoRA (r=16 on every
    linear layer, PEFT's fp32 adapter over the bf16 base), SDPA, no checkpointing, torch's fused AdamW (on a GPU),
    one sequence of `block` tokens a step; tokens/s without the first step, and its peak GPU memory."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.gpu_train", "--eager-worker", str(base), "--block", str(block), "--steps",
         str(steps), "--device", device],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode:
        return {"failed": (done.stdout + done.stderr)[-1500:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def eager_worker(base: Path, block: int, steps: int, device: str) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, device_map=device)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    model.train()
    cuda = device == "cuda"
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=cuda)
    generator = torch.Generator(device=device).manual_seed(0)
    seconds = []
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (1, block), device=device, generator=generator)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    print(json.dumps({"tokens_per_s": block * (steps - 1) / sum(seconds[1:]), "peak_gpu_memory_mb": peak}))


def measure(*, work: Path, variants: list[str], steps: int, tokenizer: Path, corpus: Path, smoke: bool, keep) -> dict:
    """Every variant in `work` (the random model written once, kept there for a later call): their figures, handed
    to `keep` after each variant (a GPU window that closes mid-run keeps what it measured)."""
    accelerator = "cpu" if smoke else "cuda"
    shape, block = (SMOKE_SHAPE, SMOKE_BLOCK) if smoke else (SHAPE, BLOCK)
    base = work / "base"
    if not (base / "config.json").is_file():
        write_random_llama(base, tokenizer, shape=shape, device=accelerator)
    # each side fits data.max_seq_len (block / 2 tokens) with its prompt in the Alpaca template (about 50 tokens):
    # about 1.9 tokens a character here; at smoke size a few characters and room for the template
    characters = max(8, (block // 2 - 64) // 2)
    side = block // 2 if not smoke else 96
    pairs = preference_pairs(corpus, work / "pairs.jsonl", pairs=8 if smoke else 24, characters=characters)
    shared = overrides(steps=steps, block=block, accelerator=accelerator, corpus=corpus)
    figures = {"device": torch.cuda.get_device_name(0) if not smoke else "cpu", "block": block, "steps": steps}
    for name in variants:
        if name == "eager":
            figures[name] = eager_rate(base=base, block=block, steps=min(steps, 10), device=accelerator)
            keep(figures)
            continue
        settings, data = VARIANTS[name]
        extra = [f"data.train_file={pairs}", f"data.heldout_file={pairs}", "data.format=preference",
                 f"data.max_seq_len={side}"]  # fmt: skip
        extra = extra if data == "dpo" else []
        step_count = NEMO_STEPS if name == "nemo" else steps
        run = [*shared, *extra, *settings, f"train.max_steps={step_count}", f"train.eval_every={step_count}",
               f"train.save_every={step_count}"]  # fmt: skip
        figures[name] = train(work=work, name=name, base=base, tokenizer=tokenizer, settings=run, profile=not smoke)
        keep(figures)
    return figures


def ratios(figures: dict) -> dict:
    """Each variant's tokens/s over the previous path's and over the eager loop's."""

    def rate(name: str) -> float | None:
        value = figures.get(name, {})
        return value.get("steady_tokens_per_s") or value.get("tokens_per_s")

    out = {}
    for name in figures:
        if isinstance(figures[name], dict) and rate(name):
            for other in ("previous", "eager", "default"):
                if other != name and rate(other):
                    out[f"{name}_over_{other}"] = round(rate(name) / rate(other), 3)
    peak = peak_tflops(figures.get("device", ""))
    if peak:
        out["peak_tflops"] = peak
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--variants", help=f"default: {','.join(ALL)} ({','.join(SMOKE_VARIANTS)} with --smoke)")
    parser.add_argument("--work", type=Path, help="where the random model and the runs go (kept: a later call reuses "
                        "the model); default: a temporary folder")  # fmt: skip
    parser.add_argument("--tokenizer", type=Path, default=Path("artifacts/tokenizer"), help="from `make run`")
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus"), help="from `make run`")
    parser.add_argument("--name", default="gpu_train", help="the results file's name (several runs in one folder)")
    parser.add_argument("--eager-worker", type=Path, help=argparse.SUPPRESS)  # eager_rate's process: a base folder
    parser.add_argument("--block", type=int, default=BLOCK, help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    smoke_arguments(parser)
    args = parser.parse_args(argv)
    if args.eager_worker:
        eager_worker(args.eager_worker, args.block, args.steps, args.device)
        return
    if not args.smoke and not torch.cuda.is_available():
        print("bench.gpu_train: no CUDA device here; nothing measured")
        return
    results = results_folder(args)
    variants = args.variants.split(",") if args.variants else list(SMOKE_VARIANTS if args.smoke else ALL)
    unknown = [v for v in variants if v not in VARIANTS and v != "eager"]
    if unknown:
        raise SystemExit(f"bench.gpu_train: unknown variants {unknown}; expected some of {[*VARIANTS, 'eager']}")
    here = contextlib.nullcontext(Path.cwd())
    with smoke_project(args.project) if args.smoke else here as project, tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        steps = SMOKE_STEPS if args.smoke else args.steps
        results.mkdir(parents=True, exist_ok=True)

        def keep(figures: dict) -> None:
            latest = [name for name in figures if isinstance(figures[name], dict)][-1]
            print(f"gpu_train: {latest}: {json.dumps(figures[latest])}", flush=True)
            write_json(results / f"{args.name}.json", {**figures, **ratios(figures), "partial": True})

        figures = measure(
            work=work, variants=variants, steps=steps, tokenizer=project / args.tokenizer,
            corpus=project / args.corpus, smoke=args.smoke, keep=keep,
        )  # fmt: skip
    report(args.name, {**figures, **ratios(figures), **({"smoke": True} if args.smoke else {})}, results)


if __name__ == "__main__":
    main()
