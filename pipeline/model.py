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


def peft_config(lora: LoraSpec, model_config):
    """PEFT's LoraConfig for `lora` on a model of `model_config`."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        use_rslora=lora.use_rslora,
        target_modules=list(lora.target_modules),  # PEFT edits the lists it is given
        modules_to_save=list(lora.modules_to_save) or None,
        ensure_weight_tying=bool(model_config.tie_word_embeddings and lora.modules_to_save),
        task_type="CAUSAL_LM",
    )


def lora_skeleton(*, base_dir: Path, vocab_rows: int, lora: LoraSpec, dtype: torch.dtype = torch.float32):
    """The LoRA model without the base's weights: its trainable parameters zeros of their real shapes (a checkpoint
    fills them), every frozen one a one-element placeholder (ties kept). Enough for an engine to partition and save
    a checkpoint of any layout; the base is never read."""
    from accelerate import init_empty_weights
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(base_dir)
    config.vocab_size = vocab_rows
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if config.tie_word_embeddings:
        model.tie_weights()  # outside the context, which would give the head a parameter of its own
    model = get_peft_model(model, peft_config(lora, config), autocast_adapter_dtype=False)
    placed: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) not in placed:
                shape = param.shape if param.requires_grad else (1,)
                placed[id(param)] = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), param.requires_grad)
            if param is not None:
                module._parameters[name] = placed[id(param)]
    return model


def load_lora_model(
    *,
    base_dir: Path,
    vocab_rows: int,
    lora: LoraSpec,
    seed: int,
    dtype: torch.dtype = torch.float32,
    gradient_checkpointing: bool = False,
    zero3_config: dict | None = None,
):
    """The base in the dtype it trains in (whole, or with `zero3_config` partitioned across the ranks as it is
    built), its embeddings grown to `vocab_rows`, wrapped in a fresh LoRA adapter (seeded init, in `dtype` too)."""
    from peft import get_peft_model

    from pipeline import base_weights

    if zero3_config is None:
        model = base_weights.load_whole(
            base_dir=base_dir, dtype=dtype, vocab_rows=vocab_rows, init=lora.init_new_embeddings, seed=seed
        )
    else:
        model = base_weights.load_partitioned(
            base_dir=base_dir,
            dtype=dtype,
            vocab_rows=vocab_rows,
            init=lora.init_new_embeddings,
            seed=seed,
            zero3_config=zero3_config,
        )
    check_targets(model, lora.target_modules, lora.modules_to_save)
    model.config.use_cache = False
    torch.manual_seed(seed)
    model = get_peft_model(model, peft_config(lora, model.config), autocast_adapter_dtype=False)  # one dtype
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
