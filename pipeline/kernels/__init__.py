"""Every speed path of the training ranks, behind one switch (`train.kernels: auto | off`), decided on the device
the rank trains on. Each module replaces a forward of the stock model with one computing the same within rounding
(figures: docs/kernels.md); turned off, a rank runs stock transformers + PEFT + DeepSpeed:

- `lean_layers`: LLaMA's SwiGLU MLP and RMSNorm keeping less for the backward pass (any device; C++ on a CPU).
- `fused_loss`: the output head and the cross-entropy a chunk at a time, no full logits (any device; under ZeRO-3
  where the head is frozen: it is gathered for the micro-batch).
- `lora_linear`: a PEFT LoRA Linear layer's step as one autograd function (any device; under ZeRO-3 inside the
  decoder layers, which ZeRO-3 gathers whole).
- `linear`: frozen fp32 Linear layers through oneDNN's matmul (CPU).
- `attention`: SDPA's forward, the backward as matmuls in causal query blocks and two C++ passes (CPU).
- `allocator`: the loop's large tensors from a region of its own, freed memory kept, glibc tuned (CPU).
- `compiled_layers`: each decoder layer through torch.compile, its elementwise work fused (CUDA; under ZeRO-3 the
  layer is gathered whole around the compiled forward).
- on the engine DeepSpeed built, on any device: `zero_tail` (ZeRO-1/2's overflow check and clipping norm in one
  pass), `zero3_lists`, `zero3_fetch`, `zero3_release`, `zero3_flags` (ZeRO-3's host work): patches of DeepSpeed's
  internals, kept with the others in `pipeline/core/deepspeed_patches.py`, each off on another DeepSpeed version.
- `cpp`: the C++ of csrc/, compiled once per environment with -march=native (`make setup`); another CPU's path
  (`PIPELINE_KERNELS_ISA`: avx512, avx2, scalar) into a folder of its own, for tests.
- `cpu_paths`: which path each CPU-dependent library takes here (ATen, oneDNN, MKL, `cpp`), by name: the train
  metrics' `cpu_paths` and the tests' header.

One memory path for long sequences is not a speed path and not behind the switch: the plan turns it on
(`train.gradient_checkpointing: offload`; docs/long_context.md):
- `offloaded_checkpoints`: activation checkpointing with each layer's kept input in host memory (GPU).

`auto` installs the CPU paths on CPU ranks only, and elsewhere the device-generic ones (PyTorch operators; their
GPU tests are marked `gpu`); `train.kernels_skip` names paths to leave out (a benchmark's previous path, or one a
user distrusts). A rank calls `environment` before it starts (its launcher's variables), `apply` on the model before
DeepSpeed wraps it, `tune_engine` on the engine DeepSpeed built, and `settle` once the engine is loaded, before the
loop."""

from __future__ import annotations

import importlib

from pipeline.core.deepspeed_patches import ENGINE  # installed on the engine DeepSpeed built (tune_engine)

SWITCH = ("auto", "off")
MODULES = {  # imported only when chosen
    "lean_layers": "pipeline.kernels.lean_layers",
    "fused_loss": "pipeline.kernels.fused_loss",
    "lora_linear": "pipeline.kernels.lora_linear",
    "linear": "pipeline.kernels.linear",
    "attention": "pipeline.kernels.attention",
    "compiled_layers": "pipeline.kernels.compiled_layers",
}
GENERIC = ("lean_layers", "fused_loss", "lora_linear")  # PyTorch operators on any device
CPU_ONLY = ("linear", "attention")
CUDA_ONLY = ("compiled_layers",)  # last: it compiles the layers as the paths before it left them


def _checked(enabled: str, skip: tuple[str, ...]) -> None:
    if enabled not in SWITCH:
        raise ValueError(f"train.kernels: {enabled!r}; expected one of {', '.join(SWITCH)}")
    names = [*MODULES, *ENGINE]
    unknown = [name for name in skip if name not in names]
    if unknown:
        raise ValueError(f"train.kernels_skip: {unknown} are not kernel paths; expected some of {sorted(names)}")


def chosen(*, device: str, enabled: str, skip: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The layer paths a rank training on `device` ("cpu", "cuda", ...) installs (under any ZeRO stage)."""
    _checked(enabled, skip)
    if enabled == "off":
        return ()
    names = GENERIC + (CPU_ONLY if device == "cpu" else CUDA_ONLY if device == "cuda" else ())
    return tuple(n for n in names if n not in skip)


def apply(model, *, device: str, zero_stage: int, enabled: str, skip: tuple[str, ...] = ()) -> dict[str, int]:
    """Install the chosen layer paths into `model` (a PEFT model, before DeepSpeed wraps it); how many modules each
    changed (0 where one does not apply to this model, such as an fp32 norm without the C++ kernels)."""
    installed = {}
    for name in chosen(device=device, enabled=enabled, skip=skip):
        module = importlib.import_module(MODULES[name])
        # lean_layers uses the C++ kernels only for a CPU run; the others pick per call, by their tensors' device
        options = {"cpp": device == "cpu"} if name == "lean_layers" else {}
        options = {"partitioned": zero_stage == 3} if name in ("fused_loss", "lora_linear") else options
        installed[name] = int(module.install(model, **options))
    return installed


def tune_engine(engine, *, enabled: str, skip: tuple[str, ...] = ()) -> dict[str, int]:
    """Install the engine-level paths into the engine DeepSpeed built (each 1 where it applied, 0 where not: a
    ZeRO-3 or offloading optimizer keeps DeepSpeed's step)."""
    _checked(enabled, skip)
    if enabled == "off":
        return {}
    return {name: int(patch(engine)) for name, patch in ENGINE.items() if name not in skip}


def environment(*, device: str, enabled: str) -> dict[str, str]:
    """Variables a rank's process must start with (the C library reads them at start): glibc and MKL tuned for the
    CPU paths' memory; nothing elsewhere or turned off. A forced C++ path this CPU cannot run (PIPELINE_KERNELS_ISA)
    is refused here, before any rank starts."""
    if enabled == "off" or device != "cpu":
        return {}
    from pipeline.kernels import cpp
    from pipeline.kernels.allocator import STARTUP_ENVIRONMENT

    cpp.target()

    return dict(STARTUP_ENVIRONMENT)


def settle(*, device: str, enabled: str) -> dict[str, int]:
    """Once the model is loaded and resumed, before the loop: on a CPU, freed memory kept in the heap and the loop's
    large tensors from the region allocator; what was installed (1) or could not be (0)."""
    if enabled == "off" or device != "cpu":
        return {}
    from pipeline.kernels import allocator

    allocator.keep_freed_memory()
    return {"allocator": int(allocator.install())}
