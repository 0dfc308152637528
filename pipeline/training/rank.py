"""One DeepSpeed rank of the train stage, reading only the run's plan: `python -m pipeline.training.rank --plan P`
(started by the stage on one node, through the deepspeed launcher on several)."""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
from pathlib import Path

from pipeline.core.log import logger
from pipeline.launching.settings import FLASH
from pipeline.training import plan as plans
from pipeline.training.plan import Plan

log = logger("train")


def build_engine(plan: Plan):
    """The LoRA model inside a DeepSpeed engine (the base loaded in the dtype the engine trains in, under ZeRO-3 each
    rank building and loading only its partition, or quantized whole on every rank; LoRA+ groups), with the speed
    paths the plan's `kernels` switch chooses for the device it trains on; and what those installed."""
    import deepspeed

    from pipeline import kernels
    from pipeline.core.precision import DTYPES
    from pipeline.kernels import offloaded_checkpoints
    from pipeline.model import tiled_mlp
    from pipeline.model.lora import load_lora_model, parameter_groups, recompute_only_last
    from pipeline.model.quantization import Quantization
    from pipeline.training import sequence_parallel, ulysses
    from pipeline.training.schedule import lr_scheduler_factory

    variant, launch = plan.run_state.variant, plan.launch
    dtype, ds_config = plan.ds_config.module_dtype, plan.ds_config.as_dict()
    quantization = None
    if variant.quantization != "none":
        quantization = Quantization(
            kind=variant.quantization, compute_dtype=DTYPES[variant.compute_dtype], storage_dtype=dtype
        )
    model = load_lora_model(
        base_dir=plan.paths.base,
        vocab_rows=plan.run_state.identity.vocab_rows,
        lora=plan.lora,
        seed=plan.schedule.seed,
        dtype=dtype,
        gradient_checkpointing=launch.gradient_checkpointing,
        zero3_config=ds_config if plan.zero_stage == 3 else None,
        quantization=quantization,
        device=f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if launch.accelerator == "cuda" else "cpu",
        attention=launch.attention,
    )
    attention = model.config._attn_implementation  # the one the architecture supports (before any kernel's own)
    if launch.gradient_checkpointing and plan.checkpointed_layers is not None:
        recompute_only_last(model, plan.checkpointed_layers)
    skip = tuple(plan.kernels_skip)
    if launch.sequence_parallel > 1:
        skip += ("compiled_layers",)  # Ulysses rewrites the attention inside the layers: proven eager only
    # the tiled MLP and offloaded checkpoints run with the compiled layers (tests/unit/kernels/test_compiled_layers.py;
    # bench.long_context's GPU path, whose figures calibrated the memory estimate)
    installed = kernels.apply(
        model, device=launch.accelerator, zero_stage=plan.zero_stage, enabled=plan.kernels, skip=skip
    )
    # long sequences (issue 46): each rank 1/N of every sequence, the MLPs in tiles, checkpoints in host memory
    layout = sequence_parallel.initialize(launch.sequence_parallel, zero_stage=plan.zero_stage)
    ulysses.install(model, layout)
    if launch.tiled_mlp:
        installed["tiled_mlp"] = tiled_mlp.install(model)
    if launch.checkpoint_offload:
        installed["offloaded_checkpoints"] = offloaded_checkpoints.install(model)
    if plan.zero_stage == 3:
        gather_whole_layers(model)
    engine, *_ = deepspeed.initialize(
        model=model,
        model_parameters=parameter_groups(
            model, plan.optimizer.weight_decay, lr=plan.optimizer.lr, lr_ratio=plan.optimizer.lr_ratio
        ),
        config=ds_config,
        lr_scheduler=lr_scheduler_factory(plan.schedule),
        mpu=sequence_parallel.mpu(layout),  # ZeRO's reductions average over the data-parallel groups
    )
    installed |= kernels.tune_engine(engine, enabled=plan.kernels, skip=skip)
    return engine, installed, attention


