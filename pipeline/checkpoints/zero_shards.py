"""Read a DeepSpeed ZeRO checkpoint tag (stage 0-3, any world size, fp32/bf16/fp16 engine): the fp32 master of
every trainable parameter (and, for ZeRO 1-3, its Adam moments), as a shape and a reader, after checking that the
files belong together.

Loads are memory-mapped through an unpickler that does not import DeepSpeed; what is not asked for (moments, frozen
weights) is never paged in, and pages of a partition are released as they are copied. Every partition must be
consumed exactly."""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import pickle
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

SHARD = re.compile(
    r"^(?P<bf16>bf16_)?(?:zero_pp_rank_(?P<rank>\d+)_)?mp_rank_(?P<mp>\d+)_(?P<kind>model|optim)_states\.pt$"
)


@dataclass(frozen=True)
class Source:
    """Where the tensors came from (recorded in the manifest)."""

    tag: str
    zero_stage: int
    world_size: int
    ds_version: str
    step: int | None
    optimizer_step: int | None = None  # Adam's own step counter (below `step` when fp16 skipped steps)


class _Opaque:
    """Stands in for a DeepSpeed object inside a checkpoint (a loss scaler...): not needed, not imported."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state: object) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {})


class _Unpickler(pickle.Unpickler):
    """Unpickles checkpoints without importing DeepSpeed (about 140 MB): its enums become ints."""

    def find_class(self, module: str, name: str):
        if module.split(".")[0] == "deepspeed":
            return int if name.endswith("Enum") else _Opaque
        return super().find_class(module, name)


_PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=pickle.load, __name__="pipeline_zero_checkpoint_pickle")


def _load(path: Path) -> dict:
    """Memory-mapped torch.load: tensors stay on disk until read."""
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False, pickle_module=_PICKLE)
    except Exception as err:  # torch raises RuntimeError, EOFError, UnpicklingError... for a damaged file
        raise ValueError(f"{path}: cannot be read as a DeepSpeed shard (truncated or corrupted?): {err}") from err


def _shards(tag_dir: Path) -> dict[str, dict[int, Path]]:
    """{'model'|'optim': {rank: path}} of the tag folder; model-parallel checkpoints are refused."""
    found: dict[str, dict[int, Path]] = {"model": {}, "optim": {}}
    for path in sorted(tag_dir.iterdir()):
        match = SHARD.match(path.name)
        if match is None:
            continue
        if int(match["mp"]) != 0:
            raise ValueError(f"{path}: tensor/model-parallel checkpoints (mp_rank > 0) are not supported")
        found[match["kind"]][int(match["rank"] or 0)] = path
    if not found["model"]:
        raise FileNotFoundError(f"{tag_dir}: no *_model_states.pt file: not a DeepSpeed checkpoint tag")
    return found


def _optimizer_step(state: object) -> int | None:
    """The first Adam 'step' counter inside an optimizer state (None when there is none)."""
    if isinstance(state, dict):
        if "step" in state and not isinstance(state["step"], dict | list):
            return int(state["step"])
        values = state.values()
    elif isinstance(state, list | tuple):
        values = state
    else:
        return None
    for value in values:
        if (found := _optimizer_step(value)) is not None:
            return found
    return None


def _check_same(values: dict[Path, object], what: str) -> object:
    distinct = {json.dumps(v, sort_keys=True, default=str) for v in values.values()}
    if len(distinct) > 1:
        detail = ", ".join(f"{p.name}: {v}" for p, v in values.items())
        raise ValueError(
            f"{next(iter(values)).parent}: files of different saves mixed under one tag ({what}: {detail})"
        )
    return next(iter(values.values()))


MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's first and second moments, as DeepSpeed names them


def _read_optim(paths: dict[int, Path]) -> tuple[int, int, str, dict, list | None, int | None]:
    """(stage, world size, version, {"fp32"|moment: per-rank partition groups}, alignment paddings, Adam's step),
    checked (the optimizer step must agree across ranks too). Moments are there when every group of every rank
    has them."""
    states = {p: _load(p) for p in paths.values()}
    inner = {p: s.get("optimizer_state_dict") for p, s in states.items()}
    for path, osd in inner.items():
        if not isinstance(osd, dict):
            raise ValueError(f"{path}: no optimizer_state_dict: not a DeepSpeed optimizer shard")
    stage = _check_same({p: o.get("zero_stage", 0) for p, o in inner.items()}, "zero_stage")
    counts = {p: o.get("partition_count") for p, o in inner.items()}
    world = _check_same({p: max(c) if isinstance(c, list) else c for p, c in counts.items()}, "partition_count")
    version = _check_same({p: str(s.get("ds_version")) for p, s in states.items()}, "ds_version")
    adam_step = _check_same({p: _optimizer_step(o) for p, o in inner.items()}, "optimizer step")
    missing = sorted(set(range(world)) - set(paths))
    if missing or len(paths) != world:
        raise ValueError(
            f"{next(iter(paths.values())).parent}: world size {world} but optimizer shards for ranks "
            f"{sorted(paths)}; missing ranks {missing or 'none'} (a rank did not finish saving?)"
        )
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    groups: dict[str, list[list[torch.Tensor]]] = {"fp32": []}
    for rank in range(world):
        osd = inner[paths[rank]]
        if key not in osd:
            raise ValueError(f"{paths[rank]}: no '{key}' (fp32 master partitions) in the optimizer shard")
        groups["fp32"].append(list(osd[key]))
    for moment in MOMENTS:
        per_rank = []
        for rank in range(world):
            osd = inner[paths[rank]]
            states = (osd.get("optimizer_state_dict" if stage == 3 else "base_optimizer_state") or {}).get("state", {})
            per_rank.append([states.get(g, {}).get(moment) for g in range(len(groups["fp32"][rank]))])
        if all(t is not None for rank_groups in per_rank for t in rank_groups):
            groups[moment] = per_rank
    return stage, world, version, groups, inner[paths[0]].get("param_alignment_paddings"), adam_step


def _param_shapes(model_state: dict, path: Path) -> list[dict[str, torch.Size]]:
    shapes = model_state.get("param_shapes")
    if not shapes:
        raise ValueError(f"{path}: no param_shapes recorded: was this checkpoint saved with an optimizer?")
    return [{name: torch.Size(shape) for name, shape in group.items()} for group in shapes]


BLOCK = 1 << 20  # elements copied (and released) at a time
Lazy = tuple[torch.Size, Callable[[], torch.Tensor]]  # a tensor's shape, and how to read it when it is written
_LIBC = ctypes.CDLL(None, use_errno=True)


def _release(tensor: torch.Tensor) -> None:
    """Drop the whole pages under a memory-mapped slice from this process's memory (the file keeps them)."""
    start = tensor.data_ptr()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (start + tensor.numel() * tensor.element_size()) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        _LIBC.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), 4)  # MADV_DONTNEED


