"""A DeepSpeed checkpoint tag's files: which file is which, that they are one save (files another save or layout
left beside them are named and refused, never silently skipped), and loading them memory-mapped without importing
DeepSpeed.

File names, as DeepSpeed's `save_checkpoint` writes them (deepspeed/checkpoint/constants.py):
`mp_rank_00_model_states.pt` (ZeRO 0-2, written once), `zero_pp_rank_R_mp_rank_00_model_states.pt` (ZeRO-3, one per
rank), `[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt` (partitioned optimizers, one per rank; `bf16_` exactly
when the engine ran in bf16)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.checkpoints import safe_pickle
from pipeline.checkpoints.mapped import is_legacy
from pipeline.core.imports import torch

SHARD = re.compile(
    r"^(?P<bf16>bf16_)?(?:zero_pp_rank_(?P<rank>\d+)_)?mp_rank_(?P<mp>\d+)_(?P<kind>model|optim)_states\.pt$"
)
# Files of parallelism this reader does not reassemble (pipeline stages, MoE experts).
UNSUPPORTED = re.compile(r"^(layer_\d+-model_.*|layer_\d+_expert_\d+_.*|(bf16_)?expp_rank_\d+_.*)\.pt$")
NVME = "offloaded_tensors"  # ZeRO-3 with offload_optimizer.device=nvme keeps partitions here as *.tensor.swp
Lazy = tuple["torch.Size", Callable[[], "torch.Tensor"]]  # a tensor's shape, and how to read it when it is written


def load(path: Path) -> dict:
    """A shard through the checkpoint loader (`safe_pickle`), memory-mapped (files saved with DeepSpeed's
    `"checkpoint": {"checkpoint_serialization": false}` are in torch's legacy format, which cannot be mapped: those
    are read whole)."""
    try:
        return safe_pickle.load(path)
    except safe_pickle.UnsafePickle:
        raise
    except Exception as err:  # a damaged file (with --trust-pickles: torch's RuntimeError, EOFError...)
        detail = getattr(err, "detail", err)
        raise ValueError(f"{path}: cannot be read as a DeepSpeed shard (truncated or corrupted?): {detail}") from None


@dataclass(frozen=True)
class TagFiles:
    """The shards of one save: {rank: path} of model-state and optimizer-state files."""

    model: dict[int, Path]
    optim: dict[int, Path]
    legacy: list[Path] = field(default_factory=list)  # files read whole (legacy serialization)


def tag_files(tag_dir: Path) -> TagFiles:
    """The tag's shard files, refused when they cannot be one save of a layout this reader knows."""
    if not tag_dir.is_dir():
        raise FileNotFoundError(f"{tag_dir}: no such checkpoint tag folder")
    if (tag_dir / NVME).is_dir():
        raise ValueError(
            f"{tag_dir / NVME}: ZeRO-3 optimizer state offloaded to NVMe (*.tensor.swp), which this reader does not "
            f"read; load the checkpoint into an engine with the same NVMe offload and save it again without it"
        )
    if (tag_dir / "zero").is_dir():
        raise ValueError(
            f"{tag_dir / 'zero'}: a universal checkpoint (zero/<parameter>/fp32.pt, written by ds_to_universal or "
            f"`convert --to universal`), not a ZeRO tag; read the tag it was converted from (DeepSpeed's converter "
            f"misnames ZeRO-1/2 partitions under round_robin_gradients), or `convert --to zero` it first"
        )
    groups: dict[str, dict[int, Path]] = {}
    for path in sorted(tag_dir.iterdir()):
        if UNSUPPORTED.match(path.name):
            raise ValueError(f"{path}: a pipeline-parallel or MoE checkpoint file; only data-parallel ZeRO is read")
        match = SHARD.match(path.name)
        if match is None:
            continue
        if int(match["mp"]) != 0:
            raise ValueError(f"{path}: tensor/model-parallel checkpoints (mp_rank > 0) are not supported")
        if match["kind"] == "model":
            kind = "model (ZeRO-3, one per rank)" if match["rank"] else "model (ZeRO 0-2, one file)"
        else:
            kind = f"optimizer ({'bf16' if match['bf16'] else 'fp32/fp16'} engine)"
        groups.setdefault(kind, {})[int(match["rank"] or 0)] = path
    models = {kind: files for kind, files in groups.items() if kind.startswith("model")}
    optims = {kind: files for kind, files in groups.items() if kind.startswith("optimizer")}
    if not models:
        raise FileNotFoundError(f"{tag_dir}: no *_model_states.pt file: not a DeepSpeed checkpoint tag")
    for found in (models, optims):
        if len(found) > 1:
            detail = "; ".join(f"{kind}: {sorted(p.name for p in files.values())}" for kind, files in found.items())
            raise ValueError(
                f"{tag_dir}: holds shard files of two saves ({detail}): two runs wrote into this tag, so which set is "
                f"current is a guess; remove the stray files or save into an empty tag"
            )
    optim = next(iter(optims.values()), {})
    model = next(iter(models.values()))
    every = [*model.values(), *optim.values()]
    return TagFiles(model, optim, [p for p in every if is_legacy(p)])


def check_same(values: dict[Path, object], what: str) -> object:
    """The one value every file records for `what`; files that disagree are named."""
    distinct = {json.dumps(v, sort_keys=True, default=str) for v in values.values()}
    if len(distinct) > 1:
        detail = ", ".join(f"{p.name}: {v}" for p, v in values.items())
        raise ValueError(
            f"{next(iter(values)).parent}: files of different saves mixed under one tag ({what}: {detail})"
        )
    return next(iter(values.values()))


def check_one_config(configs: dict[Path, object]) -> None:
    """Every file of a save records the same DeepSpeed config: name the keys where one differs."""
    first_path, first = next(iter(configs.items()))
    for path, config in configs.items():
        if json.dumps(config, sort_keys=True, default=str) != json.dumps(first, sort_keys=True, default=str):
            keys = sorted(
                key
                for key in {*(first or {}), *(config or {})}
                if json.dumps((first or {}).get(key), sort_keys=True, default=str)
                != json.dumps((config or {}).get(key), sort_keys=True, default=str)
            )
            raise ValueError(
                f"{path.parent}: files of different saves mixed under one tag (ds_config differs between "
                f"{first_path.name} and {path.name} in {keys}); remove the stray files or save into an empty tag"
            )