def reporting(plan: Plan, engine, *, block: int, load: dict):
    """How this rank reports (rank 0 logs to the pipeline's MLflow run and draws the progress bar; the others stay
    silent), and the call that writes the metrics and the curve at the end (rank 0)."""
    import deepspeed.comm as dist
    from tqdm import tqdm

    from pipeline.checkpoints.universal import MANIFEST
    from pipeline.core.atomic import read_json, write_json
    from pipeline.model.lora import count_parameters
    from pipeline.tracking.execution import pipeline_run, workspace
    from pipeline.training import figures
    from pipeline.training.loop import Reporting

    rank, world = dist.get_rank(), dist.get_world_size()
    trainable, total = count_parameters(engine.module)
    tracker = None
    if rank == 0:  # the execution's run, opened here or by an earlier stage (the train stage logs its params after)
        tracker = pipeline_run(
            uri=plan.tracking.uri,
            experiment=plan.tracking.experiment,
            run_id_file=plan.paths.run_id_file,
        )
    curves = None
    if rank == 0 and plan.tracking.tensorboard and plan.paths.tensorboard is not None:
        from pipeline.tracking.tensorboard import CurveWriter, run_dir

        curves = CurveWriter(run_dir(plan.paths.tensorboard, workspace()))
        log.info(f"TensorBoard events in {curves.folder} (tensorboard --logdir {plan.paths.tensorboard})")
    bar = tqdm(total=plan.schedule.max_steps, desc="train", dynamic_ncols=True, disable=rank != 0)
    if tracker is not None:
        tracker.set_tags({"world_size": str(world), "zero_stage": str(plan.zero_stage)})
        log.info(f"{trainable:,} trainable of {total:,} parameters ({100 * trainable / total:.2f}%)")
        if plan.resume.universal is not None:
            source = read_json(plan.resume.universal / MANIFEST)["source"]
            converted = f"ZeRO-{source['zero_stage']} x {source['world_size']} rank(s), {source['tag']}"
            tracker.set_tags({"resume.converted_from": converted})

    def log_step(metrics: dict, step: int) -> None:
        if tracker is not None:
            tracker.log_metrics({k: v for k, v in metrics.items() if k != "step"}, step=step)
        if curves is not None:
            curves.log(metrics, step)

    def progress(step: int, shown: dict) -> None:
        bar.n = step
        bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=rank == 0)

    def describe(summary: dict) -> dict:
        mfu = figures.mfu(
            tokens_per_s=summary["steady_tokens_per_s"] or summary["tokens_per_s"],
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
            "zero_stage": plan.zero_stage,
            "precision": plan.launch.precision,
            "gradient_checkpointing": plan.checkpointing,
            "mfu": mfu,
            **compiled_graphs(load.get("kernels", {})),
        }

    def finish(metrics: dict) -> None:
        bar.close()
        if curves is not None:
            curves.close()
        if tracker is None:
            return
        history = metrics.pop("history")
        write_json(plan.paths.metrics, metrics)
        figures.write_curve(plan.paths.curve, history)
        tracker.close()
        log.info(f"{json.dumps(metrics)}")

    return Reporting(log=log_step, progress=progress, describe=describe), finish


def gather_whole_layers(model) -> None:
    """ZeRO-3 gathers each decoder layer's weights at once, as DeepSpeed's leaf modules: one fetch and release a
    layer, where the hooks of every module inside it (a LoRA layer is several) ran in Python forward and backward (on
    an H200 the 8B step waited 917 ms for them, ZeRO-3 at 0.19x ZeRO-2). A leaf gathers for the backward pass through
    its input, so the first layer's input is made to need a gradient (PEFT's `enable_input_require_grads`: with frozen
    embeddings it would not; the backward then read a partitioned, empty weight)."""
    from deepspeed.utils import set_z3_leaf_modules

    from pipeline.kernels.compiled_layers import decoder_layers

    layers = {type(m) for m in decoder_layers(model)}
    if layers:
        set_z3_leaf_modules(model, sorted(layers, key=lambda cls: cls.__qualname__))
        model.enable_input_require_grads()


def compiled_graphs(installed: dict[str, int]) -> dict[str, int]:
    """With the compiled layers installed, the graphs torch.compile made (the first step's, then one per new
    shape: no more after warm-up on packed blocks)."""
    if not installed.get("compiled_layers"):
        return {}
    from pipeline.kernels.compiled_layers import graphs

    return {"compiled_graphs": graphs()}


def _rounded(value):
    """Figures as the metrics file shows them: 6 decimals, memory lists to 0.1 MB."""
    if isinstance(value, float):
        return round(value, 6)
    return [round(v, 1) for v in value] if isinstance(value, list) else value


