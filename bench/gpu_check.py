"""`make gpu-check`: the chain's CUDA paths in minutes on one GPU, then the throughput benchmark. A random 1B Llama
with an untied head (the Llama-3 8B/70B case) trained by the train stage under ZeRO-2 and ZeRO-3, bf16, activation
checkpointing on; each consolidated and compared with the live engine's tensors; the ZeRO-3 adapter merged (the
merge stage's own proof) and base, adapter and merged model evaluated on the GPU; DPO on the packaged review pairs
(the reference: the adapter disabled), and under ZeRO-3 from the ZeRO-3 adapter (`train.init_adapter`, the reference:
that adapter's model); QLoRA nf4 where bitsandbytes is installed; the `gpu`-marked unit tests (the
speed paths against PyTorch's operators on CUDA) where pytest is; then `bench.gpu_train` (Llama-3-8B shape) unless
--no-throughput. Every step runs even when one before it failed (those that need its output are
skipped); the figures go to RESULTS/gpu_check.json after each step and every command's output to
RESULTS/gpu_check.log.

    python -m bench.gpu_check [--steps 20] [--no-throughput]            # on a CUDA machine
    python -m bench.gpu_check --smoke [--results DIR] [--project DIR]   # the same chain on CPU, a tiny model
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
from bench.scale_check import write_random_llama
from pipeline.core import config
from pipeline.core.atomic import read_json
from pipeline.core.environment import with_venv_path

SHAPE = {  # Llama-3.2-1B's layers with an untied head and the project tokenizer's vocabulary
    "hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 49152, "tie_word_embeddings": False, "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}  # fmt: skip
SMOKE_SHAPE = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 49152, "tie_word_embeddings": False, "max_position_embeddings": 2048,
}  # fmt: skip
ZERO_STAGES = (2, 3)
EVAL_SETS = {"in_domain": "peoples_daily_heldout.txt", "en_wiki": "enwiki_heldout.txt"}
# On CPU (the smoke) the tiny experiment's sizes, its window the trained block: 8,000 bytes a set in windows of 512
# cost the smoke's evaluate 30 s of CPU (a vocabulary of 49,152 rows) for the same code path.
EVAL = {"cuda": {"max_bytes": 8000}, "cpu": {"max_bytes": 1500, "context": 64, "stride": 32}}
TRAIN_FIGURES = (
    "tokens_per_s", "steady_tokens_per_s", "mfu", "peak_gpu_memory_mb", "peak_memory_mb", "final_train_loss",
    "val_loss", "val_preference_accuracy", "val_reward_margin", "checkpointed_layers", "kernels",
)  # fmt: skip


def overrides(*, base: Path, corpus: Path, accelerator: str, zero: int, steps: int, block: int, quantized: bool):
    """The run's config: r=16 on every linear layer, bf16, activation checkpointing, one rank."""
    return [
        f"model.path={base}", "model.dtype=bfloat16", f"data.train_file={corpus / 'peoples_daily_train.txt'}",
        f"data.heldout_file={corpus / 'peoples_daily_heldout.txt'}", f"data.block_size={block}",
        f"data.max_seq_len={block}", "lora.r=16", "lora.alpha=32", "lora.dropout=0.0",
        f"lora.quantization={'nf4' if quantized else 'none'}", f"deepspeed=zero{zero}", f"train.max_steps={steps}",
        "train.warmup_steps=2", "train.micro_batch_size=2", "train.precision=bf16", "train.gradient_checkpointing=true",
        f"train.eval_every={steps}", f"train.save_every={steps}", "train.eval_max_rows=4", "merge.dtype=bf16",
        *(f"eval.sets.{name}={corpus / file}" for name, file in EVAL_SETS.items()),
        *(f"eval.{key}={value}" for key, value in EVAL[accelerator].items()), "eval.max_new_tokens=8",
        f"launcher.accelerator={accelerator}", "launcher.ranks_per_node=1", "tracking.uri=",
        "tracking.tensorboard=false",
    ]  # fmt: skip


