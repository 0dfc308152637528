"""Stage train: check everything that can be checked, then start the DeepSpeed ranks (stages/_train_rank.py)."""

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pipeline import config, imports, outline
from pipeline import ds_config as dsc
from pipeline.atomic import read_json, write_json
from pipeline.checkpoints import folder
from pipeline.checkpoints.universal import ensure_universal
from pipeline.model import ALL_LINEAR, check_targets, describe_targets, resolve_targets
from pipeline.processes import Ranks, before_launch, free_port, remove_stale_shm_buffers, with_venv_path
from pipeline.tokenizer import META, load_tokenizer
from stages._common import run

# Not part of a training trajectory: reporting and checkpointing, and how the global batch is split into micro-batches
# and accumulation steps (a resume under another world size re-splits it).
UNTRACKED_TRAIN_KEYS = (
    "eval_every", "eval_max_rows", "save_every", "keep_last", "resume_from", "convert_layout", "micro_batch_size",
    "gradient_accumulation_steps", "gradient_checkpointing",
)  # fmt: skip
FORWARDED = (
    "base", "tokenizer", "dataset", "checkpoints", "metrics", "curve", "run_id_file", "final_state", "tensorboard",
    "loaded_state",
)  # fmt: skip


def vocab_rows(base_rows: int, tokenizer: Path, resize: bool) -> int:
    """Embedding rows for training: the tokenizer's padded size, or the model's when resizing is off."""
    meta = read_json(tokenizer / META)
    if resize:
        return max(base_rows, meta["padded_vocab_size"])
    if meta["vocab_size"] > base_rows:
        raise ValueError(
            f"train.resize_embeddings: false, but the tokenizer has {meta['vocab_size']} tokens and the model "
            f"{base_rows} embedding rows; expected resize_embeddings=true or a tokenizer of at most {base_rows} tokens"
        )
    return base_rows


def resolve(cfg: config.Config) -> dict:
    """The `auto` settings made concrete for this machine: accelerator, ranks, precision, accumulation, activation
    checkpointing (the ranks read them from run.json)."""
    t, launcher = cfg.train, cfg.launcher
    accelerator = dsc.accelerator_name(launcher.accelerator)
    ranks = dsc.ranks_on_this_node(launcher.ranks_per_node, accelerator)
    world = ranks * launcher.num_nodes
    checkpointing = t.gradient_checkpointing
    return {
        "accelerator": accelerator,
        "ranks_per_node": ranks,
        "world_size": world,
        "precision": dsc.training_precision(t.precision, accelerator),
        "gradient_accumulation_steps": dsc.accumulation_steps(
            t.gradient_accumulation_steps, global_batch=t.global_batch_size, micro=t.micro_batch_size, world_size=world
        ),
        "gradient_checkpointing": accelerator == "cuda" if checkpointing == "auto" else checkpointing,
    }


def variant(lora: config.LoraConfig, launch: dict) -> dict:
    """What kind of adapter this run trains, resolved (the compute dtype) and checked where it can be before a launch:
    bitsandbytes must quantize on this accelerator. Checkpoints carry it to the adapter, merge, evaluate and MLflow."""
    quantized = lora.quantization != "none"
    if quantized:
        from pipeline.quantization import check_available

        version = check_available(lora.quantization, launch["accelerator"])
        print(f"train: the base is loaded in {lora.quantization} by bitsandbytes {version} on every rank")
    compute = lora.compute_dtype if lora.compute_dtype != "auto" else launch["precision"]
    return {
        "use_dora": lora.use_dora,
        "lr_ratio": lora.lr_ratio,
        "quantization": lora.quantization,
        "compute_dtype": compute if quantized else None,
        "load_dtype": launch["precision"],  # the dtype the base is loaded (and quantized) from
    }


def run_state(args: argparse.Namespace, cfg: config.Config, launch: dict) -> dict:
    """What identifies this run's checkpoints: the model it trains and the fingerprint of its trajectory; checked."""
    lora, t = cfg.lora, cfg.train
    layers = outline.read(args.base)
    targets = resolve_targets(layers, lora.target_modules)
    check_targets(layers, targets, lora.modules_to_save)
    if lora.target_modules == ALL_LINEAR:
        print(f"train: lora.target_modules all-linear is {len(targets)} layers: {describe_targets(targets)}")
    base_rows = read_json(args.base / "config.json")["vocab_size"]
    rows = vocab_rows(base_rows, args.tokenizer, t.resize_embeddings)
    if rows > base_rows and "embed_tokens" not in lora.modules_to_save:
        raise ValueError(
            f"lora.modules_to_save: the vocabulary grows from {base_rows} to {rows} rows but embed_tokens is not "
            f"trained, so every new token would keep its initial embedding; expected [embed_tokens, lm_head]"
        )
    identity = {
        "base_config": folder.file_digest([args.base / "config.json"]),
        "vocab_rows": rows,
        "lora_r": lora.r,
        "target_modules": sorted(targets),
        "modules_to_save": sorted(lora.modules_to_save),
        "use_dora": lora.use_dora,
    }
    trajectory = {**t.model_dump(), "precision": launch["precision"]}
    settings = {
        "lora": lora.model_dump(),
        "train": {k: v for k, v in trajectory.items() if k not in UNTRACKED_TRAIN_KEYS},
    }
    inputs = {
        name: folder.file_digest([path]) for name, path in (("tokenizer", args.tokenizer), ("dataset", args.dataset))
    }
    return {
        "fingerprint": folder.fingerprint({**inputs, **identity}, settings),
        "identity": identity,
        "world_size": launch["world_size"],
        "zero_stage": cfg.deepspeed.stage,
        "launch": launch,
        "variant": variant(lora, launch),
    }


