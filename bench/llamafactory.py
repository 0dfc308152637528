"""LLaMA-Factory, the peer of bench/train.py and bench/preference.py, run as its users run it: `llamafactory-cli
train cfg.yaml` with FORCE_TORCHRUN=1 (torchrun: one OpenMP thread per rank), HF Trainer + DeepSpeed + PEFT
underneath, in its own virtual environment (bench/llamafactory_venv.py: built once per machine; the smoke runs of
`make test` build it too where `make peer` did not, and fail where it cannot be built).

Each comparison is shown twice: at equal work (activation checkpointing off on both sides: ours does not recompute
on a CPU, LLaMA-Factory is given `disable_gradient_checkpointing`), and at each side's defaults (LLaMA-Factory
recomputes activations by default). A benchmark fails, rather than report a ratio, where the two sides did not train
the same tokens or their loss logs do not pair up."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import yaml

from bench.llamafactory_venv import VENV
from pipeline.core.environment import free_port

# LLaMA-Factory's examples/deepspeed/ds_z2_config.json: what its users pass as `deepspeed:` (HF fills the "auto"s).
ZERO2 = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto", "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                          "overlap_comm": False, "reduce_scatter": True, "reduce_bucket_size": 5e8,
                          "contiguous_gradients": True, "round_robin_gradients": True},
}  # fmt: skip


def write_data(folder: Path, *, text_lines: list[str], chats: list[str]) -> Path:
    """Its dataset folder: `corpus` (pretraining text, one document per line) and `chat` (OpenAI-style messages)."""
    folder.mkdir(parents=True, exist_ok=True)
    documents = (json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in text_lines)
    (folder / "corpus.jsonl").write_text("".join(documents))
    (folder / "chat.jsonl").write_text("".join(line.rstrip("\n") + "\n" for line in chats))
    info = {
        "corpus": {"file_name": "corpus.jsonl", "columns": {"prompt": "text"}},
        "chat": {
            "file_name": "chat.jsonl", "formatting": "sharegpt", "columns": {"messages": "messages"},
            "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant",
                     "system_tag": "system"},
        },
    }  # fmt: skip
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=1))
    return folder


def write_pairs(folder: Path, pairs: list[dict], *, system: str) -> Path:
    """Its dataset folder for DPO: `pairs`, a ranking dataset of {"prompt", "chosen", "rejected"} rows in the order
    given, each with `system` as its system turn (what its template renders before the prompt)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = (json.dumps({**p, "system": system}, ensure_ascii=False) + "\n" for p in pairs)
    (folder / "pairs.jsonl").write_text("".join(rows))
    columns = {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "system": "system"}
    info = {"pairs": {"file_name": "pairs.jsonl", "ranking": True, "columns": columns}}
    (folder / "dataset_info.json").write_text(json.dumps(info, indent=1))
    return folder


STAGES = {"text": ("pt", "corpus"), "chat": ("sft", "chat"), "pairs": ("dpo", "pairs")}  # kind: (stage, dataset)


def config(*, base: Path, data: Path, kind: str, precision: str, steps: int, micro: int, block: int, lr: float,
           work: Path, tokenized: Path, warmup_steps: int = 2, beta: float = 0.1,
           checkpointing: bool = True) -> dict:  # fmt: skip
    """`llamafactory-cli train` options for LoRA r=8 on q_proj,v_proj, everything not named at its defaults
    (lora_dropout 0, HF's AdamW; gradient checkpointing on unless `checkpointing` is false), loading the data
    `tokenize_once` saved. `kind`: text (pretraining), chat (SFT, the rows in the order written) or pairs (DPO,
    `beta`, the sigmoid loss, the reference = the adapter disabled, its pairs in the order written: `block` is then
    each side's cutoff)."""
    (work / "ds_z2.json").write_text(json.dumps(ZERO2))
    stage, dataset = STAGES[kind]
    options = {
        "model_name_or_path": str(base.resolve()), "stage": stage, "do_train": True,
        "finetuning_type": "lora", "lora_rank": 8, "lora_alpha": 16, "lora_target": "q_proj,v_proj",
        "dataset": dataset, "dataset_dir": str(data.resolve()),
        "cutoff_len": block, "tokenized_path": str(tokenized.resolve()),
        "output_dir": str((work / "out").resolve()), "overwrite_output_dir": True,
        "per_device_train_batch_size": micro, "gradient_accumulation_steps": 1, "max_steps": steps,
        "learning_rate": lr, "lr_scheduler_type": "cosine", "warmup_steps": warmup_steps, "logging_steps": 1,
        "use_cpu": True, "deepspeed": str((work / "ds_z2.json").resolve()), "report_to": "none",
        "include_num_input_tokens_seen": "non_padding", "seed": 42,
    }  # fmt: skip
    if kind in ("chat", "pairs"):
        options["template"] = "smollm2"  # ChatML with SmolLM2's default system turn, as its chat template
        # disable_shuffling: it takes the rows in the file's order (the sampler only; its speed is unchanged)
        options["disable_shuffling"] = True
    if kind == "pairs":
        options.update(pref_beta=beta, pref_loss="sigmoid")
    if not checkpointing:
        options["disable_gradient_checkpointing"] = True
    if precision == "bf16":
        options["bf16"] = True
    return options


def tokenize_once(work: Path, *, base: Path, data: Path, kind: str, block: int, tokenized: Path, ranks: int) -> None:
    """Its first run with `tokenized_path` (unmeasured: it tokenizes, saves, then trains one step); the measured
    runs load what it saved, as its users' later runs do."""
    if tokenized.exists():
        return
    work.mkdir(parents=True, exist_ok=True)
    options = config(base=base, data=data, kind=kind, precision="fp32", steps=1, micro=1, block=block, lr=1e-4,
                     work=work, tokenized=tokenized)  # fmt: skip
    (work / "cfg.yaml").write_text(yaml.safe_dump(options))
    subprocess.run(command(work / "cfg.yaml"), env=environment(ranks), check=True, capture_output=True)


