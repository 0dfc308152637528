"""Training speed and memory of our train stage against LLaMA-Factory (bench/llamafactory.py), side by side in one
run: the same base (artifacts/base), the same text, LoRA r=8 on q_proj,v_proj, 2 CPU ranks x 2 rows x 256 tokens,
ZeRO-2, 8 steps, in bf16 (where the CPU computes it) and fp32, on packed pretraining text and on chat SFT
(experiment=sft_chat; tokens counted without padding). The two sides alternate; each figure is the median of
--runs runs. Beside them, the bare eager rate: the same PEFT model's forward+backward on the same micro-batches, one
process per core, no DeepSpeed. Needs `make run` first (artifacts/base and artifacts/tokenizer).

    python -m bench.train [--runs 3] [--kinds text chat] [--precisions bf16 fp32]
    python -m bench.train --smoke [--results DIR]   # the tiny pipeline's model, 3 steps of 64 tokens, fp32 (make test)

The smoke run trains LLaMA-Factory too where its environment is built (`python -m bench.llamafactory`, from the
package registry); elsewhere it runs ours and eager and says that it skipped LLaMA-Factory."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import yaml

from bench import llamafactory
from bench.common import report, results_folder, run_measured, smoke_arguments, smoke_project
from pipeline.core import config
from pipeline.core.atomic import read_json
from pipeline.core.environment import with_venv_path
from pipeline.core.precision import native_bf16
from pipeline.launching.ops import before_launch

LR = 2e-4
CORPUS = {"text": Path("data/corpus/peoples_daily_train.txt"), "chat": Path("data/corpus/chitchat_train.jsonl")}
HELDOUT = {"text": Path("data/corpus/peoples_daily_heldout.txt"), "chat": Path("data/corpus/chitchat_heldout.jsonl")}


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One bench run's sizes and inputs: `root` the project whose artifacts/ and data/corpus/ it reads."""

    steps: int
    ranks: int
    micro: int  # rows per rank and step
    block: int  # tokens per row
    lines: int  # of each corpus: enough blocks and dialogues for the steps, quick to tokenize
    root: Path = Path(".")

    @property
    def base(self) -> Path:
        return self.root / "artifacts/base"

    @property
    def tokenizer(self) -> Path:
        return self.root / "artifacts/tokenizer"


FULL = Setup(steps=8, ranks=2, micro=2, block=256, lines=3000)
SMOKE = Setup(steps=3, ranks=2, micro=1, block=64, lines=200)  # steps > 2 warm-up steps; a 256-token window


def subset_file(work: Path, kind: str) -> Path:
    return work / f"{kind}{CORPUS[kind].suffix}"


def overrides(setup: Setup, kind: str, precision: str, work: Path) -> list[str]:
    data = [f"data.train_file={subset_file(work, kind)}", f"data.heldout_file={setup.root / HELDOUT[kind]}"]
    steps, micro, block = setup.steps, setup.micro, setup.block
    if kind == "chat":
        data = ["experiment=sft_chat", *data, f"data.max_seq_len={block}"]
    return [
        *data, f"data.block_size={block}", "lora.r=8", "lora.alpha=16", "lora.dropout=0.0",
        "lora.target_modules=[q_proj,v_proj]", f"train.max_steps={steps}", "train.warmup_steps=2", f"train.lr={LR}",
        f"train.micro_batch_size={micro}", f"train.global_batch_size={micro * setup.ranks}",
        f"train.precision={precision}", f"launcher.ranks_per_node={setup.ranks}", "deepspeed=zero2",
        f"train.eval_every={steps}", f"train.save_every={steps}", "train.eval_max_rows=4", "tracking.uri=",
        "tracking.tensorboard=false",
    ]  # fmt: skip


