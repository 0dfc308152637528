"""`train.init_adapter`: a run that starts from an adapter folder (a finished run's consolidated adapter, or one
PEFT saved) instead of LoRA's initialisation (B = 0), e.g. DPO on the result of SFT. The folder is checked against
the run's LoRA before anything launches; each rank places its tensors into the engine's fp32 masters (ZeRO 0-3) as a
resume places a universal checkpoint's, and refuses an adapter of other modules or shapes. What the run consolidates
is the starting adapter plus what it trained: it merges into the base as any adapter does. DPO's reference is the
starting model (the base with this adapter), precomputed before the first step (training.loop)."""

from __future__ import annotations

from pathlib import Path

from pipeline.checkpoints import adapter
from pipeline.core import config


def check(folder: Path, lora: config.LoraConfig) -> dict:
    """The adapter's config, after checking that it is an adapter of the run's LoRA settings: what scales its
    product. The modules, ranks and shapes are checked on the ranks, against the model's trainable tensors (PEFT
    rewrites modules_to_save of a tied embedding, so the config's list is not compared)."""
    settings, _ = adapter.read(folder)
    theirs = {
        "r": settings.get("r"),
        "alpha": settings.get("lora_alpha"),
        "use_rslora": bool(settings.get("use_rslora")),
        "use_dora": bool(settings.get("use_dora")),
    }
    ours = {k: getattr(lora, k) for k in theirs}
    differing = [f"lora.{k}: {ours[k]} (the adapter's: {theirs[k]})" for k in theirs if ours[k] != theirs[k]]
    if settings.get("rank_pattern") or settings.get("alpha_pattern"):
        differing.append("rank_pattern/alpha_pattern: set in the adapter, which this run's LoRA has not")
    if differing:
        raise ValueError(
            f"train.init_adapter: {folder} is an adapter of other LoRA settings ({'; '.join(differing)}); expected "
            "the run's lora settings to be the adapter's"
        )
    return settings


def place(engine, folder: Path) -> None:
    """Every trainable parameter of the engine from the adapter folder's tensor of the same (PEFT) name; refused
    where the names or shapes differ. Call on every rank, before the first step."""
    from pipeline.checkpoints.universal import set_master

    _, tensors = adapter.read(folder)
    trainable = {adapter.peft_key(n): p for n, p in engine.module.named_parameters() if p.requires_grad}
    extra = set(tensors) - set(trainable)  # allowed where a copy of a trained tensor: a tied head beside its embedding
    shapes = {tuple(tensors[name].shape) for name in extra}
    placed = {tensors[n].digest() for n in set(trainable) & set(tensors) if tuple(tensors[n].shape) in shapes}
    tied = {name for name in extra if tensors[name].digest() in placed}
    if set(trainable) != set(tensors) - tied:
        only_theirs, only_ours = sorted(set(tensors) - tied - set(trainable)), sorted(set(trainable) - set(tensors))
        raise ValueError(
            f"train.init_adapter: {folder} holds other tensors than this run trains (only in the adapter: "
            f"{only_theirs[:3]}; only in the run: {only_ours[:3]}); expected an adapter of this base and LoRA targets"
        )
    for name, param in trainable.items():
        shape = tuple(getattr(param, "ds_shape", param.shape))
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"train.init_adapter: {folder}: {name} has shape {tuple(tensors[name].shape)}, the run's is {shape} "
                "(another vocabulary or base?)"
            )
        set_master(param, tensors[name].read().float())