class Steps:
    """Runs commands one after another into one log, keeping each one's outcome and seconds in `figures`, written
    to RESULTS/gpu_check.json after every step (a run cut short still leaves what it measured)."""

    def __init__(self, results: Path, extra: dict):
        self.results, self.figures = results, {**extra, "steps": {}}
        results.mkdir(parents=True, exist_ok=True)
        self.log = (results / "gpu_check.log").open("w", encoding="utf-8")

    def run(self, name: str, command: list[str], needs: tuple[str, ...] = ()) -> bool:
        failed = [n for n in needs if not self.figures["steps"].get(n, {}).get("ok")]
        if failed:
            self.record(name, {"ok": False, "skipped": f"needs {', '.join(failed)}"})
            return False
        print(f"gpu-check: {name}", flush=True)
        self.log.write(f"\n===== {name}: {' '.join(command)}\n")
        self.log.flush()
        start = time.perf_counter()
        done = subprocess.run(command, stdout=self.log, stderr=subprocess.STDOUT, env=with_venv_path())
        self.record(name, {"ok": done.returncode == 0, "seconds": round(time.perf_counter() - start, 1)})
        return done.returncode == 0

    def record(self, name: str, outcome: dict) -> None:
        self.figures["steps"][name] = {**self.figures["steps"].get(name, {}), **outcome}
        (self.results / "gpu_check.json").write_text(json.dumps(self.figures, indent=2, sort_keys=True) + "\n")
        print(f"gpu-check: {name}: {outcome}", flush=True)


def stage(name: str, params: Path, **arguments: Path) -> list[str]:
    flags = [x for key, value in arguments.items() for x in (f"--{key.replace('_', '-')}", str(value))]
    return [sys.executable, "-m", f"stages.{name}", "--params", str(params), *flags]


def live_vs_consolidated(final: Path, adapter: Path) -> dict:
    """The consolidated adapter against the live engine's gathered fp32 tensors (in the adapter's dtype)."""
    from safetensors.torch import load_file

    from pipeline.checkpoints.adapter import WEIGHTS as ADAPTER_WEIGHTS

    live, written = load_file(final), load_file(adapter / ADAPTER_WEIGHTS)
    diffs = [
        (written[k.replace(".default.", ".")].float() - v.to(written[k.replace(".default.", ".")].dtype).float())
        .abs().max().item()
        for k, v in live.items()
    ]  # fmt: skip
    return {"tensors": len(live), "max_abs_diff_vs_live": max(diffs)}


def adapters_apart(a: Path, b: Path) -> float:
    """Largest difference between two adapters' tensors (ZeRO-2 and ZeRO-3 trained the same steps)."""
    from safetensors.torch import load_file

    from pipeline.checkpoints.adapter import WEIGHTS as ADAPTER_WEIGHTS

    left, right = load_file(a / ADAPTER_WEIGHTS), load_file(b / ADAPTER_WEIGHTS)
    return max((left[k].float() - right[k].float()).abs().max().item() for k in left)


