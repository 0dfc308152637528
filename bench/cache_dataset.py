"""Our stage cache_dataset against the recipe users would otherwise run, each in its own process, as ratios.

    python -m bench.cache_dataset                              # 100 MB and 1 GB of text, 500k SFT rows
    python -m bench.cache_dataset --sizes-mb 100 --sft-rows 50000
    python -m bench.cache_dataset --smoke --work DIR           # the same path at 4 and 8 MB, 2k rows

Ours is `python -m stages.cache_dataset` as `dvc repro` runs it (a copy of params.yaml pointing data.train_file at
the generated corpus; `--workers <cores>` where the stage has that option). The reference is Chinese-LLaMA-Alpaca-2's
recipe (bench/clm_recipe.py: run_clm_pt_with_peft.py's two `datasets.map` passes, or run_clm_sft_with_peft.py's
build_instruction_dataset, num_proc = cores, an empty datasets cache each run). Both are timed from the outside
(imports and writing included) and their peak memory is the summed resident memory of the process tree. Beside
them, the bare Rust tokenizer (`encode_batch_fast`, 10k lines a batch, all cores) over the same text: the rate no
tokenize-and-pack can beat. The text corpus repeats data/corpus/peoples_daily_train.txt to each size; the SFT rows
pair its consecutive lines (user = line i, assistant = line i+1). Generated files are kept in --work and reused.
Figures go to bench/results/cache_dataset.json (with --smoke, to DIR/cache_dataset.json)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import RESULTS, peoples_daily_text, report, run_tree_peak, side_by_side
from pipeline.core.atomic import atomic_path, read_json
from pipeline.core.errors import guarded

REPO = Path(__file__).resolve().parents[1]
HELDOUT = REPO / "data/corpus/peoples_daily_heldout.txt"  # not the train file, so the stage holds nothing out
BLOCK_SIZE = 512
ENCODE_BATCH = 10_000  # lines a bare encode_batch_fast call takes
GOALS = {"tokens_per_s_ratio": 1.5, "memory_ratio": 0.3, "ours_peak_flatness": 0.10, "ours_over_bare": 0.8}
AT_LEAST = {"tokens_per_s_ratio", "ours_over_bare"}  # the other goals are ceilings


def corpus_lines(text: bytes) -> list[bytes]:
    """The text's non-blank lines, each ending in a newline."""
    return [line + b"\n" for line in text.splitlines() if line.strip()]


def repeat_plan(lines: list[bytes], target_bytes: int) -> tuple[int, int, int]:
    """(whole copies, lines of one more copy, bytes) of the shortest repetition of `lines` reaching target_bytes."""
    copies, rest = divmod(target_bytes, sum(map(len, lines)))
    count, size = 0, 0
    while size < rest:
        size += len(lines[count])
        count += 1
    return copies, count, copies * sum(map(len, lines)) + size


def text_corpus(lines: list[bytes], *, size_mb: int, work: Path, tag: str) -> Path:
    """The corpus of `size_mb` MB in `work` (written once; reused when its size is right)."""
    copies, count, size = repeat_plan(lines, size_mb * 2**20)
    path = work / f"text_{size_mb}mb_{tag}.txt"
    if path.is_file() and path.stat().st_size == size:
        return path
    whole = b"".join(lines)
    with atomic_path(path) as tmp, tmp.open("wb") as out:
        for _ in range(copies):
            out.write(whole)
        out.write(b"".join(lines[:count]))
    return path