def load_figures(engine, loading: dict[str, float]) -> dict:
    """What loading the model cost each rank (host MB before and at the end of the load), and under ZeRO-3 how many
    of the parameters DeepSpeed does not keep whole (`ds_persist`: the small ones) are partitioned, a rank holding
    at most its ceil(n / world) elements of each: all of them. `checkpointed_layers`: the layers whose activations
    are recomputed in the backward pass (transformers marks them when activation checkpointing is on)."""
    import deepspeed.comm as dist
    from transformers.modeling_layers import GradientCheckpointingLayer

    from pipeline.training.figures import per_rank

    figures = {f"load_{k}_mb_per_rank": [round(v, 1) for v in per_rank(x, engine.device)] for k, x in loading.items()}
    layers = [m for m in engine.module.modules() if isinstance(m, GradientCheckpointingLayer)]
    figures["checkpointed_layers"] = sum(m.gradient_checkpointing is True for m in layers)
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

    from pipeline.core.atomic import atomic_path
    from pipeline.training.loop import gathered_trainable

    if path is None:
        return
    state = gathered_trainable(engine, moments=moments)
    if dist.get_rank() == 0:
        with atomic_path(path) as tmp:
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))


def run(plan: Plan) -> None:
    """Build the engine, resume, train to the plan's last step (unless the run is already finished), report."""

    from pipeline import kernels
    from pipeline.data.saved_splits import SplitRows
    from pipeline.launching.ranks import exit_rank, leave_process_group
    from pipeline.training import initial, loop, resume, sequence_parallel

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    engine, installed, attention = build_engine(plan)
    loading = {"before": before, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    data = {split: SplitRows(plan.paths.dataset / split) for split in ("train", "validation")}
    block = len(data["train"][0]["input_ids"])
    figures = {**load_figures(engine, loading), "sequence_parallel": plan.launch.sequence_parallel}
    figures["attention"] = attention  # the implementation trained with (the model's own support applied)
    saved = resume.load(engine=engine, resume=plan.resume, seed=plan.schedule.seed)
    if saved is None and plan.init_adapter is not None:  # a fresh start from an adapter, not from B = 0
        initial.place(engine, plan.init_adapter)
    save_gathered(engine, plan.paths.loaded_state, moments=True)  # what the run continues from, as loaded
    installed |= kernels.settle(device=plan.launch.accelerator, enabled=plan.kernels)
    if plan.launch.accelerator == "cpu":  # which code paths the CPU's features chose: they round differently
        from pipeline.kernels.cpu_paths import describe

        figures["cpu_paths"] = describe(kernels=plan.kernels != "off")
    report, finish = reporting(plan, engine, block=block, load={**figures, "kernels": installed})
    if plan.resume.finished is not None:
        metrics = {**plan.resume.finished, "history": saved["history"]}
    else:
        layout = sequence_parallel.current()
        steps = loop.Loop(
            engine=engine,
            train_rows=data["train"],
            val_rows=data["validation"],
            schedule=plan.schedule,
            objective=plan.objective,
            pad_id=plan.pad_token_id,
            varlen=attention == FLASH,
            bucketed=bool(installed.get("compiled_layers")),  # static shapes: a graph for each of a few widths
            rank=layout.data_rank,  # the ranks of a sequence-parallel group share their rows (issue 46)
            world=layout.data_world,
        )
        metrics = loop.train(
            steps,
            run_state=plan.run_state,
            saved=saved,
            directory=plan.paths.checkpoints,
            tokenizer_dir=plan.paths.tokenizer,
            reporting=report,
        )
    save_gathered(engine, plan.paths.final_state)
    finish(metrics)
    leave_process_group()
    exit_rank()


def main() -> None:
    """The rank's process: imports, then waits until the stage releases it (started ahead on one node), then runs
    the plan the stage wrote."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from pipeline.core import deepspeed_patches, imports
    from pipeline.core.errors import guarded
    from pipeline.core.quiet import quiet_third_parties
    from pipeline.launching.ranks import KEEP_BITSANDBYTES, released
    from pipeline.launching.rendezvous import join

    quiet_third_parties()
    if os.environ.get(KEEP_BITSANDBYTES) != "1":  # known before the plan is read: the imports come first
        imports.without_unused()
    deepspeed = deepspeed_patches.imported()
    import peft  # noqa: F401  (imported before the load is measured)
    import transformers  # noqa: F401

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--plan", type=Path, required=True, help="the run's plan.json (written by the train stage)")
    parser.add_argument("--local_rank", type=int, default=-1, help="passed by the deepspeed launcher")
    args = parser.parse_args()
    released()  # the stage's checks are done and the plan is written
    plan = plans.read(args.plan)
    launch = plan.launch
    guarded(lambda: join(hosts=launch.hosts, ranks_per_node=launch.ranks_per_node, timeout_s=launch.join_timeout_s))
    deepspeed.init_distributed()
    guarded(lambda: run(plan))


if __name__ == "__main__":
    main()
