"""Stage train: resolve the run into one plan, checked, then run it on this node's DeepSpeed ranks."""

import argparse
import dataclasses
import sys
from pathlib import Path

from pipeline.core import config, imports
from pipeline.core.atomic import read_json, write_json
from pipeline.launching import cluster, preflight
from pipeline.launching import ranks as launch
from pipeline.launching.settings import resolve_launch
from pipeline.training import plan, resume
from pipeline.training.figures import write_curve
from stages._common import run


def main(args: argparse.Namespace, cfg: config.Config) -> dict:
    if cfg.lora.quantization == "none":
        imports.without_unused()  # a base without an outline is outlined from its architecture: model code
    settings = resolve_launch(train=cfg.train, launcher=cfg.launcher)
    nodes = cluster.resolve(cfg.launcher)
    if nodes.mode in ("ssh", "slurm"):
        preflight.check_nodes(nodes, checkpoints=args.checkpoints)
    planned = args.checkpoints / plan.FILE
    env = launch.rank_environment(
        accelerator=settings.accelerator,
        ranks_per_node=settings.ranks_per_node,
        kernels=cfg.train.kernels,
        keep_bitsandbytes=cfg.lora.quantization != "none",
    )
    ranks = launch.start_ranks(cluster=nodes, ranks=settings.ranks_per_node, plan=planned, env=env)
    try:
        paths = plan.Paths(**{f.name: getattr(args, f.name, None) for f in dataclasses.fields(plan.Paths)})
        the_plan = plan.make(
            paths=paths, train=cfg.train, lora=cfg.lora, deepspeed=cfg.deepspeed, launch=settings, tracking=cfg.tracking
        )
        state = the_plan.run_state
        done = resume.finished(args.checkpoints, fingerprint=state["fingerprint"], max_steps=cfg.train.max_steps)
        if done is not None and args.final_state is None and args.loaded_state is None:
            tag = done["metrics"]["reused_checkpoint"]
            print(f"train: {args.checkpoints / tag} is this run's final checkpoint; its figures are reported")
            write_json(args.metrics, done["metrics"])
            write_curve(args.curve, done["history"])
            return done["metrics"]
        start = resume.prepare(
            directory=args.checkpoints,
            state=state,
            resume_from=Path(cfg.train.resume_from) if cfg.train.resume_from else None,
            convert=cfg.train.convert_layout,
        )
        finished = None if done is None else done["metrics"]
        plan.write(dataclasses.replace(the_plan, resume=dataclasses.replace(start, finished=finished)), planned)
        print(f"train: {dataclasses.asdict(settings)}")
        code = launch.run_ranks(ranks, cluster=nodes, ranks=settings.ranks_per_node, plan=planned, env=env)
        ranks = None
    finally:
        if ranks is not None:
            ranks.cancel()  # never released: the checks failed, or the run was already done
    if code != 0:
        print(f"error: train: the DeepSpeed ranks failed (exit {code}); see their output above", file=sys.stderr)
        sys.exit(1)
    return read_json(args.metrics)  # global rank 0 runs on node 0, this one


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