def sft_corpus(lines: list[bytes], *, rows: int, work: Path, tag: str, chat: bool) -> Path:
    """`rows` SFT rows pairing consecutive corpus lines (cyclically): chat `messages`, or Alpaca {instruction,
    output} for a tokenizer without a chat template. Written once (atomically, so an existing file is whole)."""
    path = work / f"sft_{'chat' if chat else 'alpaca'}_{rows}_{tag}.jsonl"
    if path.is_file():
        return path
    texts = [line.decode("utf-8").strip() for line in lines]
    with atomic_path(path) as tmp, tmp.open("w", encoding="utf-8") as out:
        for i in range(rows):
            user, assistant = texts[i % len(texts)], texts[(i + 1) % len(texts)]
            if chat:
                row = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}
            else:
                row = {"instruction": user, "output": assistant}
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def stage_workers(cores: int) -> list[str]:
    """`--workers <cores>` where the stage lists that option, else nothing (it runs in one process)."""
    done = subprocess.run(
        [sys.executable, "-m", "stages.cache_dataset", "--help"], cwd=REPO, capture_output=True, text=True
    )
    return ["--workers", str(cores)] if "--workers" in done.stdout else []


def run_ours(
    *, data: Path, data_format: str, template: str, tokenizer: Path, base_config: Path, work: Path, workers: list[str]
) -> dict:
    """The stage on `data`, as users run it; its wall seconds, peak tree memory and the metrics it wrote."""
    side = work / "ours"
    shutil.rmtree(side, ignore_errors=True)
    side.mkdir(parents=True)
    params = yaml.safe_load((REPO / "params.yaml").read_text(encoding="utf-8"))
    files = {"train_file": str(data), "heldout_file": str(HELDOUT), "sources": []}
    shape = {"block_size": BLOCK_SIZE, "max_seq_len": BLOCK_SIZE, "tail": "drop"}
    params["data"].update(format=data_format, prompt_template=template, **files, **shape)
    params["tracking"]["uri"] = ""
    (side / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False), encoding="utf-8")
    command = [
        sys.executable, "-m", "stages.cache_dataset", "--params", str(side / "params.yaml"),
        "--tokenizer", str(tokenizer), "--base-config", str(base_config), "--out", str(side / "dataset"),
        "--metrics", str(side / "metrics.json"), "--run-id-file", str(side / "run.json"), *workers,
    ]  # fmt: skip
    seconds, peak_mb = run_tree_peak(command)
    metrics = read_json(side / "metrics.json")
    rows = metrics["train_rows"] + metrics["validation_rows"]
    shutil.rmtree(side)
    packed = rows * BLOCK_SIZE if data_format == "text" else metrics["tokens"]
    figures = {"seconds": seconds, "peak_mb": peak_mb, "packed_tokens": packed, "rows": rows}
    return {**figures, "documents": metrics["documents"], "tokens": metrics["tokens"]}


def run_reference(*, mode: str, data: Path, tokenizer: Path, work: Path, cores: int) -> dict:
    """bench/clm_recipe.py on `data` in its own process (its own, emptied datasets cache); its figures."""
    side = work / "reference"
    shutil.rmtree(side, ignore_errors=True)
    side.mkdir(parents=True)
    command = [
        sys.executable, "-m", "bench.clm_recipe", mode, "--data", str(data), "--tokenizer", str(tokenizer),
        "--cache-dir", str(side / "hf_cache"), "--out", str(side / "dataset"), "--figures", str(side / "figures.json"),
        "--num-proc", str(cores), "--block-size", str(BLOCK_SIZE), "--max-seq-len", str(BLOCK_SIZE),
    ]  # fmt: skip
    seconds, peak_mb = run_tree_peak(command)
    figures = read_json(side / "figures.json")
    if mode == "sft":  # counted here, after the timing: the recipe keeps them, our stage drops them
        figures["tokens_written"] = figures["tokens"]
        figures["tokens"] = figures["packed_tokens"] = trained_example_tokens(side / "dataset" / "train")
    shutil.rmtree(side)
    return {"seconds": seconds, "peak_mb": peak_mb, **figures}