def check(*, work: Path, tokenizer: Path, corpus: Path, accelerator: str, steps: int, block: int, steps_log: Steps):
    base = work / "base"
    start = time.perf_counter()
    shape = SHAPE if accelerator == "cuda" else SMOKE_SHAPE
    steps_log.figures["parameters"] = write_random_llama(base, tokenizer, shape=shape, device=accelerator)
    steps_log.record("random_base", {"ok": True, "seconds": round(time.perf_counter() - start, 1)})

    def params(zero: int, quantized: bool = False, preference: bool = False, start: Path | None = None) -> Path:
        name = f"zero{zero}{'_nf4' if quantized else ''}{'_dpo' if preference else ''}{'_from' if start else ''}"
        path = work / f"params_{name}.yaml"
        chosen = overrides(
            base=base, corpus=corpus, accelerator=accelerator, zero=zero, steps=steps, block=block, quantized=quantized
        )
        if start is not None:  # DPO on from a trained adapter, against it as the reference
            chosen += [f"train.init_adapter={start}", "train.reference=precomputed"]
        if preference:
            chosen += [  # the packaged review pairs, longer than the text blocks
                f"data.train_file={corpus / 'reviews_pref_train.jsonl'}",
                "data.format=preference",
                f"data.heldout_file={corpus / 'reviews_pref_heldout.jsonl'}",
                "train.objective=dpo",
                "data.max_seq_len=384",
            ]
        path.write_text(yaml.safe_dump(config.compose("conf", chosen)))
        return path

    common = {"run_id_file": work / "run.json"}
    dataset, dataset_json = work / "dataset", work / "dataset.json"
    steps_log.run("cache_dataset", stage(
        "cache_dataset", params(2), tokenizer=tokenizer, base_config=base / "config.json", out=dataset,
        metrics=dataset_json, **common,
    ))  # fmt: skip
    for zero in ZERO_STAGES:
        out = work / f"zero{zero}"
        train(steps_log, f"train_zero{zero}", out, stage(
            "train", params(zero), base=base, tokenizer=tokenizer, dataset=dataset, checkpoints=out / "ckpt",
            metrics=out / "train.json", curve=out / "curve.csv", final_state=out / "final.safetensors", **common,
        ))  # fmt: skip
        if steps_log.run(f"consolidate_zero{zero}", stage(
            "consolidate", params(zero), checkpoints=out / "ckpt", out=out / "adapter",
            metrics=out / "consolidate.json", dataset_metrics=dataset_json, train_metrics=out / "train.json", **common,
        ), needs=(f"train_zero{zero}",)):  # fmt: skip
            compared = live_vs_consolidated(out / "final.safetensors", out / "adapter")
            steps_log.record(f"consolidate_zero{zero}", compared)
    if all(steps_log.figures["steps"][f"consolidate_zero{z}"]["ok"] for z in ZERO_STAGES):
        apart = adapters_apart(work / "zero2" / "adapter", work / "zero3" / "adapter")
        steps_log.figures["zero2_vs_zero3_max_abs_diff"] = apart
    last, merged, sets = work / f"zero{ZERO_STAGES[-1]}", work / "merged", work / "sets"
    if steps_log.run("merge", stage(
        "merge", params(ZERO_STAGES[-1]), base=base, adapter=last / "adapter", out=merged,
        metrics=work / "merge.json", dataset_metrics=dataset_json, train_metrics=last / "train.json", **common,
    ), needs=(f"consolidate_zero{ZERO_STAGES[-1]}",)):  # fmt: skip
        steps_log.record("merge", read_json(work / "merge.json"))
    for name, file in EVAL_SETS.items():
        eval_set = [sys.executable, "-m", "stages.eval_set", "--params", str(params(2)), "--name", name]
        steps_log.run(f"eval_set_{name}", [*eval_set, "--file", str(corpus / file), "--out", str(sets / name)])
    if steps_log.run("evaluate", stage(
        "evaluate", params(ZERO_STAGES[-1]), base=base, base_tokenizer=tokenizer, adapter=last / "adapter",
        merged=merged, sets=sets, metrics=work / "eval.json", plot=work / "eval.csv", task_plot=work / "tasks.csv",
        samples=work / "samples.md", **common,
    ), needs=("merge", *(f"eval_set_{name}" for name in EVAL_SETS))):  # fmt: skip
        steps_log.record("evaluate", {"eval": read_json(work / "eval.json")})
    pairs, out = work / "pairs", work / "dpo"
    steps_log.run("cache_pairs", stage(
        "cache_dataset", params(2, preference=True), tokenizer=tokenizer, base_config=base / "config.json", out=pairs,
        metrics=work / "pairs.json", **common,
    ))  # fmt: skip
    train(steps_log, "train_dpo_zero2", out, stage(
        "train", params(2, preference=True), base=base, tokenizer=tokenizer, dataset=pairs, checkpoints=out / "ckpt",
        metrics=out / "train.json", curve=out / "curve.csv", **common,
    ), needs=("cache_pairs",))  # fmt: skip
    if steps_log.figures["steps"]["train_dpo_zero2"]["ok"]:
        first = (out / "curve.csv").read_text().splitlines()[1].split(",")[1]
        steps_log.record("train_dpo_zero2", {"first_loss": float(first)})  # log 2: the adapter starts at B = 0
    start, out = last / "adapter", work / "dpo_from_adapter"
    train(steps_log, "train_dpo_from_adapter_zero3", out, stage(
        "train", params(3, preference=True, start=start), base=base, tokenizer=tokenizer, dataset=pairs,
        checkpoints=out / "ckpt", metrics=out / "train.json", curve=out / "curve.csv", **common,
    ), needs=("cache_pairs", f"consolidate_zero{ZERO_STAGES[-1]}"))  # fmt: skip
    if steps_log.figures["steps"]["train_dpo_from_adapter_zero3"]["ok"]:
        first = (out / "curve.csv").read_text().splitlines()[1].split(",")[1]
        steps_log.record("train_dpo_from_adapter_zero3", {"first_loss": float(first)})  # log 2: policy = reference
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        steps_log.record("train_qlora_nf4", {"ok": False, "skipped": "bitsandbytes is not installed"})
        return
    out = work / "nf4"
    train(steps_log, "train_qlora_nf4", out, stage(
        "train", params(2, quantized=True), base=base, tokenizer=tokenizer, dataset=dataset, checkpoints=out / "ckpt",
        metrics=out / "train.json", curve=out / "curve.csv", **common,
    ))  # fmt: skip


