"""Training speed and memory of our train stage against LLaMA-Factory (bench/llamafactory.py), side by side in one
run: the same base (artifacts/base), the same text, LoRA r=8 on q_proj,v_proj, 2 CPU ranks x 2 rows x 256 tokens,
ZeRO-2, 8 steps, in bf16 (where the CPU computes it) and fp32, on packed pretraining text and on chat SFT
(experiment=sft_chat; tokens counted without padding). The two sides alternate; each figure is the median of
--runs runs. Beside them, the bare eager rate: the same PEFT model's forward+backward on the same micro-batches, one
process per core, no DeepSpeed. Needs `make run` first (artifacts/base and artifacts/tokenizer)."""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from bench import llamafactory
from bench.common import report, run_measured
from pipeline.core import config
from pipeline.core.atomic import read_json
from pipeline.core.environment import with_venv_path
from pipeline.core.precision import native_bf16
from pipeline.training.launch import before_launch

STEPS, RANKS, MICRO, BLOCK, LR = 8, 2, 2, 256, 2e-4
SUBSET_LINES = 3000  # of each corpus: enough blocks and dialogues for 8 steps, quick to tokenize
CORPUS = {"text": Path("data/corpus/peoples_daily_train.txt"), "chat": Path("data/corpus/chitchat_train.jsonl")}
HELDOUT = {"text": Path("data/corpus/peoples_daily_heldout.txt"), "chat": Path("data/corpus/chitchat_heldout.jsonl")}


def subset_file(work: Path, kind: str) -> Path:
    return work / f"{kind}{CORPUS[kind].suffix}"


def overrides(kind: str, precision: str, work: Path) -> list[str]:
    data = [f"data.train_file={subset_file(work, kind)}", f"data.heldout_file={HELDOUT[kind]}"]
    if kind == "chat":
        data = ["experiment=sft_chat", *data, f"data.max_seq_len={BLOCK}"]
    return [
        *data, f"data.block_size={BLOCK}", "lora.r=8", "lora.alpha=16", "lora.dropout=0.0",
        "lora.target_modules=[q_proj,v_proj]", f"train.max_steps={STEPS}", "train.warmup_steps=2", f"train.lr={LR}",
        f"train.micro_batch_size={MICRO}", f"train.global_batch_size={MICRO * RANKS}", f"train.precision={precision}",
        f"launcher.ranks_per_node={RANKS}", "deepspeed=zero2", f"train.eval_every={STEPS}",
        f"train.save_every={STEPS}", "train.eval_max_rows=4", "tracking.uri=", "tracking.tensorboard=false",
    ]  # fmt: skip