def finished(directory: Path, state: dict) -> dict | None:
    """The trainer state of this run's final checkpoint, when it is already there with its metrics."""
    tag = folder.latest_tag(directory)
    if tag is None:
        return None
    saved = folder.read_state(directory, tag)
    return saved if saved["fingerprint"] == state["fingerprint"] and saved.get("metrics") else None


def prepare_checkpoints(*, directory: Path, state: dict, resume_from: Path | None, convert: bool) -> Path | None:
    """Keep checkpoints of this very run; move another configuration's aside; vet an explicit resume_from. Returns
    the universal checkpoint to start from when the one to resume was written under another layout."""
    source = None
    if tag := folder.latest_tag(directory):
        saved = folder.read_state(directory, tag)
        if saved["fingerprint"] != state["fingerprint"]:
            aside = directory.with_name(directory.name + ".previous")
            shutil.rmtree(aside, ignore_errors=True)
            directory.rename(aside)
            print(f"train: {directory} held another configuration's checkpoints; moved to {aside}, starting over")
        else:
            source = directory / tag
    elif resume_from is not None:
        tag = folder.latest_tag(resume_from)
        if tag is None:
            raise FileNotFoundError(f"train.resume_from: {resume_from} holds no checkpoint ('latest' missing)")
        saved, source = folder.read_state(resume_from, tag), resume_from / tag
    if source is not None:
        folder.check_same_model(saved, source.parent, state["identity"])
        folder.check_same_rates(saved, source.parent, state["variant"]["lr_ratio"])
    directory.mkdir(parents=True, exist_ok=True)
    here = (state["world_size"], state["zero_stage"])
    if source is None or folder.layout(saved) == here:
        print(f"train: resuming from {source}" if source else "train: starting from step 0")
        return None
    written = f"written by {saved['world_size']} rank(s) under ZeRO-{saved['zero_stage']}"
    wanted = f"{here[0]} rank(s) under ZeRO-{here[1]}"
    if not convert:
        raise ValueError(
            f"train.convert_layout: {source} was {written}, this run has {wanted}; expected "
            "train.convert_layout=true to convert it, or the checkpoint's layout"
        )
    if 0 in (saved["zero_stage"], here[1]):
        raise ValueError(
            f"deepspeed.stage: {source} was {written}, this run has {wanted}; ZeRO-0 keeps no partitioned "
            "optimizer state to convert: expected ZeRO 1-3 on both sides, or the checkpoint's layout"
        )
    start = time.perf_counter()
    out, manifest = ensure_universal(source)
    if manifest is None:
        print(f"train: {source} was {written}; resuming with {wanted} from its universal form {out}")
    else:
        print(
            f"train: {source} was {written}; converted it to DeepSpeed's universal layout "
            f"({len(manifest['parameters'])} parameters with their Adam moments, step {manifest['step']}, "
            f"{time.perf_counter() - start:.1f} s) in {out} to resume with {wanted}"
        )
    return out


def launch_command(launcher: config.LauncherConfig, ranks: int, worker_args: list[str]) -> list[str]:
    command = [
        "deepspeed", "--log_level", "warning", "--num_gpus", str(ranks), "--num_nodes", str(launcher.num_nodes),
        "--master_addr", launcher.master_addr, "--master_port", str(launcher.master_port or free_port()),
    ]  # fmt: skip
    if launcher.num_nodes > 1:
        command += ["--hostfile", str(launcher.hostfile), "--no_ssh", "--node_rank", str(launcher.node_rank)]
    return command + ["--module", "stages._train_rank", *worker_args]


def rank_environment(resolved: dict) -> dict[str, str]:
    env = {**with_venv_path(), "DS_ACCELERATOR": resolved["accelerator"]}
    if resolved["accelerator"] == "cpu":  # one thread per core and rank: all cores per rank oversubscribes them
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // resolved["ranks_per_node"])))
        # A fixed mmap threshold while loading: glibc otherwise raises it as tensors are freed, keeps load-sized
        # blocks in its heap and never returns them (3.9 -> 3.1 GB per rank). The loop then keeps its tensors in
        # the heap (processes.keep_freed_memory).
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
        # No per-thread cache of small freed blocks: held there they sit between the loop's freed tensors, which
        # then cannot merge, and the heap grows for the next step's (bench.train, bf16 text: 1.38 -> 1.30 GB).
        env.setdefault("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0")
        # MKL's fp32 matmuls keep their packing buffers, first allocated amid the first step's activations, where
        # they split the freed memory the next step reuses (bench.train, fp32 text: 40-50 MB per rank, no slower).
        env.setdefault("MKL_DISABLE_FAST_MM", "1")
    return env


