"""One DeepSpeed rank of the train stage (started by stages/train.py: by itself on one node, through the deepspeed
launcher on several)."""

import argparse
import json
import os
import resource
from pathlib import Path

from pipeline import config
from stages._common import run


def build_engine(args: argparse.Namespace, cfg: config.Config, run_state: dict):
    """The LoRA model inside a DeepSpeed engine, as the stage's ds_config.json and run.json describe it (the base
    loaded in the dtype the engine trains in, under ZeRO-3 each rank building and loading only its partition, or
    quantized whole on every rank; LoRA+ groups); and its schedule."""
    import deepspeed

    from pipeline import cpu_attention, cpu_linear, fused_loss, lean_layers, lora_linear, trainer
    from pipeline import ds_config as dsc
    from pipeline.atomic import read_json
    from pipeline.model import LoraSpec, load_lora_model, parameter_groups
    from pipeline.precision import DTYPES
    from pipeline.quantization import Quantization

    t, ds_config = cfg.train, read_json(args.checkpoints / "ds_config.json")
    launch, variant = run_state["launch"], run_state["variant"]
    quantization = None
    if variant["quantization"] != "none":
        quantization = Quantization(
            kind=variant["quantization"],
            compute_dtype=DTYPES[variant["compute_dtype"]],
            storage_dtype=dsc.module_dtype(ds_config),
        )
    lora = cfg.lora.model_dump(exclude={"lr_ratio", "quantization", "compute_dtype"})
    model = load_lora_model(
        base_dir=args.base,
        vocab_rows=run_state["identity"]["vocab_rows"],
        lora=LoraSpec(**{**lora, "target_modules": run_state["identity"]["target_modules"]}),
        seed=t.seed,
        dtype=dsc.module_dtype(ds_config),
        gradient_checkpointing=launch["gradient_checkpointing"],
        zero3_config=ds_config if ds_config["zero_optimization"]["stage"] == 3 else None,
        quantization=quantization,
        device=f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if launch["accelerator"] == "cuda" else "cpu",
    )
    lean_layers.install(model)
    cpu_linear.install(model)  # fp32 on a CPU: the frozen layers' matmuls through oneDNN
    cpu_attention.install(model)  # on a CPU: the attention's backward as matmuls, causal blocks
    if ds_config["zero_optimization"]["stage"] != 3:  # under ZeRO-3 a layer's weights are gathered by its forward
        fused_loss.install(model)
        lora_linear.install(model)
    schedule = trainer.Schedule(
        micro_batch_size=t.micro_batch_size,
        accumulation=ds_config["gradient_accumulation_steps"],
        max_steps=t.max_steps,
        warmup_steps=t.warmup_steps,
        lr_scheduler=t.lr_scheduler,
        eval_every=t.eval_every,
        eval_max_rows=t.eval_max_rows,
        save_every=t.save_every,
        keep_last=t.keep_last,
        seed=t.seed,
    )
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=parameter_groups(model, t.weight_decay, lr=t.lr, lr_ratio=variant["lr_ratio"]),
        config=ds_config,
        lr_scheduler=trainer.lr_scheduler_factory(schedule),
    )
    return engine, schedule


def reporting(args: argparse.Namespace, cfg: config.Config, engine, *, block: int, launch: dict, load: dict):
    """How this rank reports (rank 0 logs to the pipeline's MLflow run and draws the progress bar; the others stay
    silent), and the call that writes the metrics and the curve at the end (rank 0)."""
    import deepspeed.comm as dist
    from tqdm import tqdm

    from pipeline import trainer
    from pipeline.atomic import read_json, write_json
    from pipeline.checkpoints.universal import MANIFEST
    from pipeline.model import count_parameters
    from stages._common import pipeline_run

    rank, world = dist.get_rank(), dist.get_world_size()
    trainable, total = count_parameters(engine.module)
    tracker = pipeline_run(cfg, args.run_id_file) if rank == 0 else None  # the stage opened it: params, tags
    curves = None
    if rank == 0 and cfg.tracking.tensorboard and args.tensorboard is not None:
        from pipeline.tensorboard import CurveWriter, run_dir

        curves = CurveWriter(run_dir(args.tensorboard, Path(os.environ.get("DVC_ROOT") or Path.cwd())))
        print(f"train: TensorBoard events in {curves.folder} (tensorboard --logdir {args.tensorboard})", flush=True)
    bar = tqdm(total=cfg.train.max_steps, desc="train", dynamic_ncols=True, disable=rank != 0)
    if tracker is not None:
        tracker.set_tags({"world_size": str(world), "zero_stage": str(cfg.deepspeed.stage)})
        print(f"train: {trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.2f}%)", flush=True)
        if args.resume_universal is not None:
            source = read_json(args.resume_universal / MANIFEST)["source"]
            converted = f"ZeRO-{source['zero_stage']} x {source['world_size']} rank(s), {source['tag']}"
            tracker.set_tags({"resume.converted_from": converted})

    def log(metrics: dict, step: int) -> None:
        if tracker is not None:
            tracker.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=step)
        if curves is not None:
            curves.log(metrics, step)

    def progress(step: int, figures: dict) -> None:
        bar.n = step
        bar.set_postfix({k: f"{v:.4g}" for k, v in figures.items()}, refresh=rank == 0)

    def describe(summary: dict) -> dict:
        mfu = trainer.mfu(
            tokens_per_s=summary["tokens_per_s"],
            n_params=total,
            model_config=engine.module.config,
            seq_len=block,
            world=world,
            device=engine.device,
        )
        return {
            **{k: _rounded(v) for k, v in summary.items()},
            **load,
            "trainable_parameters": trainable,
            "total_parameters": total,
            "world_size": world,
            "zero_stage": cfg.deepspeed.stage,
            "precision": launch["precision"],
            "mfu": mfu,
        }

    def finish(metrics: dict) -> None:
        bar.close()
        if curves is not None:
            curves.close()
        if tracker is None:
            return
        history = metrics.pop("history")
        write_json(args.metrics, metrics)
        trainer.write_curve(args.curve, history)
        tracker.close()
        print(f"train: {json.dumps(metrics)}", flush=True)

    return trainer.Reporting(log=log, progress=progress, describe=describe), finish