def trained_example_tokens(split: Path) -> int:
    """Tokens of a saved SFT split's examples that train on at least one token (an example whose prompt fills
    max_seq_len is all -100), read a record batch at a time."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    files = read_json(split / "state.json")["_data_files"]
    total = 0
    for file in files:
        for batch in pa.ipc.open_stream(pa.memory_map(str(split / file["filename"]))):
            labels = batch.column("labels")
            trained = np.zeros(len(labels), dtype=bool)
            rows = pc.list_parent_indices(labels).to_numpy()
            trained[rows[pc.not_equal(pc.list_flatten(labels), -100).to_numpy(zero_copy_only=False)]] = True
            total += int(pc.list_value_length(labels).to_numpy(zero_copy_only=False)[trained].sum())
    return total


def bare_encode(tokenizer, data: Path) -> dict:
    """The Rust tokenizer alone over the text's lines, ENCODE_BATCH at a time: tokens and seconds."""
    backend = tokenizer.backend_tokenizer
    tokens, start = 0, time.perf_counter()
    with data.open(encoding="utf-8") as lines:
        while batch := [line.rstrip("\n") for _, line in zip(range(ENCODE_BATCH), lines, strict=False)]:
            tokens += sum(map(len, backend.encode_batch_fast(batch)))
    return {"tokens": tokens, "seconds": time.perf_counter() - start}


def compare(ours: dict, theirs: dict, *, cores: int, bare: dict | None = None) -> dict:
    """One size's figures: both sides, their ratios, and ours against the bare tokenizer."""
    ours_rate, their_rate = ours["tokens"] / ours["seconds"], theirs["tokens"] / theirs["seconds"]
    figures = {
        "documents": ours["documents"],
        "ours_tokens": ours["tokens"],
        "reference_tokens": theirs["tokens"],
        "ours_packed_tokens": ours["packed_tokens"],
        "reference_packed_tokens": theirs["packed_tokens"],
        **side_by_side(
            reference_seconds=theirs["seconds"],
            ours_seconds=ours["seconds"],
            reference_mb=theirs["peak_mb"],
            ours_mb=ours["peak_mb"],
        ),
        "ours_tokens_per_s": round(ours_rate),
        "reference_tokens_per_s": round(their_rate),
        "ours_tokens_per_s_per_core": round(ours_rate / cores),
        "reference_tokens_per_s_per_core": round(their_rate / cores),
        "tokens_per_s_ratio": round(ours_rate / their_rate, 3),
    }
    if bare is not None:
        bare_rate = bare["tokens"] / bare["seconds"]
        figures["bare_encode_tokens_per_s"] = round(bare_rate)
        figures["ours_over_bare"] = round(ours_rate / bare_rate, 3)
    return figures


def goal(key: str, value: float) -> str:
    """The figure beside its goal, and whether it meets it."""
    target = GOALS[key]
    met = value >= target if key in AT_LEAST else value <= target
    return f"{value:g} ({'>=' if key in AT_LEAST else '<='} {target:g}: {'met' if met else 'NOT met'})"


ROWS = [  # (label, key, formatted as a goal)
    ("documents", "documents", False),
    ("tokens (ours / reference)", None, False),
    ("ours s", "ours_seconds", False),
    ("reference s", "reference_seconds", False),
    ("ours tokens/s", "ours_tokens_per_s", False),
    ("reference tokens/s", "reference_tokens_per_s", False),
    ("ours tokens/s per core", "ours_tokens_per_s_per_core", False),
    ("reference tokens/s per core", "reference_tokens_per_s_per_core", False),
    ("tokens/s ratio", "tokens_per_s_ratio", True),
    ("ours peak MB", "ours_peak_memory_mb", False),
    ("reference peak MB", "reference_peak_memory_mb", False),
    ("peak ratio", "memory_ratio", True),
    ("bare encode tokens/s", "bare_encode_tokens_per_s", False),
    ("ours / bare encode", "ours_over_bare", True),
]


