"""Stage train: check everything that can be checked, then start the DeepSpeed ranks (stages/train_worker.py)."""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from pipeline import config
from pipeline import ds_config as dsc
from pipeline.atomic import write_json
from pipeline.checkpoint import check_same_model, file_digest, fingerprint, latest_tag, layout, read_state
from pipeline.convert import ensure_universal
from pipeline.model import check_targets, meta_model
from pipeline.tokenizer import META, load_tokenizer
from stages.common import run

# Not part of a training trajectory: reporting and checkpointing, and how the global batch is split into micro-batches
# and accumulation steps (a resume under another world size re-splits it).
UNTRACKED_TRAIN_KEYS = (
    "eval_every", "eval_max_rows", "save_every", "keep_last", "resume_from", "convert_layout", "micro_batch_size",
    "gradient_accumulation_steps",
)  # fmt: skip


def vocab_rows(base: Path, tokenizer: Path, resize: bool) -> int:
    """Embedding rows for training: the tokenizer's padded size, or the model's when resizing is off."""
    rows = json.loads((base / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    meta = json.loads((tokenizer / META).read_text(encoding="utf-8"))
    if resize:
        return max(rows, meta["padded_vocab_size"])
    if meta["vocab_size"] > rows:
        raise ValueError(
            f"train.resize_embeddings: false, but the tokenizer has {meta['vocab_size']} tokens and the model "
            f"{rows} embedding rows; expected resize_embeddings=true or a tokenizer of at most {rows} tokens"
        )
    return rows


def prepare_checkpoints(directory: Path, run_state: dict, resume_from: Path | None, convert: bool) -> Path | None:
    """Keep checkpoints of this very run; move another configuration's aside; vet an explicit resume_from. Returns
    the universal checkpoint to start from when the one to resume was written under another layout."""
    source = None
    if tag := latest_tag(directory):
        state = read_state(directory, tag)
        if state["fingerprint"] != run_state["fingerprint"]:
            aside = directory.with_name(directory.name + ".previous")
            shutil.rmtree(aside, ignore_errors=True)
            directory.rename(aside)
            print(f"train: {directory} held another configuration's checkpoints; moved to {aside}, starting over")
        else:
            source = directory / tag
    elif resume_from is not None:
        tag = latest_tag(resume_from)
        if tag is None:
            raise FileNotFoundError(f"train.resume_from: {resume_from} holds no checkpoint ('latest' missing)")
        state, source = read_state(resume_from, tag), resume_from / tag
    if source is not None:
        check_same_model(state, source.parent, run_state["identity"])
    directory.mkdir(parents=True, exist_ok=True)
    here = (run_state["world_size"], run_state["zero_stage"])
    if source is None or layout(state) == here:
        print(f"train: resuming from {source}" if source else "train: starting from step 0")
        return None
    written = f"written by {state['world_size']} rank(s) under ZeRO-{state['zero_stage']}"
    wanted = f"{here[0]} rank(s) under ZeRO-{here[1]}"
    if not convert:
        raise ValueError(
            f"train.convert_layout: {source} was {written}, this run has {wanted}; expected "
            "train.convert_layout=true to convert it, or the checkpoint's layout"
        )
    if 0 in (state["zero_stage"], here[1]):
        raise ValueError(
            f"deepspeed.stage: {source} was {written}, this run has {wanted}; ZeRO-0 keeps no partitioned "
            "optimizer state to convert: expected ZeRO 1-3 on both sides, or the checkpoint's layout"
        )
    return convert_for_resume(source, written, wanted)


def convert_for_resume(tag_dir: Path, written: str, wanted: str) -> Path:
    """DeepSpeed's universal form of `tag_dir`, beside it (made now unless a complete one is there)."""
    start = time.perf_counter()
    out, manifest = ensure_universal(tag_dir)
    if manifest is None:
        print(f"train: {tag_dir} was {written}; resuming with {wanted} from its universal form {out}")
    else:
        print(
            f"train: {tag_dir} was {written}; converted it to DeepSpeed's universal layout "
            f"({len(manifest['parameters'])} parameters with their Adam moments, step {manifest['step']}, "
            f"{time.perf_counter() - start:.1f} s) in {out} to resume with {wanted}"
        )
    return out


def launch_command(launcher: config.LauncherConfig, worker_args: list[str]) -> list[str]:
    command = [
        "deepspeed", "--num_gpus", str(launcher.ranks_per_node), "--num_nodes", str(launcher.num_nodes),
        "--master_addr", launcher.master_addr, "--master_port", str(launcher.master_port or dsc.free_port()),
    ]  # fmt: skip
    if launcher.num_nodes > 1:
        command += ["--hostfile", str(launcher.hostfile), "--no_ssh", "--node_rank", str(launcher.node_rank)]
    return command + ["--module", "stages.train_worker", *worker_args]


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    t, ds, launcher, lora = cfg.train, cfg.deepspeed, cfg.launcher, cfg.lora
    accelerator = dsc.accelerator_name(launcher.accelerator)
    dsc.check_precision(t.precision, accelerator)
    world = launcher.ranks_per_node * launcher.num_nodes
    ds_config = dsc.build(
        ds.stage, ds.offload_optimizer, ds.offload_param, ds.overlap_comm, ds.contiguous_gradients, t.precision,
        t.micro_batch_size, t.gradient_accumulation_steps, world, t.lr, t.weight_decay, t.max_grad_norm,
        t.global_batch_size,
    )  # fmt: skip
    check_targets(meta_model(args.base), lora.target_modules, lora.modules_to_save)
    rows = vocab_rows(args.base, args.tokenizer, t.resize_embeddings)
    base_rows = json.loads((args.base / "config.json").read_text(encoding="utf-8"))["vocab_size"]
    if rows > base_rows and "embed_tokens" not in lora.modules_to_save:
        raise ValueError(
            f"lora.modules_to_save: the vocabulary grows from {base_rows} to {rows} rows but embed_tokens is not "
            f"trained, so every new token would keep its initial embedding; expected [embed_tokens, lm_head]"
        )
    identity = {
        "base_config": file_digest([args.base / "config.json"]),
        "vocab_rows": rows,
        "lora_r": lora.r,
        "target_modules": sorted(lora.target_modules),
        "modules_to_save": sorted(lora.modules_to_save),
    }
    settings = {
        "lora": lora.model_dump(),
        "train": {k: v for k, v in t.model_dump().items() if k not in UNTRACKED_TRAIN_KEYS},
    }
    inputs = {name: file_digest([path]) for name, path in (("tokenizer", args.tokenizer), ("dataset", args.dataset))}
    run_state = {
        "fingerprint": fingerprint({**inputs, **identity}, settings),
        "identity": identity,
        "world_size": world,
        "zero_stage": ds.stage,
    }
    resume_from = Path(t.resume_from) if t.resume_from else None
    universal = prepare_checkpoints(args.checkpoints, run_state, resume_from, t.convert_layout)
    tokenizer = load_tokenizer(args.tokenizer)  # the ranks only need its pad id: they skip loading it
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    write_json(args.checkpoints / "run.json", {**run_state, "pad_token_id": pad or 0})
    write_json(args.checkpoints / "ds_config.json", ds_config)

    worker_args = ["--params", args.params]
    forwarded = (
        "base", "tokenizer", "dataset", "checkpoints", "metrics", "curve", "run_id_file", "final_state", "loaded_state",
    )  # fmt: skip
    for name in forwarded:
        if getattr(args, name) is not None:
            worker_args += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if resume_from is not None:
        worker_args += ["--resume-from", str(resume_from)]
    if universal is not None:
        worker_args += ["--resume-universal", str(universal)]
    env = {**os.environ, "DS_ACCELERATOR": accelerator}
    if accelerator == "cpu":  # one thread per core and rank: the default (all cores per rank) oversubscribes
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // launcher.ranks_per_node)))
        # A fixed mmap threshold: glibc otherwise raises it as tensors are freed, keeps activation-sized blocks in
        # its heap and never returns them (bench.train: peak RSS per rank 3.93 GB -> 3.05 GB).
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    done = subprocess.run(launch_command(launcher, worker_args), env=env)
    if done.returncode != 0:
        print(
            f"error: train: the DeepSpeed ranks failed (exit {done.returncode}); see their output above",
            file=sys.stderr,
        )
        sys.exit(1)
    if launcher.node_rank == 0:  # global rank 0, which writes the metrics, runs on node 0
        return json.loads(args.metrics.read_text(encoding="utf-8"))
    return {}


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
    run(main, parser, prefix="train")
