"""Training speed and memory of our train stage against LLaMA-Factory (bench/llamafactory.py), side by side in one
run: the same base (artifacts/base), LoRA r=8 on q_proj,v_proj, 2 CPU ranks x 2 rows x 256 tokens, ZeRO-2, 8 steps,
in bf16 (where the CPU computes it) and fp32, on packed pretraining text (the same text, the same number of tokens:
checked) and on chat SFT (experiment=sft_chat: the same dialogues in the same order, token for token: checked;
tokens counted without padding). LLaMA-Factory runs twice, with activation checkpointing off (equal work: ours does
not recompute on a CPU) and at its defaults (on). The sides alternate; each figure is the median of --runs runs.
Beside them, the bare eager rate: the same PEFT model's forward+backward on the same micro-batches, one process per
core, no DeepSpeed. Needs `make run` first (artifacts/base and artifacts/tokenizer). The run stops, reporting
nothing, where the two sides trained other tokens.

    python -m bench.train [--runs 3] [--kinds text chat] [--precisions bf16 fp32]
    python -m bench.train --smoke [--results DIR]   # the tiny pipeline's model, 3 steps of 64 tokens, fp32 (make test;
                                                    # LLaMA-Factory tokenizes in its first measured run)

A run with some kinds or precisions keeps the recorded figures of the others in bench/results/train.json. The smoke
run builds LLaMA-Factory's environment where it is not built yet (a few minutes, once per machine)."""

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

from bench import llamafactory, llamafactory_venv
from bench.common import report, results_folder, run_measured, smoke_arguments, smoke_project
from pipeline.core import config
from pipeline.core.atomic import read_json
from pipeline.core.environment import with_venv_path
from pipeline.core.precision import native_bf16
from pipeline.data.examples import sft_arrays
from pipeline.data.saved_splits import split_indices
from pipeline.data.tokenizer import load_tokenizer
from pipeline.launching.ops import before_launch
from pipeline.training.schedule import global_batch

LR = 2e-4
# SmolLM2's chat template's default system turn, given to LLaMA-Factory as each dialogue's first message: its smollm2
# template writes the same turn with a final period where the dialogue has none.
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CORPUS = {"text": Path("data/corpus/peoples_daily_train.txt"), "chat": Path("data/corpus/chitchat_train.jsonl")}
HELDOUT = {"text": Path("data/corpus/peoples_daily_heldout.txt"), "chat": Path("data/corpus/chitchat_heldout.jsonl")}


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One bench run's sizes and inputs: `root` the project whose artifacts/ and data/corpus/ it reads."""

    steps: int
    ranks: int
    micro: int  # rows per rank and step
    block: int  # tokens per row of packed text
    chat_len: int  # the most tokens of a dialogue (those that do not fit are left out on both sides)
    lines: int  # of each corpus: enough blocks and dialogues for the steps, quick to tokenize
    root: Path = Path(".")
    tokenize_apart: bool = True  # LLaMA-Factory tokenizes in a run of its own, unmeasured; else in its first measured

    @property
    def base(self) -> Path:
        return self.root / "artifacts/base"

    @property
    def tokenizer(self) -> Path:
        return self.root / "artifacts/tokenizer"

    @property
    def global_rows(self) -> int:
        return self.micro * self.ranks

    def row_tokens(self, kind: str) -> int:
        """Each side's cut (our data.block_size or data.max_seq_len, its cutoff_len) for `kind`."""
        return self.chat_len if kind == "chat" else self.block


FULL = Setup(steps=8, ranks=2, micro=2, block=256, chat_len=256, lines=3000)
# steps > 2 warm-up steps; the tiny model's 256-token window (the tiny corpus's 20 dialogues: those that fit)
SMOKE = Setup(steps=3, ranks=2, micro=1, block=64, chat_len=256, lines=200, tokenize_apart=False)


def subset_file(work: Path, kind: str) -> Path:
    return work / f"{kind}{CORPUS[kind].suffix}"


