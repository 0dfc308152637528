"""DeepSpeed's universal checkpoint layout. A ZeRO 1-3 checkpoint tag (any world size) -> per parameter
`zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt` ({"cat_dim": 0, "param": tensor}) and `step.pt`, which an engine of any
world size under ZeRO 1-3 loads (`load_universal`). Written beside the source, never over anything, by N worker
processes (forked: nothing has run a parallel torch kernel yet) each holding one tensor at a time, into a temporary
folder renamed into place when complete."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from pipeline.checkpoints import safe_pickle
from pipeline.checkpoints.zero_shards import MOMENTS, optimizer_state
from pipeline.core.atomic import atomic_path
from pipeline.core.imports import torch

SUFFIX = "_universal"
MANIFEST = "universal_manifest.json"
KINDS = ("fp32", *MOMENTS)
CARRIED = ("*_model_states.pt", "trainer_state.json", "adapter_config.json", "tokenizer*", "*.jinja", "*.model")


def universal_path(tag_dir: Path) -> Path:
    """Where the universal form of `tag_dir` goes: beside it, `<tag>_universal`."""
    return tag_dir.with_name(tag_dir.name + SUFFIX)


def is_universal(folder: Path) -> bool:
    """A complete universal checkpoint (the manifest is written last, inside the temporary folder)."""
    return (folder / MANIFEST).is_file() and (folder / "zero").is_dir()


def refuse_existing(out_dir: Path) -> None:
    """A conversion writes a new folder, never over one."""
    if out_dir.exists():
        raise ValueError(f"{out_dir}: already exists; a conversion writes a new folder and never over one")


def to_universal(tag_dir: Path, out_dir: Path, workers: int = 1) -> dict:
    """Convert one checkpoint tag; returns the manifest (source layout, step, parameters and shapes)."""
    tag_dir, out_dir = Path(tag_dir), Path(out_dir)
    if workers < 1:
        raise ValueError(f"--workers: expected at least 1, got {workers}")
    refuse_existing(out_dir)
    if out_dir.resolve().is_relative_to(tag_dir.resolve()):
        raise ValueError(f"{out_dir}: inside the source checkpoint {tag_dir}; expected a folder beside it")
    states, source = optimizer_state(tag_dir)  # every check on the shards happens here, before anything is written
    names = sorted(states)
    step = source.optimizer_step if source.optimizer_step is not None else source.step
    with atomic_path(out_dir) as tmp:
        (tmp / "zero").mkdir(parents=True)
        chunks = [names[i::workers] for i in range(min(workers, len(names)))]
        if len(chunks) <= 1:
            _write(states=states, zero=tmp / "zero", names=names, step=step)
        else:
            count = len(chunks)
            with ProcessPoolExecutor(count, mp_context=get_context("fork")) as pool:  # no second torch import
                list(pool.map(_write_in_worker, [tag_dir] * count, [tmp / "zero"] * count, chunks, [step] * count))
        for pattern in CARRIED:
            for path in tag_dir.glob(pattern):
                shutil.copy2(path, tmp / path.name)
        manifest = {
            "source": {**source.__dict__, "checkpoint": str(tag_dir)},
            "step": step,
            "parameters": {name: list(states[name]["fp32"][0]) for name in names},
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return manifest


def ensure_universal(tag_dir: Path, workers: int = 1) -> tuple[Path, dict | None]:
    """The universal form of `tag_dir` beside it: the complete one already there (manifest None; its files checked
    by safe_pickle), else written now (its manifest), after removing what a conversion that was killed left."""
    out = universal_path(tag_dir)
    if is_universal(out):  # received with the checkpoint, perhaps: read as data like the tag's own files
        safe_pickle.check_folder(out)
        return out, None
    for stale in tag_dir.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale)
    return out, to_universal(tag_dir, out, workers)


def _write_in_worker(tag_dir: Path, zero: Path, names: list[str], step: int | None) -> None:  # pool.map's order
    """One worker process: map the shards itself (their pages are shared) and write its parameters."""
    torch.set_num_threads(1)
    _write(states=optimizer_state(tag_dir)[0], zero=zero, names=names, step=step)


def _write(*, states: dict, zero: Path, names: list[str], step: int | None) -> None:
    """Write each parameter's files, one tensor in memory at a time."""
    for name in names:
        folder = zero / name
        folder.mkdir()
        for kind in KINDS:
            torch.save({"cat_dim": 0, "param": states[name][kind][1]()}, folder / f"{kind}.pt")
        torch.save(torch.tensor(float(step or 0)), folder / "step.pt")


def link_optimizer_state(engine) -> None:
    """Make Adam's moments reachable per parameter before the first step: its state is empty until then (zero
    moments are created in the inner optimizer's own format: torch keeps the step as a tensor, DeepSpeed's CPU Adam
    as an int), and ZeRO-1/2 link the per-parameter views of it lazily, in `step`."""
    inner = engine.optimizer.optimizer
    torch_adam = isinstance(inner, torch.optim.Adam | torch.optim.AdamW)
    partitions = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)  # ZeRO-3 swaps these in per step
    for partition in partitions or [p for group in inner.param_groups for p in group["params"]]:
        state = inner.state[partition]
        if "exp_avg" not in state:
            state["step"] = torch.tensor(0.0) if torch_adam else 0
            state["exp_avg"] = torch.zeros_like(partition)
            state["exp_avg_sq"] = torch.zeros_like(partition)
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        link()