def prepare(setup: Setup, work: Path) -> Path:
    """Both sides' data: the first `setup.lines` of each corpus, cached by our cache_dataset stage (ours) and
    written as LLaMA-Factory's dataset folder (theirs)."""
    lines = {}
    for kind, corpus in CORPUS.items():
        lines[kind] = (setup.root / corpus).read_text(encoding="utf-8").splitlines(keepends=True)[: setup.lines]
        subset_file(work, kind).write_text("".join(lines[kind]), encoding="utf-8")
        params = work / kind / "params.yaml"
        params.parent.mkdir(parents=True)
        params.write_text(yaml.safe_dump(config.compose("conf", overrides(setup, kind, "fp32", work))))
        subprocess.run([
            sys.executable, "-m", "stages.cache_dataset", "--params", str(params), "--tokenizer", str(setup.tokenizer),
            "--base-config", str(setup.base / "config.json"), "--out", str(work / kind / "dataset"),
            "--metrics", str(work / kind / "dataset.json"), "--run-id-file", str(work / "run.json"),
        ], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    return llamafactory.write_data(
        work / "llamafactory_data", text_lines=[t.rstrip("\n") for t in lines["text"]], chats=lines["chat"]
    )


def ours(setup: Setup, work: Path, kind: str, precision: str) -> dict:
    run = work / f"ours_{kind}_{precision}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir()
    params = run / "params.yaml"
    params.write_text(yaml.safe_dump(config.compose("conf", overrides(setup, kind, precision, work))))
    before_launch()
    wall, peak, _ = run_measured([
        sys.executable, "-m", "stages.train", "--params", str(params), "--base", str(setup.base),
        "--tokenizer", str(setup.tokenizer), "--dataset", str(work / kind / "dataset"),
        "--checkpoints", str(run / "ckpt"), "--metrics", str(run / "metrics.json"), "--curve", str(run / "curve.csv"),
        "--run-id-file", str(run / "run.json"),
    ], env=with_venv_path())  # fmt: skip
    metrics = read_json(run / "metrics.json")
    return {"tokens_per_s": metrics["tokens_per_s"], "wall_s": wall, "peak_mb_per_rank": peak,
            "final_loss": metrics["final_train_loss"]}  # fmt: skip


def theirs(setup: Setup, work: Path, data: Path, kind: str, precision: str) -> dict:
    run = work / f"llamafactory_{kind}_{precision}"
    run.mkdir(exist_ok=True)
    options = llamafactory.config(
        base=setup.base, data=data, kind=kind, precision=precision, steps=setup.steps, micro=setup.micro,
        block=setup.block, lr=LR, work=run, tokenized=work / f"llamafactory_tokenized_{kind}",
    )  # fmt: skip
    (run / "cfg.yaml").write_text(yaml.safe_dump(options))
    before_launch()
    wall, peak, _ = run_measured(llamafactory.command(run / "cfg.yaml"), env=llamafactory.environment(setup.ranks))
    loop_seconds, tokens = llamafactory.loop_figures(run)
    if kind == "text":  # every position of a packed block is a real token
        tokens = setup.steps * setup.micro * setup.ranks * setup.block
    return {"tokens_per_s": tokens / loop_seconds, "wall_s": wall, "peak_mb_per_rank": peak}


def eager(setup: Setup, work: Path, kind: str, precision: str) -> float:
    """Tokens/s of `setup.ranks` bare eager processes (bench/eager_loop.py) run at once, one thread each: their sum.
    They run in `setup.root`, whose artifacts/base they load."""
    command = [sys.executable, "-m", "bench.eager_loop", "--dataset", str((work / kind / "dataset").resolve()),
               "--precision", precision, "--micro", str(setup.micro), "--steps", str(setup.steps)]  # fmt: skip
    env = {**with_venv_path(), "OMP_NUM_THREADS": "1"}
    workers = [
        subprocess.Popen([*command, "--offset", str(i)], cwd=setup.root, env=env, stdout=subprocess.PIPE, text=True)
        for i in range(setup.ranks)
    ]
    return sum(json.loads(w.communicate()[0].strip().splitlines()[-1])["tokens_per_s"] for w in workers)


def compare(setup: Setup, work: Path, data: Path, *, kind: str, precision: str, runs: int, peer: bool) -> dict:
    """Both sides `runs` times, alternating, and the eager rate; medians and ratios. Without `peer`, ours and eager
    alone."""
    if peer:
        llamafactory.tokenize_once(
            work / f"llamafactory_tokenize_{kind}", base=setup.base, data=data, kind=kind, block=setup.block,
            tokenized=work / f"llamafactory_tokenized_{kind}", ranks=setup.ranks,
        )  # fmt: skip
    our, their = llamafactory.alternate(
        runs, ours=lambda: ours(setup, work, kind, precision),
        theirs=(lambda: theirs(setup, work, data, kind, precision)) if peer else None,
        label=f"bench.train: {kind} {precision}",
    )  # fmt: skip
    eager_rate = eager(setup, work, kind, precision)
    figures = llamafactory.medians(our, their)
    figures.update(
        eager_tokens_per_s=round(eager_rate, 1),
        over_eager=round(figures["ours_tokens_per_s"] / eager_rate, 3),
        runs={"ours": our, "llamafactory": their} if peer else {"ours": our},
    )
    return figures


def measure(setup: Setup, *, kinds: list[str], precisions: list[str], runs: int, peer: bool) -> dict:
    """Every (kind, precision) of `setup`, in a temporary folder; without `peer`, LLaMA-Factory is skipped."""
    figures = {"steps": setup.steps, "ranks": setup.ranks, "micro": setup.micro, "block": setup.block}
    figures["llamafactory"] = llamafactory.VERSION if peer else f"skipped: {llamafactory.VENV} is not built"
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        work = Path(tmp)
        data = prepare(setup, work)
        for kind in kinds:
            for precision in precisions:
                figures[f"{kind}_{precision}"] = compare(
                    setup, work, data, kind=kind, precision=precision, runs=runs, peer=peer
                )
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs of each side per setting (median)")
    parser.add_argument("--kinds", nargs="+", default=["text", "chat"], choices=["text", "chat"])
    parser.add_argument("--precisions", nargs="+", choices=["bf16", "fp32"], help="default: both (--smoke: fp32)")
    smoke_arguments(parser)
    args = parser.parse_args(argv)
    results = results_folder(args)
    if not args.smoke:
        llamafactory.ensure_venv()
        precisions = [p for p in args.precisions or ["bf16", "fp32"] if p != "bf16" or native_bf16("cpu")]
        figures = measure(FULL, kinds=args.kinds, precisions=precisions, runs=args.runs, peer=True)
        report("train", figures, results)
        print(table(figures))
        return
    peer = llamafactory.built("bench.train")
    precisions = [p for p in args.precisions or ["fp32"] if p != "bf16" or native_bf16("cpu")]
    with smoke_project(args.project) as project:
        figures = measure(replace(SMOKE, root=project), kinds=args.kinds, precisions=precisions, runs=1, peer=peer)
    report("train", {**figures, "smoke": True}, results)
    if peer:
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