def _gather_flat(partitions: list[torch.Tensor], offset: int, numel: int) -> torch.Tensor:
    """Elements [offset, offset + numel) of the concatenation of `partitions`, without concatenating them."""
    out, filled, start = torch.empty(numel, dtype=torch.float32), 0, 0
    for part in partitions:
        end = start + part.numel()
        lo, hi = max(offset, start), min(offset + numel, end)
        for block in range(lo, hi, BLOCK):  # a few MB at a time, each released once copied
            size = min(BLOCK, hi - block)
            out[filled : filled + size] = part[block - start : block - start + size]
            _release(part[block - start : block - start + size])
            filled += size
        start = end
    if filled != numel:
        raise ValueError(f"partitions end at element {start}, a parameter needs [{offset}, {offset + numel})")
    return out


def _zero12(shapes, world: int, groups: list[list[torch.Tensor]], paddings, where: Path) -> dict[str, Lazy]:
    """ZeRO-1/2 (and the bf16 optimizer): each group is one flat vector split evenly over the ranks."""
    state = {}
    for g, group_shapes in enumerate(shapes):
        partitions = [groups[rank][g] for rank in range(world)]
        available, offset = sum(p.numel() for p in partitions), 0
        for i, (name, shape) in enumerate(group_shapes.items()):
            state[name] = (shape, lambda p=partitions, o=offset, s=shape: _gather_flat(p, o, s.numel()).view(s))
            offset += shape.numel() + (paddings[g][i] if paddings else 0)
        if offset > available:
            raise ValueError(f"{where}: parameter group {g} holds {available} elements, its parameters {offset}")
        align = 2 * world  # DeepSpeed pads each group to a multiple of 2 x world size
        if math.ceil(offset / align) * align != math.ceil(available / align) * align:
            raise ValueError(f"{where}: parameter group {g} holds {available} elements, its parameters {offset}")
    return state


def _zero3_param(groups: list[list[torch.Tensor]], offset: int, piece: int, shape: torch.Size) -> torch.Tensor:
    pieces = [_gather_flat(rank_groups, offset, piece) for rank_groups in groups]
    return torch.cat(pieces)[: shape.numel()].view(shape)


def _zero3(shapes, world: int, groups: list[list[torch.Tensor]], where: Path) -> dict[str, Lazy]:
    """ZeRO-3: each parameter is split into `world` equal padded pieces, one per rank, in parameter order."""
    flat = {name: shape for group in shapes for name, shape in group.items()}
    rank_numel = [sum(t.numel() for t in groups[rank]) for rank in range(world)]
    if len(set(rank_numel)) != 1:
        raise ValueError(f"{where}: ranks hold different numbers of elements {rank_numel}")
    state, offset = {}, 0
    for name, shape in flat.items():
        piece = math.ceil(shape.numel() / world)
        state[name] = (shape, partial(_zero3_param, groups, offset, piece, shape))
        offset += piece
    if offset != rank_numel[0]:
        raise ValueError(f"{where}: each rank holds {rank_numel[0]} elements, the parameters consume {offset}")
    return state


