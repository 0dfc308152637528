"""Build the trainable model: base weights, embeddings resized to the tokenizer, a PEFT LoRA adapter."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.core.imports import torch
from pipeline.model.outline import Outline, of_model

if TYPE_CHECKING:
    from pipeline.model.quantization import Quantization

ALL_LINEAR = "all-linear"


def linear_module_names(outline: Outline) -> list[str]:
    """Distinct leaf names of the Linear layers (what LoRA's target_modules match)."""
    return sorted({name.rsplit(".", 1)[-1] for name in outline.linear})


def check_targets(outline: Outline, target_modules: list[str], modules_to_save: list[str]) -> None:
    """Every name (a leaf name, or the full path of one layer as all-linear resolves to) must match a Linear layer;
    PEFT itself only complains when none does."""
    linear = linear_module_names(outline)
    missing = [t for t in target_modules if t not in linear and t not in outline.linear]
    if missing:
        raise ValueError(f"lora.target_modules: {missing} match no Linear layer; available: {linear}")
    leaves = {name.rsplit(".", 1)[-1] for name in outline.modules}
    absent = [m for m in modules_to_save if m not in leaves]
    if absent:
        raise ValueError(f"lora.modules_to_save: {absent} match no module of the model")


def resolve_targets(outline: Outline, target_modules: list[str] | str) -> list[str]:
    """The LoRA targets as PEFT will wrap them: `all-linear` as the full path of every Linear layer but the output
    head (PEFT's own rule), sorted; a list of leaf names as it is."""
    if target_modules != ALL_LINEAR:
        return list(target_modules)
    return sorted(name for name in outline.linear if name != outline.head)


def describe_targets(targets: list[str]) -> str:
    """Targets by leaf name with their counts ("down_proj x30, q_proj x30"): short enough for an MLflow param."""
    counts = Counter(name.rsplit(".", 1)[-1] for name in targets)
    return ", ".join(f"{leaf} x{n}" if n > 1 else leaf for leaf, n in sorted(counts.items()))


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """The adapter to train (the `lora` config group)."""

    r: int
    alpha: float
    dropout: float
    use_rslora: bool
    target_modules: list[str] | str  # leaf names, full module paths, or all-linear
    modules_to_save: list[str]
    init_new_embeddings: str = "mean"  # mean | normal: rows added by the resize
    use_dora: bool = False


def peft_config(lora: LoraSpec, model_config):
    """PEFT's LoraConfig for `lora` on a model of `model_config`."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        use_rslora=lora.use_rslora,
        use_dora=lora.use_dora,
        target_modules=list(lora.target_modules) if lora.target_modules != ALL_LINEAR else ALL_LINEAR,  # PEFT edits
        modules_to_save=list(lora.modules_to_save) or None,
        ensure_weight_tying=bool(model_config.tie_word_embeddings and lora.modules_to_save),
        task_type="CAUSAL_LM",
    )


def lora_skeleton(*, base_dir: Path, vocab_rows: int, lora: LoraSpec, dtype: torch.dtype | None = None):
    """The LoRA model without the base's weights: its trainable parameters zeros of their real shapes (a checkpoint
    fills them), every frozen one a one-element placeholder (ties kept), in `dtype` (None: float32). Enough for an
    engine to partition and save a checkpoint of any layout; the base is never read."""
    from accelerate import init_empty_weights
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = dtype or torch.float32
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


FLASH = "flash_attention_2"


def supported_by(model_class: type) -> frozenset[str]:
    """The attention implementations a transformers model class declares (eager always)."""
    flags = {"sdpa": "_supports_sdpa", FLASH: "_supports_flash_attn"}
    return frozenset({"eager", *(kind for kind, flag in flags.items() if getattr(model_class, flag, False))})


def usable_attention(chosen: str, supported: frozenset[str]) -> str:
    """`chosen` where the model supports it, else the best below it that it does (flash-attention 2, SDPA, eager):
    what `auto` becomes on the ranks for a model whose support the train stage does not read (it imports no model
    code; `check` has refused an implementation named that the model lacks)."""
    order = (FLASH, "sdpa", "eager")
    below = order[order.index(chosen) :] if chosen in order else (chosen,)
    return next((kind for kind in below if kind in supported), chosen)


def load_lora_model(
    *,
    base_dir: Path,
    vocab_rows: int,
    lora: LoraSpec,
    seed: int,
    dtype: torch.dtype | None = None,
    gradient_checkpointing: bool = False,
    zero3_config: dict | None = None,
    quantization: Quantization | None = None,
    device: str = "cpu",
    attention: str = "sdpa",
):
    """The base in the dtype it trains in (whole on `device`, or with `zero3_config` partitioned across the ranks as
    it is built; quantized by bitsandbytes onto `device`, whole on every rank, with `quantization`), its embeddings
    grown to `vocab_rows`, its attention transformers' `attention` implementation (or the best below it that the
    architecture supports: `usable_attention`), wrapped in a fresh LoRA adapter
    (seeded init, in `dtype` too; None: float32)."""
    from peft import get_peft_model

    from pipeline.model import base_weights

    dtype = dtype or torch.float32
    common = {"base_dir": base_dir, "dtype": dtype, "vocab_rows": vocab_rows, "init": lora.init_new_embeddings}
    if quantization is not None:
        from pipeline.model import quantization as bnb_base

        model = base_weights.load_quantized(**common, seed=seed, load_kwargs=bnb_base.load_kwargs(quantization, device))
        bnb_base.prepare(model)
        if lora.use_dora:
            bnb_base.patch_peft_dequantize()
    elif zero3_config is None:
        model = base_weights.load_whole(**common, seed=seed, device=device)
    else:
        model = base_weights.load_partitioned(**common, seed=seed, zero3_config=zero3_config)
    attention = usable_attention(attention, supported_by(type(model)))
    if model.config._attn_implementation != attention:
        model.set_attn_implementation(attention)
    outline = of_model(model)
    targets = resolve_targets(outline, lora.target_modules)
    check_targets(outline, targets, lora.modules_to_save)
    model.config.use_cache = False
    torch.manual_seed(seed)
    # PEFT gathers partitioned weights where it reads them (DoRA's initial magnitudes are the weights' row norms)
    # only while transformers knows the ZeRO-3 config.
    known = _zero3_known(zero3_config) if zero3_config is not None and lora.use_dora else None
    model = get_peft_model(
        model, peft_config(replace(lora, target_modules=targets), model.config), autocast_adapter_dtype=False
    )  # one dtype
    del known
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def recompute_only_last(model: torch.nn.Module, count: int) -> int:
    """With activation checkpointing on, only the last `count` decoder layers recompute (the others keep their
    activations: faster, where memory allows); how many layers there are."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    for layer in layers[: max(len(layers) - count, 0)]:
        layer.gradient_checkpointing = False
    return len(layers)