def prepare(work: Path) -> Path:
    """Both sides' data: the first SUBSET_LINES of each corpus, cached by our cache_dataset stage (ours) and
    written as LLaMA-Factory's dataset folder (theirs)."""
    lines = {}
    for kind, corpus in CORPUS.items():
        lines[kind] = corpus.read_text(encoding="utf-8").splitlines(keepends=True)[:SUBSET_LINES]
        subset_file(work, kind).write_text("".join(lines[kind]), encoding="utf-8")
        params = work / kind / "params.yaml"
        params.parent.mkdir(parents=True)
        params.write_text(yaml.safe_dump(config.compose("conf", overrides(kind, "fp32", work))))
        subprocess.run([
            sys.executable, "-m", "stages.cache_dataset", "--params", str(params), "--tokenizer", "artifacts/tokenizer",
            "--base-config", "artifacts/base/config.json", "--out", str(work / kind / "dataset"),
            "--metrics", str(work / kind / "dataset.json"), "--run-id-file", str(work / "run.json"),
        ], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    return llamafactory.write_data(
        work / "llamafactory_data", text_lines=[t.rstrip("\n") for t in lines["text"]], chats=lines["chat"]
    )


def ours(work: Path, kind: str, precision: str) -> dict:
    run = work / f"ours_{kind}_{precision}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir()
    params = run / "params.yaml"
    params.write_text(yaml.safe_dump(config.compose("conf", overrides(kind, precision, work))))
    before_launch()
    wall, peak, _ = run_measured([
        sys.executable, "-m", "stages.train", "--params", str(params), "--base", "artifacts/base",
        "--tokenizer", "artifacts/tokenizer", "--dataset", str(work / kind / "dataset"),
        "--checkpoints", str(run / "ckpt"), "--metrics", str(run / "metrics.json"), "--curve", str(run / "curve.csv"),
        "--run-id-file", str(run / "run.json"),
    ], env=with_venv_path())  # fmt: skip
    metrics = read_json(run / "metrics.json")
    return {"tokens_per_s": metrics["tokens_per_s"], "wall_s": wall, "peak_mb_per_rank": peak,
            "final_loss": metrics["final_train_loss"]}  # fmt: skip


def theirs(work: Path, data: Path, kind: str, precision: str) -> dict:
    run = work / f"llamafactory_{kind}_{precision}"
    run.mkdir(exist_ok=True)
    options = llamafactory.config(
        base=Path("artifacts/base"), data=data, kind=kind, precision=precision, steps=STEPS, micro=MICRO,
        block=BLOCK, lr=LR, work=run, tokenized=work / f"llamafactory_tokenized_{kind}",
    )  # fmt: skip
    (run / "cfg.yaml").write_text(yaml.safe_dump(options))
    before_launch()
    wall, peak, _ = run_measured(llamafactory.command(run / "cfg.yaml"), env=llamafactory.environment(RANKS))
    loop_seconds, tokens = llamafactory.loop_figures(run)
    if kind == "text":  # every position of a packed block is a real token
        tokens = STEPS * MICRO * RANKS * BLOCK
    return {"tokens_per_s": tokens / loop_seconds, "wall_s": wall, "peak_mb_per_rank": peak}


def eager(work: Path, kind: str, precision: str) -> float:
    """Tokens/s of RANKS bare eager processes (bench/eager_loop.py) run at once, one thread each: their sum."""
    command = [sys.executable, "-m", "bench.eager_loop", "--dataset", str(work / kind / "dataset"),
               "--precision", precision, "--micro", str(MICRO), "--steps", str(STEPS)]  # fmt: skip
    env = {**with_venv_path(), "OMP_NUM_THREADS": "1"}
    workers = [
        subprocess.Popen([*command, "--offset", str(i)], env=env, stdout=subprocess.PIPE, text=True)
        for i in range(RANKS)
    ]
    return sum(json.loads(w.communicate()[0].strip().splitlines()[-1])["tokens_per_s"] for w in workers)


def median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def compare(work: Path, data: Path, kind: str, precision: str, runs: int) -> dict:
    """Both sides `runs` times, alternating (theirs first on odd rounds), and the eager rate; medians and ratios."""
    llamafactory.tokenize_once(
        work / f"llamafactory_tokenize_{kind}", base=Path("artifacts/base"), data=data, kind=kind, block=BLOCK,
        tokenized=work / f"llamafactory_tokenized_{kind}", ranks=RANKS,
    )  # fmt: skip
    our, their = [], []
    for i in range(runs):
        sides = [("ours", our), ("theirs", their)]
        for name, results in sides if i % 2 == 0 else sides[::-1]:
            results.append(ours(work, kind, precision) if name == "ours" else theirs(work, data, kind, precision))
            print(f"bench.train: {kind} {precision} {name} run {i + 1}: {json.dumps(results[-1])}", flush=True)
    eager_rate = eager(work, kind, precision)
    figures = {
        "ours_tokens_per_s": round(median(our, "tokens_per_s"), 1),
        "llamafactory_tokens_per_s": round(median(their, "tokens_per_s"), 1),
        "eager_tokens_per_s": round(eager_rate, 1),
        "ours_wall_s": round(median(our, "wall_s"), 1),
        "llamafactory_wall_s": round(median(their, "wall_s"), 1),
        "ours_peak_mb_per_rank": round(median(our, "peak_mb_per_rank")),
        "llamafactory_peak_mb_per_rank": round(median(their, "peak_mb_per_rank")),
    }
    figures.update(
        speedup=round(figures["ours_tokens_per_s"] / figures["llamafactory_tokens_per_s"], 3),
        over_eager=round(figures["ours_tokens_per_s"] / eager_rate, 3),
        wall_ratio=round(figures["ours_wall_s"] / figures["llamafactory_wall_s"], 3),
        memory_ratio=round(figures["ours_peak_mb_per_rank"] / figures["llamafactory_peak_mb_per_rank"], 3),
        runs={"ours": our, "llamafactory": their},
    )
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="runs of each side per setting (median)")
    parser.add_argument("--kinds", nargs="+", default=["text", "chat"], choices=["text", "chat"])
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    args = parser.parse_args(argv)
    llamafactory.ensure_venv()
    precisions = [p for p in args.precisions if p != "bf16" or native_bf16("cpu")]
    figures = {"steps": STEPS, "ranks": RANKS, "micro": MICRO, "block": BLOCK, "llamafactory": llamafactory.VERSION}
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        work = Path(tmp)
        data = prepare(work)
        for kind in args.kinds:
            for precision in precisions:
                figures[f"{kind}_{precision}"] = compare(work, data, kind, precision, args.runs)
    report("train", figures)
    print(table(figures))


def table(figures: dict) -> str:
    """The README's table."""
    lines = [
        "| data, precision | tokens/s: ours / LLaMA-Factory / eager | ours/theirs | ours/eager | wall s: ours / theirs "
        "| peak MB per rank: ours / theirs |",
        "|---|---|---|---|---|---|",
    ]
    for key, f in figures.items():
        if isinstance(f, dict) and "speedup" in f:
            lines.append(
                f"| {key.replace('_', ', ')} | {f['ours_tokens_per_s']} / {f['llamafactory_tokens_per_s']} / "
                f"{f['eager_tokens_per_s']} | {f['speedup']}x | {f['over_eager']}x | {f['ours_wall_s']} / "
                f"{f['llamafactory_wall_s']} ({f['wall_ratio']}x) | {f['ours_peak_mb_per_rank']} / "
                f"{f['llamafactory_peak_mb_per_rank']} ({f['memory_ratio']}x) |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