def _rounded(value):
    """Figures as the metrics file shows them: 6 decimals, memory lists to 0.1 MB."""
    if isinstance(value, float):
        return round(value, 6)
    return [round(v, 1) for v in value] if isinstance(value, list) else value


def load_figures(engine, loading: dict[str, float]) -> dict:
    """What loading the model cost each rank (host MB before and at the end of the load), and under ZeRO-3 how many
    of the parameters DeepSpeed does not keep whole (`ds_persist`: the small ones) are partitioned, a rank holding
    at most its ceil(n / world) elements of each: all of them."""
    import math

    import deepspeed.comm as dist

    from pipeline.trainer import per_rank

    figures = {f"load_{k}_mb_per_rank": [round(v, 1) for v in per_rank(x, engine.device)] for k, x in loading.items()}
    params = list(engine.module.parameters())
    if all(hasattr(p, "ds_numel") for p in params):
        world = dist.get_world_size()
        large = [p for p in params if not p.ds_persist]
        held = sum(p.numel() == 0 and p.ds_tensor.numel() <= math.ceil(p.ds_numel / world) for p in large)
        figures.update(zero3_partitioned_parameters=held, zero3_large_parameters=len(large))
    return figures


def save_gathered(engine, path: Path | None, moments: bool = False) -> None:
    """The gathered fp32 trainable tensors (with Adam's moments) into `path` (tests compare them); collective."""
    import deepspeed.comm as dist
    from safetensors.torch import save_file

    from pipeline import trainer
    from pipeline.atomic import atomic_path

    if path is None:
        return
    state = trainer.gathered_trainable(engine, moments=moments)
    if dist.get_rank() == 0:
        with atomic_path(path) as tmp:
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))


def main(args: argparse.Namespace, cfg: config.Config) -> None:
    from pipeline import imports

    if cfg.lora.quantization == "none":
        imports.without_unused()
    deepspeed = imports.deepspeed()
    import peft  # noqa: F401  (imported before the load is measured)
    import transformers  # noqa: F401

    from pipeline import trainer
    from pipeline.atomic import read_json
    from pipeline.dataset import SplitRows
    from pipeline.processes import exit_rank, keep_freed_memory, leave_process_group, released

    universal = released().get("resume_universal")  # the stage's checks are done: run.json is written
    if universal is not None:
        args.resume_universal = Path(universal)
    run_state = read_json(args.checkpoints / "run.json")
    deepspeed.init_distributed()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    engine, schedule = build_engine(args, cfg, run_state)
    loading = {"before": before, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    data = {split: SplitRows(args.dataset / split) for split in ("train", "validation")}
    block, launch = len(data["train"][0]["input_ids"]), run_state["launch"]
    report, finish = reporting(args, cfg, engine, block=block, launch=launch, load=load_figures(engine, loading))
    saved = trainer.resume(
        engine=engine,
        directory=args.checkpoints,
        resume_from=args.resume_from,
        universal=args.resume_universal,
        seed=cfg.train.seed,
    )
    save_gathered(engine, args.loaded_state, moments=True)  # what the run continues from, as loaded
    keep_freed_memory()
    if launch["accelerator"] == "cpu":
        from pipeline import cpu_allocator

        cpu_allocator.install()  # the loop's large tensors in a region of their own: no heap split by small ones
    metrics = trainer.train(
        engine=engine,
        train_rows=data["train"],
        val_rows=data["validation"],
        schedule=schedule,
        directory=args.checkpoints,
        tokenizer_dir=args.tokenizer,
        pad_id=run_state["pad_token_id"],
        run_state=run_state,
        saved=saved,
        reporting=report,
    )
    save_gathered(engine, args.final_state)
    finish(metrics)
    leave_process_group()
    exit_rank()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    for name in ("base", "tokenizer", "dataset", "checkpoints", "metrics", "curve", "run-id-file"):
        parser.add_argument(f"--{name}", type=Path, required=True)
    parser.add_argument("--final-state", type=Path, help="also write the gathered fp32 trainable tensors here")
    parser.add_argument("--resume-from", type=Path, help="checkpoint folder to start from when --checkpoints is empty")
    parser.add_argument("--resume-universal", type=Path, help="universal checkpoint to start from (another layout)")
    parser.add_argument("--loaded-state", type=Path, help="write the gathered state the run resumes from here")
    parser.add_argument("--tensorboard", type=Path, help="TensorBoard folder (tracking.tensorboard)")
    run(main, parser)
