"""DPO speed, memory and first losses of our train stage against LLaMA-Factory's DPO (bench/llamafactory.py), side by
side in one run: the same base (artifacts/base), the same review pairs (data/corpus/reviews_pref_train.jsonl), the
same tokens (both rendered with SmolLM2's chat template, checked token by token), the same pairs in each step (it
reads them in the order our loop draws them), LoRA r=8 on q_proj,v_proj, beta 0.1 (the sigmoid loss; the reference =
the base with the adapter disabled, in every step), 2 CPU ranks x 2 pairs, ZeRO-2, 8 steps, lr 2e-4 cosine without
warmup, in bf16 (where the CPU computes it) and fp32; everything else at each tool's defaults, except that
LLaMA-Factory runs twice: with activation checkpointing off (equal work: ours does not recompute on a CPU) and at its
default (on). The sides alternate; each figure is the median of --runs runs. Tokens are those of the chosen and
rejected sequences (prompt included, padding not), over each side's whole training loop: every run of every side must
count the same, or the benchmark stops. The losses of the first steps are the proof that both compute the same
objective: step 1 is log 2 on both (the adapter's B is zero) and in fp32 the steps after it agree within
LOSS_TOLERANCE (else the benchmark stops); in bf16 they part by each tool's rounding. Needs `make run` first
(artifacts/base and artifacts/tokenizer).

    python -m bench.preference [--runs 3] [--precisions bf16 fp32] [--steps 8]
    python -m bench.preference --smoke [--results DIR]   # the tiny pipeline's model, 3 steps, 1 pair a rank (make test;
                                                         # LLaMA-Factory tokenizes in its first measured run)

The smoke run builds LLaMA-Factory's environment where it is not built yet (a few minutes, once per machine)."""

from __future__ import annotations

import argparse
import csv
import json
import math
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
from pipeline.data.examples import preference_arrays
from pipeline.data.saved_splits import split_indices
from pipeline.data.tokenizer import load_tokenizer
from pipeline.launching.ops import before_launch
from pipeline.training.schedule import global_batch

LR = 2e-4
BETA = 0.1
PAIRS = Path("data/corpus/reviews_pref_train.jsonl")
HELDOUT = Path("data/corpus/reviews_pref_heldout.jsonl")
# SmolLM2's chat template's default system turn, given to LLaMA-Factory as each pair's system column: its smollm2
# template writes the same turn with a final period.
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
FIRST = 3  # steps whose losses are reported
# The same pairs, order, settings and initial adapter (B = 0: step 1 is log 2 on both): in fp32 the same losses but for
# the rounding of two implementations. In bf16 the later steps differ more (each rounds its activations elsewhere).
LOSS_TOLERANCE = 1e-3
COLUMNS = {  # ours: LLaMA-Factory's
    "input_ids": "chosen_input_ids", "labels": "chosen_labels",
    "rejected_input_ids": "rejected_input_ids", "rejected_labels": "rejected_labels",
}  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Setup:
    """One bench run's sizes and inputs: `root` the project whose artifacts/ and data/corpus/ it reads."""

    steps: int
    ranks: int
    micro: int  # pairs per rank and step
    pairs: int  # the first pairs of PAIRS that neither side truncates: enough for the steps and validation
    max_len: int  # tokens per side: our data.max_seq_len, its cutoff_len
    root: Path = Path(".")
    tokenize_apart: bool = True  # LLaMA-Factory tokenizes in a run of its own, unmeasured; else in its first measured

    @property
    def base(self) -> Path:
        return self.root / "artifacts/base"

    @property
    def tokenizer(self) -> Path:
        return self.root / "artifacts/tokenizer"

    @property
    def global_pairs(self) -> int:
        return self.micro * self.ranks


FULL = Setup(steps=8, ranks=2, micro=2, pairs=400, max_len=384)
SMOKE = Setup(steps=3, ranks=2, micro=1, pairs=24, max_len=256, tokenize_apart=False)  # the tiny model's positions