def load_universal(engine, folder: Path) -> dict:
    """Place a universal checkpoint's fp32 masters and Adam moments into this engine's partitions (ZeRO 1-3, any
    world size), the module's own copy of each parameter too, and restore Adam's step, the LR scheduler and the
    engine's step counters; returns the source's model-state dict. Call on every rank."""
    from deepspeed.utils import safe_set_full_optimizer_state

    zero = folder / "zero"
    trainable = {n: p for n, p in engine.module.named_parameters() if p.requires_grad}
    saved = {p.name for p in zero.iterdir() if p.is_dir()}
    if saved != set(trainable):
        raise ValueError(
            f"{folder}: holds other parameters than this model trains (only in the checkpoint: "
            f"{sorted(saved - set(trainable))[:5]}; only in the model: {sorted(set(trainable) - saved)[:5]})"
        )
    link_optimizer_state(engine)
    step = 0
    for name, param in trainable.items():
        shape = tuple(getattr(param, "ds_shape", param.shape))
        for kind in KINDS:
            value = parameter_file(zero / name / f"{kind}.pt").float()
            if tuple(value.shape) != shape:
                raise ValueError(f"{zero / name / kind}.pt: shape {tuple(value.shape)}, the model's is {shape}")
            if kind == "fp32":
                set_master(param, value)
            elif hasattr(param, "ds_id"):
                _place_zero3(param, value, kind)
            else:
                safe_set_full_optimizer_state(param, value, kind)
        step = _step(zero / name / "step.pt")
    for state in engine.optimizer.optimizer.state.values():
        if "step" in state:
            old = state["step"]
            state["step"] = torch.full_like(old, step) if torch.is_tensor(old) else step
    model_state = safe_pickle.load(next(folder.glob("*model_states.pt")))
    if engine.lr_scheduler is not None and model_state.get("lr_scheduler"):
        engine.lr_scheduler.load_state_dict(model_state["lr_scheduler"])
        for group, lr in zip(engine.optimizer.param_groups, engine.lr_scheduler.get_last_lr(), strict=True):
            group["lr"] = lr  # load_state_dict restores the schedule, not the rate the next step uses
    engine.global_steps = model_state.get("global_steps", step)
    engine.global_samples = model_state.get("global_samples", 0)
    engine.skipped_steps = model_state.get("skipped_steps", 0)
    return model_state


def parameter_file(path: Path) -> torch.Tensor:
    """The tensor of a universal checkpoint's `{"cat_dim": 0, "param": tensor}` file, through safe_pickle."""
    saved = safe_pickle.load(path)
    if not isinstance(saved, dict) or not isinstance(saved.get("param"), torch.Tensor):
        raise ValueError(f"{path}: expected {{'cat_dim': 0, 'param': tensor}} as a universal checkpoint holds")
    return saved["param"]


def _step(path: Path) -> int:
    """A universal checkpoint's `step.pt`: Adam's step as a one-number tensor (or a number)."""
    saved = safe_pickle.load(path)
    if isinstance(saved, torch.Tensor) and saved.numel() == 1:
        return int(saved)
    if type(saved) in (int, float):
        return int(saved)
    raise ValueError(f"{path}: expected Adam's step as one number")


def set_master(param, value: torch.Tensor) -> None:
    """A trainable parameter's full fp32 value into its fp32 master (this rank's partition under ZeRO-3, the mapped
    copy under ZeRO-1/2 and DeepSpeed's bf16 optimizer) and into the module's own copy; without an optimizer that
    keeps masters (fp32 under ZeRO-0), the module's tensor is the master. Call on every rank."""
    from deepspeed.utils import safe_set_full_fp32_param

    if hasattr(param, "ds_id"):
        _place_zero3(param, value, None)
        return
    safe_set_full_fp32_param(param, value)
    param.data.copy_(value.to(param.dtype))  # ZeRO 0-2 keep the whole parameter on every rank


def _place_zero3(param, value: torch.Tensor, key: str | None) -> None:
    """This rank's slice of a ZeRO-3 parameter (of its fp32 master or an Adam moment); the last slice may be
    padded. With the master, the module's own partition (`ds_tensor`) too."""
    optimizer = param._z3_optimizer
    partition, _ = optimizer._get_fp32_opt_state_partition(param, release_swap_buffers=False, optim_state_key=key)
    start = partition.numel() * optimizer._get_param_partition_rank(param)
    piece = value.flatten()[start : start + partition.numel()]
    partition.data.zero_()
    partition.data[: piece.numel()].copy_(piece)
    if key is None:
        param.ds_tensor.data.zero_()
        param.ds_tensor.data[: piece.numel()].copy_(piece.to(param.ds_tensor.dtype))
