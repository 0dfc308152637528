"""Every speed path of the training ranks, behind one switch (`train.kernels: auto | off`), decided on the device
the rank trains on. Each module replaces a forward of the stock model with one computing the same within rounding
(figures: docs/kernels.md); turned off, a rank runs stock transformers + PEFT + DeepSpeed:

- `lean_layers`: LLaMA's SwiGLU MLP and RMSNorm keeping less for the backward pass (any device; C++ on a CPU).
- `fused_loss`: the output head and the cross-entropy a chunk at a time, no full logits (any device; under ZeRO-3
  where the head is frozen: it is gathered for the micro-batch).
- `lora_linear`: a PEFT LoRA Linear layer's step as one autograd function (any device; not ZeRO-3).
- `linear`: frozen fp32 Linear layers through oneDNN's matmul (CPU).
- `attention`: SDPA's forward, the backward as matmuls in causal query blocks and two C++ passes (CPU).
- `allocator`: the loop's large tensors from a region of its own, freed memory kept, glibc tuned (CPU).
- `cpp`: the C++ of csrc/, compiled once per environment with -march=native (`make setup`).

One memory path for long sequences is not a speed path and not behind the switch: the plan turns it on
(`train.gradient_checkpointing: offload`; docs/long_context.md):
- `offloaded_checkpoints`: activation checkpointing with each layer's kept input in host memory (GPU).

`auto` installs the CPU paths on CPU ranks only, and elsewhere the device-generic ones (PyTorch operators; their
GPU tests are marked `gpu`). A rank calls `environment` before it starts (its launcher's variables), `apply` on the
model before DeepSpeed wraps it, and `settle` once the engine is loaded, before the loop."""

from __future__ import annotations

import importlib

SWITCH = ("auto", "off")
MODULES = {  # imported only when chosen
    "lean_layers": "pipeline.kernels.lean_layers",
    "fused_loss": "pipeline.kernels.fused_loss",
    "lora_linear": "pipeline.kernels.lora_linear",
    "linear": "pipeline.kernels.linear",
    "attention": "pipeline.kernels.attention",
}
GENERIC = ("lean_layers", "fused_loss", "lora_linear")  # PyTorch operators on any device
CPU_ONLY = ("linear", "attention")
NOT_UNDER_ZERO3 = ("lora_linear",)  # ZeRO-3 gathers a layer's weights only when that layer is called


def chosen(*, device: str, zero_stage: int, enabled: str) -> tuple[str, ...]:
    """The layer paths a rank training on `device` ("cpu", "cuda", ...) installs under ZeRO `zero_stage`."""
    if enabled not in SWITCH:
        raise ValueError(f"train.kernels: {enabled!r}; expected one of {', '.join(SWITCH)}")
    if enabled == "off":
        return ()
    names = GENERIC + (CPU_ONLY if device == "cpu" else ())
    return tuple(n for n in names if not (zero_stage == 3 and n in NOT_UNDER_ZERO3))


def apply(model, *, device: str, zero_stage: int, enabled: str) -> dict[str, int]:
    """Install the chosen layer paths into `model` (a PEFT model, before DeepSpeed wraps it); how many modules each
    changed (0 where one does not apply to this model, such as an fp32 norm without the C++ kernels)."""
    installed = {}
    for name in chosen(device=device, zero_stage=zero_stage, enabled=enabled):
        module = importlib.import_module(MODULES[name])
        # lean_layers uses the C++ kernels only for a CPU run; the others pick per call, by their tensors' device
        options = {"cpp": device == "cpu"} if name == "lean_layers" else {}
        options = {"partitioned": zero_stage == 3} if name == "fused_loss" else options
        installed[name] = int(module.install(model, **options))
    return installed


def environment(*, device: str, enabled: str) -> dict[str, str]:
    """Variables a rank's process must start with (the C library reads them at start): glibc and MKL tuned for the
    CPU paths' memory; nothing elsewhere or turned off."""
    if enabled == "off" or device != "cpu":
        return {}
    from pipeline.kernels.allocator import STARTUP_ENVIRONMENT

    return dict(STARTUP_ENVIRONMENT)


def settle(*, device: str, enabled: str) -> dict[str, int]:
    """Once the model is loaded and resumed, before the loop: on a CPU, freed memory kept in the heap and the loop's
    large tensors from the region allocator; what was installed (1) or could not be (0)."""
    if enabled == "off" or device != "cpu":
        return {}
    from pipeline.kernels import allocator

    allocator.keep_freed_memory()
    return {"allocator": int(allocator.install())}