def markdown(columns: dict[str, dict]) -> str:
    """A table of the figures: one column a run."""
    lines = [f"| figure | {' | '.join(columns)} |", "|---" * (len(columns) + 1) + "|"]
    for label, key, is_goal in ROWS:
        cells = []
        for figures in columns.values():
            if key is None:
                cells.append(f"{figures['ours_tokens']:,} / {figures['reference_tokens']:,}")
            elif key not in figures:
                cells.append("-")
            else:
                cells.append(goal(key, figures[key]) if is_goal else f"{figures[key]:,}")
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> None:
    from pipeline.data.tokenizer import load_tokenizer

    for path in (args.tokenizer, args.base_config):
        if not path.exists():
            raise FileNotFoundError(f"{path}: not found; run `make run` first, or pass --tokenizer and --base-config")
    cores = len(os.sched_getaffinity(0))
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(args.tokenizer)
    chat = bool(tokenizer.chat_template)
    lines = corpus_lines(peoples_daily_text())
    tag = hashlib.sha256(b"".join(lines)).hexdigest()[:8]
    workers = stage_workers(cores)
    common = {"tokenizer": args.tokenizer.resolve(), "work": work}
    ours_only = {"base_config": args.base_config.resolve(), "workers": workers}
    figures: dict = {
        "cores": cores,
        "ours_options": " ".join(workers) or "none (one process)",
        "tokenizer": str(args.tokenizer),
        "tokenizer_size": len(tokenizer),
        "block_size": BLOCK_SIZE,
        "goals": GOALS,
        "text": {},
    }
    for size_mb in args.sizes_mb:
        data = text_corpus(lines, size_mb=size_mb, work=work, tag=tag)
        ours = run_ours(data=data, data_format="text", template="alpaca", **common, **ours_only)
        theirs = run_reference(mode="text", data=data, cores=cores, **common)
        bare = bare_encode(tokenizer, data)
        measured = compare(ours, theirs, cores=cores, bare=bare)
        figures["text"][f"{size_mb}mb"] = {"corpus_bytes": data.stat().st_size, **measured}
        print(f"cache_dataset bench: text {size_mb} MB done", flush=True)
    peaks = [f["ours_peak_memory_mb"] for f in figures["text"].values()]
    if len(peaks) > 1:
        figures["ours_peak_flatness"] = round(max(peaks) / min(peaks) - 1, 3)
    data = sft_corpus(lines, rows=args.sft_rows, work=work, tag=tag, chat=chat)
    template = "chat" if chat else "alpaca"
    ours = run_ours(data=data, data_format=template, template=template, **common, **ours_only)
    theirs = run_reference(mode="sft", data=data, cores=cores, **common)
    written = {"reference_tokens_written": theirs["tokens_written"]}  # its all-masked examples too
    figures["sft"] = {"rows": args.sft_rows, "template": template, **written, **compare(ours, theirs, cores=cores)}
    report("cache_dataset", figures, results=work if args.smoke else RESULTS)
    columns = {f"text {k.removesuffix('mb')} MB": v for k, v in figures["text"].items()}
    print("\n" + markdown({**columns, f"SFT {args.sft_rows:,} rows ({template})": figures["sft"]}))
    if "ours_peak_flatness" in figures:
        flatness = goal("ours_peak_flatness", figures["ours_peak_flatness"])
        print(f"\nour peak across sizes: {', '.join(f'{p:,} MB' for p in peaks)}; flatness {flatness}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[100, 1024], help="text corpus sizes (MB)")
    parser.add_argument("--sft-rows", type=int, default=500_000, help="SFT rows to generate")
    work = Path(tempfile.gettempdir()) / "bench_cache_dataset"
    parser.add_argument("--work", type=Path, default=work, help="generated corpora (kept) and the runs' outputs")
    parser.add_argument("--tokenizer", type=Path, default=REPO / "artifacts/tokenizer", help="tokenizer folder")
    base_context = REPO / "artifacts/base_context.json"  # what `dvc repro cache_dataset` writes (its config.json too)
    parser.add_argument("--base-config", type=Path, default=base_context, help="JSON with max_position_embeddings")
    parser.add_argument("--smoke", action="store_true", help="4 and 8 MB, 2k SFT rows; figures to --work only")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes_mb, args.sft_rows = [4, 8], 2000  # both sizes hold 2+ parts: both workers busy
    guarded(lambda: run(args))


if __name__ == "__main__":
    main()
