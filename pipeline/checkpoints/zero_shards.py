"""Read a DeepSpeed checkpoint tag (ZeRO 0-3, any world size, fp32/bf16/fp16 engine, any optimizer wrapper
DeepSpeed builds for it): the fp32 master of every trainable parameter (and, for the partitioned optimizers, its
Adam moments), as a shape and a reader, after checking that the files belong together.

The layout is told by the keys DeepSpeed writes, not by what the config says (deepspeed/checkpoint/constants.py,
zero_to_fp32.py): `fp32_flat_groups` (ZeRO-3: each parameter split into equal padded pieces, one per rank),
`single_partition_of_fp32_groups` with `zero_stage` (ZeRO-1/2: each group one flat vector split over the ranks,
named by the model state's `param_shapes`, never by `param_slice_mappings`, which `round_robin_gradients` makes
wrong) or without it (BF16_Optimizer: same split, partitions saved unstripped); ZeRO-0 keeps everything in the
model-state file (zero0_masters.py). Loads are memory-mapped; what is not asked for (moments, frozen weights) is
never paged in, pages of a partition are released as they are copied, and every partition must be consumed
exactly."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from pipeline.checkpoints.mapped import release
from pipeline.checkpoints.shard_files import Lazy, TagFiles, check_one_config, check_same, load, tag_files
from pipeline.checkpoints.zero0_masters import adapter_names, zero0_masters
from pipeline.core.imports import torch
from pipeline.core.precision import dtype_name


@dataclass(frozen=True)
class Source:
    """Where the tensors came from (recorded in the manifest)."""

    tag: str
    zero_stage: int
    world_size: int
    ds_version: str
    step: int | None
    optimizer_step: int | None = None  # Adam's own step counter (below `step` when fp16 skipped steps)


@dataclass(frozen=True)
class Layout:
    """How the files store the masters: the engine's optimizer wrapper, the masters' dtype, what to know, and the
    tied names ({alias: source}) that share a parameter."""

    optimizer: str
    master_dtype: str
    notes: tuple[str, ...] = ()
    aliases: dict[str, str] = field(default_factory=dict)


MOMENTS = ("exp_avg", "exp_avg_sq")  # Adam's first and second moments, as DeepSpeed names them
BLOCK = 1 << 20  # elements copied (and released) at a time


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


@dataclass(frozen=True)
class _Partitions:
    """What the optimizer shards of one save hold."""

    stage: int
    world: int
    version: str
    groups: dict  # {"fp32" | moment: [rank][group] partition}
    paddings: list | None  # ZeRO-1/2: zeros after each parameter (parameter_alignment)
    adam_step: int | None
    wrapper: str
    configs: dict  # {path: ds_config}


def _moment_groups(osd: dict, flat3: bool, count: int) -> list[dict]:
    """Per parameter group, the inner optimizer's state (elastic checkpoints keep a list of them)."""
    if flat3:
        states = (osd.get("optimizer_state_dict") or {}).get("state", {})
        return [states.get(g) or {} for g in range(count)]
    base = osd.get("base_optimizer_state") or {}
    if isinstance(base, list):  # zero_optimization.elastic_checkpoint: one lean state per group
        return [state or {} for state in base] + [{}] * (count - len(base))
    states = base.get("state", {})
    return [states.get(g) or {} for g in range(count)]