def command(config_file: Path) -> list[str]:
    return [str(VENV / "bin" / "llamafactory-cli"), "train", str(config_file)]


def environment(ranks: int) -> dict[str, str]:
    """As its users launch it on CPU ranks: FORCE_TORCHRUN makes llamafactory-cli call torchrun (one OpenMP thread
    per rank); the venv's bin first on PATH so that it finds its own torchrun, its own op-build folder."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "VIRTUAL_ENV", "PYTHONPATH")}
    env.update(
        PATH=f"{(VENV / 'bin').resolve()}{os.pathsep}{env.get('PATH', '')}", FORCE_TORCHRUN="1",
        NPROC_PER_NODE=str(ranks), DS_ACCELERATOR="cpu", MASTER_PORT=str(free_port()),
        TORCH_EXTENSIONS_DIR=str((VENV / "torch_extensions").resolve()),
    )  # fmt: skip
    return env


CHECKPOINTING_ON = "Gradient checkpointing enabled."  # what it logs where it recomputes activations


def check_checkpointing(output: str, *, expected: bool, run: Path) -> None:
    """Refuse a run whose activation checkpointing is not what the comparison says (from its log)."""
    if (CHECKPOINTING_ON in output) != expected:
        state = "on" if CHECKPOINTING_ON in output else "off"
        raise SystemExit(f"{run}: LLaMA-Factory ran with gradient checkpointing {state}; expected the other")


def loop_figures(work: Path) -> tuple[float, int]:
    """(the training loop's seconds, the non-padding input tokens it trained on, all ranks): `train_runtime` and
    `num_input_tokens_seen` (HF Trainer's count) of its train_results.json."""
    figures = json.loads((work / "out" / "train_results.json").read_text())
    return figures["train_runtime"], figures["num_input_tokens_seen"]


def step_losses(work: Path) -> list[float]:
    """The training loss of each step (logging_steps 1: the mean over ranks), from its trainer_state.json."""
    state = json.loads((work / "out" / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def tokenized_rows(tokenized: Path) -> dict[str, list]:
    """The train rows `tokenize_once` saved (datasets' save_to_disk: Arrow streams), column by column, in order."""
    import pyarrow as pa

    shards = sorted((tokenized / "train").glob("*.arrow")) or sorted(tokenized.glob("*.arrow"))
    if not shards:
        raise FileNotFoundError(f"{tokenized}: no Arrow shards (train/*.arrow) where tokenize_once saved its data")
    table = pa.concat_tables(pa.ipc.open_stream(shard).read_all() for shard in shards)
    return table.to_pydict()


# The sides every comparison runs: ours at its defaults (no activation checkpointing on a CPU: checked), LLaMA-Factory
# with checkpointing off (the same work as ours), and LLaMA-Factory at its defaults (checkpointing on).
SIDES = {"ours": None, "llamafactory_no_checkpointing": False, "llamafactory": True}
COMPARISONS = {"equal_work": "llamafactory_no_checkpointing", "defaults": "llamafactory"}  # ours over which side


def alternate(runs: int, sides: dict[str, Callable[[], dict]], *, label: str) -> dict[str, list[dict]]:
    """Every side `runs` times, in turn (the order reversed on odd rounds), each run's figures printed; the runs of
    each side."""
    results: dict[str, list[dict]] = {name: [] for name in sides}
    order = list(sides)
    for i in range(runs):
        for name in order if i % 2 == 0 else order[::-1]:
            results[name].append(sides[name]())
            print(f"{label} {name} run {i + 1}: {json.dumps(results[name][-1])}", flush=True)
    return results


def medians(runs: dict[str, list[dict]]) -> dict:
    """Each side's median tokens/s, wall seconds and peak MB per rank, and ours over LLaMA-Factory's in each
    comparison (equal work, defaults)."""
    figures: dict = {}
    for side, done in runs.items():
        figures[f"{side}_tokens_per_s"] = round(statistics.median(r["tokens_per_s"] for r in done), 1)
        figures[f"{side}_wall_s"] = round(statistics.median(r["wall_s"] for r in done), 1)
        figures[f"{side}_peak_mb_per_rank"] = round(statistics.median(r["peak_mb_per_rank"] for r in done))
    for comparison, theirs in COMPARISONS.items():
        figures[comparison] = {
            "against": theirs,
            "speedup": round(figures["ours_tokens_per_s"] / figures[f"{theirs}_tokens_per_s"], 3),
            "wall_ratio": round(figures["ours_wall_s"] / figures[f"{theirs}_wall_s"], 3),
            "memory_ratio": round(figures["ours_peak_mb_per_rank"] / figures[f"{theirs}_peak_mb_per_rank"], 3),
        }
    return figures


def same_count(what: str, ours: int, theirs: int) -> int:
    """`ours`, where both sides counted the same; else the benchmark stops: its ratios would compare other work."""
    if ours != theirs:
        raise SystemExit(f"bench: the two sides trained other {what}: ours {ours}, LLaMA-Factory's {theirs}")
    return ours


def paired(what: str, ours: list[float], theirs: list[float]) -> list[tuple[float, float]]:
    """The two sides' values step by step; the benchmark stops where one logged other steps than the other."""
    if len(ours) != len(theirs) or not ours:
        raise SystemExit(f"bench: {what}: ours logged {len(ours)} step(s), LLaMA-Factory {len(theirs)}")
    return list(zip(ours, theirs, strict=True))
