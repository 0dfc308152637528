"""`make scale-check`: the whole chain on a model no rank could hold the old way, on this 24 GB, 2-core machine.

A randomly initialised LLaMA of Llama-3.2-3B's shape (3.2 B parameters, bf16, generated deterministically from a
seed into a safetensors folder) runs through every stage, as `dvc repro` runs them (the same commands, in the
graph's order, each under a wrapper that measures its seconds and the peak resident memory of its largest
process): train with 2 CPU ranks under ZeRO-3 for a few steps of short blocks, consolidate, merge with its
verification, evaluate on a small text. The training data is a generated corpus of several GB (People's Daily's
training file repeated, --data-mb), so check, cache_dataset and train show their memory at the users' data scale
too. Then the old loading path (every rank loads the whole base in fp32, as
train did before) is started with 2 ranks inside a memory cgroup the size of this machine's free memory, to show
that it cannot run here. Writes metrics/scale_check.json in the check's copy of the project and prints the table.

    python -m bench.scale_check [--workdir DIR]
    python -m bench.scale_check --smoke       # the same path on a tiny model, no cgroup (make test runs it)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import peoples_daily_text, run_measured
from pipeline.checkpoints import model_files, safetensors_stream
from pipeline.core.atomic import read_json, write_json
from pipeline.core.environment import with_venv_path
from pipeline.model import outline
from tools.repro_check import copy_project, sh

SHAPE = {  # Llama-3.2-3B
    "hidden_size": 3072, "num_hidden_layers": 28, "intermediate_size": 8192, "num_attention_heads": 24,
    "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True, "max_position_embeddings": 2048,
    "rope_theta": 500000.0,
}  # fmt: skip
SMOKE_SHAPE = {
    "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 49152, "tie_word_embeddings": True, "max_position_embeddings": 2048,
}  # fmt: skip
OVERRIDES = [
    "experiment=tiny", "deepspeed=zero3", "train.precision=bf16", "launcher.ranks_per_node=2", "merge.dtype=bf16",
    "model.dtype=bfloat16", "tracking.uri=", "eval.max_new_tokens=4",
]  # fmt: skip
SHARD_BYTES = 2 * 10**9
DATA_MB, SMOKE_DATA_MB = 3072, 8
CORPUS = "scale_corpus/corpus.txt"  # in the check's copy of the project (data/corpus is prepare_corpus's output)


def write_corpus(path: Path, megabytes: int) -> int:
    """People's Daily's training file repeated to at least `megabytes` MB, at `path`; its bytes."""
    block = peoples_daily_text()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as out:
        for _ in range(-(-megabytes * 2**20 // len(block))):
            out.write(block)
    return path.stat().st_size


def write_random_llama(
    out: Path, tokenizer_dir: Path, seed: int = 0, shape: dict | None = None, device: str = "cpu"
) -> int:
    """The model of `shape` (default SHAPE) with N(0, 0.02) weights (norms 1), bf16, one tensor in memory at a time,
    drawn on `device` (a GPU draws an 8B model's in seconds, where 16 CPU cores take minutes), with its module outline
    (as prepare_base writes it: a train stage given this folder reads it, not transformers' model code); its
    parameters."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(shape or SHAPE), torch_dtype="bfloat16", architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        shapes = {name: tuple(p.shape) for name, p in LlamaForCausalLM(config).named_parameters()}
    out.mkdir(parents=True)
    config.save_pretrained(out)
    shards, current, size = [], [], 0
    for name, shape in shapes.items():
        if current and size + 2 * math.prod(shape) > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += 2 * math.prod(shape)
    shards.append(current)
    index = list(shapes)

    def produce(name: str) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shapes[name], dtype=torch.bfloat16)
        generator = torch.Generator(device=device).manual_seed(seed * 100_003 + index.index(name))
        return (torch.randn(shapes[name], generator=generator, device=device) * 0.02).to(torch.bfloat16).cpu()

    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, shard in zip(names, shards, strict=True):
        safetensors_stream.write(out / file, [(n, shapes[n], torch.bfloat16) for n in shard], produce)
    weight_map = {n: file for file, shard in zip(names, shards, strict=True) for n in shard}
    total = sum(2 * math.prod(s) for s in shapes.values())
    write_json(out / safetensors_stream.INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
    for path in tokenizer_dir.iterdir():
        (out / path.name).write_bytes(path.read_bytes())
    outline.write(out)
    return sum(math.prod(s) for s in shapes.values())


def stage_commands(project: Path) -> list[tuple[str, str]]:
    """(stage, command) in the order `dvc repro` runs them, from its dry run."""
    dry = sh(["dvc", "repro", "--dry", "--force"], project).stdout
    return re.findall(r"Running stage '([\w@.-]+)':\n> (.+)", dry)  # eval_set@NAME too


def old_loading_path(base: Path, limit_bytes: int) -> dict:
    """2 processes each loading the whole base in fp32 (what every rank did before), inside a memory cgroup of
    `limit_bytes`: killed, or how far they got."""
    group = Path("/sys/fs/cgroup/memory/scale_check_old_path")
    try:
        group.mkdir(exist_ok=True)
        (group / "memory.limit_in_bytes").write_text(str(limit_bytes))
    except OSError as err:
        return {"skipped": f"no writable cgroup v1 memory controller here ({err})"}
    code = (
        "import sys, torch; from transformers import AutoModelForCausalLM; "
        "AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32); print('loaded')"
    )
    inside = f'echo $$ > {group}/cgroup.procs && exec "$0" -c "$1" "$2"'  # the shell joins, then becomes Python
    start = time.perf_counter()
    ranks = [
        subprocess.Popen(["sh", "-c", inside, sys.executable, code, str(base)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    results = [(p.wait(), p.stdout.read().strip()) for p in ranks]
    peak = int((group / "memory.max_usage_in_bytes").read_text())
    oom = int(next(line.split()[1] for line in (group / "memory.oom_control").read_text().splitlines()
                   if line.startswith("oom_kill ")))  # fmt: skip
    group.rmdir()
    return {
        "limit_gb": round(limit_bytes / 1e9, 1),
        "exit_codes": [code for code, _ in results],
        "loaded": sum(out == "loaded" for _, out in results),
        "oom_kills": oom,
        "peak_gb": round(peak / 1e9, 2),
        "seconds": round(time.perf_counter() - start, 1),
    }


def read_yaml(path: Path) -> dict:
    import yaml

    return yaml.safe_load(path.read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> int:
    import psutil

    from pipeline.core.assets import resolve
    from pipeline.data.tokenizer import load_tokenizer
    from tools.repro_check import REPO

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "scale-check")
    parser.add_argument("--smoke", action="store_true", help="a tiny model: the same stages, in a few minutes")
    parser.add_argument("--data-mb", type=int, help=f"training corpus size (default {DATA_MB}; smoke {SMOKE_DATA_MB})")
    args = parser.parse_args(argv)
    os.environ.update(with_venv_path())  # the stage commands call `python`, `deepspeed`
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    base = work / ("llama_tiny_random" if args.smoke else "llama_3b_random")
    if not (base / safetensors_stream.INDEX).is_file():
        start = time.perf_counter()
        gguf = resolve(read_yaml(REPO / "conf/model/smollm2_135m.yaml")["path"])
        load_tokenizer(gguf.parent, gguf_file=gguf.name).save_pretrained(str(work / "tokenizer"))
        parameters = write_random_llama(base, work / "tokenizer", shape=SMOKE_SHAPE if args.smoke else None)
        print(f"scale-check: {parameters / 1e9:.2f} B parameters in {base} ({time.perf_counter() - start:.0f} s)")
    parameters = sum(math.prod(t.shape) for t in model_files.model_tensors(base).values())
    project = work / "project"
    if project.exists():
        sh(["rm", "-rf", str(project)], work)
    copy_project(project, REPO)
    corpus_bytes = write_corpus(project / CORPUS, args.data_mb or (SMOKE_DATA_MB if args.smoke else DATA_MB))
    data = [f"data.train_file={CORPUS}", "data.heldout_file=data/corpus/peoples_daily_heldout.txt"]
    sh([sys.executable, "-m", "pipeline.core.config", *OVERRIDES, *data, f"model.path={base}"], project)
    rows = []
    for stage, command in stage_commands(project):
        seconds, peak_mb, _ = run_measured(["bash", "-c", f"cd {project} && {command}"])
        rows.append({"stage": stage, "seconds": round(seconds, 1), "peak_memory_mb": round(peak_mb)})
        print(f"scale-check: {stage:<18} {seconds:8.1f} s {peak_mb:10.0f} MB", flush=True)
    train = read_json(project / "metrics/train.json")
    merge = read_json(project / "metrics/merge.json")
    old = {"skipped": "--smoke"} if args.smoke else old_loading_path(base, int(psutil.virtual_memory().available * 0.9))
    result = {
        "parameters": parameters,
        "bf16_model_gb": round(2 * parameters / 1e9, 2),
        "fp32_model_gb": round(4 * parameters / 1e9, 2),
        "corpus_mb": round(corpus_bytes / 2**20),
        "dataset": read_json(project / "metrics/dataset.json"),
        "stages": rows,
        "train_peak_memory_mb_per_rank": train["peak_memory_mb_per_rank"],
        "train_load_peak_mb_per_rank": train.get("load_peak_mb_per_rank"),
        "train_zero3_partitioned": [train.get("zero3_partitioned_parameters"), train.get("zero3_large_parameters")],
        "merge_verification": {k: merge.get(k) for k in ("max_abs_logit_diff", "mean_kl")},
        "eval": read_json(project / "metrics/eval.json"),
        "old_loading_path": old,
    }
    write_json(project / "metrics/scale_check.json", result)
    print(json.dumps(result, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
