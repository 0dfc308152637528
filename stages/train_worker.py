"""One DeepSpeed rank of the train stage (started by stages/train.py through the deepspeed launcher)."""

import argparse
import json
import os
from pathlib import Path

from pipeline import config
from stages.common import run


def main(args: argparse.Namespace, cfg: config.Config) -> None:
    import deepspeed
    import deepspeed.comm as dist
    import torch
    from datasets import load_from_disk
    from safetensors.torch import save_file

    from pipeline import trainer
    from pipeline.atomic import atomic_path, write_json
    from pipeline.convert import MANIFEST
    from pipeline.model import count_parameters, load_lora_model, parameter_groups
    from stages.common import pipeline_run

    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    run_state = json.loads((args.checkpoints / "run.json").read_text(encoding="utf-8"))
    ds_config = json.loads((args.checkpoints / "ds_config.json").read_text(encoding="utf-8"))
    t, lora = cfg.train, cfg.lora
    model = load_lora_model(
        args.base, run_state["identity"]["vocab_rows"], lora.init_new_embeddings, lora.r, lora.alpha, lora.dropout,
        lora.use_rslora, lora.target_modules, lora.modules_to_save, t.seed, t.gradient_checkpointing,
    )  # fmt: skip
    trainable, total = count_parameters(model)
    schedule = trainer.Schedule(
        t.micro_batch_size, t.gradient_accumulation_steps, t.max_steps, t.warmup_steps, t.lr_scheduler,
        t.eval_every, t.eval_max_rows, t.save_every, t.keep_last, t.seed,
    )  # fmt: skip
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=parameter_groups(model, t.weight_decay),
        config=ds_config,
        lr_scheduler=trainer.lr_scheduler_factory(schedule),
    )
    data = load_from_disk(str(args.dataset)).with_format("numpy")
    pad_id = run_state["pad_token_id"]

    tracker = bar = None
    if rank == 0:
        from tqdm import tqdm

        tracker = pipeline_run(cfg, args.run_id_file)  # the train stage opened it: params and tags are there
        tracker.set_tags({"world_size": str(world), "zero_stage": str(cfg.deepspeed.stage)})
        print(f"train: {trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.2f}%)", flush=True)
        bar = tqdm(total=t.max_steps, desc="train", dynamic_ncols=True)

    def log(metrics: dict, step: int) -> None:
        if tracker is not None:
            tracker.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=step)

    def progress(step: int, figures: dict) -> None:
        if bar is not None:
            bar.n = step
            bar.set_postfix({k: f"{v:.4g}" for k, v in figures.items()}, refresh=True)

    saved = trainer.resume(engine, args.checkpoints, args.resume_from, args.resume_universal, t.seed)
    if args.loaded_state is not None:  # what the run continues from, as the engine holds it (tests compare it)
        loaded = trainer.gathered_trainable(engine, moments=True)
        if rank == 0:
            with atomic_path(args.loaded_state) as tmp:
                save_file({k: v.contiguous() for k, v in loaded.items()}, str(tmp))
    if rank == 0 and args.resume_universal is not None:
        source = json.loads((args.resume_universal / MANIFEST).read_text(encoding="utf-8"))["source"]
        tracker.set_tags(
            {"resume.converted_from": f"ZeRO-{source['zero_stage']} x {source['world_size']} rank(s), {source['tag']}"}
        )
    summary = trainer.train(
        engine, data["train"], data["validation"], schedule, args.checkpoints, args.tokenizer, pad_id, run_state,
        saved, log, progress,
    )  # fmt: skip
    final_state = trainer.gathered_trainable(engine) if args.final_state is not None else None
    peak = torch.tensor(float(trainer.peak_memory_bytes(engine.device)), device=engine.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank != 0:
        return
    bar.close()
    if args.final_state is not None:
        with atomic_path(args.final_state) as tmp:
            save_file({k: v.contiguous() for k, v in final_state.items()}, str(tmp))
    history = summary.pop("history")
    metrics = {
        **{k: round(v, 6) if isinstance(v, float) else v for k, v in summary.items()},
        "peak_memory_mb": round(float(peak) / 2**20, 1),
        "trainable_parameters": trainable,
        "total_parameters": total,
        "world_size": world,
        "zero_stage": cfg.deepspeed.stage,
        "precision": t.precision,
        "mfu": trainer.mfu(
            summary["tokens_per_s"], total, model.config, len(data["train"][0]["input_ids"]), world, engine.device
        ),
    }
    write_json(args.metrics, metrics)
    trainer.write_curve(args.curve, history)
    tracker.close()
    print(f"train: {json.dumps(metrics)}", flush=True)


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
    run(main, parser)