def _adapter_names(module: dict) -> tuple[list[str], dict[str, str]]:
    """ZeRO-0 keeps no parameter list: the module's LoRA and modules_to_save tensors, and {tied alias: source}."""
    names, aliases, first = [], {}, {}
    for name, value in module.items():
        if "lora_" in name or ".modules_to_save." in name:
            view = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride())
            source = first.setdefault(view, name)  # ZeRO may keep parameters as views of one flat buffer
            if source == name:
                names.append(name)
            else:
                aliases[name] = source
    return names, aliases


def _zero0(model_state: dict, path: Path) -> dict[str, Lazy]:
    """ZeRO-0: fp32 engines train the module's own tensors; bf16/fp16 ones keep fp32 copies in the optimizer,
    in group order, each matched to the module tensor it rounds to (within a group, module order)."""
    module = model_state["module"]
    names, _ = _adapter_names(module)
    masters = (model_state.get("optimizer") or {}).get("fp32_groups")
    if masters is None:
        if any(module[n].dtype != torch.float32 for n in names):
            raise ValueError(f"{path}: half-precision ZeRO-0 checkpoint without fp32_groups: no master weights")
        return {name: (module[name].shape, module[name].float) for name in names}
    state, free = {}, list(names)
    for master in (t for group in masters for t in group):
        match = next(
            (n for n in free if module[n].shape == master.shape and torch.equal(master.to(module[n].dtype), module[n])),
            None,
        )
        if match is None:
            raise ValueError(f"{path}: an fp32 master of shape {tuple(master.shape)} matches no module tensor")
        free.remove(match)
        state[match] = (master.shape, master.float)
    if free:
        raise ValueError(f"{path}: no fp32 master for {free}")
    return state


def master_weights(tag_dir: Path) -> tuple[dict[str, Lazy], Source]:
    """Every trainable parameter's shape and a reader of its fp32 master value (engine names), and where they
    came from. Shapes and element counts are checked here; values are read when written."""
    shards, first_path, first, models = _model_states(tag_dir)
    kinds, source = _tensors(tag_dir, shards, first_path, first, models, ("fp32",))
    state = kinds["fp32"]
    aliases = first.get("shared_params")
    aliases = _adapter_names(first["module"])[1] if aliases is None else aliases
    state.update({alias: state[src] for alias, src in aliases.items() if src in state})  # PEFT wants both names
    return state, source


def optimizer_state(tag_dir: Path) -> tuple[dict[str, dict[str, Lazy]], Source]:
    """{parameter: {"fp32" | "exp_avg" | "exp_avg_sq": reader}} for every trainable parameter of a ZeRO 1-3
    checkpoint (engine names, tied aliases left out), and where it came from."""
    shards, first_path, first, models = _model_states(tag_dir)
    if not shards["optim"]:
        raise ValueError(f"{tag_dir}: a ZeRO-0 checkpoint keeps its optimizer whole, not in partitions to convert")
    kinds, source = _tensors(tag_dir, shards, first_path, first, models, ("fp32", *MOMENTS))
    return {name: {kind: kinds[kind][name] for kind in kinds} for name in kinds["fp32"]}, source


def _model_states(tag_dir: Path) -> tuple[dict, Path, dict, dict]:
    shards = _shards(tag_dir)
    models = {p: _load(p) for p in shards["model"].values()}
    for path, state in models.items():
        if not isinstance(state, dict) or "module" not in state:
            raise ValueError(f"{path}: no 'module' entry: not a DeepSpeed model-state file")
    first_path, first = next(iter(models.items()))
    return shards, first_path, first, models


def _tensors(
    tag_dir: Path, shards: dict, first_path: Path, first: dict, models: dict, kinds: tuple[str, ...]
) -> tuple[dict[str, dict[str, Lazy]], Source]:
    """{kind: {parameter: reader}} for each of `kinds` ("fp32", moments), the shards read once; ZeRO-0: fp32 only."""
    steps = _check_same({p: s.get("global_steps") for p, s in models.items()}, "global_steps")
    if not shards["optim"]:
        world = int(first.get("dp_world_size", 1))
        return {"fp32": _zero0(first, first_path)}, Source(tag_dir.name, 0, world, str(first.get("ds_version")), steps)
    stage, world, version, groups, paddings, adam_step = _read_optim(shards["optim"])
    _check_same({first_path: str(first.get("ds_version")), shards["optim"][0]: version}, "ds_version")
    if missing := [kind for kind in kinds if kind not in groups]:
        raise ValueError(f"{tag_dir}: the optimizer shards hold no {missing} for every parameter group (not Adam?)")
    shapes = _param_shapes(first, first_path)
    if stage == 3 and sorted(shards["model"]) != list(range(world)):
        raise ValueError(
            f"{tag_dir}: ZeRO-3 needs a model-state file per rank 0..{world - 1}, found {sorted(shards['model'])}"
        )
    if stage == 3:
        readers = {kind: _zero3(shapes, world, groups[kind], tag_dir) for kind in kinds}
    else:
        readers = {kind: _zero12(shapes, world, groups[kind], paddings, tag_dir) for kind in kinds}
    return readers, Source(tag_dir.name, int(stage), world, version, steps, adam_step)
