"""A training run from the train stage's side, the one call it makes (`run`): the launch settings resolved and every
node checked; this node's ranks started at once (they import while the run is planned); the plan made and checked,
the checkpoint folder made ready, the plan written; the ranks released and waited for. A run already finished starts
no rank: its final checkpoint's figures are reported instead."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.core import config, imports
from pipeline.core.atomic import read_json, write_json
from pipeline.core.log import logger
from pipeline.launching import cluster, preflight, ranks
from pipeline.launching.settings import resolve_launch
from pipeline.training import plan, resume
from pipeline.training.figures import write_curve

log = logger("train")


class RanksFailed(RuntimeError):
    """The DeepSpeed ranks ended with a non-zero exit code (their own output says why)."""

    def __init__(self, code: int):
        super().__init__(f"train: the DeepSpeed ranks failed (exit {code}); see their output above")
        self.code = code


def run(
    *,
    paths: plan.Paths,
    train: config.TrainConfig,
    lora: config.LoraConfig,
    deepspeed: config.DeepSpeedConfig,
    launcher: config.LauncherConfig,
    tracking: config.TrackingConfig,
) -> dict:
    """Train the run these sections describe (resuming where its checkpoints stop) and return its metrics, which
    global rank 0 writes to `paths.metrics` (with the curve); RanksFailed if a rank fails."""
    if lora.quantization == "none":
        imports.without_unused()  # a base without an outline is outlined from its architecture: model code
    settings = resolve_launch(train=train, launcher=launcher)  # the model's own support: applied by the ranks
    nodes = cluster.resolve(launcher)
    if nodes.mode in ("ssh", "slurm"):
        preflight.check_nodes(nodes, checkpoints=paths.checkpoints)
    planned = paths.checkpoints / plan.FILE
    env = ranks.rank_environment(
        accelerator=settings.accelerator,
        ranks_per_node=settings.ranks_per_node,
        kernels=train.kernels,
        keep_bitsandbytes=lora.quantization != "none",
    )
    started = ranks.start_ranks(cluster=nodes, ranks=settings.ranks_per_node, plan=planned, env=env)
    try:
        the_plan = plan.make(
            paths=paths, train=train, lora=lora, deepspeed=deepspeed, launch=settings, tracking=tracking
        )
        done = resume.finished(paths.checkpoints, fingerprint=the_plan.run_state.fingerprint, max_steps=train.max_steps)
        if done is not None and paths.final_state is None and paths.loaded_state is None:
            return reported(paths, done)
        start = resume.prepare(
            directory=paths.checkpoints,
            state=the_plan.run_state,
            resume_from=Path(train.resume_from) if train.resume_from else None,
            convert=train.convert_layout,
        )
        finished = None if done is None else done["metrics"]
        plan.write(dataclasses.replace(the_plan, resume=dataclasses.replace(start, finished=finished)), planned)
        log.info(f"{dataclasses.asdict(settings)}")
        code = ranks.run_ranks(started, cluster=nodes, ranks=settings.ranks_per_node, plan=planned, env=env)
        started = None
    finally:
        if started is not None:
            started.cancel()  # never released: the checks failed, or the run was already done
    if code != 0:
        raise RanksFailed(code)
    return read_json(paths.metrics)  # global rank 0 runs on node 0, this one


def reported(paths: plan.Paths, done: dict) -> dict:
    """A finished run's figures (its final checkpoint's) written again as the stage's outputs."""
    final = paths.checkpoints / done["metrics"]["reused_checkpoint"]
    log.info(f"{final} is this run's final checkpoint; its figures are reported")
    write_json(paths.metrics, done["metrics"])
    write_curve(paths.curve, done["history"])
    return done["metrics"]