def overrides(setup: Setup, kind: str, precision: str, work: Path) -> list[str]:
    data = [f"data.train_file={subset_file(work, kind)}", f"data.heldout_file={setup.root / HELDOUT[kind]}"]
    steps, micro, block = setup.steps, setup.micro, setup.block
    if kind == "chat":
        data = ["experiment=sft_chat", *data, f"data.max_seq_len={setup.chat_len}"]
    return [
        *data, f"data.block_size={block}", "lora.r=8", "lora.alpha=16", "lora.dropout=0.0",
        "lora.target_modules=[q_proj,v_proj]", f"train.max_steps={steps}", "train.warmup_steps=2", f"train.lr={LR}",
        f"train.micro_batch_size={micro}", f"train.global_batch_size={micro * setup.ranks}",
        f"train.precision={precision}", f"launcher.ranks_per_node={setup.ranks}", "deepspeed=zero2",
        f"train.eval_every={steps}", f"train.save_every={steps}", "train.eval_max_rows=4", "tracking.uri=",
        "tracking.tensorboard=false",
    ]  # fmt: skip


def fitting_dialogues(setup: Setup, lines: list[str]) -> list[str]:
    """Of the first `setup.lines` dialogues, those that fit `setup.chat_len` tokens as we render them: the two tools
    cut long dialogues by different rules, so the benchmark trains none that either would cut."""
    tokenizer, kept = load_tokenizer(setup.tokenizer), []
    for line in lines[: setup.lines]:
        arrays, counts = sft_arrays(tokenizer, [json.loads(line)], template="chat", max_seq_len=10**9)
        if not counts["dropped_examples"] and arrays["lengths"][0] <= setup.chat_len:
            kept.append(line)
    if len(kept) <= setup.steps * setup.global_rows:
        raise ValueError(
            f"{setup.root / CORPUS['chat']}: {len(kept)} dialogues fit {setup.chat_len} tokens; expected more than "
            f"{setup.steps * setup.global_rows} (the rows of {setup.steps} steps)"
        )
    return kept


def trained_order(setup: Setup, cfg: dict, n_rows: int) -> tuple[list[int], list[int]]:
    """The rows our loop trains, in its order, as positions in the train split cache_dataset keeps and as indices of
    the `n_rows` rows it read (it keeps them all: none is cut), drawn as the loop draws its global batches."""
    kept, _ = split_indices(n_rows, cfg["data"]["validation_fraction"], cfg["data"]["seed"])
    seed = cfg["train"]["seed"]
    positions = [
        int(i)
        for step in range(setup.steps)
        for i in global_batch(step, n_rows=len(kept), global_batch_size=setup.global_rows, seed=seed)
    ]
    return positions, [int(kept[i]) for i in positions]