def _zero3_known(zero3_config: dict):
    """Transformers' handle on a ZeRO-3 config: while it lives, is_deepspeed_zero3_enabled() is true."""
    from transformers.integrations import HfDeepSpeedConfig

    return HfDeepSpeedConfig(dict(zero3_config))


def parameter_groups(
    model: torch.nn.Module, weight_decay: float, *, lr: float | None = None, lr_ratio: float | None = None
) -> list[dict]:
    """AdamW groups: decay on matrices, none on biases, norms and embeddings. With `lr_ratio` (LoRA+, as PEFT's
    create_loraplus_optimizer: every lora_B and every 1-D trained tensor, DoRA's magnitudes included) those learn
    at lr x lr_ratio, the rest at `lr`; the weight decay stays as above. Empty groups are left out (DeepSpeed drops
    them too); the first group learns at `lr`."""
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        plain = param.ndim < 2 or "norm" in name or "bias" in name or "embed_tokens" in name
        fast = lr_ratio is not None and ("lora_B" in name or param.ndim == 1)
        groups.setdefault((fast, plain), []).append(param)
    out = []
    for fast, plain in sorted(groups):
        group = {"params": groups[fast, plain], "weight_decay": 0.0 if plain else weight_decay}
        if lr_ratio is not None:
            group["lr"] = lr * lr_ratio if fast else lr
        out.append(group)
    return out


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; under ZeRO-3 the partitioned sizes are read from ds_numel; a 4-bit
    weight counts its values, not its packed bytes."""
    trainable = total = 0
    for param in model.parameters():
        n = getattr(param, "ds_numel", param.numel())
        if type(param).__name__ == "Params4bit":  # two 4-bit values per byte of its packed storage
            n *= 2 * param.element_size()
        total += n
        trainable += n if param.requires_grad else 0
    return trainable, total
