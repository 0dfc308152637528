"""Where a run starts: the one decision that it is already finished, the checkpoint folder made ready (this run's
checkpoints kept, another configuration's moved aside, another layout converted to the universal one), and the
ranks' load of what it continues from."""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

from pipeline.checkpoints import engine_loads, folder, safe_pickle
from pipeline.checkpoints.universal import ensure_universal, load_universal, universal_path
from pipeline.core.atomic import read_json
from pipeline.core.log import logger
from pipeline.training.plan import Resume, RunState

log = logger("train")


def finished(directory: Path, *, fingerprint: str, max_steps: int) -> dict | None:
    """{"metrics", "history"} of this run when its final checkpoint is already in `directory` (the metrics marked
    with that checkpoint): the only place that decides a run has nothing left to train."""
    tag = folder.latest_tag(directory)
    if tag is None:
        return None
    saved = folder.read_state(directory, tag)
    if saved["fingerprint"] != fingerprint or saved["step"] < max_steps:
        return None
    if not saved.get("metrics"):
        raise ValueError(
            f"train: {directory / tag} is this run's final checkpoint but keeps no figures (written before final "
            "checkpoints kept them); expected it moved aside or deleted, to train again"
        )
    return {"metrics": {**saved["metrics"], "reused_checkpoint": tag}, "history": saved["history"]}


def prepare(*, directory: Path, state: RunState, resume_from: Path | None, convert: bool) -> Resume:
    """Keep checkpoints of this very run; move another configuration's aside; vet an explicit resume_from; convert
    a checkpoint written under another layout to the universal one. Returns what the ranks start from."""
    source = None
    if tag := folder.latest_tag(directory):
        saved = folder.read_state(directory, tag)
        if saved["fingerprint"] != state.fingerprint:
            aside = directory.with_name(directory.name + ".previous")
            shutil.rmtree(aside, ignore_errors=True)
            directory.rename(aside)
            log.info(f"{directory} held another configuration's checkpoints; moved to {aside}, starting over")
        else:
            source = directory / tag
    elif resume_from is not None:
        tag = folder.latest_tag(resume_from)
        if tag is None:
            raise FileNotFoundError(f"train.resume_from: {resume_from} holds no checkpoint ('latest' missing)")
        saved, source = folder.read_state(resume_from, tag), resume_from / tag
    if source is not None:
        check_pickles(source)
        folder.check_same_model(saved, source.parent, dataclasses.asdict(state.identity))
        folder.check_same_rates(saved, source.parent, state.variant.lr_ratio)
    directory.mkdir(parents=True, exist_ok=True)
    here = (state.world_size, state.zero_stage)
    if source is None or folder.layout(saved) == here:
        log.info(f"resuming from {source}" if source else "starting from step 0")
        return Resume(source=None if source is None else source.parent)
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
        log.info(f"{source} was {written}; resuming with {wanted} from its universal form {out}")
    else:
        log.info(
            f"{source} was {written}; converted it to DeepSpeed's universal layout "
            f"({len(manifest['parameters'])} parameters with their Adam moments, step {manifest['step']}, "
            f"{time.perf_counter() - start:.1f} s) in {out} to resume with {wanted}"
        )
    return Resume(universal=out)


def check_pickles(tag_dir: Path) -> None:
    """Read every pickle a resume from `tag_dir` would load through the restricted loader now, so that a refusal
    comes before a rank starts or anything is written: the tag's files (RNG states against their schema) and the
    tag's universal form where one lies beside it (a run of another layout loads that form). The ranks read them
    through the same loader again (`load`)."""
    for path in sorted(tag_dir.glob("*.pt")):
        if path.name.startswith("rng_state_rank"):
            folder.read_rng_state(path)
        else:
            safe_pickle.check(path)
    if universal_path(tag_dir).is_dir():
        safe_pickle.check_folder(universal_path(tag_dir))


def load(*, engine, resume: Resume, seed: int) -> dict | None:
    """Load what the run continues from into `engine` and return its trainer state (None: a fresh start): the
    universal checkpoint of another layout (each rank's RNG is then reseeded from the seed, step and rank:
    per-rank streams do not map across world sizes), else the newest checkpoint of the source folder."""
    import deepspeed.comm as dist

    rank = dist.get_rank()
    if resume.universal is not None:
        load_universal(engine, resume.universal)
        saved = read_json(resume.universal / folder.STATE)
        folder.seed_rng(seed * 1_000_003 + saved["step"] * 1_009 + rank)
        return saved
    if resume.source is None or (tag := folder.latest_tag(resume.source)) is None:
        return None
    engine_loads.restrict(engine)  # DeepSpeed reads the tag's files through safe_pickle, not its own torch.load
    engine.load_checkpoint(str(resume.source), tag=tag, load_module_strict=False)
    folder.set_rng_state(folder.read_rng_state(folder.rng_file(resume.source, tag, rank)))
    return folder.read_state(resume.source, tag)
