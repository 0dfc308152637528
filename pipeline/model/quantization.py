"""A base quantized by bitsandbytes (QLoRA): 4-bit NF4 with double quantization, or LLM.int8. What loading it takes,
the two CPU traps of bitsandbytes 0.50 / PEFT 0.21 made harmless, and the weights exactly as the quantized base
computes with them (for the merge's measure of what merging into the unquantized base changes).

- On CPUs with AVX512-BF16, bitsandbytes' first eval-mode no-grad forward of a Linear4bit repacks its weight in
  place into a CPU layout: dequantizing it afterwards gives garbage, and gradients through it after such a pass are
  wrong. `prepare` turns that path off on every Linear4bit.
- PEFT's `dequantize_module_weight` (which DoRA calls in every forward) reassigns `module.weight` on CPU: an int8
  weight loses its scales (the next forward crashes), a 4-bit one under ZeRO-3 loses DeepSpeed's attributes.
  `patch_peft_dequantize` gives PEFT a version that only dequantizes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("nf4", "int8")
BLOCKSIZE = 64  # bitsandbytes' 4-bit block (Params4bit's default on CPU and CUDA)


@dataclass(frozen=True, kw_only=True)
class Quantization:
    """How the frozen base is quantized: `kind` nf4 | int8; a 4-bit base computes in `compute_dtype` and keeps its
    packed data in `storage_dtype`, the training dtype (DeepSpeed casts floating-point parameters to it by value,
    which would corrupt another floating storage; PEFT's DeepSpeed guide asks the same for ZeRO-3)."""

    kind: str
    compute_dtype: torch.dtype
    storage_dtype: torch.dtype


def check_available(kind: str, device: str) -> str:
    """bitsandbytes' version after quantizing and dequantizing a tensor on `device` (cpu | cuda); a ValueError naming
    lora.quantization and what it needs otherwise."""
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bnb_functional
    except ImportError as err:
        raise ValueError(
            f"lora.quantization: {kind} needs bitsandbytes, which does not import here ({err}); expected "
            "`pip install bitsandbytes==0.50.2` (make setup installs it), or lora.quantization=none"
        ) from None
    try:
        probe = torch.linspace(-1, 1, 2 * BLOCKSIZE, device=device).reshape(2, BLOCKSIZE)
        if kind == "nf4":
            packed, state = bnb_functional.quantize_4bit(probe, blocksize=BLOCKSIZE, quant_type="nf4")
            restored = bnb_functional.dequantize_4bit(packed, state)
        else:
            codes, scales, _ = bnb_functional.int8_vectorwise_quant(probe.half())
            restored = bnb_functional.int8_vectorwise_dequant(codes, scales)
        if not torch.allclose(restored.float().cpu(), probe.cpu(), atol=0.15):  # NF4 steps up to 0.28 apart
            raise RuntimeError("its round trip of a test tensor came back wrong")
    except Exception as err:  # bitsandbytes raises many kinds where a backend is missing
        raise ValueError(
            f"lora.quantization: bitsandbytes {bnb.__version__} cannot quantize to {kind} on {device} here "
            f"({type(err).__name__}: {err}); expected a CUDA GPU or an x86-64 CPU, or lora.quantization=none"
        ) from None
    return bnb.__version__


def check_available_apart(kind: str, device: str) -> str:
    """`check_available` in a child process that exits after it: the process that launches the ranks then holds
    neither bitsandbytes nor, on a GPU, a CUDA context (about 500 MB of GPU 0 for the whole run)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
        return pool.submit(check_available, kind, device).result()


def load_kwargs(quantization: Quantization, device: str) -> dict:
    """The from_pretrained arguments that load the base quantized onto `device` (the whole model on every rank)."""
    from transformers import BitsAndBytesConfig

    if quantization.kind == "nf4":
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=quantization.compute_dtype,
            bnb_4bit_quant_storage=quantization.storage_dtype,
        )
    else:
        config = BitsAndBytesConfig(load_in_8bit=True)
    return {"quantization_config": config, "device_map": {"": device}}


def prepare(model: torch.nn.Module) -> int:
    """Turn off bitsandbytes' in-place CPU repacking on every 4-bit layer; returns how many layers are quantized."""
    import bitsandbytes as bnb

    count = 0
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
        count += isinstance(module, bnb.nn.Linear4bit | bnb.nn.Linear8bitLt)
    return count


def dequantize(module: torch.nn.Module) -> torch.Tensor:
    """The weight a bitsandbytes layer computes with, dequantized, the module left untouched (other weights as
    they are)."""
    import bitsandbytes.functional as bnb_functional

    weight = module.weight
    kind = type(weight).__name__
    if kind == "Params4bit":
        return bnb_functional.dequantize_4bit(weight.data, weight.quant_state)
    if kind == "Int8Params":
        state = module.state  # after the first forward the scales live on the layer's state
        codes = state.CB if state.CB is not None else weight.CB
        scales = state.SCB if state.SCB is not None else weight.SCB
        return bnb_functional.int8_vectorwise_dequant(codes, scales)
    return weight


def patch_peft_dequantize() -> None:
    """Make PEFT's LoRA layers (DoRA's weight norm) dequantize without reassigning the base layer's weight."""
    from peft.tuners.lora import dora, layer, variants

    for module in (dora, layer, variants):
        module.dequantize_module_weight = dequantize


def round_trip(weight: torch.Tensor, *, kind: str, load_dtype: torch.dtype) -> torch.Tensor:
    """`weight` (out x in) as the quantized base holds it: quantized from `load_dtype` as from_pretrained does, then
    dequantized, in fp32."""
    import bitsandbytes.functional as bnb_functional

    if kind == "nf4":
        packed, state = bnb_functional.quantize_4bit(
            weight.to(load_dtype).contiguous(), blocksize=BLOCKSIZE, compress_statistics=True, quant_type="nf4"
        )
        return bnb_functional.dequantize_4bit(packed, state).float()
    codes, scales, _ = bnb_functional.int8_vectorwise_quant(weight.to(torch.float16).contiguous())
    return bnb_functional.int8_vectorwise_dequant(codes, scales).float()
