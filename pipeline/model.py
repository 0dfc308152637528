"""Build the trainable model: base weights, embeddings resized to the tokenizer, a PEFT LoRA adapter."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


def linear_module_names(model: torch.nn.Module) -> list[str]:
    """Distinct leaf names of the Linear layers (what LoRA's target_modules match)."""
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)})


def check_targets(model: torch.nn.Module, target_modules: list[str], modules_to_save: list[str]) -> None:
    """Every name must match; PEFT itself only complains when none does."""
    linear = linear_module_names(model)
    missing = [t for t in target_modules if t not in linear]
    if missing:
        raise ValueError(f"lora.target_modules: {missing} match no Linear layer; available: {linear}")
    leaves = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    absent = [m for m in modules_to_save if m not in leaves]
    if absent:
        raise ValueError(f"lora.modules_to_save: {absent} match no module of the model")


def meta_model(base_dir: Path) -> torch.nn.Module:
    """The architecture without weights (cheap): for checks before a launch."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_dir))


def resize_embeddings(model, new_size: int, init: str) -> int:
    """Resize input/output embeddings to `new_size` rows; new rows are the old rows' mean or N(0, init_range)."""
    old = model.get_input_embeddings().weight.shape[0]
    if new_size < old:
        raise ValueError(f"tokenizer: {new_size} rows is fewer than the model's {old} embeddings")
    if new_size == old:
        return old
    model.resize_token_embeddings(new_size, mean_resizing=False)
    std = model.config.initializer_range
    with torch.no_grad():
        for weight in {
            id(w): w for w in (model.get_input_embeddings().weight, model.get_output_embeddings().weight)
        }.values():
            if init == "mean":
                weight[old:] = weight[:old].mean(dim=0, keepdim=True)
            else:
                weight[old:].normal_(0.0, std)
    return old


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """The adapter to train (the `lora` config group)."""

    r: int
    alpha: float
    dropout: float
    use_rslora: bool
    target_modules: list[str]
    modules_to_save: list[str]
    init_new_embeddings: str = "mean"  # mean | normal: rows added by the resize


def load_lora_model(
    *, base_dir: Path, vocab_rows: int, lora: LoraSpec, seed: int, gradient_checkpointing: bool = False
):
    """Base model in fp32, resized to `vocab_rows`, wrapped in a fresh LoRA adapter (seeded init)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    check_targets(model, lora.target_modules, lora.modules_to_save)
    resize_embeddings(model, vocab_rows, lora.init_new_embeddings)
    model.config.use_cache = False
    config = LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        use_rslora=lora.use_rslora,
        target_modules=list(lora.target_modules),  # PEFT edits the lists it is given
        modules_to_save=list(lora.modules_to_save) or None,
        ensure_weight_tying=bool(model.config.tie_word_embeddings and lora.modules_to_save),
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(seed)
    model = get_peft_model(model, config)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on matrices, none on biases, norms and embeddings."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        plain = param.ndim < 2 or "norm" in name or "bias" in name or "embed_tokens" in name
        (no_decay if plain else decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; under ZeRO-3 the partitioned sizes are read from ds_numel."""
    trainable = total = 0
    for param in model.parameters():
        n = getattr(param, "ds_numel", param.numel())
        total += n
        trainable += n if param.requires_grad else 0
    return trainable, total