def overrides(setup: Setup, precision: str, work: Path) -> list[str]:
    steps, micro = setup.steps, setup.micro
    return [
        "experiment=dpo_reviews", f"data.train_file={work / 'pairs.jsonl'}",
        f"data.heldout_file={setup.root / HELDOUT}", f"data.max_seq_len={setup.max_len}", "data.prompt_template=chat",
        "lora.r=8", "lora.alpha=16", "lora.dropout=0.0", "lora.target_modules=[q_proj,v_proj]",
        f"train.beta={BETA}", "train.reference=step", f"train.max_steps={steps}", "train.warmup_steps=0",
        f"train.lr={LR}", f"train.micro_batch_size={micro}", f"train.global_batch_size={setup.global_pairs}",
        f"train.precision={precision}", f"launcher.ranks_per_node={setup.ranks}", "deepspeed=zero2",
        f"train.eval_every={steps}", f"train.save_every={steps}", "train.eval_max_rows=4", "tracking.uri=",
        "tracking.tensorboard=false",
    ]  # fmt: skip


def fitting_pairs(setup: Setup) -> list[dict]:
    """The first `setup.pairs` pairs whose both sides fit `setup.max_len` tokens as we render them: the two tools cut
    long pairs by different rules, so the benchmark trains none that either would cut."""
    tokenizer = load_tokenizer(setup.tokenizer)
    rows = [json.loads(line) for line in (setup.root / PAIRS).read_text(encoding="utf-8").splitlines() if line.strip()]
    arrays, _ = preference_arrays(tokenizer, rows, template="chat", max_seq_len=10**9)
    lengths = arrays["lengths"].reshape(-1, 2).max(axis=1)
    kept = [row for row, length in zip(rows, lengths, strict=True) if length <= setup.max_len][: setup.pairs]
    if len(kept) < setup.pairs:
        raise ValueError(f"{setup.root / PAIRS}: {len(kept)} pairs fit {setup.max_len} tokens; expected {setup.pairs}")
    return kept