def _read_optim(paths: dict[int, Path], model_state: dict) -> _Partitions:
    """The optimizer shards of every rank, checked to be one save (the optimizer step must agree too). Moments are
    there when every group of every rank has them."""
    states = {p: load(p) for p in paths.values()}
    inner = {p: s.get("optimizer_state_dict") for p, s in states.items()}
    for path, osd in inner.items():
        if not isinstance(osd, dict):
            raise ValueError(f"{path}: no optimizer_state_dict: not a DeepSpeed optimizer shard")
    counts = {p: o.get("partition_count") for p, o in inner.items()}
    world = check_same({p: max(c) if isinstance(c, list) else c for p, c in counts.items()}, "partition_count")
    if not isinstance(world, int):
        raise ValueError(f"{next(iter(paths.values()))}: no partition_count: not a partitioned optimizer shard")
    version = check_same({p: str(s.get("ds_version")) for p, s in states.items()}, "ds_version")
    adam_step = check_same({p: _optimizer_step(o) for p, o in inner.items()}, "optimizer step")
    stage = check_same({p: o.get("zero_stage") for p, o in inner.items()}, "zero_stage")
    missing = sorted(set(range(world)) - set(paths))
    if missing or len(paths) != world:
        raise ValueError(
            f"{next(iter(paths.values())).parent}: world size {world} but optimizer shards for ranks "
            f"{sorted(paths)}; missing ranks {missing or 'none'} (a rank did not finish saving?)"
        )
    first = inner[paths[0]]
    flat3 = "fp32_flat_groups" in first
    key = "fp32_flat_groups" if flat3 else "single_partition_of_fp32_groups"
    if stage is None:  # BF16_Optimizer records no stage: its run's config does
        stage = ((model_state.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0)
        stage = stage if isinstance(stage, int) else 0
        wrapper = "BF16_Optimizer"
    else:
        wrapper = "DeepSpeedZeroOptimizer_Stage3" if flat3 else "DeepSpeedZeroOptimizer"
    groups: dict[str, list[list[torch.Tensor]]] = {"fp32": []}
    for rank in range(world):
        osd = inner[paths[rank]]
        if key not in osd:
            raise ValueError(
                f"{paths[rank]}: no '{key}' (fp32 master partitions) in the optimizer shard; found {sorted(osd)}"
            )
        groups["fp32"].append(list(osd[key]))
    for moment in MOMENTS:
        per_rank = []
        for rank in range(world):
            count = len(groups["fp32"][rank])
            per_rank.append([s.get(moment) for s in _moment_groups(inner[paths[rank]], flat3, count)][:count])
        if all(t is not None for rank_groups in per_rank for t in rank_groups):
            groups[moment] = per_rank
    configs = {p: s.get("ds_config") for p, s in states.items()}
    return _Partitions(
        int(stage), world, version, groups, first.get("param_alignment_paddings"), adam_step, wrapper, configs
    )


def _param_shapes(model_state: dict, path: Path) -> list[dict[str, torch.Size]]:
    shapes = model_state.get("param_shapes")
    if not shapes:
        raise ValueError(
            f"{path}: no param_shapes recorded (the parameter names of the partitions): was this checkpoint saved "
            f"with an optimizer?"
        )
    return [{name: torch.Size(shape) for name, shape in group.items()} for group in shapes]


def _gather_flat(partitions: list[torch.Tensor], offset: int, numel: int, mapped: bool = True) -> torch.Tensor:
    """Elements [offset, offset + numel) of the concatenation of `partitions` in fp32, without concatenating them;
    memory-mapped pages are released once copied (never pages of a file read whole: those hold the only copy)."""
    out, filled, start = torch.empty(numel, dtype=torch.float32), 0, 0
    for part in partitions:
        end = start + part.numel()
        lo, hi = max(offset, start), min(offset + numel, end)
        for block in range(lo, hi, BLOCK):  # a few MB at a time
            size = min(BLOCK, hi - block)
            out[filled : filled + size] = part[block - start : block - start + size]
            if mapped:
                release(part[block - start : block - start + size])
            filled += size
        start = end
    if filled != numel:
        raise ValueError(f"partitions end at element {start}, a parameter needs [{offset}, {offset + numel})")
    return out


def _zero12(
    *, shapes, parts: _Partitions, groups: list[list[torch.Tensor]], module: dict, where: Path, mapped: bool
) -> dict[str, Lazy]:
    """ZeRO-1/2 and BF16_Optimizer: each group is one flat vector split evenly over the ranks. Where the module's
    tensors are views into that vector (they are, as saved by ZeRO-1/2), each view's offset must be the one
    computed from `param_shapes`: a cheap proof that names and offsets agree."""
    state, world, paddings = {}, parts.world, parts.paddings
    for g, group_shapes in enumerate(shapes):
        partitions = [groups[rank][g] for rank in range(world)]
        available, offset = sum(p.numel() for p in partitions), 0
        for i, (name, shape) in enumerate(group_shapes.items()):
            view = module.get(name)
            shared = view is not None and view.untyped_storage().nbytes() > view.numel() * view.element_size()
            if shared and view.storage_offset() != offset:
                raise ValueError(
                    f"{where}: {name} sits at element {view.storage_offset()} of the module's flat buffer, the "
                    f"optimizer's param_shapes put it at {offset}: the files do not describe one layout"
                )
            read = partial(_gather_flat, partitions, offset, shape.numel(), mapped)
            state[name] = (shape, lambda r=read, s=shape: r().view(s))
            offset += shape.numel() + (paddings[g][i] if paddings else 0)
        if offset > available:
            raise ValueError(f"{where}: parameter group {g} holds {available} elements, its parameters {offset}")
        align = 2 * world  # DeepSpeed pads each group to a multiple of 2 x world size
        if math.ceil(offset / align) * align != math.ceil(available / align) * align:
            raise ValueError(f"{where}: parameter group {g} holds {available} elements, its parameters {offset}")
    return state


def _zero3_param(groups, offset: int, piece: int, shape: torch.Size, mapped: bool) -> torch.Tensor:
    pieces = [_gather_flat(rank_groups, offset, piece, mapped) for rank_groups in groups]
    return torch.cat(pieces)[: shape.numel()].view(shape)


def _zero3(*, shapes, world: int, groups: list[list[torch.Tensor]], where: Path, mapped: bool) -> dict[str, Lazy]:
    """ZeRO-3: each parameter is split into `world` equal padded pieces, one per rank, in parameter order."""
    flat = {name: shape for group in shapes for name, shape in group.items()}
    rank_numel = [sum(t.numel() for t in groups[rank]) for rank in range(world)]
    if len(set(rank_numel)) != 1:
        raise ValueError(f"{where}: ranks hold different numbers of elements {rank_numel}")
    state, offset = {}, 0
    for name, shape in flat.items():
        piece = math.ceil(shape.numel() / world)
        state[name] = (shape, partial(_zero3_param, groups, offset, piece, shape, mapped))
        offset += piece
    if offset != rank_numel[0]:
        raise ValueError(f"{where}: each rank holds {rank_numel[0]} elements, the parameters consume {offset}")
    return state


def master_weights(tag_dir: Path) -> tuple[dict[str, Lazy], Source, Layout]:
    """Every trainable parameter's shape and a reader of its fp32 master value (engine names, tied aliases under
    both names, as PEFT wants them), where they came from and how they were stored. Shapes and element counts are
    checked here; values are read when written."""
    files, first_path, first, models = _model_states(tag_dir)
    kinds, source, layout = _tensors(tag_dir, files, first_path, first, models, ("fp32",))
    state = kinds["fp32"]
    aliases = first.get("shared_params")
    aliases = adapter_names(first["module"])[1] if aliases is None else aliases
    aliases = {alias: src for alias, src in aliases.items() if src in state}
    state.update({alias: state[src] for alias, src in aliases.items()})
    return state, source, replace(layout, aliases=aliases)


def optimizer_state(tag_dir: Path) -> tuple[dict[str, dict[str, Lazy]], Source]:
    """{parameter: {"fp32" | "exp_avg" | "exp_avg_sq": reader}} for every trainable parameter of a checkpoint with
    partitioned optimizer state (engine names, tied aliases left out), and where it came from."""
    files, first_path, first, models = _model_states(tag_dir)
    if not files.optim:
        raise ValueError(f"{tag_dir}: a ZeRO-0 checkpoint keeps its optimizer whole, not in partitions to convert")
    kinds, source, _ = _tensors(tag_dir, files, first_path, first, models, ("fp32", *MOMENTS))
    return {name: {kind: kinds[kind][name] for kind in kinds} for name in kinds["fp32"]}, source


def _model_states(tag_dir: Path) -> tuple[TagFiles, Path, dict, dict]:
    files = tag_files(tag_dir)
    models = {p: load(p) for p in files.model.values()}
    for path, state in models.items():
        if not isinstance(state, dict) or "module" not in state:
            raise ValueError(f"{path}: no 'module' entry: not a DeepSpeed model-state file")
    first_path, first = next(iter(models.items()))
    return files, first_path, first, models


def _tensors(
    tag_dir: Path, files: TagFiles, first_path: Path, first: dict, models: dict, kinds: tuple[str, ...]
) -> tuple[dict[str, dict[str, Lazy]], Source, Layout]:
    """{kind: {parameter: reader}} for each of `kinds` ("fp32", moments), the shards read once; ZeRO-0: fp32 only."""
    steps = check_same({p: s.get("global_steps") for p, s in models.items()}, "global_steps")
    notes = tuple(f"{p.name}: legacy torch serialization, read whole (not memory-mapped)" for p in files.legacy)
    if not files.optim:
        world = int(first.get("dp_world_size", 1))
        state, wrapper, dtype = zero0_masters(first, first_path)
        source = Source(tag_dir.name, 0, world, str(first.get("ds_version")), steps)
        return {"fp32": state}, source, Layout(wrapper, dtype_name(dtype), notes)
    parts = _read_optim(files.optim, first)
    check_same({first_path: str(first.get("ds_version")), files.optim[0]: parts.version}, "ds_version")
    whole = first.get("optimizer")
    if isinstance(whole, dict) and {"fp32_groups_flat", "fp32_groups"} & set(whole):
        raise ValueError(
            f"{tag_dir}: {first_path.name} is a ZeRO-0 save (its optimizer kept whole) beside optimizer shards of a "
            f"partitioned one {sorted(p.name for p in files.optim.values())}: two runs wrote into this tag, so which "
            f"set is current is a guess; remove the stray files or save into an empty tag"
        )
    check_one_config({**{p: s.get("ds_config") for p, s in models.items()}, **parts.configs})
    if missing := [kind for kind in kinds if kind not in parts.groups]:
        raise ValueError(f"{tag_dir}: the optimizer shards hold no {missing} for every parameter group (not Adam?)")
    shapes = _param_shapes(first, first_path)
    world, mapped = parts.world, not files.legacy
    if parts.wrapper == "DeepSpeedZeroOptimizer_Stage3":
        if sorted(files.model) != list(range(world)):
            raise ValueError(
                f"{tag_dir}: ZeRO-3 needs a model-state file per rank 0..{world - 1}, found {sorted(files.model)}"
            )
        readers = {
            kind: _zero3(shapes=shapes, world=world, groups=parts.groups[kind], where=tag_dir, mapped=mapped)
            for kind in kinds
        }
    else:
        module = first["module"]
        readers = {
            kind: _zero12(
                shapes=shapes, parts=parts, groups=parts.groups[kind], module=module, where=tag_dir, mapped=mapped
            )
            for kind in kinds
        }
    dtype = dtype_name(parts.groups["fp32"][0][0].dtype) if parts.groups["fp32"][0] else "float32"
    if dtype != "float32":
        notes += (
            f"the checkpoint keeps no fp32 masters: its master weights are {dtype} "
            f"(bf16_master_weights_and_grads / fp16_master_weights_and_grads); they are written widened to fp32",
        )
    source = Source(tag_dir.name, parts.stage, world, parts.version, steps, parts.adam_step)
    return readers, source, Layout(parts.wrapper, dtype, notes)
