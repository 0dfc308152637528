"""ZeRO-0 checkpoints keep the optimizer whole inside the model-state file; where the fp32 masters are depends on
the wrapper the engine built (deepspeed/runtime/engine.py, `_configure_fp16_optimizer`):

- none (fp32 engine): the module's own tensors are the masters;
- `FP16_Optimizer` (fp16/bf16 with DeepSpeed's FusedAdam: an `"optimizer"` in the config, or a client FusedAdam):
  `fp32_groups_flat`, one flat vector per parameter group; the module's trainable tensors are views into one flat
  low-precision buffer per group, so a tensor's storage offset is its offset in the group's vector;
- `FP16_UnfusedOptimizer` (fp16/bf16 with any other optimizer): `fp32_groups`, one tensor per parameter, unnamed:
  each is matched to the module tensor it rounds to."""

from __future__ import annotations

from pathlib import Path

from pipeline.checkpoints.shard_files import Lazy
from pipeline.core.imports import torch

SAMPLE = 4096  # elements compared at each end of a flat group to tell which module buffer it is


def adapter_names(module: dict) -> tuple[list[str], dict[str, str]]:
    """The module's LoRA and modules_to_save tensors, and {tied alias: source} among them."""
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


def zero0_masters(model_state: dict, path: Path) -> tuple[dict[str, Lazy], str, torch.dtype]:
    """{name: (shape, reader)} of every trainable parameter's master, the wrapper's name and the masters' dtype."""
    module, optimizer = model_state["module"], model_state.get("optimizer")
    if isinstance(optimizer, dict) and "fp32_groups_flat" in optimizer:
        return _fused(module, optimizer["fp32_groups_flat"], path), "FP16_Optimizer", torch.float32
    if isinstance(optimizer, dict) and "fp32_groups" in optimizer:
        return _unfused(module, optimizer["fp32_groups"], path), "FP16_UnfusedOptimizer", torch.float32
    names, _ = adapter_names(module)
    if any(module[n].dtype != torch.float32 for n in names):
        found = sorted(optimizer) if isinstance(optimizer, dict) else type(optimizer).__name__
        raise ValueError(
            f"{path}: a half-precision ZeRO-0 checkpoint whose optimizer state ({found}) holds no fp32 masters; "
            f"expected 'fp32_groups_flat' (DeepSpeed's FP16_Optimizer) or 'fp32_groups' (FP16_UnfusedOptimizer): "
            f"save the checkpoint with its optimizer state"
        )
    groups = optimizer.get("param_groups") if isinstance(optimizer, dict) else None
    if groups is not None and sum(len(g["params"]) for g in groups) != len(names):
        raise ValueError(
            f"{path}: the optimizer trains {sum(len(g['params']) for g in groups)} tensors, the module holds "
            f"{len(names)} LoRA/modules_to_save tensors; expected a PEFT LoRA model (other trainable parameters "
            f"have no place in an adapter)"
        )
    return {name: (module[name].shape, module[name].float) for name in names}, "none (fp32 module)", torch.float32


def _whole_storage(tensor: torch.Tensor) -> torch.Tensor:
    """The flat buffer a module tensor is a view of, in the tensor's dtype."""
    numel = tensor.untyped_storage().nbytes() // tensor.element_size()
    return torch.empty(0, dtype=tensor.dtype).set_(tensor.untyped_storage(), 0, (numel,), (1,))


def _rounds_to(flat: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether the fp32 group rounds to the module buffer at both ends (DeepSpeed copies one into the other after
    every step; comparing the ends is enough to tell groups of equal size apart)."""
    ends = [slice(0, SAMPLE), slice(max(0, flat.numel() - SAMPLE), flat.numel())]
    return all(torch.equal(flat[end].to(buffer.dtype), buffer[end]) for end in ends)


def _fused(module: dict, flats: list[torch.Tensor], path: Path) -> dict[str, Lazy]:
    """FP16_Optimizer: name the slices of each fp32 group by the module views into the matching buffer."""
    views: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, value in module.items():
        if value.is_floating_point():
            views.setdefault(value.untyped_storage().data_ptr(), []).append((name, value))
    state, used = {}, set()
    for g, flat in enumerate(flats):
        matches = [
            key
            for key, members in views.items()
            if key not in used
            and _whole_storage(members[0][1]).numel() == flat.numel()
            and _rounds_to(flat, _whole_storage(members[0][1]))
        ]
        if len(matches) != 1:
            raise ValueError(
                f"{path}: fp32_groups_flat[{g}] ({flat.numel()} elements) matches {len(matches)} module buffers; "
                f"expected exactly one (the module of another save, or saved without its trainable tensors?)"
            )
        used.add(matches[0])
        covered, seen = 0, {}
        for name, value in sorted(views[matches[0]], key=lambda item: item[1].storage_offset()):
            offset, numel = value.storage_offset(), value.numel()
            if seen.get(offset) == tuple(value.shape):
                continue  # a tied alias of the previous name (added back by the caller)
            if offset != covered:
                raise ValueError(f"{path}: module views of fp32_groups_flat[{g}] do not tile it ({name} at {offset})")
            seen[offset] = tuple(value.shape)
            state[name] = (value.shape, lambda f=flat, o=offset, v=value: f[o : o + v.numel()].view(v.shape))
            covered += numel
        if covered != flat.numel():
            raise ValueError(f"{path}: module views cover {covered} of the {flat.numel()} elements of group {g}")
    return state


def _unfused(module: dict, groups: list[list[torch.Tensor]], path: Path) -> dict[str, Lazy]:
    """FP16_UnfusedOptimizer: each master (in group order) is the module tensor it rounds to; among equal ones the
    next in module order after the previous match (the order optimizers list parameters in)."""
    names, _ = adapter_names(module)
    state, taken, last = {}, set(), -1
    for master in (t for group in groups for t in group):
        candidates = [
            i
            for i, n in enumerate(names)
            if i not in taken and module[n].shape == master.shape and torch.equal(master.to(module[n].dtype), module[n])
        ]
        if not candidates:
            raise ValueError(f"{path}: an fp32 master of shape {tuple(master.shape)} matches no module tensor")
        pick = next((i for i in candidates if i > last), candidates[0])
        taken.add(pick)
        last = pick
        state[names[pick]] = (master.shape, master.float)
    if free := [n for i, n in enumerate(names) if i not in taken]:
        raise ValueError(f"{path}: no fp32 master for {free}")
    return state