def prepare(setup: Setup, work: Path) -> tuple[Path, list[int]]:
    """Both sides' data: the pairs cached by our cache_dataset stage (ours), and LLaMA-Factory's dataset folder
    holding the pairs each of our steps trains, in our order (it reads them in order: disable_shuffling). Returns its
    folder and the indices of our cached train rows in the order trained."""
    pairs = fitting_pairs(setup)
    (work / "pairs.jsonl").write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs))
    cfg = config.compose("conf", overrides(setup, "fp32", work))
    params = work / "params.yaml"
    params.write_text(yaml.safe_dump(cfg))
    subprocess.run([
        sys.executable, "-m", "stages.cache_dataset", "--params", str(params), "--tokenizer", str(setup.tokenizer),
        "--base-config", str(setup.base / "config.json"), "--out", str(work / "dataset"),
        "--metrics", str(work / "dataset.json"), "--run-id-file", str(work / "run.json"),
    ], check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    counts = read_json(work / "dataset.json")
    if counts.get("dropped_pairs") or counts.get("truncated_pairs"):
        raise ValueError(f"{work / 'dataset.json'}: pairs were cut or dropped ({counts}); expected none")
    data, train = cfg["data"], cfg["train"]
    kept, _ = split_indices(len(pairs), data["validation_fraction"], data["seed"])  # as cache_dataset splits them
    order = [
        int(i)
        for step in range(setup.steps)
        for i in global_batch(step, n_rows=len(kept), global_batch_size=setup.global_pairs, seed=train["seed"])
    ]  # as our loop draws them
    folder = llamafactory.write_pairs(work / "llamafactory_data", [pairs[kept[i]] for i in order], system=SYSTEM)
    return folder, order


def cached_rows(dataset: Path) -> dict[str, list]:
    """Our cached train split's columns (Arrow streams in datasets' layout)."""
    import pyarrow as pa

    table = pa.concat_tables(pa.ipc.open_stream(s).read_all() for s in sorted((dataset / "train").glob("*.arrow")))
    return table.select(list(COLUMNS)).to_pydict()


def same_tokens(work: Path, order: list[int], tokenized: Path) -> dict:
    """Both sides' token ids and labels of the pairs trained, in the order trained: whether they are equal, and the
    tokens (chosen + rejected) each side's data holds."""
    ours, theirs = cached_rows(work / "dataset"), llamafactory.tokenized_rows(tokenized)
    ours = {name: [column[i] for i in order] for name, column in ours.items()}
    llamafactory.same_count("pairs", len(order), len(theirs["chosen_input_ids"]))
    for name, other in COLUMNS.items():
        if ours[name] != theirs[other]:
            raise SystemExit(f"bench.preference: our {name} and LLaMA-Factory's {other} differ for the same pairs")
    return {
        "equal": True,
        "ours_tokens": sum(map(len, ours["input_ids"] + ours["rejected_input_ids"])),
        "llamafactory_tokens": sum(map(len, theirs["chosen_input_ids"] + theirs["rejected_input_ids"])),
        "pairs": len(order),
    }


def curve_losses(curve: Path) -> list[float]:
    with open(curve, encoding="utf-8", newline="") as handle:
        return [float(row["loss"]) for row in csv.DictReader(handle) if row.get("loss")]


def ours(setup: Setup, work: Path, precision: str) -> dict:
    run = work / f"ours_{precision}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir()
    params = run / "params.yaml"
    params.write_text(yaml.safe_dump(config.compose("conf", overrides(setup, precision, work))))
    before_launch()
    wall, peak, _ = run_measured([
        sys.executable, "-m", "stages.train", "--params", str(params), "--base", str(setup.base),
        "--tokenizer", str(setup.tokenizer), "--dataset", str(work / "dataset"),
        "--checkpoints", str(run / "ckpt"), "--metrics", str(run / "metrics.json"), "--curve", str(run / "curve.csv"),
        "--run-id-file", str(run / "run.json"),
    ], env=with_venv_path())  # fmt: skip
    metrics = read_json(run / "metrics.json")
    if metrics["checkpointed_layers"]:
        raise SystemExit(f"{run}: our train stage recomputed activations on a CPU; expected its default, off")
    tokens = metrics["tokens_per_s"] * metrics["train_seconds"]
    return {"tokens_per_s": metrics["tokens_per_s"], "tokens": round(tokens), "wall_s": wall,
            "peak_mb_per_rank": peak, "losses": curve_losses(run / "curve.csv")[:FIRST]}  # fmt: skip


def theirs(setup: Setup, work: Path, data: Path, precision: str, checkpointing: bool) -> dict:
    run = work / f"llamafactory_{precision}_{'checkpointing' if checkpointing else 'no_checkpointing'}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir()
    options = llamafactory.config(
        base=setup.base, data=data, kind="pairs", precision=precision, steps=setup.steps, micro=setup.micro,
        block=setup.max_len, lr=LR, work=run, tokenized=work / "llamafactory_tokenized", warmup_steps=0, beta=BETA,
        checkpointing=checkpointing,
    )  # fmt: skip
    (run / "cfg.yaml").write_text(yaml.safe_dump(options))
    before_launch()
    wall, peak, output = run_measured(llamafactory.command(run / "cfg.yaml"), env=llamafactory.environment(setup.ranks))
    llamafactory.check_checkpointing(output, expected=checkpointing, run=run)
    loop_seconds, tokens = llamafactory.loop_figures(run)
    return {"tokens_per_s": tokens / loop_seconds, "tokens": tokens, "wall_s": wall, "peak_mb_per_rank": peak,
            "losses": llamafactory.step_losses(run)[:FIRST]}  # fmt: skip


def compare(setup: Setup, work: Path, data: Path, *, precision: str, runs: int) -> dict:
    """Every side `runs` times, in turn; medians, ratios and the first losses (the first run's: a run repeats them).
    The benchmark stops where a run trained other tokens than ours, logged other steps, or (fp32) other losses."""
    sides = {"ours": lambda: ours(setup, work, precision)}
    for side, checkpointing in llamafactory.SIDES.items():
        if checkpointing is not None:
            sides[side] = lambda c=checkpointing: theirs(setup, work, data, precision, c)
    done = llamafactory.alternate(runs, sides, label=f"bench.preference: {precision}")
    tokens = done["ours"][0]["tokens"]
    for side, results in done.items():
        for result in results:
            llamafactory.same_count(f"tokens ({side}, {precision})", tokens, result["tokens"])
    figures = llamafactory.medians(done)
    figures.update(tokens=tokens, ours_first_losses=[round(x, 8) for x in done["ours"][0]["losses"]], runs=done)
    for side in done.keys() - {"ours"}:
        pairs = llamafactory.paired(f"{side}'s first losses", done["ours"][0]["losses"], done[side][0]["losses"])
        figures[f"{side}_first_losses"] = [round(b, 8) for _, b in pairs]
        figures[f"{side}_first_losses_max_diff"] = round(max(abs(a - b) for a, b in pairs), 8)
        if not all(abs(x - math.log(2)) <= LOSS_TOLERANCE for x in pairs[0]):
            raise SystemExit(f"bench.preference: step 1's losses {pairs[0]} ({side}); expected log 2 on both sides")
        if precision == "fp32" and figures[f"{side}_first_losses_max_diff"] > LOSS_TOLERANCE:
            raise SystemExit(f"bench.preference: fp32 losses of ours and {side} part: {pairs}")
    return figures


def measure(setup: Setup, *, precisions: list[str], runs: int) -> dict:
    """Every precision of `setup`, in a temporary folder."""
    figures = {"steps": setup.steps, "ranks": setup.ranks, "micro_pairs": setup.micro, "max_len": setup.max_len}
    figures |= {"beta": BETA, "lr": LR, "llamafactory": llamafactory_venv.VERSION}
    with tempfile.TemporaryDirectory(prefix="bench-preference-") as tmp:
        work = Path(tmp)
        data, order = prepare(setup, work)
        tokenized = work / "llamafactory_tokenized"
        if setup.tokenize_apart:
            llamafactory.tokenize_once(
                work / "llamafactory_tokenize", base=setup.base, data=data, kind="pairs", block=setup.max_len,
                tokenized=tokenized, ranks=setup.ranks,
            )  # fmt: skip
        for precision in precisions:
            figures[precision] = compare(setup, work, data, precision=precision, runs=runs)
        figures["same_tokens"] = same_tokens(work, order, tokenized)
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs of each side per precision (median)")
    parser.add_argument("--precisions", nargs="+", choices=["bf16", "fp32"], help="default: both (--smoke: fp32)")
    parser.add_argument("--steps", type=int, help=f"optimizer steps (default {FULL.steps}; --smoke {SMOKE.steps})")
    smoke_arguments(parser)
    args = parser.parse_args(argv)
    results = results_folder(args)
    llamafactory_venv.ensure_venv()
    default = ["fp32"] if args.smoke else ["bf16", "fp32"]
    precisions = [p for p in args.precisions or default if p != "bf16" or native_bf16("cpu")]
    if args.smoke:
        with smoke_project(args.project) as project:
            setup = replace(SMOKE, root=project, steps=args.steps or SMOKE.steps)
            figures = measure(setup, precisions=precisions, runs=1)
        report("preference", {**figures, "smoke": True}, results)
    else:
        figures = measure(replace(FULL, steps=args.steps or FULL.steps), precisions=precisions, runs=args.runs)
        report("preference", figures, results)
    print(table(figures))


COMPARED = {"equal_work": "off on both (equal work)", "defaults": "each side's defaults (theirs on)"}


def table(figures: dict) -> str:
    """docs/preference.md's table: per precision, ours against LLaMA-Factory at equal work (activation checkpointing
    off on both), then at each side's defaults (LLaMA-Factory recomputes activations)."""
    lines = [
        "| precision | activation checkpointing | tokens/s: ours / LLaMA-Factory | ours / theirs | wall s: ours / "
        "theirs | peak MB per rank: ours / theirs | loss of steps 1-3: ours (theirs: max abs difference) |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, f in figures.items():
        if not (isinstance(f, dict) and "equal_work" in f):
            continue
        for comparison, label in COMPARED.items():
            c, side = f[comparison], f[comparison]["against"]
            lines.append(
                f"| {key} | {label} | {f['ours_tokens_per_s']} / {f[f'{side}_tokens_per_s']} | {c['speedup']}x | "
                f"{f['ours_wall_s']} / {f[f'{side}_wall_s']} ({c['wall_ratio']}x) | {f['ours_peak_mb_per_rank']} / "
                f"{f[f'{side}_peak_mb_per_rank']} ({c['memory_ratio']}x) | {_losses(f['ours_first_losses'])} "
                f"({f[f'{side}_first_losses_max_diff']:.1e}) |"
            )
    return "\n".join(lines)


def _losses(values: list[float]) -> str:
    return ", ".join(f"{x:.6f}" for x in values)


if __name__ == "__main__":
    main()