def train(steps_log: Steps, name: str, out: Path, command: list[str], needs: tuple[str, ...] = ("cache_dataset",)):
    """Run the train stage (once its dataset is cached) and keep its figures."""
    if steps_log.run(name, command, needs=needs):
        metrics = read_json(out / "train.json")
        steps_log.record(name, {k: metrics[k] for k in TRAIN_FIGURES if k in metrics})


def gpu_tests(steps_log: Steps) -> None:
    """The unit tests marked `gpu` (skipped on CPU machines, so only run here), their summary line recorded."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        steps_log.record("gpu_tests", {"ok": False, "skipped": "pytest is not installed (make gpu-wheels carries it)"})
        return
    marked = sorted(str(f) for f in Path("tests/unit").rglob("test_*.py") if "mark.gpu" in f.read_text())
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *marked]
    steps_log.run("gpu_tests", command)
    summary = steps_log.results / "gpu_check.log"
    last = [line for line in summary.read_text().splitlines() if " passed" in line or " failed" in line]
    steps_log.record("gpu_tests", {"summary": last[-1].strip("= ") if last else None})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-throughput", dest="throughput", action="store_false", help="skip bench.gpu_train")
    parser.add_argument("--tokenizer", type=Path, default=Path("artifacts/tokenizer"), help="from `make run`")
    parser.add_argument("--corpus", type=Path, default=Path("data/corpus"), help="from `make run`")
    smoke_arguments(parser)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print("bench.gpu_check: no CUDA device here; nothing checked (--smoke runs the chain on CPU)")
        return 0
    results = results_folder(args)
    accelerator = "cuda" if cuda and not args.smoke else "cpu"
    extra = {"device": torch.cuda.get_device_name(0) if accelerator == "cuda" else "cpu", "smoke": args.smoke,
             "torch": torch.__version__}  # fmt: skip
    steps_log = Steps(results, extra)
    project_folder = smoke_project(args.project) if args.smoke else contextlib.nullcontext(Path.cwd())
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp, project_folder as project:
        check(
            work=Path(tmp), tokenizer=(project / args.tokenizer).resolve(), corpus=(project / args.corpus).resolve(),
            accelerator=accelerator, steps=3 if args.smoke else args.steps, block=64 if args.smoke else 1024,
            steps_log=steps_log,
        )  # fmt: skip
    if accelerator == "cuda":
        gpu_tests(steps_log)
    if accelerator == "cuda" and args.throughput:
        steps_log.run("gpu_train", [sys.executable, "-m", "bench.gpu_train", "--results", str(results)])
    report("gpu_check", steps_log.figures, results)
    failed = [name for name, step in steps_log.figures["steps"].items() if not step["ok"] and "skipped" not in step]
    if failed:
        print(f"gpu-check: failed: {', '.join(failed)} (output in {results / 'gpu_check.log'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