def prepare(setup: Setup, work: Path) -> tuple[Path, dict[str, list[int]]]:
    """Both sides' data: the first `setup.lines` of each corpus (of the chat corpus, those that fit a row), cached by
    our cache_dataset stage (ours) and written as LLaMA-Factory's dataset folder (theirs), the chat rows in the order
    our loop trains them (it reads them in order). Its folder, and per kind the indices of our cached train rows in
    the order trained (the chat rows only: pretraining packs the text into blocks)."""
    lines, orders = {}, {}
    for kind, corpus in CORPUS.items():
        lines[kind] = (setup.root / corpus).read_text(encoding="utf-8").splitlines(keepends=True)
        lines[kind] = fitting_dialogues(setup, lines[kind]) if kind == "chat" else lines[kind][: setup.lines]
        subset_file(work, kind).write_text("".join(lines[kind]), encoding="utf-8")
        params = work / kind / "params.yaml"
        params.parent.mkdir(parents=True)
        cfg = config.compose("conf", overrides(setup, kind, "fp32", work))
        params.write_text(yaml.safe_dump(cfg))
        subprocess.run([
            sys.executable, "-m", "stages.cache_dataset", "--params", str(params), "--tokenizer", str(setup.tokenizer),
            "--base-config", str(setup.base / "config.json"), "--out", str(work / kind / "dataset"),
            "--metrics", str(work / kind / "dataset.json"), "--run-id-file", str(work / "run.json"),
        ], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        if kind == "chat":
            orders[kind], sources = trained_order(setup, cfg, len(lines[kind]))
    first = {"role": "system", "content": SYSTEM}
    chats = [json.loads(lines["chat"][i]) for i in sources]
    chats = [json.dumps({**c, "messages": [first, *c["messages"]]}, ensure_ascii=False) for c in chats]
    text = [t.rstrip("\n") for t in lines["text"]]
    return llamafactory.write_data(work / "llamafactory_data", text_lines=text, chats=chats), orders


def same_chat_tokens(work: Path, order: list[int], tokenized: Path) -> dict:
    """Our cached chat rows in the order trained against the rows LLaMA-Factory tokenized: equal token ids (else
    the benchmark stops), and whether the trained positions (labels) are the same too."""
    ours, theirs = llamafactory.tokenized_rows(work / "chat" / "dataset"), llamafactory.tokenized_rows(tokenized)
    rows = [ours["input_ids"][i] for i in order]
    llamafactory.same_count("chat rows", len(rows), len(theirs["input_ids"]))
    if rows != theirs["input_ids"]:
        first = next(i for i, (a, b) in enumerate(zip(rows, theirs["input_ids"], strict=True)) if a != b)
        raise SystemExit(f"bench.train: chat row {first} (of those trained) is tokenized otherwise by LLaMA-Factory")
    labels = [ours["labels"][i] for i in order] == theirs["labels"]
    return {"rows": len(rows), "tokens": sum(map(len, rows)), "labels_equal": labels}


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
    if metrics["checkpointed_layers"]:
        raise SystemExit(f"{run}: our train stage recomputed activations on a CPU; expected its default, off")
    tokens = round(metrics["tokens_per_s"] * metrics["train_seconds"])
    return {"tokens_per_s": metrics["tokens_per_s"], "tokens": tokens, "wall_s": wall, "peak_mb_per_rank": peak,
            "final_loss": metrics["final_train_loss"]}  # fmt: skip


def theirs(setup: Setup, work: Path, data: Path, kind: str, precision: str, checkpointing: bool) -> dict:
    run = work / f"llamafactory_{kind}_{precision}_{'checkpointing' if checkpointing else 'no_checkpointing'}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir()
    options = llamafactory.config(
        base=setup.base, data=data, kind=kind, precision=precision, steps=setup.steps, micro=setup.micro,
        block=setup.row_tokens(kind), lr=LR, work=run, tokenized=work / f"llamafactory_tokenized_{kind}",
        checkpointing=checkpointing,
    )  # fmt: skip
    (run / "cfg.yaml").write_text(yaml.safe_dump(options))
    before_launch()
    wall, peak, output = run_measured(llamafactory.command(run / "cfg.yaml"), env=llamafactory.environment(setup.ranks))
    llamafactory.check_checkpointing(output, expected=checkpointing, run=run)
    loop_seconds, tokens = llamafactory.loop_figures(run)
    return {"tokens_per_s": tokens / loop_seconds, "tokens": tokens, "wall_s": wall, "peak_mb_per_rank": peak}


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


def compare(setup: Setup, work: Path, data: Path, *, kind: str, precision: str, runs: int) -> dict:
    """Every side `runs` times, in turn, and the eager rate; medians and ratios, where every run of every side
    trained the same number of tokens (else the benchmark stops)."""
    sides = {"ours": lambda: ours(setup, work, kind, precision)}
    for side, checkpointing in llamafactory.SIDES.items():
        if checkpointing is not None:
            sides[side] = lambda c=checkpointing: theirs(setup, work, data, kind, precision, c)
    done = llamafactory.alternate(runs, sides, label=f"bench.train: {kind} {precision}")
    tokens = done["ours"][0]["tokens"]
    if kind == "text":  # every position of a packed block is a real token
        tokens = llamafactory.same_count("text tokens", setup.steps * setup.global_rows * setup.block, tokens)
    for side, results in done.items():
        for result in results:
            llamafactory.same_count(f"{kind} tokens ({side})", tokens, result["tokens"])
    eager_rate = eager(setup, work, kind, precision)
    figures = llamafactory.medians(done)
    figures.update(
        tokens=tokens,
        eager_tokens_per_s=round(eager_rate, 1),
        over_eager=round(figures["ours_tokens_per_s"] / eager_rate, 3),
        runs=done,
    )
    return figures


def measure(setup: Setup, *, kinds: list[str], precisions: list[str], runs: int) -> dict:
    """Every (kind, precision) of `setup`, in a temporary folder."""
    figures = {"steps": setup.steps, "ranks": setup.ranks, "micro": setup.micro, "block": setup.block,
               "chat_len": setup.chat_len}  # fmt: skip
    figures["llamafactory"] = llamafactory_venv.VERSION
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        work = Path(tmp)
        data, orders = prepare(setup, work)
        for kind in kinds:
            tokenized = work / f"llamafactory_tokenized_{kind}"
            if setup.tokenize_apart:
                llamafactory.tokenize_once(
                    work / f"llamafactory_tokenize_{kind}", base=setup.base, data=data, kind=kind,
                    block=setup.row_tokens(kind), tokenized=tokenized, ranks=setup.ranks,
                )  # fmt: skip
            for precision in precisions:
                figures[f"{kind}_{precision}"] = compare(setup, work, data, kind=kind, precision=precision, runs=runs)
            if kind == "chat":
                figures["same_chat_tokens"] = same_chat_tokens(work, orders["chat"], tokenized)
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs of each side per setting (median)")
    parser.add_argument("--kinds", nargs="+", default=["text", "chat"], choices=["text", "chat"])
    parser.add_argument("--precisions", nargs="+", choices=["bf16", "fp32"], help="default: both (--smoke: fp32)")
    smoke_arguments(parser)
    args = parser.parse_args(argv)
    results = results_folder(args)
    llamafactory_venv.ensure_venv()
    default = ["fp32"] if args.smoke else ["bf16", "fp32"]
    precisions = [p for p in args.precisions or default if p != "bf16" or native_bf16("cpu")]
    if args.smoke:
        with smoke_project(args.project) as project:
            figures = measure(replace(SMOKE, root=project), kinds=args.kinds, precisions=precisions, runs=1)
        report("train", {**figures, "smoke": True}, results)
    else:
        figures = measure(FULL, kinds=args.kinds, precisions=precisions, runs=args.runs)
        report("train", {**recorded(results / "train.json"), **figures}, results)
    print(table(figures))


def recorded(path: Path) -> dict:
    """The figures a full run recorded before (a run of some kinds or precisions keeps the others)."""
    return read_json(path) if path.is_file() else {}


COMPARED = {"equal_work": "checkpointing off on both (equal work)", "defaults": "each side's defaults (theirs on)"}


def table(figures: dict) -> str:
    """docs/benchmarks.md's table: per data and precision, ours against LLaMA-Factory at equal work (activation
    checkpointing off on both), then at each side's defaults (LLaMA-Factory recomputes activations)."""
    lines = [
        "| data, precision | activation checkpointing | tokens/s: ours / LLaMA-Factory | ours / theirs | ours / eager "
        "| wall s: ours / theirs | peak MB per rank: ours / theirs |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, f in figures.items():
        if not (isinstance(f, dict) and "equal_work" in f):
            continue
        for comparison, label in COMPARED.items():
            c, side = f[comparison], f[comparison]["against"]
            lines.append(
                f"| {key.replace('_', ', ')} | {label} | {f['ours_tokens_per_s']} / {f[f'{side}_tokens_per_s']} | "
                f"{c['speedup']}x | {f['over_eager']}x | {f['ours_wall_s']} / {f[f'{side}_wall_s']} "
                f"({c['wall_ratio']}x) | {f['ours_peak_mb_per_rank']} / {f[f'{side}_peak_mb_per_rank']} "
                f"({c['memory_ratio']}x) |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