def worker_args(args: argparse.Namespace, cfg: config.Config) -> list[str]:
    """The ranks' arguments (all but the universal checkpoint to resume from, known once the checks are done)."""
    worker = ["--params", args.params]
    for name in FORWARDED:
        if getattr(args, name, None) is not None:
            worker += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if cfg.train.resume_from is not None:
        worker += ["--resume-from", str(cfg.train.resume_from)]
    return worker


def start_ranks(args: argparse.Namespace, cfg: config.Config, resolved: dict) -> Ranks | None:
    """On one node, this node's ranks, started now: they import while the stage checks the run, and wait for
    `launch` to release them. None on several nodes (the deepspeed launcher starts them in `launch`)."""
    if cfg.launcher.num_nodes != 1:
        return None
    before_launch()
    return Ranks(
        [sys.executable, "-m", "stages._train_rank", *worker_args(args, cfg)],
        ranks=resolved["ranks_per_node"],
        env=rank_environment(resolved),
        master_addr=cfg.launcher.master_addr,
        master_port=cfg.launcher.master_port or free_port(),
    )


def launch(
    args: argparse.Namespace, cfg: config.Config, resolved: dict, universal: Path | None, ranks: Ranks | None
) -> None:
    """Release this node's ranks (or start them on several nodes) and wait for them."""
    if ranks is not None:
        ranks.release({"resume_universal": None if universal is None else str(universal)})
        returncode = ranks.wait()
    else:
        worker = worker_args(args, cfg) + ([] if universal is None else ["--resume-universal", str(universal)])
        before_launch()
        command = launch_command(cfg.launcher, resolved["ranks_per_node"], worker)
        returncode = subprocess.run(command, env=rank_environment(resolved)).returncode
    remove_stale_shm_buffers()
    if returncode != 0:
        print(
            f"error: train: the DeepSpeed ranks failed (exit {returncode}); see their output above",
            file=sys.stderr,
        )
        sys.exit(1)


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    if cfg.lora.quantization == "none":
        imports.without_unused()  # a base without an outline is outlined from its architecture: model code
    resolved = resolve(cfg)
    ranks = start_ranks(args, cfg, resolved)
    try:
        return checked_run(args, cfg, resolved, ranks)
    finally:
        if ranks is not None:
            ranks.cancel()  # unless released: the checks failed, or the run was already done


def checked_run(args: argparse.Namespace, cfg: config.Config, resolved: dict, ranks: Ranks | None) -> dict:
    t = cfg.train
    ds_config = dsc.build(
        zero=dsc.ZeroSettings(**cfg.deepspeed.model_dump()),
        precision=resolved["precision"],
        micro=t.micro_batch_size,
        accumulation=resolved["gradient_accumulation_steps"],
        world_size=resolved["world_size"],
        lr=t.lr,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        global_batch=t.global_batch_size,
        lean_gathers=resolved["accelerator"] == "cpu",
    )
    state = run_state(args, cfg, resolved)
    if (saved := finished(args.checkpoints, state)) and args.final_state is None and args.loaded_state is None:
        from pipeline.trainer import write_curve

        tag = folder.tag_for(saved["step"])
        print(f"train: {args.checkpoints / tag} is this run's final checkpoint; its figures are reported")
        metrics = {**saved["metrics"], "reused_checkpoint": tag}
        write_json(args.metrics, metrics)
        write_curve(args.curve, saved["history"])
        return metrics
    resume_from = Path(t.resume_from) if t.resume_from else None
    universal = prepare_checkpoints(
        directory=args.checkpoints, state=state, resume_from=resume_from, convert=t.convert_layout
    )
    tokenizer = load_tokenizer(args.tokenizer)  # the ranks only need its pad id: they skip loading it
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    write_json(args.checkpoints / "run.json", {**state, "pad_token_id": pad or 0})
    write_json(args.checkpoints / "ds_config.json", ds_config)
    print(f"train: {resolved}")
    launch(args, cfg, resolved, universal, ranks)
    return read_json(args.metrics) if cfg.launcher.node_rank == 0 else {}  # global rank 0 runs on node 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    for name, meaning in (
        ("base", "prepared base model folder"),
        ("tokenizer", "prepared tokenizer folder"),
        ("dataset", "cached dataset folder"),
        ("checkpoints", "DeepSpeed checkpoint folder (kept across runs: resume)"),
        ("metrics", "training metrics JSON to write"),
        ("curve", "per-step CSV to write (a DVC plot)"),
    ):
        parser.add_argument(f"--{name}", type=Path, required=True, help=meaning)
    parser.add_argument("--final-state", type=Path, help="also write the gathered fp32 trainable tensors here")
    parser.add_argument("--loaded-state", type=Path, help="also write the state the run resumes from (+ moments)")
    parser.add_argument("--tensorboard", type=Path, help="TensorBoard folder (written when tracking.tensorboard)")
    run(main, parser, prefix="train")
